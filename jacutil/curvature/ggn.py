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

from .compiled import products_operator


def ggn_operator(
    model, x, loss="squared_error", *, y=None, sample_weight=None, variables=None,
    chunk_size=None,
):  # fmt: skip
    """G = sum_i w_i J_i.T H_i J_i as a ``scipy.sparse.linalg.LinearOperator``.

    Introduced in ``11-curvature-and-uncertainty``. The operator reads the
    model's variables when it is applied (it follows training), and its
    products are compiled once per model, loss and input shape. ``H_i`` is
    block-diagonal, one block per output head, each from that head's loss.

    Args:
        model: a Keras model (for a cross-entropy: one whose heads output
            logits), or a callable ``f(x)`` with ``variables=``.
        x: the n samples, or a ``tf.data.Dataset`` / ``keras.utils.PyDataset``
            of ``model.fit``'s batches: ``x``, ``(x, y)`` or ``(x, y,
            sample_weight)`` (then neither ``y`` nor ``sample_weight``).
        loss: a plain name (``"squared_error"``, ``"softmax_cross_entropy"``,
            ``"sigmoid_cross_entropy"``: summed over samples), a Keras loss
            object or name (its reduction: ``"sum_over_batch_size"`` divides
            G by n), a callable ``loss(y_true, y_pred)``, or a list or dict of
            them, one per head (``jacutil.curvature.losses``).
        y: the targets, needed only by a loss differentiated as given.
        sample_weight: (n,) non-negative weights ``w_i``, or None (ones).
        variables: the variables (default: the trainable ones), m in all.
        chunk_size: samples per pass, or None for the whole batch at once.

    Returns:
        A symmetric ``LinearOperator`` of shape (m, m), float64.

    Raises:
        ValueError: an unknown loss, a cross-entropy on a head that outputs
            probabilities, a bad chunk_size, an empty x, NaN in x or y.
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
    return products_operator(
        "ggn", model, x, loss, y, sample_weight, variables, chunk_size
    )
