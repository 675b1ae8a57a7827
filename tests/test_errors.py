"""Bad input gets a clear error; an unused variable gets its true zeros."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf

ALL_STAGES = [
    ju.loop_jacobian,
    ju.vectorized_jacobian,
    ju.per_sample_jacobian,
    lambda model, x, **kw: ju.compiled_jacobian(model, **kw)(x),
    lambda model, x, **kw: ju.chunked_jacobian(model, x, progress=False, **kw),
]


@pytest.fixture(scope="module")
def model():
    return ju.question_mlp(n_inputs=4, n_outputs=2, hidden=(5,))


def linear_with_spare(dtype="float64"):
    """f(x) = x @ W + b with keras Variables, plus one variable it never reads."""
    rng = np.random.default_rng(0)
    W = keras.Variable(rng.standard_normal((3, 2)).astype(dtype), name="W")
    b = keras.Variable(rng.standard_normal(2).astype(dtype), name="b")
    spare = keras.Variable(np.ones(4, dtype), name="spare")

    def f(x):
        return tf.matmul(x, W) + b

    return f, [W, spare, b]


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_unused_variable_gets_zeros_beside_connected_ones(stage):
    f, variables = linear_with_spare()
    x = np.arange(6.0).reshape(2, 3)
    J = stage(f, x, variables=variables)
    assert J.shape == (2, 2, 6 + 4 + 2)
    np.testing.assert_array_equal(J[:, :, 6:10], 0.0)
    # d(x @ W + b)[i, k] / dW[j, k] = x[i, j]; / db[k] = 1.
    np.testing.assert_allclose(J[:, 0, 0:6:2], x)
    np.testing.assert_allclose(J[:, 1, 1:6:2], x)
    np.testing.assert_allclose(J[:, :, 10:], np.broadcast_to(np.eye(2), (2, 2, 2)))


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_no_connected_variable_is_an_error_not_zeros(stage, model):
    """The classic mistake: differentiate w.r.t. a flattened copy of the variables."""
    flat_copy = tf.Variable(
        tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    )
    with pytest.raises(ValueError, match="None of the 1 variables reaches the outputs"):
        stage(model, np.ones((2, 4)), variables=[flat_copy])


def test_a_tensor_instead_of_variables_is_refused(model):
    flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    with pytest.raises(TypeError, match="pass the variables themselves"):
        ju.per_sample_jacobian(model, np.ones((2, 4)), variables=[flat])


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_one_sample_without_batch_axis(stage, model):
    with pytest.raises(ValueError, match=r"use x\[None\]"):
        stage(model, np.ones(4))


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_wrong_feature_size(stage, model):
    with pytest.raises(ValueError, match=r"should have shape \(n_samples, 4\)"):
        stage(model, np.ones((3, 5)))


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_non_numeric_input(stage, model):
    with pytest.raises(TypeError, match="x must hold numbers"):
        stage(model, np.array([["a", "b", "c", "d"]]))


def test_empty_batch(model):
    with pytest.raises(ValueError, match="no samples"):
        ju.per_sample_jacobian(model, np.ones((0, 4)))


@pytest.mark.parametrize("chunk_size", [0, -3])
def test_chunk_size_must_be_positive(chunk_size, model):
    with pytest.raises(ValueError, match="chunk_size must be at least 1"):
        ju.chunked_jacobian(model, np.ones((3, 4)), chunk_size=chunk_size)


def test_chunk_size_must_be_whole(model):
    with pytest.raises(TypeError, match="whole number"):
        ju.chunked_jacobian(model, np.ones((3, 4)), chunk_size=1.5)


def test_memory_budget_smaller_than_one_sample(model):
    with pytest.raises(ValueError, match="smaller than one sample needs"):
        ju.chunked_jacobian(model, np.ones((3, 4)), memory_budget=100)


def test_out_of_wrong_shape(model):
    with pytest.raises(ValueError, match=r"needs shape \(3, 2, 37\)"):
        ju.chunked_jacobian(model, np.ones((3, 4)), out=np.empty((3, 2, 36), "float32"))


def test_model_without_trainable_variables():
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    model.trainable = False
    with pytest.raises(ValueError, match="has no trainable variables"):
        ju.vectorized_jacobian(model, np.ones((2, 3)))


def test_callable_without_variables():
    with pytest.raises(TypeError, match="pass variables="):
        ju.per_sample_jacobian(lambda x: x, np.ones((2, 3)))


def test_scalar_output_is_refused():
    f, variables = linear_with_spare()
    with pytest.raises(ValueError, match="is a scalar"):
        ju.per_sample_jacobian(
            lambda x: tf.reduce_sum(f(x)), np.ones((2, 3)), variables=variables
        )


def test_keras_zero_gradient_trap_is_avoided(model):
    """ZERO on a disconnected Keras 3 variable raises AttributeError in TF 2.21."""
    spare = keras.Variable(np.ones(3, "float32"))
    J = ju.vectorized_jacobian(
        model, np.ones((2, 4)), variables=[*model.trainable_variables, spare]
    )
    np.testing.assert_array_equal(J[:, :, -3:], 0.0)
