"""Hessian-vector products of the loss (notebook 11-curvature-and-uncertainty).

The Hessian of the summed loss, ``sum_i d^2 L_i / d theta^2`` (m x m), is
G plus the terms G leaves out: the outputs' own second derivatives weighted
by the residuals. Near a minimum they are small, far from it they are not,
and the Hessian may have negative eigenvalues where G never has.
:func:`hessian_operator` gives it as a SciPy ``LinearOperator`` whose
product is forward mode over the reverse-mode gradient (one pass each).
"""

import numpy as np

from ..core.arguments import check_chunk_size
from ..core.data import read_data
from ..core.target import variable_list
from .compiled import curvature_inputs, curvature_products


def hessian_operator(
    model, x, y, loss="squared_error", *, sample_weight=None, variables=None,
    chunk_size=None,
):  # fmt: skip
    """The loss's Hessian as a ``scipy.sparse.linalg.LinearOperator``.

    Introduced in ``11-curvature-and-uncertainty``. The loss is the sum over
    samples (times ``sample_weight`` and each head's reduction, as for
    :func:`jacutil.curvature.ggn.ggn_operator`); its products are compiled
    once per model, loss and input shape.

    Args:
        model: a Keras model (for a cross-entropy: one whose heads output
            logits), or a callable ``f(x)`` with ``variables=``.
        x: the n samples.
        y: their targets (values, or integer labels for a softmax), one
            array per head as a list or dict like the outputs.
        loss: as for ``ggn_operator``: a plain name, a Keras loss, a
            callable, or one per head.
        sample_weight: (n,) non-negative weights, or None.
        variables: the variables (default: the trainable ones), m in all.
        chunk_size: samples per pass, or None for the whole batch at once.

    Returns:
        A symmetric ``LinearOperator`` of shape (m, m), float64.

    Raises:
        ValueError: an unknown loss, y of the wrong shape, a bad chunk_size,
            an empty x, NaN in x or y.
        jacutil.core.guards.JacobianError: no variable reaches the loss.
    """
    from scipy.sparse.linalg import LinearOperator

    chunk_size = check_chunk_size(chunk_size)
    variables = None if variables is None else variable_list(variables)
    products = curvature_products(model, variables=variables, chunk_size=chunk_size)
    x, y, sample_weight = read_data(x, y, sample_weight)
    if y is None:
        raise ValueError("hessian_operator needs y: the Hessian depends on it.")
    given = curvature_inputs(model, products.target, x, loss, y, sample_weight)
    m = products.n_params

    def matvec(v):
        return products.hvp(
            given.loss, given.batch, given.targets, np.ravel(v), given.weights
        ).astype(np.float64)

    return LinearOperator((m, m), matvec=matvec, rmatvec=matvec, dtype=np.float64)
