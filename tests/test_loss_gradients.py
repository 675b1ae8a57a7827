"""Per-sample gradients of a loss and their norms, against one tape per sample."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from tests.architectures import ARCHITECTURES, build

LOSS = keras.losses.mean_squared_error  # one loss per sample


def one_at_a_time(model, x, y, variables):
    """The reference: a fresh tape for each sample's own loss."""
    variables = variables or model.trainable_variables
    rows = []
    for i in range(len(y)):
        x_i = tf.nest.map_structure(lambda t, i=i: t[i : i + 1], x)
        with tf.GradientTape() as tape:
            tape.watch(
                [v.value if isinstance(v, keras.Variable) else v for v in variables]
            )
            loss = tf.reduce_mean(LOSS(y[i : i + 1], model(x_i)))  # one sample
        grads = tape.gradient(loss, variables)
        rows.append(
            np.concatenate(
                [
                    np.zeros(int(np.prod(v.shape)))
                    if g is None
                    else np.ravel(tf.convert_to_tensor(g))
                    for g, v in zip(grads, variables, strict=True)
                ]
            )
        )
    return np.array(rows)


SINGLE_OUTPUT = [
    name
    for name in sorted(ARCHITECTURES)
    if name not in ("two_heads_list", "dict_heads", "two_inputs_two_heads")
]


@pytest.mark.parametrize("name", SINGLE_OUTPUT)
def test_per_sample_gradients_equal_one_tape_per_sample(name):
    case = build(name)
    x = case.batch(4)
    model, variables = case.model64, case.variables64
    shape = np.shape(model(x) if variables is None else model(x))
    y = np.random.default_rng(0).standard_normal(shape)
    G = ju.per_sample_gradients(model, LOSS, x, y, variables=variables)
    expected = one_at_a_time(model, x, y, variables)
    np.testing.assert_allclose(G, expected, rtol=1e-9, atol=1e-11)
    norms = ju.per_sample_gradient_norms(model, LOSS, x, y, variables=variables)
    np.testing.assert_allclose(norms, np.linalg.norm(expected, axis=1), rtol=1e-9)


def test_dense_norms_need_no_gradients_and_match():
    model = ju.question_mlp(seed=1, dtype="float64")
    x, y = ju.regression_data(6, seed=1)
    norms = ju.per_sample_gradient_norms(model, LOSS, x, y)
    G = ju.per_sample_gradients(model, LOSS, x, y)
    np.testing.assert_allclose(norms, np.linalg.norm(G, axis=1), rtol=1e-10)


def test_a_reduced_loss_is_an_error_that_says_what_to_use():
    model = ju.question_mlp(hidden=(4,))
    x, y = ju.regression_data(5)
    with pytest.raises(ValueError, match="one loss per sample"):
        ju.per_sample_gradients(model, keras.losses.MeanSquaredError(), x, y)
    with pytest.raises(ValueError, match="one target per sample"):
        ju.per_sample_gradients(model, LOSS, x, y[:3])
