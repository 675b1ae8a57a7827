"""Hessian-vector products of the loss (notebook 11-curvature-and-uncertainty).

The Hessian of the summed loss, ``sum_i d^2 L_i / d theta^2`` (m x m), is
G plus the terms G leaves out: the outputs' own second derivatives weighted
by the residuals. Near a minimum they are small, far from it they are not,
and the Hessian may have negative eigenvalues where G never has.
:func:`hessian_operator` gives it as a SciPy ``LinearOperator`` whose
product is forward mode over the reverse-mode gradient (one pass each).
"""

from ..core.data import read_data
from .compiled import products_operator


def hessian_operator(
    model, x, y, loss="squared_error", *, sample_weight=None, variables=None,
    chunk_size=None,
):  # fmt: skip
    """The loss's Hessian as a ``scipy.sparse.linalg.LinearOperator``.

    Introduced in ``11-curvature-and-uncertainty``. The loss is the sum over
    samples (times ``sample_weight`` and each head's reduction, as for
    :func:`jacutil.curvature.ggn.ggn_operator`); its products are compiled
    once per model, loss and input shape.

    Arguments as for ``ggn_operator``, except that ``y`` is needed: the
    targets (values, or integer labels for a softmax), one array per head
    as a list or dict like the outputs.

    Returns:
        A symmetric ``LinearOperator`` of shape (m, m), float64.

    Raises:
        ValueError: an unknown loss, y of the wrong shape, a bad chunk_size,
            an empty x, NaN in x or y.
        jacutil.core.guards.JacobianError: no variable reaches the loss.
    """
    x, y, sample_weight = read_data(x, y, sample_weight)
    if y is None:
        raise ValueError("hessian_operator needs y: the Hessian depends on it.")
    return products_operator(
        "hvp", model, x, loss, y, sample_weight, variables, chunk_size
    )
