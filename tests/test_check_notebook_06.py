"""06-pitfalls's exercise checks: typical wrong answers get their hint."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from jacutil.teaching import check
from tests.check_hints import hint


def test_06_1_per_sample_gradients():
    model = ju.question_mlp(hidden=(4,))
    x, y = ju.regression_data(3)
    J = ju.per_sample_jacobian(model, x)  # (n, l, m)
    rows = 2 * np.einsum("ik,ikp->ip", model(x).numpy() - y, J)
    context = {"model": model, "x": x, "y": y}
    assert check.verdict("06-1", rows, **context).correct
    message = hint("06-1", rows.sum(axis=0), **context)
    assert "summed" in message and "(n, m)" in message
    same = np.broadcast_to(rows.mean(axis=0), rows.shape)
    assert "every row is the same" in hint("06-1", same, **context)
    assert "2 (f - y)" in hint("06-1", rows / 2, **context)
    assert "output axis" in hint("06-1", rows[:, None], **context)
    assert "Jacobian of the model's outputs" in hint("06-1", J, **context)


def bn_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((10,)),
        keras.layers.Dense(4, activation="tanh"),
        keras.layers.BatchNormalization(name="batch_norm"),
        keras.layers.Dense(2),
    ])


def tape_jacobian(model, x, training):
    with tf.GradientTape() as tape:
        y = model(x, training=training)
    blocks = tape.jacobian(y, model.trainable_variables)
    return np.concatenate([b.numpy().reshape(len(x), 2, -1) for b in blocks], 2)


def test_06_2_frozen_batch_norm():
    x = ju.regression_data(4)[0]
    model = bn_model()
    model(x)
    unfrozen = tape_jacobian(model, x, training=True)  # gamma, beta included
    message = hint("06-2", unfrozen, model=model, x=x)
    assert "gamma and beta" in message and "trainable = False" in message
    model.get_layer("batch_norm").trainable = False
    J = ju.per_sample_jacobian(model, x, training=True)
    assert J.shape == (4, 2, 44 + 10)
    assert check.verdict("06-2", J, model=model, x=x).correct
    assert check.verdict("06-2", tape_jacobian(model, x, True), model=model,
                         x=x).correct
    assert "inference mode" in hint("06-2", J * 1.5, model=model, x=x)


@pytest.fixture(scope="module")
def curve():
    # two hidden layers: along a direction, a cubic in each linear region
    model = ju.question_mlp(hidden=(8, 4), dtype="float64")
    x = ju.regression_data(3)[0]
    direction = np.random.default_rng(0).standard_normal(ju.flat_params(model).size)
    return model, x, direction / np.linalg.norm(direction)


def best_steps(model, x, direction):
    """h* = (3 eps |f| / |f'''|)^(1/3) of float16, 32 and 64, and eps |f|."""
    theta = ju.flat_params(model)

    def f(t):
        ju.set_flat_params(model, theta + t * direction)
        return model(x).numpy()

    h = 2e-3
    third = (f(2 * h) - 2 * f(h) + 2 * f(-h) - f(-2 * h)) / (2 * h**3)
    size = np.abs(f(0.0)).max()
    ju.set_flat_params(model, theta)
    eps = np.array([np.finfo(t).eps for t in (np.float16, np.float32, np.float64)])
    return (3 * eps * size / np.abs(third).max()) ** (1 / 3), eps * size


def test_06_3_best_step_float16(curve):
    model, x, direction = curve
    context = {"model": model, "x": x, "direction": direction}
    steps, R = best_steps(*curve)
    right = np.array([steps[0], 1.5 * R[0] / steps[0]])
    assert check.verdict("06-3", right, **context).correct
    assert check.verdict("06-3", right * [1.3, 1 / 1.3], **context).correct
    message = hint("06-3", [np.finfo(np.float16).eps ** (1 / 3), 1.0], **context)
    assert "eps ** (1/3)" in message and f"{steps[0]:.1e}" not in message
    # float32's or float64's best step, as the Findings print them
    assert "float32's" in hint("06-3", [steps[1], 1.5 * R[1] / steps[1]],
                               **context)
    assert "float64's" in hint("06-3", [steps[2], 1.5 * R[2] / steps[2]],
                               **context)
    assert "too small" in hint("06-3", right / [3, 1], **context)
    assert "3/2 R/h*" in hint("06-3", [steps[0], R[0] / steps[0]], **context)
    assert "(2,)" in hint("06-3", steps[0], **context)
    assert "positive" in hint("06-3", [steps[0], -1.0], **context)
    theta = ju.flat_params(model)
    check.verdict("06-3", right, **context)
    np.testing.assert_array_equal(ju.flat_params(model), theta)  # put back
