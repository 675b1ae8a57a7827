"""Hessian-vector products of the loss (notebook 11-curvature-and-uncertainty).

The Hessian of the summed loss, ``sum_i d^2 L_i / d theta^2`` (m x m), is
G plus the terms G leaves out: the outputs' own second derivatives weighted
by the residuals. Near a minimum they are small, far from it they are not,
and the Hessian may have negative eigenvalues where G never has.
:func:`hessian_operator` gives it as a SciPy ``LinearOperator`` whose
product is forward mode over the reverse-mode gradient (one pass each).
"""

import numpy as np

from .compiled import checked_batch, curvature_products
from .losses import output_loss


def hessian_operator(
    model, x, y, loss="squared_error", *, variables=None, chunk_size=None
):
    """The loss's Hessian as a ``scipy.sparse.linalg.LinearOperator``.

    Introduced in ``11-curvature-and-uncertainty``. The loss is summed over
    samples; its products are compiled once per model, loss and input shape.

    Args:
        model: a Keras model (for a cross-entropy: one that outputs logits),
            or a callable ``f(x)`` with ``variables=``.
        x: the n samples.
        y: their targets (values, or integer labels for softmax).
        loss: ``"squared_error"``, ``"softmax_cross_entropy"`` or
            ``"sigmoid_cross_entropy"``.
        variables: the variables (default: the trainable ones), m in all.
        chunk_size: samples per pass, or None for the whole batch at once.

    Returns:
        A symmetric ``LinearOperator`` of shape (m, m), float64.

    Raises:
        ValueError: an unknown loss, or y of the wrong shape.
        jacutil.core.guards.JacobianError: no variable reaches the loss.
    """
    from scipy.sparse.linalg import LinearOperator

    loss = output_loss(loss, model)
    products = curvature_products(
        model, loss, variables=variables, chunk_size=chunk_size
    )
    batch, _ = checked_batch(products, x)
    targets = loss.targets(y, products.outputs(batch)).astype(products.target.dtype)
    m = products.n_params

    def matvec(v):
        return products.hvp(batch, targets, np.ravel(v)).astype(np.float64)

    def matmat(V):
        return np.stack([matvec(V[:, j]) for j in range(V.shape[1])], axis=1)

    return LinearOperator(
        (m, m), matvec=matvec, rmatvec=matvec, matmat=matmat, dtype=np.float64
    )
