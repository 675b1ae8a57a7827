"""The losses curvature is taken for, and their Hessians at the outputs
(notebook 11-curvature-and-uncertainty).

Every curvature in ``jacutil.curvature`` is built from per-sample pieces:
the model's outputs ``f_i`` (length l, flattened as ``jacutil.jacobian``
flattens them), the Jacobian ``J_i`` (l, m) and the Hessian ``H_i`` (l, l)
of sample i's loss with respect to ``f_i``. The loss of a batch is the *sum*
over samples, so the Gauss-Newton matrix is ``G = sum_i J_i.T H_i J_i``.

Three losses, by name:

* ``"squared_error"``: ``L_i = 0.5 * |f_i - y_i|^2``, so ``H_i = I``.
* ``"softmax_cross_entropy"``: ``f_i`` are logits over the classes (the last
  axis of the output), ``y_i`` integer labels or one-hot rows;
  ``H_i = diag(p) - p p.T`` per position, ``p = softmax(f_i)``.
* ``"sigmoid_cross_entropy"``: ``f_i`` are logits of independent yes/no
  outputs, ``y_i`` in {0, 1}; ``H_i = diag(s (1 - s))``, ``s = sigmoid(f_i)``.

For the cross-entropies the model must output *logits* (no softmax or
sigmoid at the end): the Hessian of cross-entropy with respect to
probabilities is not positive semi-definite, and the curvature would be
wrong. ``check_logits`` refuses such a model with that advice.

``sqrt_hessian(f)`` gives ``S_i`` with ``H_i = S_i S_i.T`` (l, l): its
columns are the signals a backward pass starts from to build the exact
diagonal of G and the KFAC factors without forming ``J_i.T H_i J_i``. For
softmax, ``S = diag(sqrt p) - p sqrt(p).T``, since the ``p`` sum to one.
"""

import numpy as np

from ..core._tf import keras, tf

NAMES = ("squared_error", "softmax_cross_entropy", "sigmoid_cross_entropy")


def _softmax(f):
    z = f - f.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _sigmoid(f):
    return 0.5 * (1.0 + np.tanh(0.5 * f))  # no overflow for large |f|


class OutputLoss:
    """One loss, seen from the outputs: its value, gradient and Hessian.

    Every method takes the outputs as a NumPy array ``f`` of shape (n, l)
    (flattened per sample) and works per sample. ``classes`` is the length
    of the last axis of the model's output (the softmax runs over it).

    Args:
        name: one of ``NAMES``.
        classes: the number of classes (the output's last axis); 1 is fine
            for the squared error and the sigmoid.
    """

    def __init__(self, name, classes=1):
        if name not in NAMES:
            raise ValueError(
                f"loss must be one of {', '.join(map(repr, NAMES))}; got {name!r}."
            )
        self.name = name
        self.classes = int(classes)

    def __repr__(self):
        return f"OutputLoss({self.name!r}, classes={self.classes})"

    # -- shapes ---------------------------------------------------------------

    def _positions(self, f):
        """``f`` as (n, positions, classes) for the softmax."""
        n, n_out = f.shape
        if n_out % self.classes:
            raise ValueError(
                f"{n_out} outputs per sample are not a whole number of rows of "
                f"{self.classes} classes."
            )
        return f.reshape(n, n_out // self.classes, self.classes)

    def targets(self, y, f):
        """``y`` as an (n, l) array of target values (one-hot for labels)."""
        y = np.asarray(y)
        n, n_out = f.shape
        if self.name == "softmax_cross_entropy" and y.size * self.classes == n * n_out:
            labels = y.reshape(n, -1).astype(int)
            if labels.min() < 0 or labels.max() >= self.classes:
                raise ValueError(
                    f"labels must be integers in 0..{self.classes - 1}; got values "
                    f"from {labels.min()} to {labels.max()}."
                )
            return np.eye(self.classes, dtype=f.dtype)[labels].reshape(n, n_out)
        if y.size != n * n_out:
            raise ValueError(
                f"y has shape {y.shape}; it needs {n_out} value(s) per sample for "
                f"{n} samples (or one integer label per row of classes)."
            )
        return y.reshape(n, n_out).astype(f.dtype)

    # -- the loss and its derivatives ---------------------------------------

    def mean(self, f):
        """The prediction: ``f`` itself, or the probabilities of the logits."""
        if self.name == "squared_error":
            return f
        if self.name == "sigmoid_cross_entropy":
            return _sigmoid(f)
        return _softmax(self._positions(f)).reshape(f.shape)

    def value(self, f, y):
        """Each sample's loss, shape (n,)."""
        t = self.targets(y, f)
        if self.name == "squared_error":
            return 0.5 * np.sum((f - t) ** 2, axis=1)
        if self.name == "sigmoid_cross_entropy":  # log(1 + e^f) - t f, stable
            return np.sum(np.logaddexp(0.0, f) - t * f, axis=1)
        z = self._positions(f)
        log_p = z - z.max(-1, keepdims=True)
        log_p = log_p - np.log(np.exp(log_p).sum(-1, keepdims=True))
        return -np.sum(self._positions(t) * log_p, axis=(1, 2))

    def gradient(self, f, y):
        """``dL_i / df_i``, shape (n, l)."""
        return self.mean(f) - self.targets(y, f)

    def hessian(self, f):
        """``H_i``, shape (n, l, l)."""
        n, n_out = f.shape
        if self.name == "squared_error":
            return np.broadcast_to(
                np.eye(n_out, dtype=f.dtype), (n, n_out, n_out)
            ).copy()
        if self.name == "sigmoid_cross_entropy":
            s = _sigmoid(f)
            return np.einsum("ik,kj->ikj", s * (1 - s), np.eye(n_out, dtype=f.dtype))
        p = self._positions(self.mean(f))
        blocks = np.einsum("irk,kj->irkj", p, np.eye(self.classes, dtype=f.dtype))
        blocks -= np.einsum("irk,irj->irkj", p, p)
        return _block_diagonal(blocks)

    def sqrt_hessian(self, f):
        """``S_i`` with ``H_i = S_i S_i.T``, shape (n, l, l); column c is the
        signal c a backward pass starts from."""
        n, n_out = f.shape
        if self.name == "squared_error":
            return self.hessian(f)
        if self.name == "sigmoid_cross_entropy":
            s = _sigmoid(f)
            return np.einsum(
                "ik,kj->ikj", np.sqrt(s * (1 - s)), np.eye(n_out, dtype=f.dtype)
            )
        p = self._positions(self.mean(f))
        root = np.sqrt(p)
        blocks = np.einsum("irk,kj->irkj", root, np.eye(self.classes, dtype=f.dtype))
        blocks -= np.einsum("irk,irj->irkj", p, root)
        return _block_diagonal(blocks)

    def hessian_product(self, f, u):
        """``H_i @ u_i`` for every sample, shape (n, l), without forming H."""
        if self.name == "squared_error":
            return u
        if self.name == "sigmoid_cross_entropy":
            s = _sigmoid(f)
            return s * (1 - s) * u
        p = self._positions(self.mean(f))
        w = self._positions(u)
        return (p * w - p * np.sum(p * w, axis=-1, keepdims=True)).reshape(u.shape)

    # -- the same in TensorFlow, for compiled products ----------------------

    def hessian_product_tf(self, f, u):
        """``H_i @ u_i`` in a TensorFlow graph; ``f`` and ``u`` of shape (n, l)."""
        if self.name == "squared_error":
            return u
        if self.name == "sigmoid_cross_entropy":
            s = tf.sigmoid(f)
            return s * (1 - s) * u
        shape = tf.shape(f)
        p = tf.nn.softmax(tf.reshape(f, [shape[0], -1, self.classes]))
        w = tf.reshape(u, tf.shape(p))
        hw = p * w - p * tf.reduce_sum(p * w, axis=-1, keepdims=True)
        return tf.reshape(hw, shape)

    def sqrt_hessian_tf(self, f):
        """``S_i`` (n, l, l) in a TensorFlow graph (columns: the signals)."""
        n = tf.shape(f)[0]
        n_out = f.shape[1] if f.shape[1] is not None else tf.shape(f)[1]
        eye = tf.eye(n_out, dtype=f.dtype)
        if self.name == "squared_error":
            return tf.broadcast_to(eye, [n, n_out, n_out])
        if self.name == "sigmoid_cross_entropy":
            s = tf.sigmoid(f)
            return tf.sqrt(s * (1 - s))[:, :, None] * eye
        c = self.classes
        p = tf.reshape(tf.nn.softmax(tf.reshape(f, [n, -1, c])), [n, n_out])
        root = tf.sqrt(p)
        softmax_of = tf.range(n_out) // c  # which softmax each output is in
        same_row = tf.cast(softmax_of[:, None] == softmax_of[None, :], f.dtype)
        return root[:, :, None] * eye - p[:, :, None] * root[:, None, :] * same_row

    def value_tf(self, f, t):
        """The summed loss of a batch in a graph; ``t`` as :meth:`targets` gives."""
        if self.name == "squared_error":
            return 0.5 * tf.reduce_sum(tf.square(f - t))
        if self.name == "sigmoid_cross_entropy":
            return tf.reduce_sum(tf.math.softplus(f) - t * f)
        n = tf.shape(f)[0]
        z = tf.reshape(f, [n, -1, self.classes])
        return -tf.reduce_sum(tf.reshape(t, tf.shape(z)) * tf.nn.log_softmax(z))


def _block_diagonal(blocks):
    """(n, r, c, c) blocks -> (n, r*c, r*c) block-diagonal matrices."""
    n, r, c, _ = blocks.shape
    out = np.zeros((n, r * c, r * c), blocks.dtype)
    for j in range(r):
        out[:, j * c : (j + 1) * c, j * c : (j + 1) * c] = blocks[:, j]
    return out


def output_loss(loss, model=None):
    """``loss`` as an :class:`OutputLoss`, its classes read from the model.

    Introduced in ``11-curvature-and-uncertainty``.

    Args:
        loss: a name from ``NAMES``, or an :class:`OutputLoss`.
        model: the Keras model (its output's last axis gives the classes, and
            a cross-entropy is refused on a model that ends in a softmax or
            sigmoid), or None.

    Returns:
        An :class:`OutputLoss`.
    """
    if isinstance(loss, OutputLoss):
        return loss
    classes = 1
    if model is not None and isinstance(model, keras.Model):
        shape = model.outputs[0].shape if getattr(model, "outputs", None) else None
        if shape is not None and len(shape) > 1 and shape[-1] is not None:
            classes = int(shape[-1])
        if loss != "squared_error":
            check_logits(model)
    if loss == "softmax_cross_entropy" and classes == 1:
        raise ValueError(
            "softmax cross-entropy needs the number of classes, the length of the "
            "output's last axis; this model's is 1 or unknown (a softmax over one "
            "class is constant). For a yes/no output use \"sigmoid_cross_entropy\"; "
            "for a callable pass OutputLoss(\"softmax_cross_entropy\", classes=k)."
        )
    return OutputLoss(loss, classes if loss == "softmax_cross_entropy" else 1)


def check_logits(model):
    """Refuse a model whose output passes through a softmax or sigmoid.

    Args:
        model: a Keras model.

    Raises:
        ValueError: its last layer applies a softmax or a sigmoid.
    """
    last = model.layers[-1] if getattr(model, "layers", None) else None
    activation = getattr(last, "activation", None)
    name = getattr(activation, "__name__", "")
    if isinstance(last, keras.layers.Softmax) or name in ("softmax", "sigmoid"):
        raise ValueError(
            f"the model's last layer {last.name!r} applies a {name or 'softmax'}: "
            "curvature for a cross-entropy is taken at the logits. Build the model "
            "with no activation on its last layer (it outputs logits), and apply "
            "the softmax or sigmoid to its predictions yourself."
        )
