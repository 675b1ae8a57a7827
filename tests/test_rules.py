"""The layer rules (jacutil.rules) and the one entry, jacutil.jacobian.

Every rule is proved against float64 finite differences on the zoo in
test_stages.py (stages "rules" and "jacobian"); here: which rule each layer
gets, what falls back and why, a rule that lies is caught, and the entry's
choices (chunks, out, copies, the cache).
"""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, rules, tf
from tests.architectures import build

layers = keras.layers

# zoo entry -> the rule of each layer, input to output
PLANS = {
    "mlp": ["dense+relu", "dense+relu", "dense"],
    "lstm": ["lstm (BPTT)", "dense"],
    "gru_sequences": ["gru (BPTT)", "dense"],
    "simple_rnn": ["simple_rnn (BPTT)", "dense"],
    "convolution": ["conv2d+tanh", "reshape", "dense"],
    "strided_conv": ["conv2d+tanh", "reshape", "dense"],
    "embedding": ["embedding", "reshape", "dense"],
    "frozen_layer": ["dense+tanh", "batch_norm (inference)", "dense"],
    "activation_layers": [
        "dense", "tanh", "dense", "ReLU (slope by autodiff)",
        "identity (inference)", "dense",
    ],
    "causal_conv1d": [
        "conv1d+gelu (slope by autodiff)", "layer_norm",
        "conv1d+silu (slope by autodiff)",
        "global_average_pooling", "dense+softmax",
    ],
    "dilated_conv": [
        "conv2d+elu (slope by autodiff)", "max_pooling",
        "conv2d+softplus (slope by autodiff)", "reshape", "dense+log_softmax",
    ],
    "custom_layer": [
        "dense+<lambda> (signal by autodiff)", "autodiff (no rule for Scale)",
        "dense+tanh", "LeakyReLU (slope by autodiff)", "dense",
    ],
    # graphs (tests/test_rules_graphs.py): steps in topological order
    "attention": [
        "multi_head_attention (einsum_dense x4, its softmax core by vjp)", "add",
        "layer_norm", "reshape", "dense",
    ],
    "two_inputs": ["reshape", "concatenate", "dense+tanh", "dense"],
    "dict_heads": ["dense+tanh", "dense", "dense"],
    "two_heads_list": ["dense+tanh", "dense", "dense+tanh"],
    "two_inputs_two_heads": ["concatenate", "dense+tanh", "dense", "dense+tanh"],
}  # fmt: skip

FALLBACKS = {
    "bidirectional": "is a Bidirectional",
    "subclassed": "TanhSkip is a subclass",
    "sequential_subclass": "DoubledSequential is a subclass",
    "explicit_nontrainable": "not a Keras model",
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_each_layer_gets_its_rule(name):
    case = build(name)
    jac = ju.compiled_jacobian(case.model32, method="rules")
    assert jac.fallback is None
    assert [rule for _, rule in jac.plan.layers()] == PLANS[name]


@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_models_beyond_the_rules_fall_back_and_say_why(name):
    case = build(name)
    x = case.batch(3)
    J, choice = ju.jacobian(case.model64, x, variables=case.variables64, explain=True)
    assert choice.path == "per-sample autodiff"
    assert FALLBACKS[name] in choice.why
    assert "vectorized_map" in choice.formulation or "map_fn" in choice.formulation
    np.testing.assert_allclose(
        J,
        ju.per_sample_jacobian(case.model64, x, variables=case.variables64),
        rtol=1e-10,
        atol=1e-12,
    )


def test_training_mode_and_frozen_variables():
    model = build("mlp").model32
    jac = ju.compiled_jacobian(model, method="rules", training=True)
    assert jac.plan is None and "training=True" in jac.fallback
    model = build("frozen_layer").model32
    # BatchNorm's moving statistics are variables no rule writes
    jac = ju.compiled_jacobian(model, method="rules", variables=model.variables)
    assert jac.plan is None and "moving_mean" in jac.fallback


def test_unused_variable_gets_zero_columns():
    case = build("custom_layer")
    x = case.batch(4)
    J = ju.jacobian(case.model64, x)
    names = [v.path for v in case.model64.trainable_variables]
    sizes = [int(np.prod(v.shape)) for v in case.model64.trainable_variables]
    start = sum(sizes[: names.index(next(n for n in names if "unused" in n))])
    assert np.all(J[:, :, start : start + 2] == 0)
    assert np.abs(J).max() > 0.1


def test_a_wrong_rule_is_caught_on_the_first_call():
    """A rule that lies (here: Dense without its activation) is checked on one
    sample against autodiff; the model falls back, with the reason."""

    class Lying(rules.dense.DenseRule):
        def __init__(self, layer):
            super().__init__(layer)
            self.activation = rules.activations.Activation(None)

    with rules.registered(layers.Dense, Lying):
        case = build("mlp")
        x = case.batch(4)
        jac = ju.compiled_jacobian(case.model64, method="rules")
        assert jac.plan is not None
        J = jac(x)
    assert rules.RULES[layers.Dense] is rules.dense.DenseRule
    assert jac.plan is None and "differ from autodiff" in jac.fallback
    np.testing.assert_allclose(J, ju.per_sample_jacobian(case.model64, x), rtol=1e-10)


def test_a_registered_rule_is_used():
    """Users register a rule for their own layer type: ``@rules.register(T)``,
    or for a while: ``with rules.registered(T, RuleClass):``."""

    class Double(layers.Layer):
        def call(self, x):
            return 2 * x

    class DoubleRule(rules.Rule):
        name = "double"

        def _forward(self, a):
            return 2 * a, None

        def _backward(self, saved, delta, wanted, need_signal):
            return {}, 2 * delta

    with rules.registered(Double, DoubleRule):
        model = keras.Sequential(
            [
                keras.Input((3,)),
                layers.Dense(4, activation="tanh"),
                Double(),
                layers.Dense(2),
            ]
        )
        x = np.random.default_rng(0).standard_normal((5, 3)).astype("float32")
        J, choice = ju.jacobian(model, x, explain=True)
    assert Double not in rules.RULES
    assert "double" in [rule for _, rule in choice.layers]
    np.testing.assert_allclose(
        J, ju.per_sample_jacobian(model, x), rtol=1e-5, atol=1e-6
    )


def test_conv_options_against_finite_differences():
    """Strides with valid padding, a causal Conv1D without dilation, no bias."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((9, 2), dtype="float64"),
            layers.Conv1D(
                2, 3, strides=2, use_bias=False, activation="tanh", dtype="float64"
            ),
            layers.Conv1D(2, 2, padding="causal", dtype="float64"),
            layers.Flatten(dtype="float64"),
            layers.Dense(2, dtype="float64"),
        ]
    )
    x = np.random.default_rng(1).standard_normal((3, 9, 2))
    J, choice = ju.jacobian(model, x, explain=True)
    assert choice.path == "layer rules"
    np.testing.assert_allclose(
        J, ju.finite_difference_jacobian(model, x), rtol=1e-6, atol=1e-8
    )


def test_entry_chunks_into_out_when_past_the_budget(tmp_path):
    model = ju.question_mlp(hidden=(8,))
    x, _ = ju.regression_data(50)
    expected = ju.per_sample_jacobian(model, x)
    J, choice = ju.jacobian(model, x, memory_budget=40_000, explain=True)
    assert choice.chunks > 1 and choice.chunk_size < 50
    np.testing.assert_allclose(J, expected, rtol=1e-5, atol=1e-6)
    out = np.lib.format.open_memmap(
        tmp_path / "J.npy", mode="w+", dtype="float32", shape=expected.shape
    )
    J, choice = ju.jacobian(model, x, out=out, explain=True)
    assert J is out and choice.chunks == 1
    np.testing.assert_allclose(
        np.load(tmp_path / "J.npy"), expected, rtol=1e-5, atol=1e-6
    )


def test_entry_returns_a_view_unless_asked_to_copy_and_reuses_its_function():
    model = ju.question_mlp(hidden=(8,))
    x, _ = ju.regression_data(20)
    J, first = ju.jacobian(model, x, explain=True)
    # the first call on a shape runs the rules eagerly; the second traces
    assert not first.traced and "ran eagerly" in str(first)
    assert not J.flags.writeable
    J, second = ju.jacobian(model, x[:7], copy=True, explain=True)
    assert second.traced and J.flags.writeable and J.shape[0] == 7
    J, third = ju.jacobian(model, x[:3], explain=True)
    assert not third.traced and "compiled function reused" in str(third)
    assert "layer dense_0: dense+relu" in str(third)


def test_a_shared_layer_is_on_the_rules_its_calls_summed():
    """Issue 64: a layer called twice is a step per call, its blocks summed."""
    case = build("shared_layer")
    x = case.batch(3)
    J, choice = ju.jacobian(case.model64, x, variables=case.variables64, explain=True)
    assert choice.path == "layer rules", choice.why
    reference = ju.loop_jacobian(case.model64, x, variables=case.variables64)
    np.testing.assert_allclose(J, reference, rtol=1e-10, atol=1e-12)


def test_entry_errors_teach():
    model = ju.question_mlp(hidden=(8,))
    x, _ = ju.regression_data(5)
    with pytest.raises(ValueError, match="memory_budget must be a positive"):
        ju.jacobian(model, x, memory_budget=0)
    with pytest.raises(ValueError, match="smaller than one sample"):
        ju.jacobian(model, x, memory_budget=10)
    with pytest.raises(ValueError, match="takes"):
        ju.jacobian(model, x[:, :3])


def test_rules_under_xla_and_float32_match():
    case = build("dilated_conv")
    x = case.batch(6)
    expected = ju.finite_difference_jacobian(case.model64, x)
    J = ju.compiled_jacobian(case.model32, method="rules", jit_compile=True)(x)
    np.testing.assert_allclose(J, expected, rtol=1e-4, atol=1e-5)


def test_normalization_over_feature_maps_against_finite_differences():
    """BatchNorm (moved statistics) and LayerNorm on a 4-D feature map: their
    blocks sum over every pixel."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [
            keras.Input((5, 5, 1), dtype="float64"),
            layers.Conv2D(3, 2, activation="tanh", dtype="float64"),
            layers.BatchNormalization(dtype="float64"),
            layers.LayerNormalization(dtype="float64"),
            layers.AveragePooling2D(2, dtype="float64"),
            layers.Flatten(dtype="float64"),
            layers.Dense(2, dtype="float64"),
        ]
    )
    rng = np.random.default_rng(5)
    model.set_weights(
        [w + 0.3 * rng.random(w.shape) for w in model.get_weights()]
    )  # moving variance stays positive
    x = rng.standard_normal((3, 5, 5, 1))
    J, choice = ju.jacobian(model, x, explain=True)
    assert choice.path == "layer rules"
    assert [rule for _, rule in choice.layers][1:3] == [
        "batch_norm (inference)",
        "layer_norm",
    ]
    np.testing.assert_allclose(
        J, ju.finite_difference_jacobian(model, x), rtol=1e-6, atol=1e-8
    )


def test_explicit_variables_in_any_order():
    """Columns follow ``variables=``, here a bias before a kernel, a layer skipped."""
    case = build("mlp")
    model = case.model64
    dense = [layer for layer in model.layers if layer.weights]
    chosen = [dense[2].bias, dense[0].kernel, dense[0].bias]
    x = case.batch(4)
    jac = ju.compiled_jacobian(model, method="rules", variables=chosen)
    J = jac(x)
    assert jac.plan is not None
    np.testing.assert_allclose(
        J,
        ju.finite_difference_jacobian(model, x, variables=chosen),
        rtol=1e-6,
        atol=1e-8,
    )


def test_a_joint_block_is_split_where_its_variables_are_apart():
    """A kernel and its bias come as one joint block; the engine places it whole
    where they are adjacent and splits it where they are not (or reversed)."""
    case = build("mlp")
    model = case.model64
    dense = [layer for layer in model.layers if layer.weights]
    x = case.batch(3)
    for chosen in (
        [dense[0].bias, dense[1].kernel, dense[0].kernel],  # apart, reversed
        [dense[1].bias, dense[1].kernel],  # adjacent, reversed
    ):
        jac = ju.compiled_jacobian(model, method="rules", variables=chosen)
        J = jac(x)
        assert jac.plan is not None
        np.testing.assert_allclose(
            J, ju.per_sample_jacobian(model, x, variables=chosen), rtol=1e-10,
            atol=1e-12,
        )  # fmt: skip


def test_the_registry_refuses_a_second_rule_unless_asked():
    class Other(rules.dense.DenseRule):
        name = "other"

    with pytest.raises(rules.AlreadyRegistered, match="registered"):
        rules.register(layers.Dense)(Other)
    assert rules.RULES[layers.Dense] is rules.dense.DenseRule
    rules.register(layers.Dense)(rules.dense.DenseRule)  # the same rule again: fine
    with rules.registered(layers.Dense, Other):
        assert rules.RULES[layers.Dense] is Other
    assert rules.RULES[layers.Dense] is rules.dense.DenseRule
    try:
        rules.register(layers.Dense, overwrite=True)(Other)
        assert rules.RULES[layers.Dense] is Other
    finally:
        rules.register(layers.Dense, overwrite=True)(rules.dense.DenseRule)


def test_a_rule_writes_the_private_steps_not_the_checked_ones():
    with pytest.raises(TypeError, match="write _backward instead"):

        class Overriding(rules.Rule):
            def backward(self, saved, delta, wanted, need_signal):
                return {}, delta

    with pytest.raises(TypeError, match="abstract"):
        type("NoBackward", (rules.Rule,), {})(layers.Dense(2))


def test_entry_takes_forward_mode_when_outputs_outnumber_parameters():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            layers.Dense(2, activation="tanh"),
            layers.Dense(1000, trainable=False),
        ]
    )  # m = 8 parameters, l = 1,000 outputs
    x = np.random.default_rng(0).standard_normal((6, 3)).astype("float32")
    J, choice = ju.jacobian(model, x, explain=True)
    assert choice.path == "forward mode" and choice.traced
    np.testing.assert_allclose(
        J, ju.per_sample_jacobian(model, x), rtol=1e-5, atol=1e-6
    )
    _, again = ju.jacobian(model, x, explain=True)
    assert not again.traced


class ClipLayer(layers.Layer):
    def call(self, x, limit=1.0):
        return keras.ops.clip(x, -limit, limit)


def _clipped_model():
    keras.utils.set_random_seed(21)
    inputs = keras.Input((4,))
    h = ClipLayer()(layers.Dense(8, activation="tanh")(inputs), limit=0.3)
    return keras.Model(inputs, layers.Dense(2)(h))


def _quiet_sample_zero():
    x = np.random.default_rng(0).standard_normal((12, 4)).astype("float32") * 3
    x[0] *= 1e-3  # inside the clip: sample 0 alone cannot tell a wrong rule
    return x


def test_the_plan_replays_each_call_with_its_arguments():
    model = _clipped_model()
    nodes = rules.chain_nodes(model)
    assert [n.extra_arguments() for n in nodes] == ["", "limit=0.3", ""]
    jac = ju.compiled_jacobian(model, method="rules")
    x = _quiet_sample_zero()
    np.testing.assert_allclose(jac(x), ju.loop_jacobian(model, x), rtol=1e-4,
                               atol=1e-6)  # fmt: skip
    assert jac.plan is not None  # proved: the rules replay limit=0.3
    assert "autodiff (no rule for ClipLayer)" in jac.plan.describe()


def test_a_rule_that_ignores_call_arguments_falls_back_and_says_so():
    class ClipAsIdentity(rules.Rule):
        def _forward(self, a):
            return a, None

        def _backward(self, saved, delta, wanted, need_signal):
            return {}, delta

    with rules.registered(ClipLayer, ClipAsIdentity):
        model = _clipped_model()
        jac = ju.compiled_jacobian(model, method="rules")
        jac(_quiet_sample_zero())
    assert jac.plan is not None and "called with limit=0.3" in jac.plan.describe()


class ClipAt03(layers.Layer):
    def call(self, x):
        return keras.ops.clip(x, -0.3, 0.3)


def test_the_check_looks_past_sample_zero():
    """A rule that takes the clip for the identity is right on sample 0 (its
    units stay inside the clip) and wrong on the others: caught."""

    class ClipAsIdentity(rules.Rule):
        def _forward(self, a):
            return a, None

        def _backward(self, saved, delta, wanted, need_signal):
            return {}, delta

    model = keras.Sequential(
        [keras.Input((4,)), layers.Dense(8, activation="tanh"), ClipAt03(),
         layers.Dense(2)]
    )  # fmt: skip
    x = _quiet_sample_zero()
    with rules.registered(ClipAt03, ClipAsIdentity):
        jac = ju.compiled_jacobian(model, method="rules")
        J = jac(x)
    assert jac.plan is None and "differ from autodiff" in jac.fallback
    assert "on sample 0" not in jac.fallback
    np.testing.assert_allclose(J, ju.loop_jacobian(model, x), rtol=1e-4, atol=1e-6)


def test_a_plan_is_used_only_where_it_was_checked():
    model = ju.question_mlp(seed=0, hidden=(4,))
    x, _ = ju.regression_data(5, seed=1)
    target = ju.core.target.resolve_target(model)
    plan, _ = rules.plan_for(model, target.variables)
    with pytest.raises(rules.plan.UncheckedPlan):
        plan.tensor(ju.core.batch.as_batch(x, target))
    assert plan.check(target, ju.core.batch.as_batch(x, target)) is None
    np.testing.assert_allclose(
        plan.tensor(ju.core.batch.as_batch(x, target)), ju.loop_jacobian(model, x),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize("padding", ["VALID", "SAME"])
@pytest.mark.parametrize("static", [True, False])
def test_kernel_offsets_are_extract_patches(padding, static):
    """ConvRule's patches (``kernel_offsets``, strided slices) equal
    ``tf.image.extract_patches`` - same order, strides, dilation and
    padding - with static and with unknown image sizes."""
    from jacutil.rules.conv import kernel_offsets

    rng = np.random.default_rng(0)
    cases = [((5, 6), (1, 1), (1, 1), (1, 1)), ((7, 9), (3, 2), (2, 1), (1, 1)),
             ((8, 9), (2, 3), (1, 2), (1, 1)), ((8, 7), (3, 3), (1, 1), (2, 2)),
             ((6, 9), (2, 3), (1, 1), (1, 3))]  # fmt: skip
    for size, kernel, strides, rates in cases:
        image = tf.constant(rng.normal(size=(3, *size, 2)))
        expected = tf.image.extract_patches(
            image, [1, *kernel, 1], [1, *strides, 1], [1, *rates, 1], padding
        )

        def patches(image, kernel=kernel, strides=strides, rates=rates):
            offsets = kernel_offsets(image, kernel, strides, rates, padding)
            return tf.concat(offsets, -1)

        spec = tf.TensorSpec([None, *(size if static else (None, None)), 2], tf.float64)
        got = tf.function(patches, input_signature=[spec])(image)
        np.testing.assert_array_equal(got.numpy(), expected.numpy())


@pytest.mark.parametrize(
    "kind, options",
    [
        ("Conv2D", dict(kernel_size=(3, 2), padding="valid")),
        ("Conv2D", dict(kernel_size=(3, 2), padding="same")),
        ("Conv2D", dict(kernel_size=(2, 3), padding="same", dilation_rate=(2, 1))),
        ("Conv2D", dict(kernel_size=4, padding="same")),  # the odd pad after
        ("Conv1D", dict(kernel_size=3, padding="causal", dilation_rate=2)),
        ("Conv1D", dict(kernel_size=2, padding="same")),
    ],
)
def test_the_signal_below_a_convolution_is_one_grouped_convolution(kind, options):
    """ConvRule's signal below for every row at once (one convolution of l
    groups, ``_below_by_rows``) equals the input gradient by autodiff of
    each row, in float64; strides and groups take autodiff."""
    from jacutil.rules.conv import ConvRule

    rng = np.random.default_rng(0)
    layer = getattr(layers, kind)(3, dtype="float64", **options)
    size = (7,) if layer.rank == 1 else (7, 6)
    layer.build((None, *size, 2))
    layer.kernel.assign(rng.normal(size=layer.kernel.shape))
    rule = ConvRule(layer)
    image = rule._as_image(tf.constant(rng.normal(size=(5, *size, 2))))
    z_shape = rule._convolve(image).shape[1:]
    delta = tf.constant(rng.normal(size=(5, 3, *z_shape)))  # (n, l, h', w', c_out)
    by_rows = rule._below_by_rows(image, delta)
    assert by_rows is not None
    for k in range(3):
        with tf.GradientTape() as tape:
            tape.watch(image)
            z = rule._convolve(image)
        expected = tape.gradient(z, image, delta[:, k])
        np.testing.assert_allclose(by_rows[:, k], expected, rtol=1e-12, atol=1e-12)
    traced = []  # traced with unknown sizes: the channels stay known

    def below(image, delta):
        traced.append(rule._below_by_rows(image, delta).shape)
        return traced[-1].rank

    unknown = [
        tf.TensorSpec([None] * 3 + [2], tf.float64),
        tf.TensorSpec([None, 3, None, None, delta.shape[-1]], tf.float64),
    ]
    tf.function(below, input_signature=unknown)(image, delta)  # fmt: skip
    assert traced == [tf.TensorShape([None, 3, None, None, 2])]
    for other in (dict(strides=2), dict(groups=2)):
        layer = layers.Conv2D(4, 2, dtype="float64", **other)
        layer.build((None, 7, 6, 2))
        assert ConvRule(layer)._below_by_rows(image, delta) is None, other
