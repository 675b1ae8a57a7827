"""The rules of a transformer's layers: EinsumDense, LoRA, RMSNorm, attention.

Each rule alone against autodiff in float64 (``check_rule``: blocks, signal,
ghost norms by both routes), its weighted sums against ``sum_i w_i`` of its
blocks, MultiHeadAttention (several inputs, so not ``check_rule``'s) against
a tape per sample, and a 2-layer transformer with LoRA on its attention
end to end. A rule made wrong on purpose (LoRA's scale, RMSNorm's epsilon)
fails the same checks.
"""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, rules, tf
from jacutil.core.target import resolve_target
from jacutil.rules.attention import MultiHeadAttentionRule
from jacutil.rules.dense import DenseRule
from jacutil.rules.normalization import LayerNormRule
from jacutil.rules.walk import Weighing
from jacutil.testing import check_rule
from tests.generated import tape_jacobian

layers = keras.layers
F64 = "float64"


def lora64(layer, rank=2, alpha=3):
    """``layer.enable_lora(rank, alpha)`` with float64 factors (Keras makes
    them float32, which a float64 check cannot tell from a wrong rule)."""
    add_weight = layer.add_weight

    def in_float64(*args, **kwargs):
        return add_weight(*args, **{**kwargs, "dtype": F64})

    object.__setattr__(layer, "add_weight", in_float64)
    try:
        layer.enable_lora(rank, lora_alpha=alpha)
    finally:
        object.__delattr__(layer, "add_weight")
    return layer


def built(layer, input_shape, lora=False, seed=0):
    """The float64 layer built on ``input_shape``, LoRA enabled, weights moved."""
    layer.build((None, *input_shape))
    if lora:
        lora64(layer)
    rng = np.random.default_rng(seed)
    for v in layer.weights:
        v.assign(v.numpy() + 0.3 * rng.standard_normal(v.shape))
    return layer


EQUATIONS = [  # equation, output_shape, input_shape, bias_axes
    ("abc,cd->abd", (None, 5), (3, 4), "d"),  # a Dense on positions
    ("abc,cde->abde", (None, 2, 3), (3, 4), "de"),  # per-head projections
    ("abcd,cde->abe", (None, 5), (3, 2, 4), "e"),  # the heads' output projection
    ("ab,bc->ac", (5,), (4,), "c"),
    ("...b,bc->...c", (5,), (3, 4), "c"),
    ("abc,cd->adb", (5, None), (3, 4), "d"),  # the output transposed
    ("abc,cd->abd", (3, 5), (3, 4), "bd"),  # a bias per position
    ("abc,dc->abd", (None, 5), (3, 4), "d"),  # the kernel transposed
]


@pytest.mark.parametrize("equation, output_shape, input_shape, bias_axes", EQUATIONS)
@pytest.mark.parametrize("bias, activation", [(False, None), (True, None),
                                              (True, "tanh")])  # fmt: skip
def test_einsum_dense(equation, output_shape, input_shape, bias_axes, bias, activation):
    layer = layers.EinsumDense(
        equation, output_shape, activation=activation,
        bias_axes=bias_axes if bias else None, dtype=F64,
    )  # fmt: skip
    report = check_rule(built(layer, input_shape), input_shape=input_shape)
    assert report.rule.startswith("einsum_dense")


@pytest.mark.parametrize("equation, output_shape, input_shape, bias_axes",
                         EQUATIONS[:-1])  # fmt: skip
def test_einsum_dense_with_lora(equation, output_shape, input_shape, bias_axes):
    layer = layers.EinsumDense(
        equation, output_shape, bias_axes=bias_axes, activation="tanh", dtype=F64
    )
    layer = built(layer, input_shape, lora=True)
    assert [v.trainable for v in layer.weights][:1] == [False]  # the frozen W0
    report = check_rule(layer, input_shape=input_shape)
    assert "+lora" in report.rule


@pytest.mark.parametrize(
    "equation, output_shape, lora, reason",
    [
        ("abc,dc->abd", (None, 5), True, "last axis is contracted"),
        ("abc,cd->ad", (5,), False, "summed away"),
        ("abc,bcd->abd", (3, 5), False, "in input, kernel and output"),
    ],
)
def test_einsum_dense_refusals(equation, output_shape, lora, reason):
    layer = built(layers.EinsumDense(equation, output_shape, dtype=F64), (3, 4), lora)
    rule, why = rules.rule_for(layer)
    assert rule is None and reason in why and equation in why


@pytest.mark.parametrize("input_shape", [(4,), (3, 4)])
@pytest.mark.parametrize("bias, activation", [(False, None), (True, "tanh")])
def test_dense_with_lora(input_shape, bias, activation):
    layer = layers.Dense(5, activation=activation, use_bias=bias, dtype=F64)
    layer = built(layer, input_shape, lora=True)
    assert [v.trainable for v in layer.weights][:1] == [False]  # the frozen W0
    report = check_rule(layer, input_shape=input_shape)
    assert report.rule.startswith("dense+lora")


def test_a_wrong_lora_scale_fails_the_check():
    """The checks see a LoRA rule off by its scale (alpha / rank)."""

    class Doubled(DenseRule):
        def __init__(self, layer):
            super().__init__(layer)
            self.lora = (*self.lora[:3], 2 * self.lora[3])

    layer = built(layers.Dense(3, dtype=F64), (4,), lora=True)
    report = check_rule(layer, Doubled, input_shape=(4,), raise_on_failure=False)
    assert not report.passed and {"vjp", "jvp"} & {c for c, _ in report.failures}


@pytest.mark.parametrize("input_shape", [(4,), (2, 3)])
def test_embedding_with_lora(input_shape):
    layer = built(layers.Embedding(5, 3, dtype=F64), input_shape, lora=True)
    report = check_rule(layer, input_shape=input_shape, input_dtype="int32")
    assert report.rule == "embedding+lora"


def test_quantized_layers_keep_their_refusal():
    dense = layers.Dense(4)
    dense.build((None, 8))
    dense.quantize("int8")
    rule, why = rules.rule_for(dense)
    assert rule is None and "quantized Dense" in why


@pytest.mark.parametrize("axis, input_shape", [(-1, (5,)), (-1, (3, 4)),
                                               ([-2, -1], (3, 4))])  # fmt: skip
@pytest.mark.parametrize("scale", [True, False])
def test_rms_layer_norm(axis, input_shape, scale):
    layer = layers.LayerNormalization(
        axis=axis, rms_scaling=True, scale=scale, epsilon=0.3, dtype=F64
    )
    report = check_rule(layer, input_shape=input_shape)
    assert report.rule == "layer_norm (rms)" and "jvp" in report.errors  # gamma


@pytest.mark.parametrize("axis, input_shape", [(-1, (5,)), (-1, (3, 4)),
                                               ([-2, -1], (3, 4))])  # fmt: skip
def test_rms_normalization(axis, input_shape):
    layer = layers.RMSNormalization(axis=axis, epsilon=0.3, dtype=F64)
    report = check_rule(layer, input_shape=input_shape)
    assert report.rule == "rms_norm" and "jvp" in report.errors


def test_rms_with_epsilon_misplaced_fails_the_check():
    """Keras's RMS scaling is ``a / sqrt(var + eps)``: ``sqrt(var) + eps`` fails."""

    class Misplaced(LayerNormRule):
        def _forward(self, a):
            _, variance = tf.nn.moments(a, axes=self.axes, keepdims=True)
            inverse = 1 / (tf.sqrt(variance) + self.layer.epsilon)
            return self._affine(a * inverse), (a * inverse, (inverse, a * 0))

    layer = layers.LayerNormalization(rms_scaling=True, epsilon=0.3, dtype=F64)
    report = check_rule(layer, Misplaced, input_shape=(5,), raise_on_failure=False)
    assert not report.passed and "forward" in {c for c, _ in report.failures}


# -- weighted sums (DP-SGD's book-keeping) --------------------------------------


def _rows(rule, x, rng, n_rows=1):
    y, saved = rule.forward(x)
    delta = tf.constant(rng.standard_normal((x.shape[0], n_rows, *y.shape[1:])))
    return saved, delta


@pytest.mark.parametrize(
    "make, input_shape",
    [
        (lambda: layers.EinsumDense("abc,cde->abde", (None, 2, 3), bias_axes="de",
                                    activation="tanh", dtype=F64), (3, 4)),
        (lambda: layers.EinsumDense("abc,cd->adb", (5, None), bias_axes="d",
                                    dtype=F64), (3, 4)),
        (lambda: layers.Dense(5, activation="tanh", dtype=F64), (3, 4)),
    ],
)  # fmt: skip
@pytest.mark.parametrize("lora", [False, True])
def test_weighted_sums_are_the_weighted_blocks(make, input_shape, lora):
    layer = built(make(), input_shape, lora=lora)
    rule, _ = rules.rule_for(layer)
    rng = np.random.default_rng(3)
    x = tf.constant(rng.standard_normal((4, *input_shape)))
    saved, delta = _rows(rule, x, rng)
    weights = tf.constant([0.5, 0.0, 2.0, 1.5], F64)  # DP's: 0 skips a sample
    for wanted in [rule.variables, rule.variables[-1:], rule.variables[:1]]:
        sums = rule.weighted_sums(saved, delta, wanted, weights)
        assert len(sums) == len(wanted)
        for v in wanted:
            block = rule.backward(saved, delta, [v], False)[0][v][:, 0].numpy()
            expected = np.einsum("n,nm->m", weights.numpy(), block)
            np.testing.assert_allclose(sums[v].numpy(), expected, rtol=1e-12,
                                       atol=1e-13)  # fmt: skip


# -- MultiHeadAttention ------------------------------------------------------------


def attention_model(cross=False, mask=False, causal=False, lora=False, key=False):
    """A functional model of one MultiHeadAttention, its inputs as called."""
    query = keras.Input((4, 6), dtype=F64)
    inputs = [query]
    value = keras.Input((5, 6), dtype=F64) if cross else query
    if cross:
        inputs.append(value)
    options = {}
    if key:
        options["key"] = keras.Input((5 if cross else 4, 6), dtype=F64)
        inputs.append(options["key"])
    if mask:
        options["attention_mask"] = keras.Input((4, 5 if cross else 4), dtype="bool")
        inputs.append(options["attention_mask"])
    if causal:
        options["use_causal_mask"] = True
    attention = layers.MultiHeadAttention(2, 3, dtype=F64)
    model = keras.Model(inputs, attention(query, value, **options))
    if lora:
        for name in ("_query_dense", "_value_dense", "_output_dense"):
            lora64(getattr(attention, name))
    rng = np.random.default_rng(0)
    for v in attention.weights:
        v.assign(v.numpy() + 0.3 * rng.standard_normal(v.shape))
    return model, attention


def _attention_batch(model, rng, n):
    x = []
    for t in model.inputs:
        shape = (n, *t.shape[1:])
        if t.dtype == "bool":  # every query sees at least itself
            seen = rng.random(shape) > 0.4
            x.append(tf.constant(seen | np.eye(shape[1], shape[2], dtype=bool)))
        else:
            x.append(tf.constant(rng.standard_normal(shape)))
    return x


def _tape_rows(model, x, variables):
    """Per sample: the Jacobian of the flat output in the variables (l, m), and
    in each float input, by id ``{id(input): (l, *shape)}``."""
    found = []
    for i in range(int(x[0].shape[0])):
        x_i = [t[i : i + 1] for t in x]
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([t for t in x_i if t.dtype.is_floating])
            y = tf.reshape(model(x_i), [-1])
        parts = tape.jacobian(y, variables)
        J = np.concatenate([np.reshape(p.numpy(), (len(y), -1)) for p in parts], 1)
        by_input = {
            id(t): tape.jacobian(y, x_t).numpy()[:, 0]
            for t, x_t in zip(model.inputs, x_i, strict=True) if x_t.dtype.is_floating
        }  # fmt: skip
        found.append((J, by_input))
        del tape
    return found


ATTENTION_CASES = {
    "self": {},
    "cross": {"cross": True},
    "cross_with_key": {"cross": True, "key": True},
    "self_masked": {"mask": True},
    "self_causal": {"causal": True},
    "cross_masked_causal": {"cross": True, "mask": True, "causal": True},
    "self_lora": {"lora": True},
    "cross_lora_masked": {"cross": True, "lora": True, "mask": True},
}


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_multi_head_attention(case):
    model, attention = attention_model(**ATTENTION_CASES[case])
    rule = MultiHeadAttentionRule(attention)
    assert ("+lora" in rule.describe()) == ("lora" in case)
    rng = np.random.default_rng(1)
    x = _attention_batch(model, rng, 3)
    by_id = {id(t): value for t, value in zip(model.inputs, x, strict=True)}
    values = [by_id[id(t)] for t in rule.inputs]  # as the layer was called
    need = [v.dtype.is_floating for v in values]
    y, saved = rule.forward(values)
    np.testing.assert_allclose(y.numpy(), model(x).numpy(), rtol=1e-13, atol=1e-14)
    n_outputs = int(np.prod(y.shape[1:]))
    identity = tf.reshape(tf.eye(n_outputs, dtype=F64), [1, n_outputs, *y.shape[1:]])
    delta = tf.broadcast_to(identity, [3, *identity.shape[1:]])
    blocks, below = rule.backward(saved, delta, rule.variables, need)
    J = tf.concat([blocks[v] for v in rule.variables], -1).numpy()
    for i, (J_i, by_input) in enumerate(_tape_rows(model, x, rule.variables)):
        np.testing.assert_allclose(J[i], J_i, rtol=1e-10, atol=1e-12)
        summed = {}  # a tensor read twice (self-attention): its signals summed
        for t, part in zip(rule.inputs, below, strict=True):
            if part is not None:
                summed[id(t)] = summed.get(id(t), 0) + part[i].numpy()
        assert summed.keys() == by_input.keys()
        for key, expected in by_input.items():
            np.testing.assert_allclose(summed[key], expected, rtol=1e-10, atol=1e-12)
    # ghost norms: the blocks' squared norms, every variable and each alone
    signal = tf.constant(rng.standard_normal((3, 2, *y.shape[1:])))
    for wanted in [rule.variables, rule.variables[:1], rule.variables[-1:]]:
        found, _ = rule.backward(saved, signal, wanted, need)
        expected = sum(np.sum(np.square(b.numpy()), -1) for _, b in found.items())
        squared, _ = rule.backward_norms(saved, signal, wanted, need)
        np.testing.assert_allclose(squared.numpy(), expected, rtol=1e-12)
    # weighted sums
    weights = tf.constant([0.5, 0.0, 2.0], F64)
    found, _ = rule.backward(saved, signal[:, :1], rule.variables, need)
    sums = rule.weighted_sums(saved, signal[:, :1], rule.variables, weights)
    for v in rule.variables:
        expected = np.einsum("n,nm->m", weights.numpy(), found[v][:, 0].numpy())
        np.testing.assert_allclose(sums[v].numpy(), expected, rtol=1e-12, atol=1e-13)


def test_multi_head_attention_refusals():
    query = keras.Input((4, 6))
    gated = layers.MultiHeadAttention(2, 3, use_gate=True)
    gated(query, query)
    assert "gated" in rules.rule_for(gated)[1]
    scores = layers.MultiHeadAttention(2, 3)
    scores(query, query, return_attention_scores=True)
    assert "scores" in rules.rule_for(scores)[1]
    twice = layers.MultiHeadAttention(2, 3)
    twice(query, query)
    twice(query, query)
    assert "2 times" in rules.rule_for(twice)[1]


class PositionEmbedding(layers.Layer):
    """``x + P``: a learned (length, width) table added to every sample, as
    KerasHub's ``PositionEmbedding`` (no rule: autodiff)."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=input_shape[1:], initializer="normal")

    def call(self, x):
        return x + self.table


def transformer(lora=True, seed=0, vocabulary=11, length=6, width=8):
    """Token and position embeddings, two blocks (MultiHeadAttention and a
    Dense feed-forward, each residual and LayerNorm'd), pooling, a head."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((length,), dtype="int32")
    h = layers.Embedding(vocabulary, width, dtype=F64)(ids)
    h = PositionEmbedding(dtype=F64)(h)
    attentions = []
    for _ in range(2):
        attention = layers.MultiHeadAttention(2, 4, dtype=F64)
        attentions.append(attention)
        h = layers.LayerNormalization(dtype=F64)(h + attention(h, h))
        inner = layers.Dense(16, activation="gelu", dtype=F64)(h)
        outer = layers.Dense(width, dtype=F64)(inner)
        h = layers.LayerNormalization(dtype=F64)(h + outer)
    h = layers.GlobalAveragePooling1D(dtype=F64)(h)
    model = keras.Model(ids, layers.Dense(3, dtype=F64)(h))
    factors = []
    if lora:
        for attention in attentions:
            for name in ("_query_dense", "_value_dense"):
                part = lora64(getattr(attention, name), rank=2, alpha=4)
                moved = np.random.default_rng(1).standard_normal(
                    part.lora_kernel_b.shape
                )
                part.lora_kernel_b.assign(0.1 * moved)  # not Keras's zeros
                factors += [part.lora_kernel_a, part.lora_kernel_b]
    x = np.random.default_rng(seed).integers(0, vocabulary, (5, length)).astype("int32")
    return model, x, factors


def test_a_transformer_with_lora_by_the_rules():
    model, x, factors = transformer()
    assert {v.path for v in model.trainable_variables} >= {v.path for v in factors}
    plan, why = rules.plan_for(model, factors)
    assert plan is not None, why
    layers_ = dict(plan.layers())
    assert all("autodiff" not in layers_[a.name] for a in model.layers
               if isinstance(a, layers.MultiHeadAttention))  # fmt: skip
    assert "multi_head_attention (einsum_dense x4+lora" in plan.describe()
    x = tf.constant(x)
    assert plan.check(resolve_target(model, factors, False), x) is None
    reference = tape_jacobian(model, x, factors)
    np.testing.assert_allclose(plan.tensor(x).numpy(), reference, rtol=1e-10,
                               atol=1e-12)  # fmt: skip
    # per-sample gradient norms of the factors for a signal of one row
    w = tf.constant(np.random.default_rng(2).standard_normal((5, 1, 3)))
    squared = plan.squared_norms(x, lambda y: w)[:, 0].numpy()
    G = np.einsum("nk,nkm->nm", w[:, 0].numpy(), reference)
    np.testing.assert_allclose(squared, np.sum(G * G, 1), rtol=1e-10)
    weights = tf.constant([1.0, 0.5, 0.0, 2.0, 0.25], F64)
    sums = plan.weighted_sums(x, Weighing(lambda y: w, lambda squared: weights))
    expected = np.einsum("n,nm->m", weights.numpy(), G)
    np.testing.assert_allclose(
        np.concatenate([np.ravel(s) for s in sums]), expected, rtol=1e-10, atol=1e-12
    )


def test_a_transformer_with_lora_end_to_end():
    """``jacutil.jacobian`` in the LoRA factors: the tape's, whatever path."""
    model, x, factors = transformer()
    J = ju.jacobian(model, x, variables=factors)
    np.testing.assert_allclose(J, tape_jacobian(model, x, factors), rtol=1e-9,
                               atol=1e-11)  # fmt: skip


def test_plan_for_takes_attention():
    model, _, factors = transformer()
    plan, why = rules.plan_for(model, factors)
    assert plan is not None, why
    by_layer = dict(plan.layers())
    attention = [a for a in model.layers if isinstance(a, layers.MultiHeadAttention)]
    assert attention and all("autodiff" not in by_layer[a.name] for a in attention)


# --- a layer called twice (issue 64): each call's blocks summed -------------------


def tied_model(dense_twice=False):
    """GPT-2's tie in float64: ids -> ReversibleEmbedding -> Dense (tanh) ->
    LayerNorm -> the same embedding's matrix, transposed, gives the logits;
    with ``dense_twice`` one Dense (a rule of its own) is called twice too."""
    from jacutil.teaching.transformer import ReversibleEmbedding

    keras.utils.set_random_seed(4)
    ids = keras.Input((5,), dtype="int32")
    embedding = ReversibleEmbedding(11, 6, dtype="float64")
    h = embedding(ids)
    inner = keras.layers.Dense(6, activation="tanh", dtype="float64")
    h = inner(h)
    if dense_twice:
        h = inner(h)
    h = keras.layers.LayerNormalization(dtype="float64")(h)
    return keras.Model(ids, embedding(h, reverse=True))


@pytest.mark.parametrize("dense_twice", [False, True])
def test_a_layer_called_twice_is_on_the_rules_its_calls_summed(dense_twice):
    model = tied_model(dense_twice)
    ids = np.random.default_rng(5).integers(0, 11, (4, 5)).astype("int32")
    labels = np.random.default_rng(6).integers(0, 11, (4, 5)).astype("int32")
    J, choice = ju.jacobian(model, ids, explain=True)
    assert choice.path == "layer rules", choice.why
    reference = tape_jacobian(model, ids, model.trainable_variables)
    np.testing.assert_allclose(J, reference, rtol=1e-10, atol=1e-12)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    gradients = ju.per_sample_gradients(model, loss, ids, labels)
    with tf.GradientTape(persistent=True) as tape:
        per_sample = tf.reduce_mean(loss(labels, model(ids)), axis=1)
        each = [per_sample[i] for i in range(4)]
    variables = model.trainable_variables
    rows = [
        np.concatenate([np.ravel(g) for g in tape.gradient(e, variables)])
        for e in each
    ]
    np.testing.assert_allclose(gradients, rows, rtol=1e-9, atol=1e-12)
    norms = ju.per_sample_gradient_norms(model, loss, ids, labels)
    np.testing.assert_allclose(norms, np.linalg.norm(rows, axis=1), rtol=1e-9)
    # G's diagonal: the squares of the summed blocks, not the sum of squares
    from jacutil.curvature.diagonal import ggn_diagonal

    y = np.random.default_rng(7).standard_normal((4, 55))
    reshape = keras.layers.Reshape((55,), dtype="float64")
    flat = keras.Model(model.inputs, reshape(model.outputs[0]))
    diagonal, how = ggn_diagonal(flat, ids, y=y, explain=True)
    assert "layer rules" in str(how)
    J_flat = tape_jacobian(flat, ids, flat.trainable_variables)
    np.testing.assert_allclose(diagonal, np.einsum("nlm,nlm->m", J_flat, J_flat),
                               rtol=1e-9, atol=1e-12)  # fmt: skip


# --- a composite layer opened into its sublayers (issue 64) --------------------


class EncoderBlock(keras.layers.Layer):
    """A post-norm encoder block of sublayers, as KerasHub's TransformerEncoder."""

    def __init__(self, width, heads, **kwargs):
        super().__init__(**kwargs)
        policy = self.dtype_policy
        self.attention = keras.layers.MultiHeadAttention(
            heads, width // heads, dtype=policy
        )
        self.norm1 = keras.layers.LayerNormalization(dtype=policy)
        self.inner = keras.layers.Dense(2 * width, activation="gelu", dtype=policy)
        self.outer = keras.layers.Dense(width, dtype=policy)
        self.norm2 = keras.layers.LayerNormalization(dtype=policy)

    def call(self, x, padding_mask=None):
        mask = keras.ops.expand_dims(padding_mask, 1)
        h = self.norm1(x + self.attention(x, x, attention_mask=mask))
        return self.norm2(h + self.outer(self.inner(h)))


class ValueDependent(EncoderBlock):
    """Its call uses a TensorFlow op, which a Keras tensor refuses: it cannot
    be opened, and stays whole."""

    def call(self, x, padding_mask=None):
        return super().call(tf.math.softplus(x), padding_mask)

    def compute_output_spec(self, x, padding_mask=None):
        return keras.KerasTensor(x.shape, dtype=x.dtype)


def encoder(block=EncoderBlock):
    keras.utils.set_random_seed(3)
    ids = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, dtype="float64")(ids)
    mask = keras.ops.not_equal(ids, 0)
    h = block(8, 2, dtype="float64")(h, padding_mask=mask)
    h = EncoderBlock(8, 2, dtype="float64")(h, padding_mask=mask)
    pooled = keras.layers.GlobalAveragePooling1D(dtype="float64")(h)
    return keras.Model(ids, keras.layers.Dense(3, dtype="float64")(pooled))


def test_a_composite_layer_is_opened_into_its_sublayers_rules():
    model = encoder()
    x = np.random.default_rng(1).integers(1, 20, (4, 6)).astype("int32")
    x[:, 4:] = 0  # padding
    J, choice = ju.jacobian(model, x, explain=True)
    assert choice.path == "layer rules", choice.why
    rules_used = [rule for _, rule in choice.layers]
    assert rules_used.count("multi_head_attention (einsum_dense x4, its softmax "
                            "core by vjp)") == 2  # fmt: skip
    assert not any("EncoderBlock" in rule for rule in rules_used)
    reference = tape_jacobian(model, x, model.trainable_variables)
    np.testing.assert_allclose(J, reference, rtol=1e-10, atol=1e-12)
    y = np.random.default_rng(2).standard_normal((4, 3))
    loss = keras.losses.mean_squared_error
    norms = ju.per_sample_gradient_norms(model, loss, x, y)
    gradients = ju.per_sample_gradients(model, loss, x, y)
    np.testing.assert_allclose(norms, np.linalg.norm(gradients, axis=1), rtol=1e-10)


def test_a_composite_whose_call_reads_values_stays_whole_and_right():
    model = encoder(ValueDependent)
    x = np.random.default_rng(1).integers(1, 20, (3, 6)).astype("int32")
    J, choice = ju.jacobian(model, x, explain=True)
    layers_named = dict(choice.layers)
    assert any("autodiff" in rule for name, rule in layers_named.items()
               if name.startswith("value_dependent"))  # fmt: skip
    reference = tape_jacobian(model, x, model.trainable_variables)
    np.testing.assert_allclose(J, reference, rtol=1e-10, atol=1e-12)
