"""The layer rules on functional graphs: branches, merges, several inputs and heads.

Each model is a graph, not a chain (a residual ``Add``, two heads, two inputs
joined by ``Concatenate``, a ``Multiply`` gate, one tensor read by three layers,
a nested model, a Conv2D residual block): the rules take it (``jac.plan`` is
not None), agree with the per-sample stage and with a float64 GradientTape
loop, and give the per-sample gradient norms of a single-output model.
"""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, rules, tf

layers = keras.layers
F64 = "float64"


def _dense(width, activation=None):
    return layers.Dense(width, activation=activation, dtype=F64)


def residual_mlp():
    x = keras.Input((6,), dtype=F64)
    h = _dense(8, "tanh")(x)
    for _ in range(2):
        h = layers.Add(dtype=F64)([h, _dense(8, "tanh")(h)])
    return keras.Model(x, _dense(2)(h)), np.zeros(6)


def two_heads():
    x = keras.Input((4,), dtype=F64)
    h = _dense(5, "tanh")(x)
    return keras.Model(x, [_dense(2)(h), _dense(3, "tanh")(h)]), np.zeros(4)


def dict_heads_of_a_trunk_output():
    """Dict outputs (sorted: "features", "score") and a head that reads the
    trunk's output, itself an output: its signal is summed."""
    x = keras.Input((4,), dtype=F64)
    h = _dense(3, "tanh")(x)
    return keras.Model(x, {"score": _dense(1)(h), "features": h}), np.zeros(4)


def two_inputs_concatenated():
    a = keras.Input((3,), dtype=F64)
    b = keras.Input((2, 2), dtype=F64)
    h = layers.Concatenate(dtype=F64)([a, layers.Flatten(dtype=F64)(b)])
    h = _dense(4, "tanh")(h)
    return keras.Model([a, b], _dense(2)(h)), [np.zeros(3), np.zeros((2, 2))]


def dict_inputs_two_heads():
    a = keras.Input((3,), dtype=F64, name="a")
    b = keras.Input((2,), dtype=F64, name="b")
    h = layers.Concatenate(dtype=F64)([b, _dense(2, "tanh")(a)])
    h = _dense(4, "tanh")(h)
    heads = [_dense(2)(h), _dense(3, "tanh")(h)]
    return keras.Model({"b": b, "a": a}, heads), {"a": np.zeros(3), "b": np.zeros(2)}


def multiply_gate():
    x = keras.Input((5,), dtype=F64)
    gate = _dense(6, "sigmoid")(x)
    h = layers.Multiply(dtype=F64)([_dense(6, "tanh")(x), gate])
    return keras.Model(x, _dense(2)(h)), np.zeros(5)


def fan_out_into_three():
    """One tensor read by three layers, merged by every merge rule."""
    x = keras.Input((4,), dtype=F64)
    h = _dense(5, "tanh")(x)
    a, b, c = _dense(3, "tanh")(h), _dense(3)(h), _dense(3, "relu")(h)
    merged = layers.Concatenate(dtype=F64)(
        [
            layers.Add(dtype=F64)([a, b, c]),
            layers.Subtract(dtype=F64)([a, b]),
            layers.Average(dtype=F64)([b, c]),
            layers.Maximum(dtype=F64)([a, b, c]),
            layers.Minimum(dtype=F64)([a, c]),
        ]
    )
    return keras.Model(x, _dense(2)(merged)), np.zeros(4)


def nested_block():
    """A functional residual block and a Sequential, each used once."""
    inner_x = keras.Input((5,), dtype=F64)
    inner_h = _dense(5, "tanh")(_dense(5, "relu")(inner_x))
    block = keras.Model(inner_x, layers.Add(dtype=F64)([inner_x, inner_h]))
    head = keras.Sequential([_dense(4, "tanh"), _dense(2)])
    x = keras.Input((3,), dtype=F64)
    return keras.Model(x, head(block(_dense(5)(x)))), np.zeros(3)


def conv_residual():
    x = keras.Input((5, 5, 2), dtype=F64)
    h = layers.Conv2D(3, 3, padding="same", activation="tanh", dtype=F64)(x)
    inner = layers.Conv2D(3, 3, padding="same", dtype=F64)(h)
    h = layers.Add(dtype=F64)([h, inner])
    h = layers.Flatten(dtype=F64)(h)
    return keras.Model(x, _dense(2)(h)), np.zeros((5, 5, 2))


def ops_between_layers():
    """``a + b`` and ``a * 2`` in the model: keras.ops, by autodiff."""
    x = keras.Input((4,), dtype=F64)
    h = _dense(4, "tanh")(x) + _dense(4)(x) * 2.0
    return keras.Model(x, _dense(2)(h)), np.zeros(4)


def concatenate_on_time():
    """Concatenate on the time axis of sequences, then on the features."""
    x = keras.Input((3, 2), dtype=F64)
    a = _dense(4, "tanh")(x)
    h = layers.Concatenate(axis=1, dtype=F64)([a, _dense(4)(x)])  # (6, 4)
    h = layers.Concatenate(axis=-1, dtype=F64)([h, h])  # (6, 8)
    return keras.Model(x, _dense(1)(layers.Flatten(dtype=F64)(h))), np.zeros((3, 2))


def ids_and_floats():
    """Token ids (Embedding) and floats (Dense), as a dict, joined."""
    ids = keras.Input((4,), dtype="int32", name="ids")
    floats = keras.Input((3,), dtype=F64, name="floats")
    embedded = layers.Flatten(dtype=F64)(layers.Embedding(7, 2, dtype=F64)(ids))
    h = layers.Concatenate(dtype=F64)([embedded, _dense(3, "tanh")(floats)])
    return keras.Model({"ids": ids, "floats": floats}, _dense(2)(h)), {
        "ids": np.zeros(4),
        "floats": np.zeros(3),
    }


def sequential_holding_a_graph():
    """A Sequential whose middle layer is a functional residual block."""
    inner_x = keras.Input((5,), dtype=F64)
    block = keras.Model(
        inner_x, layers.Add(dtype=F64)([inner_x, _dense(5, "tanh")(inner_x)])
    )
    model = keras.Sequential(
        [keras.Input((3,), dtype=F64), _dense(5), block, _dense(2)]
    )
    return model, np.zeros(3)


class Bilinear(layers.Layer):
    """``a * (b @ W)``: a custom layer of two inputs holding a variable."""

    def build(self, input_shape):
        width = input_shape[1][-1]
        self.w = self.add_weight(shape=(width, width), initializer="glorot_uniform")

    def call(self, inputs):
        a, b = inputs
        return a * keras.ops.matmul(b, self.w)


class Gate(layers.Layer):
    """``a * sigmoid(b)``, called with two positional tensors."""

    def call(self, a, b):
        return a * keras.ops.sigmoid(b)


def custom_layers_of_two_inputs():
    x = keras.Input((4,), dtype=F64)
    a, b = _dense(3, "tanh")(x), _dense(3)(x)
    h = Bilinear(dtype=F64)([a, b])
    h = Gate(dtype=F64)(h, b)
    return keras.Model(x, _dense(2)(h)), np.zeros(4)


GRAPHS = {
    "residual_mlp": (residual_mlp, "add"),
    "two_heads": (two_heads, "dense+tanh"),
    "dict_heads_of_a_trunk_output": (dict_heads_of_a_trunk_output, "dense"),
    "two_inputs_concatenated": (two_inputs_concatenated, "concatenate"),
    "dict_inputs_two_heads": (dict_inputs_two_heads, "concatenate"),
    "multiply_gate": (multiply_gate, "multiply"),
    "fan_out_into_three": (fan_out_into_three, "maximum"),
    "nested_block": (nested_block, "add"),
    "conv_residual": (conv_residual, "add"),
    "ops_between_layers": (ops_between_layers, "autodiff (Add"),
    "concatenate_on_time": (concatenate_on_time, "concatenate"),
    "ids_and_floats": (ids_and_floats, "embedding"),
    "sequential_holding_a_graph": (sequential_holding_a_graph, "add"),
    "custom_layers_of_two_inputs": (custom_layers_of_two_inputs, "no rule for Gate"),
}


def _model_and_batch(name, n_samples=5, seed=0):
    keras.utils.set_random_seed(seed)
    model, like = GRAPHS[name][0]()
    rng = np.random.default_rng(seed)
    x = tf.nest.map_structure(
        lambda leaf: rng.normal(size=(n_samples, *np.shape(leaf))), like
    )
    if isinstance(x, dict) and "ids" in x:
        x["ids"] = rng.integers(0, 7, size=x["ids"].shape).astype("int32")
    return model, x


def _rows(y, n_samples):
    return tf.concat([tf.reshape(t, [n_samples, -1]) for t in tf.nest.flatten(y)], 1)


def tape_loop_jacobian(model, x):
    """(n, l, m): one GradientTape per sample, in float64."""
    variables = model.trainable_variables
    n_samples = len(tf.nest.flatten(x)[0])
    out = []
    for i in range(n_samples):
        x_i = tf.nest.map_structure(lambda t, i=i: tf.constant(t[i : i + 1]), x)
        with tf.GradientTape() as tape:
            y = _rows(model(x_i, training=False), 1)[0]
        parts = tape.jacobian(y, variables)
        out.append(tf.concat([tf.reshape(p, [len(y), -1]) for p in parts], 1))
    return np.stack(out)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_the_rules_take_the_graph_and_agree(name):
    model, x = _model_and_batch(name)
    jac = ju.compiled_jacobian(model, method="rules")
    assert jac.plan is not None, jac.fallback
    J = jac(x)
    assert jac.plan is not None, jac.fallback  # proved on x: not a fallback
    assert GRAPHS[name][1] in jac.plan.describe()
    per_sample = ju.compiled_jacobian(model, method="per_sample")(x)
    np.testing.assert_allclose(J, per_sample, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(J, tape_loop_jacobian(model, x), rtol=1e-10,
                               atol=1e-12)  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [n for n in sorted(GRAPHS) if n not in ("two_heads", "dict_heads_of_a_trunk_output",
                                            "dict_inputs_two_heads")],
)  # fmt: skip
def test_squared_norms_of_a_single_output_graph(name):
    model, x = _model_and_batch(name, n_samples=4)
    jac = ju.compiled_jacobian(model, method="rules")
    jac(x)  # proves the plan on x's shape
    assert jac.plan is not None, jac.fallback
    x = tf.nest.map_structure(tf.constant, x)
    weights = tf.constant(np.random.default_rng(1).normal(size=(4, 1, 2)))
    l_out = int(model.outputs[0].shape[-1])
    weights = weights[:, :, :l_out]

    def signal(y):
        return tf.reshape(weights, [4, 1, *y.shape[1:]])

    squared = jac.plan.squared_norms(x, signal)[:, 0].numpy()
    G = np.einsum("ik,ikm->im", weights[:, 0].numpy(), tape_loop_jacobian(model, x))
    np.testing.assert_allclose(squared, np.sum(G * G, axis=1), rtol=1e-10)
    rows_signal = rules.OutputRows(weights)  # the same signal, as rows
    np.testing.assert_allclose(
        jac.plan.squared_norms(x, rows_signal)[:, 0].numpy(), squared, rtol=1e-12
    )


def test_a_signal_function_on_several_outputs_is_refused():
    model, x = _model_and_batch("two_heads", n_samples=3)
    jac = ju.compiled_jacobian(model, method="rules")
    jac(x)
    x = tf.constant(x)
    with pytest.raises(rules.SignalOnSeveralOutputs):
        jac.plan.tensor(x, lambda y: y[:, None])
    rows_signal = rules.OutputRows(tf.ones([1, 1, 5], F64))  # one row: l = 2 + 3
    G = jac.plan.tensor(x, rows_signal)[:, 0].numpy()
    np.testing.assert_allclose(G, jac(x).sum(axis=1), rtol=1e-12)


EXPLAINED = [
    "residual_mlp", "two_inputs_concatenated", "dict_inputs_two_heads",
    "conv_residual",
]  # fmt: skip


@pytest.mark.parametrize("name", EXPLAINED)
def test_jacobian_explains_the_layer_rules(name):
    model, x = _model_and_batch(name, n_samples=4)
    J, choice = ju.jacobian(model, x, explain=True)
    assert choice.path == "layer rules", choice.why
    names = [rule for _, rule in choice.layers]
    assert any(GRAPHS[name][1] in rule for rule in names)
    np.testing.assert_allclose(J, tape_loop_jacobian(model, x), rtol=1e-10,
                               atol=1e-12)  # fmt: skip


def test_only_the_wanted_branch_is_walked():
    """With one head's variables only, the other head and the trunk's
    signal below the wanted layer are not visited."""
    model, x = _model_and_batch("two_heads", n_samples=3)
    head = model.layers[-1]
    variables = head.trainable_variables
    jac = ju.compiled_jacobian(model, method="rules", variables=variables)
    J = jac(x)
    assert jac.plan is not None, jac.fallback
    full = tape_loop_jacobian(model, x)
    m_head = sum(int(np.prod(v.shape)) for v in variables)
    np.testing.assert_allclose(J, full[:, :, -m_head:], rtol=1e-10, atol=1e-12)
    visited = []

    def visit(step, saved, delta, wanted, need_signal):
        visited.append(step.layer.name)
        return step.backward(saved, delta, wanted, need_signal)[1]

    rules.walk._walk_backward(jac.plan, tf.constant(x), None, visit)
    assert visited == [head.name]


def test_a_plan_replays_each_input_of_a_node():
    model, _ = _model_and_batch("ops_between_layers")
    nodes, wiring = rules.graph_nodes(model)
    add = next(n for n in nodes if n.n_inputs == 2)
    a, b = tf.constant([[1.0, 2.0]]), tf.constant([[10.0, 20.0]])
    np.testing.assert_allclose(add(a, b), [[11.0, 22.0]])
    assert len(wiring.inputs[nodes.index(add)]) == 2


def _shared_in_a_graph():
    x = keras.Input((4,), dtype=F64)
    shared = _dense(4, "tanh")
    h = shared(x)
    return keras.Model(x, layers.Add(dtype=F64)([h, shared(h)]))


def _nested_used_twice():
    inner_x = keras.Input((4,), dtype=F64)
    block = keras.Model(inner_x, _dense(4, "tanh")(inner_x))
    x = keras.Input((4,), dtype=F64)
    return keras.Model(x, layers.Add(dtype=F64)([block(x), block(x)]))


def test_a_layer_used_twice_is_on_the_rules_its_calls_summed():
    """Issue 64: each call of the layer a step, the blocks of its variables
    summed over the calls (they fell back to autodiff before)."""
    model = _shared_in_a_graph()
    jac = ju.compiled_jacobian(model, method="rules")
    x = np.random.default_rng(0).normal(size=(3, 4))
    np.testing.assert_allclose(jac(x), tape_loop_jacobian(model, x), rtol=1e-10,
                               atol=1e-12)  # fmt: skip
    assert jac.plan is not None and jac.plan.shared, jac.fallback


def test_a_nested_model_used_twice_falls_back_and_says_why():
    model = _nested_used_twice()
    jac = ju.compiled_jacobian(model, method="rules")
    assert jac.plan is None and "used more than once" in jac.fallback
    x = np.random.default_rng(0).normal(size=(3, 4))
    np.testing.assert_allclose(jac(x), tape_loop_jacobian(model, x), rtol=1e-10,
                               atol=1e-12)  # fmt: skip


def test_a_merge_of_different_shapes_runs_by_autodiff():
    """Keras broadcasts (n, 4) and (n, 1) in Add: no merge rule, autodiff."""
    x = keras.Input((3,), dtype=F64)
    model = keras.Model(x, layers.Add(dtype=F64)([_dense(4, "tanh")(x), _dense(1)(x)]))
    jac = ju.compiled_jacobian(model, method="rules")
    x = np.random.default_rng(0).normal(size=(3, 3))
    J = jac(x)
    assert jac.plan is not None, jac.fallback
    assert "autodiff (its inputs have different shapes" in jac.plan.describe()
    np.testing.assert_allclose(J, tape_loop_jacobian(model, x), rtol=1e-10,
                               atol=1e-12)  # fmt: skip


def test_a_lying_merge_rule_is_caught_by_the_check():
    class AddAsFirst(rules.merge.AddRule):
        def _signals(self, saved, delta):
            return [delta] + [tf.zeros_like(delta)] * (self.n_inputs - 1)

    model, x = _model_and_batch("residual_mlp")
    before = rules.MERGE_RULES[layers.Add]
    rules.MERGE_RULES[layers.Add] = AddAsFirst
    try:
        jac = ju.compiled_jacobian(model, method="rules")
        J = jac(x)
    finally:
        rules.MERGE_RULES[layers.Add] = before
    assert jac.plan is None and "differ from autodiff" in jac.fallback
    np.testing.assert_allclose(J, tape_loop_jacobian(model, x), rtol=1e-10,
                               atol=1e-12)  # fmt: skip


def _softmax_residual():
    x = keras.Input((6,), dtype=F64)
    h = _dense(8, "tanh")(x)
    h = layers.Add(dtype=F64)([h, _dense(8, "tanh")(h)])
    return keras.Model(x, _dense(3, "softmax")(h))


def _tape_loss_gradients(model, loss_fn, x, y):
    variables = model.trainable_variables
    out = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(y[i : i + 1], model(x[i : i + 1])))
        grads = tape.gradient(loss, variables)
        out.append(np.concatenate([g.numpy().ravel() for g in grads]))
    return np.stack(out)


def test_loss_gradients_of_a_graph_start_at_the_logits():
    """Cross-entropy reads the softmax's logits: the signal starts at the top
    Dense's logits (a LogitsSignal), on the rules, with the gradient norms."""
    keras.utils.set_random_seed(0)
    model = _softmax_residual()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 6)), np.eye(3)[rng.integers(0, 3, 6)]
    loss_fn = keras.losses.categorical_crossentropy
    G, choice = ju.per_sample_gradients(model, loss_fn, x, y, explain=True)
    assert choice.path == "layer rules", choice.why
    expected = _tape_loss_gradients(model, loss_fn, x, y)
    np.testing.assert_allclose(G, expected, rtol=1e-9, atol=1e-12)
    norms = ju.per_sample_gradient_norms(model, loss_fn, x, y)
    np.testing.assert_allclose(norms, np.linalg.norm(expected, axis=1), rtol=1e-9)


def test_loss_gradients_of_two_heads_fall_back_to_autodiff():
    """A loss on two outputs: a signal function on several outputs is refused
    (SignalOnSeveralOutputs), and autodiff gives the gradients."""
    model, x = _model_and_batch("two_heads", n_samples=4)
    y = np.random.default_rng(1).normal(size=(4, 5))  # both heads' targets

    def loss_fn(y_true, y_pred):
        first, second = y_pred
        return tf.reduce_sum(tf.square(first - y_true[:, :2]), -1) + tf.reduce_sum(
            tf.square(second - y_true[:, 2:]), -1
        )

    G, choice = ju.per_sample_gradients(model, loss_fn, x, y, explain=True)
    assert choice.path == "per-sample autodiff"
    variables = model.trainable_variables
    for i in range(4):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i : i + 1], model(x[i : i + 1]))
        grads = tape.gradient(loss, variables)
        expected = np.concatenate([g.numpy().ravel() for g in grads])
        np.testing.assert_allclose(G[i], expected, rtol=1e-9, atol=1e-12)


def test_a_model_called_on_its_own_inputs_is_walked_once():
    """A nested model called on its own input tensors (KerasHub's tasks call
    their backbone so: ``backbone(backbone.input)``) once aliased a tensor to
    itself and the walk looped (found by issue 54's generated make_private
    check), then was refused (issue 56 found BERT's classifier refused); its
    inputs are the outer model's already: the walk takes it as it is."""
    from jacutil.rules.graph import graph_nodes

    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    outer = keras.Model(inner.inputs[0], keras.layers.Dense(1)(inner(inner.inputs[0])))
    nodes, _ = graph_nodes(outer)
    walked = [inner.layers[0], outer.layers[-1]]
    assert [node.name for node in nodes] == [layer.name for layer in walked]
    x = np.random.default_rng(0).normal(size=(4, 3))
    jac = ju.compiled_jacobian(outer, method="rules")
    J = jac(x)
    assert jac.plan is not None, jac.fallback
    np.testing.assert_allclose(J, ju.per_sample_jacobian(outer, x), rtol=1e-5)


def test_a_layer_called_with_mask_none_keeps_its_rule():
    """keras.applications call BatchNormalization with ``mask=None`` (MobileNetV3:
    34 layers, issue 56): the same call as without it, so the rule stays."""
    layers = keras.layers
    inputs = keras.Input((5, 5, 3))
    h = layers.Conv2D(4, 3)(inputs)
    h = layers.BatchNormalization()(h, mask=None)
    model = keras.Model(inputs, layers.Dense(2)(layers.Flatten()(h)))
    model.layers[2].moving_variance.assign(np.linspace(0.5, 2, 4))
    plan, why = rules.plan_for(model, model.trainable_variables)
    assert plan is not None, why
    assert [rule for _, rule in plan.layers()][1] == "batch_norm (inference)"
    x = np.random.default_rng(0).normal(size=(3, 5, 5, 3)).astype("float32")
    jac = ju.compiled_jacobian(model, method="rules")
    J = jac(x)
    assert jac.plan is not None, jac.fallback
    reference = ju.per_sample_jacobian(model, x)
    np.testing.assert_allclose(J, reference, rtol=1e-4, atol=1e-5)


class _Task(keras.Model):
    """A KerasHub-style task: a Functional subclass built by
    ``super().__init__(inputs, outputs)``, its backbone called on the
    backbone's own (dict) inputs, Keras's call untouched."""

    def __init__(self, backbone, **kwargs):
        inputs = backbone.input
        h = backbone(inputs)
        super().__init__(inputs, keras.layers.Dense(2, name="logits")(h), **kwargs)


def test_a_functional_subclass_with_keras_call_takes_the_rules():
    layers = keras.layers
    inputs = {"a": keras.Input((3,), name="a"), "b": keras.Input((2,), name="b")}
    h = layers.Concatenate()([layers.Dense(4)(inputs["a"]), inputs["b"]])
    backbone = keras.Model(inputs, layers.Dense(3, activation="tanh")(h))
    task = _Task(backbone)
    assert rules.is_exact_keras(task)
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(4, 3)), "b": rng.normal(size=(4, 2))}
    x = {k: v.astype("float32") for k, v in x.items()}
    jac = ju.compiled_jacobian(task, method="rules")
    J = jac(x)
    assert jac.plan is not None, jac.fallback
    np.testing.assert_allclose(J, ju.per_sample_jacobian(task, x), rtol=1e-5, atol=1e-6)


def test_a_subclass_with_its_own_call_keeps_autodiff():
    class Doubled(_Task):
        def call(self, inputs, training=None):
            return 2 * super().call(inputs, training=training)

    inputs = {"a": keras.Input((3,), name="a")}
    backbone = keras.Model(inputs, keras.layers.Dense(3)(inputs["a"]))
    assert not rules.is_exact_keras(Doubled(backbone))
