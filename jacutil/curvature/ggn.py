"""The Gauss-Newton matrix as an operator, without J
(notebook 11-curvature-and-uncertainty).

``G = sum_i J_i.T H_i J_i`` (m x m) is the curvature that Gauss-Newton,
Levenberg-Marquardt, natural gradient (for these losses G is the Fisher) and
Laplace approximations use. :func:`ggn_operator` gives it as a SciPy
``LinearOperator``: each product ``G v`` is one forward pass carrying the
tangent ``J v``, the loss's ``H`` at the outputs, and one backward pass -
memory of one pass over a chunk, never l*m numbers per sample. SciPy's
``eigsh``, ``cg`` or ``minres`` take it as it is.
"""

import numpy as np

from .compiled import checked_batch, curvature_products
from .losses import output_loss


def ggn_operator(model, x, loss="squared_error", *, variables=None, chunk_size=None):
    """G = sum_i J_i.T H_i J_i as a ``scipy.sparse.linalg.LinearOperator``.

    Introduced in ``11-curvature-and-uncertainty``. The operator reads the
    model's variables when it is applied (it follows training), and its
    products are compiled once per model, loss and input shape.

    Args:
        model: a Keras model (for a cross-entropy: one that outputs logits),
            or a callable ``f(x)`` with ``variables=``.
        x: the n samples.
        loss: ``"squared_error"``, ``"softmax_cross_entropy"`` or
            ``"sigmoid_cross_entropy"`` (``jacutil.curvature.losses``).
        variables: the variables (default: the trainable ones), m in all.
        chunk_size: samples per pass, or None for the whole batch at once.

    Returns:
        A symmetric ``LinearOperator`` of shape (m, m), float64.

    Raises:
        ValueError: an unknown loss, or a cross-entropy on a model whose last
            layer applies a softmax or sigmoid.
        jacutil.core.guards.JacobianError: no variable reaches the outputs.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras
        >>> from jacutil.curvature.ggn import ggn_operator
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))
        >>> G = ggn_operator(model, x)  # squared error: G = J.T J
        >>> (G @ np.ones(8)).shape
        (8,)
    """
    from scipy.sparse.linalg import LinearOperator

    loss = output_loss(loss, model)
    products = curvature_products(
        model, loss, variables=variables, chunk_size=chunk_size
    )
    batch, _ = checked_batch(products, x)
    m = products.n_params

    def matvec(v):
        return products.ggn(batch, np.ravel(v)).astype(np.float64)

    def matmat(V):
        return np.stack([matvec(V[:, j]) for j in range(V.shape[1])], axis=1)

    return LinearOperator(
        (m, m), matvec=matvec, rmatvec=matvec, matmat=matmat, dtype=np.float64
    )
