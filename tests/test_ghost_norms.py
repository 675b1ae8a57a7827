"""Per-sample gradient norms without the gradients ("ghost norms").

``plan.squared_norms(x, signal)`` (``Rule.backward_norms`` layer by layer)
against the squared norms of per-sample gradients from one tape per sample,
in float64, for Dense (flat and on sequences), Conv1D/Conv2D (strides,
dilation, groups, padding), Embedding (repeated ids) and LayerNormalization
(one and two axes), with wanted subsets, r = 1 and r = 3 signal rows, by
each rule's own choice and by each route forced. Then: the Gram route is
taken where it is smaller than the blocks (no ``_backward`` call), the
blocks where T * T is large, and ``check_rule`` catches wrong norms.
"""

import numpy as np
import pytest

from jacutil import keras, rules, testing, tf
from jacutil.core._grouped import convolutions_by_group
from jacutil.core.target import resolve_target
from jacutil.rules.blocks import norms_route
from jacutil.rules.conv import ConvRule
from jacutil.rules.dense import DenseRule
from jacutil.rules.embedding import EmbeddingRule

layers = keras.layers
N_SAMPLES = 4


def _model(input_shape, *stack, dtype="float64"):
    keras.utils.set_random_seed(0)
    x = keras.Input(input_shape, dtype=dtype)
    h = x
    for layer in stack:
        h = layer(h)
    return keras.Model(x, h)


def _models():
    f64 = {"dtype": "float64"}
    return {
        "dense_flat": _model(
            (5,), layers.Dense(4, activation="tanh", **f64), layers.Dense(3, **f64)
        ),
        "dense_rank3": _model(
            (3, 8),
            layers.Dense(8, activation="tanh", **f64),
            layers.Dense(6, activation="softmax", **f64),
        ),
        "dense_rank4_no_bias": _model(
            (2, 3, 4),
            layers.Dense(3, use_bias=False, activation="sigmoid", **f64),
            layers.Dense(2, **f64),
        ),
        "dense_long_sequence": _model((12, 2), layers.Dense(2, **f64)),
        "conv1d": _model(
            (8, 8),
            layers.Conv1D(8, 3, strides=2, padding="same", activation="tanh", **f64),
            layers.Conv1D(8, 2, dilation_rate=2, groups=2, **f64),
            layers.Conv1D(4, 2, padding="causal", **f64),
        ),
        "conv2d": _model(
            (5, 5, 4),
            layers.Conv2D(4, 3, padding="same", groups=2, activation="tanh", **f64),
            layers.Conv2D(3, 2, strides=2, use_bias=False, **f64),
            layers.Conv2D(2, 2, dilation_rate=2, padding="same", **f64),
            layers.Flatten(**f64),
            layers.Dense(2, **f64),
        ),
        "embedding": _model(
            (6,),
            layers.Embedding(9, 3, **f64),
            layers.Dense(2, activation="tanh", **f64),
            dtype="int32",
        ),
        "embedding_small_vocabulary": _model(
            (7,), layers.Embedding(3, 2, **f64), dtype="int32"
        ),
        "layer_norm": _model(
            (3, 4),
            layers.Dense(4, **f64),
            layers.LayerNormalization(**f64),
            layers.Dense(2, **f64),
        ),
        "layer_norm_two_axes": _model(
            (3, 4),
            layers.Dense(4, **f64),
            layers.LayerNormalization(axis=[-2, -1], **f64),
            layers.Dense(2, **f64),
        ),
    }


MODELS = _models()


def _batch(model, rng):
    shape = (N_SAMPLES, *model.inputs[0].shape[1:])
    if model.inputs[0].dtype.startswith("int"):
        vocabulary = model.layers[1].input_dim
        ids = rng.integers(0, vocabulary, shape)
        ids[:, 1] = ids[:, 0]  # a repeated id in every sample
        return tf.constant(ids, "int32")
    return tf.constant(rng.standard_normal(shape))


def _wanted_subsets(model):
    """Every variable, then each layer's first variable (a kernel alone, gamma
    alone), then each layer's last (a bias alone, beta alone)."""
    subsets = [list(model.trainable_variables)]
    with_weights = [layer for layer in model.layers if layer.trainable_weights]
    subsets.append([layer.trainable_weights[0] for layer in with_weights])
    subsets.append(
        [layer.trainable_weights[-1] for layer in with_weights[::-1]]  # any order
    )
    return subsets


def _tape_norms(model, variables, x, signal):
    """(n, r): the squared norm of each sample's gradient of ``sum(s[i, k] * y_i)``,
    one tape per sample (a grouped convolution one group at a time: Keras's
    compiles per call)."""
    found = np.zeros(signal.shape[:2])
    for i in range(signal.shape[0]):
        with tf.GradientTape(persistent=True) as tape, convolutions_by_group():
            y = model(x[i : i + 1], training=False)[0]
            scores = [tf.reduce_sum(signal[i, k] * y) for k in range(signal.shape[1])]
        for k, score in enumerate(scores):
            grads = tape.gradient(score, variables)
            found[i, k] = sum(float(tf.reduce_sum(tf.square(g))) for g in grads)
        del tape
    return found


def _checked_plan(model, variables, x):
    plan, why = rules.plan_for(model, variables)
    assert plan is not None, why
    reason = plan.check(resolve_target(model, variables, False), x)
    assert reason is None, reason
    return plan


@pytest.mark.parametrize("name", sorted(MODELS))
def test_squared_norms_match_one_tape_per_sample(name):
    model = MODELS[name]
    rng = np.random.default_rng(1)
    x = _batch(model, rng)
    outputs = model(x, training=False)
    for variables in _wanted_subsets(model):
        plan = _checked_plan(model, variables, x)
        for n_rows in (1, 3):
            w = tf.constant(
                rng.standard_normal((N_SAMPLES, n_rows, *outputs.shape[1:]))
            )

            def signal(y, w=w):  # a function of the outputs, as a loss's derivative
                return w * (1 + y[:, None])

            expected = _tape_norms(model, variables, x, signal(outputs).numpy())
            for route in ("ghost", "blocks", None):
                if route is None:
                    found = plan.squared_norms(x, signal).numpy()
                else:
                    with norms_route(route):
                        found = plan.squared_norms(x, signal).numpy()
                np.testing.assert_allclose(
                    found, expected, rtol=1e-10, atol=1e-12, err_msg=f"{route}"
                )


def test_layer_norm_over_two_axes_has_its_rule():
    names = [rule for _, rule in rules.plan_for(
        MODELS["layer_norm_two_axes"], MODELS["layer_norm_two_axes"].weights
    )[0].layers()]  # fmt: skip
    assert names == ["dense", "layer_norm", "dense"]
    report = testing.check_rule(
        layers.LayerNormalization(axis=[-2, -1], dtype="float64"), input_shape=(3, 4)
    )
    assert report.passed and "norms" in report.errors


def _count_backward(monkeypatch, rule):
    """The layers whose norms took the route off the Gram matrices: a
    Dense's and an Embedding's through their blocks (``_backward``), a
    convolution's through its products per kernel offset (``_offset_groups``
    called directly, not for the patches of ``_groups``)."""
    calls = []
    if rule is ConvRule:
        inside = []
        groups, offsets = rule._groups, rule._offset_groups

        def counted_groups(self, *args):
            inside.append(True)
            try:
                return list(groups(self, *args))
            finally:
                inside.pop()

        def counted_offsets(self, *args):
            if not inside:
                calls.append(self.layer.name)
            return offsets(self, *args)

        monkeypatch.setattr(rule, "_groups", counted_groups)
        monkeypatch.setattr(rule, "_offset_groups", counted_offsets)
        return calls
    original = rule._backward

    def counted(self, *args):
        calls.append(self.layer.name)
        return original(self, *args)

    monkeypatch.setattr(rule, "_backward", counted)
    return calls


@pytest.mark.parametrize(
    "name, rule, ghost",
    [
        # the Gram route where T (p + q) <= p q
        ("dense_flat", DenseRule, True),  # T = 1
        ("dense_rank3", DenseRule, True),  # T = 3: 48 <= 64, 42 <= 48
        ("dense_long_sequence", DenseRule, False),  # T = 12: 48 > 4
        ("conv1d", ConvRule, True),  # T = 4, 2, 2: 128 <= 192, 24 <= 32, 40 <= 64
        ("conv2d", ConvRule, False),  # the first: T = 25: 25 * 20 > 18 * 2
        ("embedding", EmbeddingRule, True),  # T = 6 <= vocabulary 9
        ("embedding_small_vocabulary", EmbeddingRule, False),  # T = 7 > 3
    ],
)
def test_the_gram_route_is_taken_where_it_is_smaller(monkeypatch, name, rule, ghost):
    model = MODELS[name]
    x = _batch(model, np.random.default_rng(2))
    plan = _checked_plan(model, model.trainable_variables, x)
    calls = _count_backward(monkeypatch, rule)
    plan.squared_norms(x, lambda y: y[:, None])
    assert (not calls) if ghost else calls, calls


@pytest.mark.parametrize("top", [layers.Dense, layers.Conv1D])
def test_a_signal_at_the_logits(top):
    options = {"kernel_size": 2} if top is layers.Conv1D else {}
    last = top(3, activation="softmax", dtype="float64", **options)
    model = _model((5, 2), last)
    rng = np.random.default_rng(3)
    x = _batch(model, rng)
    plan = _checked_plan(model, model.trainable_variables, x)
    w = tf.constant(rng.standard_normal((N_SAMPLES, 2, *model.outputs[0].shape[1:])))
    found = []
    for route in ("ghost", "blocks"):
        with norms_route(route):
            found.append(plan.squared_norms(x, lambda y: rules.LogitsSignal(w)))
    last.activation = keras.activations.linear  # the tape reads the logits
    try:
        expected = _tape_norms(model, model.trainable_variables, x, w.numpy())
    finally:
        last.activation = keras.activations.softmax
    for by_route in found:
        np.testing.assert_allclose(by_route, expected, rtol=1e-10, atol=1e-12)


class ForgetsTheBiasNorm(DenseRule):
    """Its ghost norms leave the bias out."""

    def _backward_norms(self, saved, delta, wanted, need_signal):
        wanted = rules.Wanted(v for v in wanted if v is not self.bias)
        return DenseRule._backward_norms(self, saved, delta, wanted, need_signal)


def test_check_rule_catches_wrong_norms():
    layer = layers.Dense(3, activation="tanh", dtype="float64")
    report = testing.check_rule(
        layer, ForgetsTheBiasNorm, input_shape=(4,), raise_on_failure=False
    )
    assert [check for check, _ in report.failures] == ["norms"]
