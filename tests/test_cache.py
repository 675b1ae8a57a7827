"""The cache of compiled functions (jacutil.core.cache): reused, and weakly owned."""

import gc
import weakref

import numpy as np

import jacutil as ju
from jacutil import keras, tf
from jacutil.core import cache


def _wide_outputs_model():
    """Few parameters, many outputs: ``jacutil.jacobian`` takes forward mode."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1), keras.layers.RepeatVector(400),
         keras.layers.Flatten()]
    )  # fmt: skip


def _gone(reference):
    gc.collect()
    return reference() is None


def test_a_keras_model_is_not_kept_alive_by_any_cache():
    model = ju.question_mlp(seed=0, hidden=(4,))
    x, _ = ju.regression_data(6, seed=1)
    ju.jacobian(model, x)
    ju.chunked_jacobian(model, x, chunk_size=4, progress=False)
    ju.jvp(model, x, np.ones(ju.flat_params(model).size, "float32"))
    ju.per_sample_gradients(model, keras.losses.mean_squared_error, x,
                            np.zeros((6, 2), "float32"))  # fmt: skip
    assert len(cache.entries("compiled", model)) >= 1
    reference = weakref.ref(model)
    del model
    assert _gone(reference)


def test_the_forward_mode_path_does_not_keep_the_model_alive():
    model = _wide_outputs_model()
    x = np.ones((3, 2), "float32")
    J, choice = ju.jacobian(model, x, explain=True)
    assert choice.path == "forward mode"
    again, choice = ju.jacobian(model, x, explain=True)
    assert not choice.traced  # the forward-mode function is cached too
    np.testing.assert_array_equal(J, again)
    reference = weakref.ref(model)
    del model, J, again
    assert _gone(reference)


def test_a_lambda_and_what_it_captured_are_not_kept_alive():
    w = tf.Variable(np.ones((3, 2)))
    captured = np.ones(1_000)  # what a user's closure holds
    f = lambda t: tf.tanh(t @ w) * captured[0]  # noqa: E731
    x = np.ones((4, 3))
    first = ju.jacobian(f, x, variables=[w])
    jac = ju.engine.compiled.compiled_for(f, [w], False, False, "rules")
    traces = jac.trace_count
    np.testing.assert_array_equal(ju.jacobian(f, x, variables=[w]), first)
    assert jac.trace_count == traces  # the second call reuses the compiled one
    references = weakref.ref(f), weakref.ref(jac)
    del f, jac
    assert _gone(references[0]) and _gone(references[1])


def test_clear_forgets_every_compiled_function():
    model = ju.question_mlp(seed=0, hidden=(4,))
    x, _ = ju.regression_data(3, seed=1)
    ju.jacobian(model, x)
    cache.clear()
    assert not cache.entries("compiled", model)
