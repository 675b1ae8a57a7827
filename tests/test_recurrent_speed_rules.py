"""The recurrent rules' blocks, signal below and squared norms (both routes)
against a float64 tape, and the cost model that picks the norms' route.

The rules form each block as one batched product over the time axis and the
norms by the Gram matrices of the steps where that is cheaper (issue 38);
every layer is built in float64 and its per-sample Jacobian is taken by
``tape.jacobian`` through Keras's own layer: an independent reference.
"""

import numpy as np
import pytest

from jacutil.core._tf import keras, tf
from jacutil.rules import recurrent
from jacutil.rules.blocks import norms_route
from jacutil.rules.registry import Wanted, rule_for

N_SAMPLES, STEPS, FEATURES, N_ROWS = 3, 5, 3, 2

LAYERS = {
    "lstm": lambda **kw: keras.layers.LSTM(4, **kw),
    "gru": lambda **kw: keras.layers.GRU(4, **kw),
    "simple_rnn": lambda **kw: keras.layers.SimpleRNN(4, **kw),
}


def _built(kind, steps=STEPS, features=FEATURES, **options):
    keras.utils.set_random_seed(7)
    layer = LAYERS[kind](dtype="float64", **options)
    inputs = keras.Input((steps, features), dtype="float64")
    keras.Model(inputs, layer(inputs))
    for variable in layer.trainable_variables:  # non-zero biases too
        variable.assign(np.random.default_rng(1).normal(0, 0.5, variable.shape))
    return layer


def _reference(layer, x, delta):
    """Per-sample blocks (n, r, m) and the signal below, by a float64 tape."""
    x = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = layer(x, training=False)
        contracted = [tf.reduce_sum(y * delta[:, k], axis=list(range(1, y.shape.rank)))
                      for k in range(delta.shape[1])]  # fmt: skip
    blocks, below = [], []
    for row in contracted:
        jac = tape.jacobian(row, layer.trainable_variables, experimental_use_pfor=False)
        blocks.append(np.concatenate([np.reshape(j, (N_SAMPLES, -1)) for j in jac], -1))
        below.append(tape.gradient(row, x).numpy())
    # row i depends on sample i alone: its gradient is sample i's block
    blocks = np.stack(blocks, 1)
    return blocks, np.stack(below, 1)


def _variants():
    for kind in LAYERS:
        for sequences in (False, True):
            for use_bias in (True, False):
                options = {"return_sequences": sequences, "use_bias": use_bias}
                yield kind, options


@pytest.mark.parametrize(("kind", "options"), list(_variants()))
def test_blocks_below_and_norms_match_a_float64_tape(kind, options):
    layer = _built(kind, **options)
    rule, reason = rule_for(layer)
    assert rule is not None, reason
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N_SAMPLES, STEPS, FEATURES))
    y, saved = rule.forward(tf.constant(x))
    np.testing.assert_allclose(y, layer(x, training=False), rtol=1e-10, atol=1e-12)
    delta = tf.constant(rng.normal(size=(N_SAMPLES, N_ROWS, *y.shape[1:])))
    expected, expected_below = _reference(layer, x, delta)

    wanted = Wanted.of(layer.trainable_variables)
    blocks, below = rule.backward(saved, delta, wanted, True)
    by_variable = {}
    for key, block in blocks.items():
        keys = key if isinstance(key, tuple) else (key,)
        sizes = [int(np.prod(v.shape)) for v in keys]
        parts = np.split(block.numpy(), np.cumsum(sizes)[:-1], axis=-1)
        by_variable.update({id(v): p for v, p in zip(keys, parts, strict=True)})
    got = np.concatenate([by_variable[id(v)] for v in layer.trainable_variables], -1)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(below, expected_below, rtol=1e-9, atol=1e-12)

    squared_reference = np.sum(expected**2, -1)
    for route in ("ghost", "blocks"):
        with norms_route(route):
            squared, below = rule.backward_norms(saved, delta, wanted, True)
        np.testing.assert_allclose(squared, squared_reference, rtol=1e-9)
        np.testing.assert_allclose(below, expected_below, rtol=1e-9, atol=1e-12)
    # each variable alone: a bias alone, a kernel without its bias
    for variable in layer.trainable_variables:
        squared, _ = rule.backward_norms(saved, delta, Wanted.of([variable]), False)
        alone = by_variable[id(variable)]
        np.testing.assert_allclose(squared, np.sum(alone**2, -1), rtol=1e-9)


def _gram_calls(monkeypatch, layer):
    """The (p, q) of each kernel whose norms took the Gram route."""
    calls = []
    real = recurrent.gram_norms

    def spy(a, delta):
        calls.append((a.shape[-1], delta.shape[-1]))
        return real(a, delta)

    monkeypatch.setattr(recurrent, "gram_norms", spy)
    rule, _ = rule_for(layer)
    x = tf.zeros([2, *layer.input.shape[1:]], "float64")
    y, saved = rule.forward(x)
    delta = tf.ones([2, 1, *y.shape[1:]], "float64")
    rule.backward_norms(saved, delta, Wanted.of(layer.trainable_variables), False)
    return calls


def test_the_cost_model_picks_the_gram_route_for_few_steps_and_wide_layers(
    monkeypatch,
):
    # T = 2 steps, 32 units, 40 features: T (p + q) is far below p q for K
    # (2 * (40 + 128) <= 40 * 128) and for R with its bias (2 * 161 <= 33 * 128)
    layer = keras.layers.LSTM(32, dtype="float64")
    keras.Model(inputs := keras.Input((2, 40), dtype="float64"), layer(inputs))
    assert sorted(_gram_calls(monkeypatch, layer)) == [(33, 128), (40, 128)]


def test_the_cost_model_forms_the_blocks_for_many_steps_and_narrow_layers(
    monkeypatch,
):
    # T = 30 steps, 2 units, 1 feature: T (p + q) > p q for K and R
    layer = keras.layers.LSTM(2, dtype="float64")
    keras.Model(inputs := keras.Input((30, 1), dtype="float64"), layer(inputs))
    assert _gram_calls(monkeypatch, layer) == []


def test_the_cost_model_splits_a_layer_between_the_routes(monkeypatch):
    # T = 8, 64 units, 2 features: K (2 x 64) takes its block (8 * 66 > 128),
    # R with its bias (65 x 64) the Gram route (8 * 129 <= 65 * 64)
    layer = keras.layers.SimpleRNN(64, dtype="float64")
    keras.Model(inputs := keras.Input((8, 2), dtype="float64"), layer(inputs))
    assert _gram_calls(monkeypatch, layer) == [(65, 64)]


@pytest.mark.parametrize(
    ("kind", "options"),
    [("gru", {"reset_after": False}), ("lstm", {"go_backwards": True})],
)
def test_configurations_without_a_rule_say_so(kind, options):
    rule, reason = rule_for(_built(kind, **options))
    assert rule is None and reason
