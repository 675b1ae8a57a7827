"""Checks of 11-curvature-and-uncertainty's exercises."""

import numpy as np

from ...stages.loop import loop_jacobian
from . import Hint, answered, as_array, checks, close_array, close_number


def _softmax_hessians(logits):
    """diag(p) - p p.T per sample, from the logits (n, l)."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    diagonal = np.einsum("ik,kj->ikj", p, np.eye(p.shape[1]))
    return diagonal - np.einsum("ik,ij->ikj", p, p)


@checks("11-1")
def trace_of_ggn(answer, model, x):
    """tr(G) for softmax cross-entropy, from J formed by the loop of 01."""
    what = "the trace of G (softmax cross-entropy)"
    answered(answer, f"{what}: one number")
    if np.size(answer) > 1:
        raise Hint(
            f"that has {np.size(answer)} numbers: the diagonal itself. The trace "
            "is one number, the sum of the diagonal."
        )
    J = loop_jacobian(model, x)
    H = _softmax_hessians(np.asarray(model(x), dtype="float64"))
    expected = float(np.einsum("ikp,ikj,ijp->", J, H, J))
    squared_error = float(np.einsum("ikp,ikp->", J, J))
    try:
        value = float(np.asarray(answer).item())
    except (TypeError, ValueError):
        raise Hint(f"expected {what}: one number.") from None
    if np.isclose(value, squared_error, rtol=1e-6) and not np.isclose(
        value, expected, rtol=1e-6
    ):
        raise Hint(
            "that is the trace for the squared error (H = I, the sum of J's "
            'squares): pass the loss, "softmax_cross_entropy".'
        )
    if not np.isclose(value, expected, rtol=1e-8) and np.isclose(
        value, expected, rtol=0.2
    ):
        raise Hint(
            "close, but not the trace itself: that is an estimate (Hutchinson's "
            "random probes, or float32 rounding). The exercise asks for the "
            "exact trace: the sum of G's diagonal, in float64."
        )
    close_number(value, expected, 1e-8, "your trace")


@checks("11-2")
def ntk_block(answer, model, x):
    """Theta(x_0, x_1) = J(x_0) J(x_1).T (l x l) from the loop of 01."""
    what = "the NTK block of samples 0 and 1"
    answered(answer, f"{what}: an (l, l) array")
    J = loop_jacobian(model, x[:2])
    n_out, m = J.shape[1], J.shape[2]
    if np.shape(answer) == (m, m):
        raise Hint(
            f"that is {m} x {m}, parameters by parameters: the shape of J.T J (G). "
            "The NTK multiplies the other way, J J.T: outputs by outputs."
        )
    array = as_array(answer, what, (n_out, n_out), "(l outputs, l outputs)")
    expected = J[0] @ J[1].T
    if np.allclose(array, J[0] @ J[0].T, rtol=1e-4) and not np.allclose(
        array, expected, rtol=1e-4
    ):
        raise Hint("that is sample 0 with itself: the block pairs sample 0 with 1.")
    if np.allclose(array, expected.T, rtol=1e-4) and not np.allclose(
        array, expected, rtol=1e-4
    ):
        raise Hint(
            "that is the transpose: rows are sample 0's outputs, columns sample 1's."
        )
    close_array(
        array,
        expected,
        what,
        rtol=1e-4,
        atol=1e-5,
        wrong="it differs from J(x_0) J(x_1).T with J formed by the loop of 01. "
        "Was it computed on the trained `net` and the first two samples of x_ntk?",
    )
