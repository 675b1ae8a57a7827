"""Checks of 06-pitfalls's exercises."""

import numpy as np

from ...core._shared import count_params
from ...core._tf import keras, tf
from ...core.layout import flat_params, set_flat_params
from ...stages.loop import loop_jacobian
from . import Hint, answered, as_array, checks, flat, same


@checks("06-1")
def per_sample_loss_gradients(answer, model, x, y):
    """Row i: the gradient of sum_k (f(x_i)_k - y_ik)**2, by a loop over i."""
    answered(answer, "the per-sample gradients, shape (n, m)")
    variables = model.trainable_variables
    rows = []
    for i in range(len(x)):  # the loop: one tape per sample
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(
                (model(x[i : i + 1], training=False) - y[i : i + 1]) ** 2
            )
        rows.append(flat(tape.gradient(loss, variables)))
    expected = np.stack(rows)
    n, m = expected.shape
    shape = np.shape(answer)
    if shape == (m,):
        raise Hint(
            "one vector of length m is the gradient of the summed "
            "loss - what tf.gradients returns. Expected one row per "
            f"sample: shape (n, m) = {(n, m)}."
        )
    if shape == (n, 1, m):
        raise Hint(
            "drop the output axis of length 1 (J[:, 0]): one row per "
            "sample, shape (n, m)."
        )
    if len(shape) == 3 and shape[0] == n and shape[2] == m:
        raise Hint(
            "that is a Jacobian of the model's outputs, (n, l, m). "
            "Differentiate each sample's loss instead: one number per "
            "sample, so one gradient row."
        )
    rows = as_array(
        answer, "the per-sample gradients", (n, m), "(n samples, m parameters)"
    )

    def like(values):
        return np.allclose(rows, values, rtol=1e-4, atol=1e-5)

    if like(expected):
        return
    if n > 1 and np.allclose(rows, rows[:1], rtol=1e-6, atol=1e-8):
        raise Hint(
            "every row is the same: a copy of one gradient (of the "
            "sum or the mean over samples). Row i must be the "
            "gradient of sample i's own loss."
        )
    if like(expected / 2):
        raise Hint("half of each row: the derivative of a square is 2 (f - y).")
    if like(-expected):
        raise Hint("the sign is flipped: the loss is sum_k (f(x_i)_k - y_ik)**2.")
    raise Hint(
        "row i should be the gradient of sample i's loss, "
        "sum_k (f(x_i)_k - y_ik)**2, with the columns in "
        "flat_params(model) order; the rows sum to tf.gradients."
    )


def _layers(model):
    for layer in getattr(model, "layers", []):
        yield layer
        yield from _layers(layer)


@checks("06-2")
def frozen_batch_norm(answer, model, x):
    """Training mode, BatchNormalization frozen: the inference-mode Jacobian."""
    answered(answer, "the Jacobian with training=True, shape (n, l, columns)")
    norms = [
        la for la in _layers(model) if isinstance(la, keras.layers.BatchNormalization)
    ]
    in_norms = {id(v) for la in norms for v in la.weights}
    variables = [
        v
        for la in model.layers
        if la not in norms
        for v in la.trainable_variables
        if id(v) not in in_norms
    ]
    # With the layer frozen, training=True uses the moving statistics: the
    # same map as inference mode, where the loop is the reference.
    expected = loop_jacobian(model, x, variables=variables, training=False)
    n, n_out, m = expected.shape
    scale_and_shift = count_params(
        v for la in norms for v in (la.gamma, la.beta) if v is not None
    )
    shape = np.shape(answer)
    if shape == (n, n_out, m + scale_and_shift):
        raise Hint(
            "J has columns for the normalization's gamma and beta: "
            "they are trainable until the layer is frozen. Freeze it "
            "(trainable = False) before asking; its variables then "
            "leave the Jacobian."
        )
    J = as_array(
        answer,
        "J",
        (n, n_out, m),
        "(n samples, l outputs, columns of the trainable variables)",
    )
    if same(J, expected):
        return
    raise Hint(
        "J differs from the Jacobian in inference mode. A frozen "
        "BatchNormalization normalizes with its moving statistics "
        "even in training mode, so the two should agree: is the layer "
        "frozen before the call, and is it the Jacobian of x?"
    )


def _constants(model, x, direction):
    """|f| (largest output) and |f'''| along ``direction``, in float64."""
    x = np.asarray(x, "float64")
    direction = np.asarray(direction, "float64")
    theta = flat_params(model).astype("float64")
    h = 1e-3  # third differences: O(h**2) off, rounding eps |f| / h**3 tiny

    def f(t):
        set_flat_params(model, theta + t * direction)
        return np.asarray(model(x), "float64")

    try:
        size = np.abs(f(0.0)).max()
        third = (f(2 * h) - 2 * f(h) + 2 * f(-h) - f(-2 * h)) / (2 * h**3)
    finally:
        set_flat_params(model, theta)
    return size, np.abs(third).max()


@checks("06-3")
def best_step_float16(answer, model, x, direction):
    """float16's h* = (3 eps |f| / |f'''|)^(1/3) and E* = 3/2 eps |f| / h*."""
    answered(answer, "[h*, E*] of float16: its best step and its error there")
    h, error = as_array(
        answer, "[h*, E*]", (2,), "(2,): [h* of float16, E* of float16]"
    )
    size, third = _constants(model, x, direction)
    eps = {
        name: float(np.finfo(name).eps) for name in ("float16", "float32", "float64")
    }

    def best(name):
        return (3 * eps[name] * size / third) ** (1 / 3)

    def near(value, right, factor=1.5):
        return abs(np.log(value / right)) <= np.log(factor)

    if h <= 0 or error <= 0:
        raise Hint("a step h* and an error E* are positive numbers.")
    if np.isclose(h, eps["float16"] ** (1 / 3), rtol=0.2):
        raise Hint(
            "that h* is eps ** (1/3): the rule of thumb, with |f| and "
            "|f'''| set to 1. Measure the two constants on the curves "
            "and minimise R/h + T h**2 with them."
        )
    for other in ("float32", "float64"):
        if near(h, best(other)):
            raise Hint(
                f"that h* is {other}'s. Only epsilon changes: take "
                "np.finfo('float16').eps in R = eps |f|, with the same "
                "|f| and T."
            )
    if not near(h, best("float16")):
        factor = h / best("float16")
        size_word = "large" if factor > 1 else "small"
        raise Hint(
            f"your h* is too {size_word}, by a factor of about "
            f"{max(factor, 1 / factor):.2g}. Check the constants: "
            "R = eps |f| with |f| the largest output, T = error / h**2 "
            "where the float64 curve rises as h**2; h* = (R / 2T)**(1/3)"
            " is where the derivative of R/h + T h**2 is zero."
        )
    rounding = eps["float16"] * size / h  # R / h* at the learner's h*
    if near(error, rounding, 1.2):
        raise Hint(
            "E* is R/h* + T h*^2, both terms: at h* the truncation "
            "term is half the rounding one, so E* = 3/2 R/h*."
        )
    if not near(error, 1.5 * rounding, 1.2):
        raise Hint(
            "h* is right; E* is the error at h*: R/h* + T h*^2, "
            "which is 3/2 R/h* with R = eps |f| of float16."
        )
