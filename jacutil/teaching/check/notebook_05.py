"""Checks of 05-scipy-least-squares's exercises."""

import numpy as np

from ...core._tf import tf
from . import Hint, answered, as_array, checks, flat

DAMPINGS = (1e-4, 1e-2, 100.0)  # exercise 3's lambdas, in this order


@checks("05-1")
def method_for_few_residuals(answer):
    """The least_squares method that accepts fewer residuals than parameters."""
    answered(answer, "the name of the method that still works (a string)")
    if not isinstance(answer, str):
        raise Hint(
            "expected the method's name, a string: what you pass to "
            "least_squares as method=."
        )
    if answer in ("trf", "dogbox"):
        return
    name = answer.strip().strip("'\"").lower()
    if name == "lm":
        raise Hint(
            "run it and read SciPy's error: MINPACK's "
            "Levenberg-Marquardt needs at least as many residuals as "
            "parameters (n*l >= m), and here there are fewer."
        )
    if name in ("trf", "dogbox"):
        # least_squares compares method= with its names as they are
        raise Hint(
            f"least_squares(method={answer!r}) raises a ValueError: "
            "it takes the name exactly as its documentation writes "
            "it - lower case, no spaces, no quotes inside the string."
        )
    raise Hint(
        f"{answer!r} is not a method of least_squares: see the "
        "method= argument of its documentation."
    )


def _mse_gradient(model, x, y):
    """tape.gradient of mean((model(x) - y)**2), flattened in variable order."""
    x = tf.constant(np.asarray(x, "float64"))  # Keras casts to its dtype
    with tf.GradientTape() as tape:
        f = model(x, training=False)
        mse = tf.reduce_mean((f - tf.cast(y, f.dtype)) ** 2)
    return flat(tape.gradient(mse, model.trainable_variables))


@checks("05-2")
def gradient_of_the_mse(answer, model, x, y):
    """2 J^T r / (n l): the gradient of the MSE, from the chunked normal equations."""
    answered(answer, "the gradient of the MSE, shape (m,)")
    expected = _mse_gradient(model, x, y)
    n, n_out = np.shape(y)
    gradient = as_array(answer, "the gradient", expected.shape, "(m parameters,)")

    def like(factor):
        return np.allclose(gradient, factor * expected, rtol=1e-6, atol=1e-12)

    if like(1.0):
        return
    if like(-1.0):
        raise Hint(
            "the sign is flipped: the gradient of the MSE points uphill. "
            "Which way does J^T r point, with r = f(x) - y?"
        )
    if like(0.5):
        raise Hint("half of it: the derivative of r**2 is 2 r.")
    if like(n * n_out) or like(n * n_out / 2):
        raise Hint(
            "too large by the number of residuals: the MSE is a mean "
            "over all n*l of them."
        )
    if like(n_out) or like(n_out / 2):
        raise Hint(
            "divided by n only: the mean runs over n*l residuals, "
            "every sample's every output."
        )
    raise Hint(
        "it is not a multiple of J^T r from the first samples. "
        "normal_equations returns (J^T J, J^T r) at the theta you give "
        "it; the gradient of the MSE is J^T r times a constant."
    )


def _step_lengths(JtJ, Jtr, damping_matrix):
    return np.array(
        [
            np.linalg.norm(np.linalg.solve(JtJ + lam * damping_matrix, -Jtr))
            for lam in DAMPINGS
        ]
    )


@checks("05-3")
def step_lengths(answer, JtJ, Jtr):
    """|delta| of (JtJ + lambda I) delta = -Jtr for lambda = 1e-4, 1e-2, 100."""
    answered(answer, "the three step lengths, one per lambda")
    JtJ, Jtr = np.asarray(JtJ, "float64"), np.asarray(Jtr, "float64")
    lengths = as_array(
        answer,
        "the step lengths",
        (3,),
        "(3,): one per lambda, in the order 1e-4, 1e-2, 100",
    )
    expected = _step_lengths(JtJ, Jtr, np.eye(len(Jtr)))

    def like(values):
        return np.allclose(lengths, values, rtol=1e-6)

    if like(expected):
        return
    if like(expected[::-1]):
        raise Hint(
            "the order is reversed: one length per lambda, in the "
            "order 1e-4, 1e-2, 100."
        )
    if like(expected**2):
        raise Hint(
            "those are squared lengths: how long is a vector whose "
            "squared length is that?"
        )
    if like(_step_lengths(JtJ, Jtr, np.diag(np.diag(JtJ)))):
        raise Hint(
            "that is Marquardt's damping, lambda * diag(J^T J); this "
            "exercise repeats the step above, with lambda * I."
        )
    if lengths[0] < lengths[-1]:
        raise Hint(
            "your steps grow with lambda. A larger lambda adds more to "
            "the diagonal of the matrix you solve with, so the step "
            "must shrink: where does lambda go in your system?"
        )
    raise Hint(
        "these are not the lengths of the damped steps of the system "
        "above, with its JtJ and Jtr and lambda * I. Compare your system, "
        "term by term, with the one in the prose."
    )
