"""08-your-own-model's exercise checks: typical wrong answers get their hint."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from jacutil.teaching import check
from tests.check_hints import hint


@pytest.fixture(scope="module")
def gru():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3, 2))  # 3 steps, and 2 outputs below
    steps = keras.layers.GRU(2, return_sequences=True)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(steps))
    x = np.random.default_rng(0).standard_normal((2, 3, 2)).astype("float32")
    return model, x, ju.per_sample_jacobian(model, x)


def test_08_1_rows_split_per_step(gru):
    model, x, J = gru
    n, _, m = J.shape
    right = ju.split_outputs(J, model, x)
    assert check.verdict("08-1", right, model=model, x=x).correct
    assert check.verdict("08-1", J.reshape(n, 3, 2, m), model=model, x=x).correct
    assert "unsplit" in hint("08-1", J, model=model, x=x)
    assert "swapped" in hint("08-1", J.reshape(n, 2, 3, m), model=model, x=x)
    misplaced = J.reshape(n, 2, 3, m).transpose(0, 2, 1, 3)
    assert "wrong places" in hint("08-1", misplaced, model=model, x=x)
    assert "all zeros" in hint("08-1", np.zeros_like(right), model=model, x=x)
    assert "differs" in hint("08-1", 2 * right, model=model, x=x)
    assert not check.verdict("08-1", None, model=model, x=x).answered


def test_08_2_rows_of_a_dict_output():
    assert check.verdict("08-2", [3, 4]).correct
    assert check.verdict("08-2", slice(3, 5)).correct
    assert check.verdict("08-2", np.arange(3, 5)).correct
    message = hint("08-2", [0, 1])
    assert "list model" in message and "tf.nest.flatten" in message
    assert "3" not in message
    assert "from 0" in hint("08-2", [4, 5])
    assert "2 rows" in hint("08-2", [2, 3, 4])
    assert "increasing" in hint("08-2", [4, 3])
    assert "not the rows themselves" in hint("08-2", np.zeros((4, 2, 9)))
    assert "integers" in hint("08-2", "score")


@pytest.fixture(scope="module")
def batch_norm():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,), dtype="float64"),
                              keras.layers.BatchNormalization(dtype="float64"),
                              keras.layers.Dense(2, dtype="float64")])
    model.layers[0].moving_mean.assign([0.5, -1.0, 2.0])
    model.layers[0].moving_variance.assign([2.0, 0.5, 1.5])
    x = np.random.default_rng(0).standard_normal((3, 3))
    return model, x, model.layers[0].moving_mean


def test_08_3_derivative_by_a_moving_mean(batch_norm):
    model, x, mean = batch_norm
    context = {"model": model, "x": x, "variable": mean}
    right = ju.per_sample_jacobian(model, x, variables=[mean])
    assert check.verdict("08-3", right, **context).correct
    trainable = ju.per_sample_jacobian(model, x)
    assert "trainable" in hint("08-3", trainable, **context)
    x_watched = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x_watched)
        y = model(x_watched)
    by_x = tape.batch_jacobian(y, x_watched).numpy()  # d outputs / d x
    assert "opposite sign" in hint("08-3", by_x, **context)
    assert "all zeros" in hint("08-3", np.zeros_like(right), **context)
    assert "shape" in hint("08-3", right.sum(axis=0), **context)
    variance = model.layers[0].moving_variance
    other = ju.per_sample_jacobian(model, x, variables=[variance])
    assert "Which variable" in hint("08-3", other, **context)
