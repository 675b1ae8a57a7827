"""Grouped convolutions on every path, forward mode's blind spots, and quiet
logs (issue 21, items 7 and 12).

Every answer is checked against one ``tf.GradientTape`` per sample and one
``tape.gradient`` per output (``tape_rows``): no pfor and no forward mode in
the reference, since pfor's conversion of a grouped convolution's gradient
and forward mode in a graph are what went wrong.
"""

import logging

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from jacutil.core.formulation import quiet_function
from jacutil.core.guards import JacobianError
from jacutil.core.second_order import ensure_second_order

layers = keras.layers
F64 = {"dtype": "float64"}


def tape_rows(call, x, variables):
    """(n, l, m): one persistent tape per sample, one gradient per output."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape(persistent=True) as tape:
            y = tf.reshape(call(x[i : i + 1]), [-1])
            outputs = [y[k] for k in range(y.shape[0])]
        rows.append([flat(tape.gradient(out, variables), variables) for out in outputs])
    return np.array(rows)


def flat(grads, variables):
    return np.concatenate(
        [
            np.zeros(int(np.prod(v.shape))) if g is None else np.ravel(g)
            for g, v in zip(grads, variables, strict=True)
        ]
    )


def grouped(rank=2, bias=True):
    """A grouped convolution between two layers (its signal below is used)."""
    keras.utils.set_random_seed(21)
    conv = {1: layers.Conv1D, 2: layers.Conv2D}[rank]
    shape = (6, 2) if rank == 1 else (6, 6, 2)
    return keras.Sequential(
        [
            keras.Input(shape, dtype="float64"),
            conv(6, 1, **F64),
            conv(4, 3, groups=2, activation="tanh", use_bias=bias, **F64),
            layers.Flatten(**F64),
            layers.Dense(2, **F64),
        ]
    )


def batch_for(model, n=3):
    return np.random.default_rng(0).standard_normal((n, *model.input_shape[1:]))


# --- item 7: forward mode and products ---------------------------------------


@pytest.mark.parametrize("rank", [1, 2])
def test_grouped_convolution_in_forward_mode_and_products(rank):
    """Keras reads a grouped kernel in a nested XLA function, where forward
    mode in a graph carried no tangent: its columns were zeros."""
    model = grouped(rank)
    x = batch_for(model)
    expected = tape_rows(model, x, model.trainable_variables)
    rng = np.random.default_rng(1)
    v, u = rng.standard_normal(expected.shape[2]), rng.standard_normal((3, 2))
    np.testing.assert_allclose(ju.forward_jacobian(model, x), expected, atol=1e-12)
    np.testing.assert_allclose(ju.jvp(model, x, v), expected @ v, atol=1e-12)
    twice = ju.jvp(model, x, v, mode="double_backward")
    np.testing.assert_allclose(twice, expected @ v, atol=1e-12)
    np.testing.assert_allclose(
        ju.vjp(model, x, u), np.einsum("ik,ikp->p", u, expected), atol=1e-12
    )


def test_forward_mode_refuses_a_variable_read_in_a_nested_function():
    """What TensorFlow gets wrong, in any model: an error, not zeros."""
    w = tf.Variable(np.random.default_rng(0).standard_normal((3, 2)))
    x = np.random.default_rng(1).standard_normal((4, 3))

    @tf.function
    def inner(t):
        return tf.tanh(t @ w)  # reads w inside

    def f(t):
        return inner(tf.convert_to_tensor(t))

    with pytest.raises(JacobianError, match="nested tf.function"):
        ju.forward_jacobian(f, x, variables=[w])
    with pytest.raises(JacobianError, match="double_backward"):
        ju.products(f, variables=[w]).jvp(x, np.ones(6))
    v = np.random.default_rng(2).standard_normal(6)
    twice = ju.products(f, variables=[w], mode="double_backward").jvp(x, v)
    np.testing.assert_allclose(twice, tape_rows(f, x, [w]) @ v, atol=1e-12)


# --- item 12: reverse mode ----------------------------------------------------


@pytest.mark.parametrize("method", ["per_sample", "batch", "rules"])
@pytest.mark.parametrize("rank, bias", [(2, True), (1, False)])
def test_grouped_convolution_in_reverse_mode(method, rank, bias):
    model = grouped(rank, bias)
    x = batch_for(model)
    expected = tape_rows(model, x, model.trainable_variables)
    jac = ju.compiled_jacobian(model, method=method)
    np.testing.assert_allclose(jac(x), expected, atol=1e-12)
    if method == "rules":  # the grouped rule itself, not the autodiff fallback
        assert jac.plan is not None, jac.fallback
        assert "autodiff" not in jac.plan.describe()


@pytest.mark.parametrize(
    "stage", ["jacobian", "per_sample_jacobian", "vectorized_jacobian"]
)
def test_grouped_convolution_in_the_eager_stages(stage):
    model = grouped()
    x = batch_for(model)
    expected = tape_rows(model, x, model.trainable_variables)
    np.testing.assert_allclose(getattr(ju, stage)(model, x), expected, atol=1e-12)


def test_dilated_convolution_rule_with_a_layer_below():
    """The conv rule's signal below: tf.nn.conv2d's input gradient refuses
    a dilation on CPU; the rule now convolves as Keras does."""
    keras.utils.set_random_seed(22)
    model = keras.Sequential(
        [keras.Input((9, 2), dtype="float64"), layers.Conv1D(3, 1, **F64),
         layers.Conv1D(2, 3, dilation_rate=2, activation="tanh", **F64),
         layers.Flatten(**F64), layers.Dense(2, **F64)]
    )  # fmt: skip
    x = batch_for(model)
    jac = ju.compiled_jacobian(model, method="rules")
    np.testing.assert_allclose(
        jac(x), tape_rows(model, x, model.trainable_variables), atol=1e-12
    )
    assert jac.plan is not None, jac.fallback


# --- item 12: forward mode through Keras's built-in activations and layers ---


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_softsign_in_forward_mode(dtype):
    """TF 2.21 has no gradient for SoftsignGrad, which forward mode and the
    double-backward JVP differentiate (jacutil.core.second_order registers it
    on first use)."""
    keras.utils.set_random_seed(12)
    model = keras.Sequential(
        [keras.Input((3,), dtype=dtype),
         layers.Dense(4, activation="softsign", dtype=dtype),
         layers.Dense(2, dtype=dtype)]
    )  # fmt: skip
    x = (np.random.default_rng(0).standard_normal((4, 3)) * 2).astype(dtype)
    expected = tape_rows(model, x, model.trainable_variables)
    tolerance = {"atol": 1e-12} if dtype == "float64" else {"atol": 1e-5}
    np.testing.assert_allclose(ju.forward_jacobian(model, x), expected, **tolerance)
    v = np.random.default_rng(1).standard_normal(expected.shape[2]).astype(dtype)
    np.testing.assert_allclose(ju.jvp(model, x, v), expected @ v, **tolerance)
    twice = ju.products(model, mode="double_backward").jvp(x, v)
    np.testing.assert_allclose(twice, expected @ v, **tolerance)


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest", "bicubic"])
def test_resizing_in_forward_mode(interpolation):
    """TF marks ResizeBilinearGrad not differentiable: forward mode took the
    tangent through a bilinear resize as zero (no error). Nearest and
    bicubic had no second-order gradient at all (LookupError)."""
    keras.utils.set_random_seed(24)
    model = keras.Sequential(
        [keras.Input((3, 3, 1)), layers.Conv2D(2, 1),
         layers.Resizing(5, 5, interpolation=interpolation),
         layers.Flatten(), layers.Dense(2)]
    )  # fmt: skip
    x = batch_for(model).astype("float32")
    expected = tape_rows(model, x, model.trainable_variables)
    v = np.random.default_rng(1).standard_normal(expected.shape[2]).astype("float32")
    tolerance = {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(ju.forward_jacobian(model, x), expected, **tolerance)
    np.testing.assert_allclose(ju.jvp(model, x, v), expected @ v, **tolerance)
    twice = ju.products(model, mode="double_backward").jvp(x, v)
    np.testing.assert_allclose(twice, expected @ v, **tolerance)


def test_softsign_second_derivative():
    """The registered gradient of SoftsignGrad, against the closed form of
    softsign'' = -2 sign(x) / (1 + |x|)**3."""
    ensure_second_order()
    x = tf.constant([-2.0, -0.5, 0.3, 1.7], tf.float64)
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.nn.softsign(x)
        slope = inner.gradient(y, x)
    expected = -2 * np.sign(x) / (1 + np.abs(x)) ** 3
    np.testing.assert_allclose(outer.gradient(slope, x), expected, rtol=1e-12)


# --- quiet logs ---------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_no_tensorflow_warning_reaches_the_user():
    """Keras's grouped convolution traces a new function on every eager call
    (jacutil's own output checks made TensorFlow warn of retracing), and pfor
    warns while it vectorizes ("Conv2DBackpropFilter uses a while_loop")."""
    model = grouped()
    x = batch_for(model, 4)
    m = ju.flat_params(model).size
    keras.utils.set_random_seed(23)
    transposed = keras.Sequential(
        [keras.Input((4, 4, 2)), layers.Conv2DTranspose(2, 2),
         layers.Flatten(), layers.Dense(2)]
    )  # fmt: skip
    xt = batch_for(transposed).astype("float32")
    records, logger = _Records(), tf.get_logger()
    logger.addHandler(records)
    try:
        for n in (2, 3, 4):  # a new shape: the output checks run the model again
            ju.vjp(model, x[:n], np.ones((n, 2)))
        ju.jvp(model, x, np.ones(m))
        ju.products(model, mode="double_backward").jvp(x, np.ones(m))
        ju.forward_jacobian(model, x)
        ju.per_sample_jacobian(model, x)
        ju.vectorized_jacobian(model, x)
        jac = ju.compiled_jacobian(transposed, method="per_sample")
        jac(xt)
        ju.per_sample_jacobian(transposed, xt)
        ju.forward_jacobian(transposed, xt)
    finally:
        logger.removeHandler(records)
    assert records.messages == []
    assert "Conv2DBackpropFilter uses a while_loop" in jac.formulation  # noted


def test_pfor_says_nothing_in_our_traces():
    """Every jacutil trace (``quiet_function``) keeps pfor's log lines, as
    the layer rules' autodiff fallback needs."""
    w = tf.Variable(np.ones((2, 2, 1, 2), "float32"))
    x = np.ones((3, 4, 4, 1), "float32")

    def per_sample_kernel_gradients(x):
        def one(xi):
            with tf.GradientTape() as tape:
                y = tf.nn.conv2d(xi[None], w, 1, "VALID")
            return tape.gradient(y, w)

        return tf.vectorized_map(one, x)

    records, logger = _Records(), tf.get_logger()
    logger.addHandler(records)
    try:
        quiet_function(per_sample_kernel_gradients)(x)
    finally:
        logger.removeHandler(records)
    assert records.messages == []
