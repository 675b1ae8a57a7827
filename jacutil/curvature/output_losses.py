"""One head's loss seen from its outputs: value, gradient, Hessian and the
Hessian's square root (notebook 11-curvature-and-uncertainty).

Every curvature in ``jacutil.curvature`` is built from per-sample pieces: the
model's outputs ``f_i`` (length l, flattened as ``jacutil.jacobian`` flattens
them), the Jacobian ``J_i`` (l, m) and the Hessian ``H_i`` (l, l) of sample
i's loss at ``f_i``: ``G = sum_i w_i J_i.T H_i J_i``. :class:`HeadLosses` holds
one :class:`OutputLoss` per head (a leaf of the output nest in ``tf.nest.flatten``
order, dict keys sorted; its class count is its last axis), so H is
block-diagonal; ``jacutil.curvature.losses`` builds them from the user's loss.

``sqrt_hessian(f)`` gives ``S_i`` with ``H_i = S_i S_i.T`` (l, l): its
columns are the signals a backward pass starts from to build the exact
diagonal of G and the KFAC factors without forming ``J_i.T H_i J_i``. Every
formula is written once, in TensorFlow; the NumPy methods run it.
"""

import math

import numpy as np

from ..core._tf import tf

NAMES = ("squared_error", "softmax_cross_entropy", "sigmoid_cross_entropy")
REDUCTIONS = ("sum", "sum_over_batch_size", "mean", "mean_with_sample_weight")


def _tensor(a, dtype=None):
    return tf.convert_to_tensor(np.asarray(a) if not tf.is_tensor(a) else a, dtype)


class OutputLoss:
    """One head's loss, seen from its outputs: value, gradient and Hessian.

    ``OutputLoss(name, classes)`` builds the class of that loss kind
    (:class:`SquaredError`, :class:`SoftmaxCrossEntropy`,
    :class:`SigmoidCrossEntropy`); :class:`AutodiffLoss` takes any callable
    and :class:`HeadLosses` holds one per head. Every method takes the outputs
    as an array ``f`` of shape (n, l) (flattened per sample) and works per
    sample; the ``*_tf`` methods are the formulas, in TensorFlow.

    Args:
        name: one of ``NAMES``.
        classes: the number of classes (the output's last axis); 1 is fine
            for the squared error and the sigmoid.
        scale: a factor on each sample's loss (Keras' MSE: 2/k).
        label_smoothing: as Keras' cross-entropies take it.
        reduction: ``"sum"`` (the plain names) or a Keras reduction.
        shape: the head's per-sample output shape, or None (the whole row).
        label: the head's name in messages.
    """

    name = None
    needs_targets = False  # the Hessian depends on y

    def __new__(cls, name=None, *args, **kwargs):
        if cls is OutputLoss:
            if name not in _KINDS:
                raise unknown_loss(repr(name))
            cls = _KINDS[name]
        return super().__new__(cls)

    def __init__(
        self, name=None, classes=1, *, scale=1.0, label_smoothing=0.0,
        reduction="sum", shape=None, label="output",
    ):  # fmt: skip
        if name is not None and name != self.name:
            raise ValueError(f"{type(self).__name__} is {self.name!r}, not {name!r}.")
        self.classes = int(classes)
        self.scale = float(scale)
        self.label_smoothing = float(label_smoothing)
        self.reduction = checked_reduction(reduction)
        self.shape = None if shape is None else tuple(int(d) for d in shape)
        self.label = label

    def __repr__(self):
        options = [f"classes={self.classes}"]
        if self.scale != 1:
            options.append(f"scale={self.scale:.6g}")
        if self.label_smoothing:
            options.append(f"label_smoothing={self.label_smoothing:g}")
        options.append(f"reduction={self.reduction!r}")
        return f"{type(self).__name__}({', '.join(options)})"

    @property
    def key(self):
        """What a compiled graph of this loss depends on (hashable)."""
        return (
            type(self).__name__, self.classes, self.scale, self.label_smoothing,
            self.shape,
        )  # fmt: skip

    def _copy(self, **changes):
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__, **changes)
        return copy

    def bind(self, shape, label, probability=None):
        """A copy of this loss bound to a head of per-sample ``shape``, named
        ``label`` in messages, whose output is made by ``probability``
        (``"softmax"``/``"sigmoid"``, or None).

        Raises:
            ValueError: the head's shape contradicts the loss (its classes),
                or a cross-entropy head outputs probabilities.
        """
        bound = self._copy(shape=tuple(shape), label=label)
        bound._check_head(probability)
        return bound

    def _check_head(self, probability):
        pass

    def summed(self):
        """A copy of this loss with the sum over samples as its reduction:
        what a likelihood is, whatever reduction training used (Laplace)."""
        return self._copy(reduction="sum")

    def _w(self, f):
        """The head's width on ``f``: static where the shape is known."""
        return _width(f) if self.shape is None else math.prod(self.shape)

    def width(self, n_outputs):
        """The head's outputs per sample, an ``int``, of the model's
        ``n_outputs`` (l; a head without a shape covers them all)."""
        return n_outputs if self.shape is None else math.prod(self.shape)

    def positions(self, width):
        """Loss values per sample (what a mean reduction divides by), an
        ``int``, of ``width`` outputs per sample: one per row of classes."""
        return max(1, width // self.classes)

    # -- targets --------------------------------------------------------------

    def targets(self, y, f):
        """The n samples' targets ``y`` as a NumPy array (n, l) of target
        values (one-hot for labels), shaped by the outputs ``f`` (n, l); (n, .)
        for a loss differentiated as given."""
        f = np.asarray(f)
        return self._targets(y, f.shape[0], f.shape[1], f.dtype)

    def _targets(self, y, n, width, dtype):
        y = np.asarray(y)
        if y.size != n * width:
            raise ValueError(
                f"y{for_output(self.label)} has shape {y.shape}; it needs {width} "
                f"value(s) per sample for {n} samples."
            )
        return y.reshape(n, width).astype(dtype)

    # -- the formulas, in TensorFlow (f, u: (n, width); t: targets) -----------

    def mean_tf(self, f):
        """The prediction: ``f`` itself, or the probabilities of the logits."""
        return f

    def values_tf(self, f, t):
        """Each sample's loss, (n,)."""
        raise NotImplementedError

    def hessian_product_tf(self, f, u, t=None):
        """``H_i @ u_i`` for every sample, (n, width), without forming H."""
        raise NotImplementedError

    def sqrt_hessian_tf(self, f, t=None):
        """``S_i`` (n, width, width) with ``H_i = S_i S_i.T`` (columns: the
        signals)."""
        raise NotImplementedError

    def hessian_tf(self, f, t=None):
        """``H_i``, (n, width, width)."""
        S = self.sqrt_hessian_tf(f, t)
        return tf.matmul(S, S, transpose_b=True)

    def value_tf(self, f, t, weights=None):
        """The weighted sum of the samples' losses in a graph; ``t`` as
        :meth:`targets` gives it, ``weights`` (n, l) as :func:`row_weights`."""
        values = self.values_tf(f, t)
        if weights is not None:
            values = values * weights[:, 0]
        return tf.reduce_sum(values)

    # -- the same, NumPy in and out -------------------------------------------

    def _t(self, y, f):
        return None if y is None else _tensor(self.targets(y, f))

    def mean(self, f):
        """The prediction, (n, l)."""
        return self.mean_tf(_tensor(f)).numpy()

    def value(self, f, y):
        """Each sample's loss, shape (n,)."""
        return self.values_tf(_tensor(f), self._t(y, f)).numpy()

    def _gradient(self, f, t):
        with tf.GradientTape() as tape:
            tape.watch(f)
            value = tf.reduce_sum(self.values_tf(f, t))
        return tape.gradient(value, f)

    def gradient(self, f, y):
        """``dL_i / df_i``, shape (n, l)."""
        f = _tensor(f)
        return self._gradient(f, self._t(y, f.numpy())).numpy()

    def hessian(self, f, y=None):
        """``H_i``, shape (n, l, l) (``y`` only for a loss whose H needs it)."""
        return self.hessian_tf(_tensor(f), self._t(y, f)).numpy()

    def sqrt_hessian(self, f, y=None):
        """``S_i`` with ``H_i = S_i S_i.T``, shape (n, l, l); column c is the
        signal c a backward pass starts from."""
        return self.sqrt_hessian_tf(_tensor(f), self._t(y, f)).numpy()

    # -- the model's own predictive distribution (the Monte Carlo Fisher) -----

    def sample_signals(self, f, draws, rng):
        """Gradients at the outputs for targets drawn from the model's own
        predictive distribution, scaled so that ``E[s s.T] = H_i`` exactly.

        Each kind says what it draws; the ``draws`` of a sample are
        independent, from ``rng`` (a ``numpy.random.Generator``). ``f`` (n, l)
        in, NumPy (n, draws, l) out.

        Raises:
            ValueError: the loss is not the likelihood of a distribution the
                model predicts (a loss differentiated as given).
        """
        raise ValueError(
            f"the loss{for_output(self.label)} "
            f"({getattr(self, 'about', self.name)}) is "
            "differentiated as given: it is no likelihood of a distribution the "
            "model predicts, so there are no targets to draw and no Monte Carlo "
            "Fisher. Use the empirical Fisher (empirical_fisher_operator, with "
            "y=) or G itself (ggn_operator, ggn_diagonal), which the Monte Carlo "
            "Fisher estimates; or describe the head by a closed-form loss "
            f"({', '.join(map(repr, NAMES))}, or Keras' MSE or a cross-entropy "
            "with from_logits=True)."
        )


class SquaredError(OutputLoss):
    """``L_i = scale/2 * |f_i - y_i|^2``: ``H_i = scale * I``."""

    name = "squared_error"

    def positions(self, width):
        return max(1, width // (self.shape[-1] if self.shape else width))

    def values_tf(self, f, t):
        return 0.5 * self.scale * tf.reduce_sum(tf.square(f - t), axis=1)

    def hessian_product_tf(self, f, u, t=None):
        return self.scale * u

    def sqrt_hessian_tf(self, f, t=None):
        eye = tf.eye(self._w(f), dtype=f.dtype) * math.sqrt(self.scale)
        return tf.broadcast_to(eye, [tf.shape(f)[0], self._w(f), self._w(f)])

    def sample_signals(self, f, draws, rng):
        """``y ~ N(f_i, I / scale)``, the likelihood ``exp(-L_i)``: the gradient
        ``scale (f_i - y)`` has ``E[s s.T] = scale I = H_i``."""
        f = np.asarray(f)
        noise = rng.standard_normal((f.shape[0], draws, f.shape[1]))
        y = f[:, None, :] + noise / math.sqrt(self.scale)
        return self.scale * (f[:, None, :] - y)


class SigmoidCrossEntropy(OutputLoss):
    """Independent yes/no logits: ``H_i = scale * diag(s (1 - s))``,
    ``s = sigmoid(f_i)``."""

    name = "sigmoid_cross_entropy"

    positions = SquaredError.positions  # one value per row of the last axis

    def _check_head(self, probability):
        _refuse_probabilities(self, probability)

    def mean_tf(self, f):
        return tf.sigmoid(f)

    def values_tf(self, f, t):
        t = t * (1 - self.label_smoothing) + 0.5 * self.label_smoothing
        return self.scale * tf.reduce_sum(tf.math.softplus(f) - t * f, axis=1)

    def hessian_product_tf(self, f, u, t=None):
        s = tf.sigmoid(f)
        return self.scale * s * (1 - s) * u

    def sqrt_hessian_tf(self, f, t=None):
        s = tf.sigmoid(f)
        root = tf.sqrt(self.scale * s * (1 - s))
        return root[:, :, None] * tf.eye(self._w(f), dtype=f.dtype)

    def sample_signals(self, f, draws, rng):
        """``y ~ Bernoulli(sigmoid(f_i))`` per output; the signal
        ``sqrt(scale) (s - y)`` has ``E[s s.T] = H_i`` (the gradient of the
        cross-entropy at y when scale is 1; label smoothing is not drawn)."""
        f = np.asarray(f)
        s = 0.5 * (1 + np.tanh(0.5 * f))[:, None, :]
        y = rng.random((f.shape[0], draws, f.shape[1])) < s
        return math.sqrt(self.scale) * (s - y)


class SoftmaxCrossEntropy(OutputLoss):
    """Logits over the last axis: ``H_i = diag(p) - p p.T`` per position,
    ``p = softmax(f_i)`` (for targets that sum to one per position, as labels,
    one-hot rows and smoothed labels do); ``S = diag(sqrt p) - p sqrt(p).T``,
    since the ``p`` sum to one."""

    name = "softmax_cross_entropy"

    def _check_head(self, probability):
        _refuse_probabilities(self, probability)
        if self.shape is None:
            return _needs_classes(self)
        classes = self.shape[-1] if self.shape else 1
        if self.classes not in (1, classes):
            raise ValueError(
                f"the loss{for_output(self.label)} was given classes="
                f"{self.classes}, but that head's last axis has {classes}. Leave "
                "classes out: each head's class count is read from its output."
            )
        self.classes = classes
        _needs_classes(self)

    def _rows(self, f):
        if isinstance(self._w(f), int) and self._w(f) % self.classes:
            raise ValueError(
                f"{self._w(f)} outputs per sample are not a whole number of rows "
                f"of {self.classes} classes."
            )
        return tf.reshape(f, [tf.shape(f)[0], -1, self.classes])

    def _targets(self, y, n, width, dtype):
        y = np.asarray(y)
        if y.size * self.classes == n * width and self.classes > 1:
            labels = y.reshape(n, -1)
            if not np.all(labels == np.round(labels)) or (
                labels.size and (labels.min() < 0 or labels.max() >= self.classes)
            ):
                raise ValueError(
                    f"labels{for_output(self.label)} must be integers in 0.."
                    f"{self.classes - 1}; got values from {labels.min()} to "
                    f"{labels.max()}."
                )
            eye = np.eye(self.classes, dtype=dtype)
            return eye[labels.astype(int)].reshape(n, width)
        if y.size != n * width:
            raise ValueError(
                f"y{for_output(self.label)} has shape {y.shape}; it needs {width} "
                f"value(s) per sample for {n} samples (or one integer label per "
                f"row of {self.classes} classes)."
            )
        return y.reshape(n, width).astype(dtype)

    def mean_tf(self, f):
        return tf.reshape(tf.nn.softmax(self._rows(f)), tf.shape(f))

    def values_tf(self, f, t):
        z = self._rows(f)
        t = tf.reshape(t, tf.shape(z))
        t = t * (1 - self.label_smoothing) + self.label_smoothing / self.classes
        return -self.scale * tf.reduce_sum(t * tf.nn.log_softmax(z), axis=[1, 2])

    def hessian_product_tf(self, f, u, t=None):
        p = tf.nn.softmax(self._rows(f))
        w = tf.reshape(u, tf.shape(p))
        hw = p * w - p * tf.reduce_sum(p * w, axis=-1, keepdims=True)
        return self.scale * tf.reshape(hw, tf.shape(f))

    def sqrt_hessian_tf(self, f, t=None):
        n, width, c = tf.shape(f)[0], self._w(f), self.classes
        p = tf.reshape(tf.nn.softmax(self._rows(f)), [n, width])
        root = tf.sqrt(p)
        softmax_of = tf.range(width) // c  # which softmax each output is in
        same_row = tf.cast(softmax_of[:, None] == softmax_of[None, :], f.dtype)
        eye = tf.eye(width, dtype=f.dtype)
        S = root[:, :, None] * eye - p[:, :, None] * root[:, None, :] * same_row
        return math.sqrt(self.scale) * S

    def sample_signals(self, f, draws, rng):
        """``y ~ Categorical(softmax(f_i))`` per row of classes; the signal
        ``sqrt(scale) (p - onehot(y))`` has ``E[s s.T] = H_i`` (the gradient
        of the cross-entropy at y when scale is 1; label smoothing is not
        drawn)."""
        f = np.asarray(f)
        n, width = f.shape
        z = f.reshape(n, -1, self.classes)
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        u = rng.random((n, draws, z.shape[1], 1))
        labels = (np.cumsum(p, axis=-1)[:, None] < u).sum(axis=-1)
        onehot = np.eye(self.classes)[np.minimum(labels, self.classes - 1)]
        signals = math.sqrt(self.scale) * (p[:, None] - onehot)
        return signals.reshape(n, draws, width)


class AutodiffLoss(OutputLoss):
    """Any loss ``fn(y_true, y_pred)``: its Hessian by automatic
    differentiation at the head's outputs, per sample, in the graph.

    ``fn`` returns one value per sample (or per position, samples first);
    they are summed per sample. ``y_true`` is shaped like the head's output,
    or like its labels (one per sample or per row of the last axis). ``fn``
    is e.g. a Keras loss's ``call`` (no reduction); ``about`` names it in
    messages; the other arguments as :class:`OutputLoss`.
    """

    name = "autodiff"
    needs_targets = True

    def __init__(
        self, fn, *, reduction="sum_over_batch_size", shape=None, label="output",
        about=None,
    ):  # fmt: skip
        super().__init__(reduction=reduction, shape=shape, label=label)
        self.fn = fn
        self.about = about or getattr(fn, "__name__", type(fn).__name__)

    def __repr__(self):
        return f"AutodiffLoss({self.about}, reduction={self.reduction!r})"

    @property
    def key(self):
        return ("AutodiffLoss", id(self.fn), self.shape)

    def _y_true(self, f, t):
        n = tf.shape(f)[0]
        if self.shape is None:
            return f, t
        prediction = tf.reshape(f, [n, *self.shape])
        size, width = t.shape[1], math.prod(self.shape)
        if size == width:
            return prediction, tf.reshape(t, [n, *self.shape])
        if size == 1:
            return prediction, tf.reshape(t, [n])
        if self.shape and size * self.shape[-1] == width:
            return prediction, tf.reshape(t, [n, *self.shape[:-1]])
        return prediction, t

    def _targets(self, y, n, width, dtype):
        y = np.asarray(y)
        if y.ndim == 0 or y.shape[0] != n:
            raise ValueError(
                f"y{for_output(self.label)} has shape {y.shape}; it needs the {n} "
                "samples first."
            )
        return y.reshape(n, -1).astype(dtype)

    def values_tf(self, f, t):
        if t is None:
            raise ValueError(
                f"the loss{for_output(self.label)} ({self.about}) is differentiated "
                "as given, and its Hessian may depend on the targets: pass y=."
            )
        prediction, y_true = self._y_true(f, tf.cast(t, f.dtype))
        values = tf.convert_to_tensor(self.fn(y_true, prediction))
        if values.shape.rank == 0:
            raise ValueError(
                f"the loss {self.about} returned one number for the batch; it must "
                "return one value per sample (a Keras loss's call(), or a function "
                "without the reduction)."
            )
        return tf.reduce_sum(tf.reshape(values, [tf.shape(f)[0], -1]), axis=1)

    def count_values(self, t_row, width, dtype):
        """Loss values per sample (one trial call on zeros)."""
        f = tf.zeros([1, width], dtype)
        prediction, y_true = self._y_true(f, tf.constant(t_row, dtype))
        values = tf.convert_to_tensor(self.fn(y_true, prediction))
        return max(1, int(np.prod(values.shape[1:])))

    def hessian_product_tf(self, f, u, t=None):
        f = tf.identity(f)
        with tf.GradientTape() as tape:
            tape.watch(f)
            g = self._gradient(f, t)
        hu = tape.gradient(g, f, output_gradients=u)  # H symmetric: u.T H = H u
        return tf.zeros_like(f) if hu is None else hu

    def hessian_tf(self, f, t=None):
        f = tf.identity(f)
        with tf.GradientTape() as tape:
            tape.watch(f)
            g = self._gradient(f, t)
        H = tape.batch_jacobian(g, f)
        return tf.zeros_like(f)[:, :, None] * f[:, None, :] if H is None else H

    def sqrt_hessian_tf(self, f, t=None):
        H = self.hessian_tf(f, t)
        e, Q = tf.linalg.eigh(0.5 * (H + tf.linalg.matrix_transpose(H)))
        floor = -1e-7 * (tf.reduce_max(tf.abs(e)) + 1e-30)
        check = tf.debugging.assert_greater_equal(
            tf.reduce_min(e) if e.shape[-1] else tf.zeros([], e.dtype),
            floor,
            message=f"the Hessian of {self.about} at the outputs is not positive "
            "semi-definite, so it has no square root: the diagonal and KFAC need "
            "one. Use ggn_operator or hessian_operator for this loss.",
        )
        with tf.control_dependencies([check]):
            return Q * tf.sqrt(tf.maximum(e, 0))[:, None, :]


_KINDS = {k.name: k for k in (SquaredError, SoftmaxCrossEntropy, SigmoidCrossEntropy)}


class HeadLosses(OutputLoss):
    """One loss per head of a model, each on its slice of the row.

    The methods split ``f`` (n, l) into the heads' slices and join the
    results (H and S block-diagonal); targets ``t`` are a list, one (n, .)
    array per head. ``heads``: an :class:`OutputLoss` per head, bound to its
    shape, in ``tf.nest.flatten`` order. ``name`` is the heads' common name,
    or their names joined by ``+``.
    """

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, heads):
        self.heads = list(heads)
        names = sorted({h.name for h in self.heads})
        self.name = names[0] if len(names) == 1 else "+".join(h.name for h in heads)
        self.classes = tuple(h.classes for h in self.heads)
        self.needs_targets = any(h.needs_targets for h in self.heads)
        self.label = "output"
        self.shape = None
        if len(self.heads) == 1:
            self.slices = [slice(None)]
        else:
            ends = np.cumsum([math.prod(h.shape) for h in self.heads])
            self.slices = [
                slice(int(e - math.prod(h.shape)), int(e))
                for h, e in zip(self.heads, ends, strict=True)
            ]

    def __repr__(self):
        return f"HeadLosses({self.heads!r})"

    def summed(self):
        """Every head's loss summed over samples (:meth:`OutputLoss.summed`)."""
        return HeadLosses([h.summed() for h in self.heads])

    @property
    def key(self):
        return tuple(h.key for h in self.heads)

    def _split(self, f):
        return [f[:, s] for s in self.slices]

    def _each(self, t):
        return [None] * len(self.heads) if t is None else list(t)

    def head_targets(self, y, n, n_outputs, dtype):
        """``y`` as one (n, .) array per head: one array for one head, else a
        list or dict as the model's outputs (or the joined rows)."""
        if y is None:
            return None
        widths = [h.width(n_outputs) for h in self.heads]
        if len(self.heads) > 1 and not isinstance(y, (list, tuple, dict)):
            y = np.asarray(y)
            if y.size != n * sum(widths):
                raise ValueError(
                    f"y has shape {y.shape}; the model has {len(self.heads)} "
                    "outputs: pass one target array per output, as a list or dict "
                    "like the model's outputs (as model.fit takes them)."
                )
            ends = np.cumsum(widths)
            y = [
                y.reshape(n, -1)[:, e - w : e]
                for w, e in zip(widths, ends, strict=True)
            ]
        leaves = [y] if len(self.heads) == 1 else tf.nest.flatten(y)
        if len(leaves) != len(self.heads):
            raise ValueError(
                f"y holds {len(leaves)} array(s) for {len(self.heads)} outputs; pass "
                "one target array per output, in the structure of the outputs."
            )
        return [
            h._targets(np.asarray(v), n, w, dtype)
            for h, v, w in zip(self.heads, leaves, widths, strict=True)
        ]

    def targets(self, y, f):
        f = np.asarray(f)
        return np.concatenate(self.head_targets(y, *f.shape, f.dtype), axis=1)

    def _t(self, y, f):
        if y is None:
            return None
        if isinstance(y, (list, tuple)) and y and tf.is_tensor(y[0]):
            return y
        f = np.asarray(f)
        return [_tensor(t) for t in self.head_targets(y, *f.shape, f.dtype)]

    def value(self, f, y):
        f = np.asarray(f)
        if not isinstance(y, (list, tuple, dict)) and len(self.heads) > 1:
            y = np.asarray(y)  # joined rows, as targets() gives them
        return self.values_tf(_tensor(f), self._t(y, f)).numpy()

    def mean_tf(self, f):
        return tf.concat(
            [h.mean_tf(p) for h, p in zip(self.heads, self._split(f), strict=True)], 1
        )

    def values_tf(self, f, t):
        parts = zip(self.heads, self._split(f), self._each(t), strict=True)
        return tf.add_n([h.values_tf(p, tp) for h, p, tp in parts])

    def value_tf(self, f, t, weights=None):
        total = []
        for h, s, p, tp in zip(
            self.heads, self.slices, self._split(f), self._each(t), strict=True
        ):
            values = h.values_tf(p, tp)
            if weights is not None:
                values = values * weights[:, s.start or 0]
            total.append(tf.reduce_sum(values))
        return tf.add_n(total)

    def hessian_product_tf(self, f, u, t=None):
        parts = zip(
            self.heads, self._split(f), self._split(u), self._each(t), strict=True
        )
        return tf.concat([h.hessian_product_tf(p, q, tp) for h, p, q, tp in parts], 1)

    def _block_diagonal(self, blocks, f):
        if len(blocks) == 1:
            return blocks[0]
        width = self.slices[-1].stop
        padded = [
            tf.pad(b, [[0, 0], [0, 0], [s.start, width - s.stop]])
            for b, s in zip(blocks, self.slices, strict=True)
        ]
        return tf.concat(padded, axis=1)

    def sqrt_hessian_tf(self, f, t=None):
        parts = zip(self.heads, self._split(f), self._each(t), strict=True)
        return self._block_diagonal([h.sqrt_hessian_tf(p, tp) for h, p, tp in parts], f)

    def sample_signals(self, f, draws, rng):
        """Each head's draws (:meth:`OutputLoss.sample_signals`), heads in
        order from the one ``rng``, joined along the outputs: (n, draws, l)."""
        f = np.asarray(f)
        parts = [
            h.sample_signals(f[:, s], draws, rng)
            for h, s in zip(self.heads, self.slices, strict=True)
        ]
        return np.concatenate(parts, axis=2)

    def hessian_tf(self, f, t=None):
        parts = zip(self.heads, self._split(f), self._each(t), strict=True)
        return self._block_diagonal([h.hessian_tf(p, tp) for h, p, tp in parts], f)

    def row_weights(self, n, n_outputs, sample_weight=None, targets=None, dtype=None):
        """The weight of each sample's H, per output: (n, l), NumPy.

        ``sample_weight`` (n,) times each head's reduction: 1 for ``"sum"``;
        ``1 / (n * values per sample)`` for ``"sum_over_batch_size"`` and
        ``"mean"``; ``1 / sum(sample_weight)`` for ``"mean_with_sample_weight"``
        with weights - as Keras reduces a loss. ``n`` samples, ``n_outputs``
        (l); ``targets``: the heads' targets (a loss differentiated as given
        counts its values per sample on them), or None.
        """
        dtype = dtype or np.float64
        w = np.ones(n, dtype) if sample_weight is None else sample_weight.astype(dtype)
        out = np.empty((n, n_outputs), dtype)
        for j, (h, s) in enumerate(zip(self.heads, self.slices, strict=True)):
            width = h.width(n_outputs)
            if h.reduction == "sum":
                divisor = 1.0
            elif h.reduction == "mean_with_sample_weight" and sample_weight is not None:
                divisor = float(np.sum(sample_weight))
            elif isinstance(h, AutodiffLoss):
                divisor = n * h.count_values(targets[j][:1], width, dtype)
            else:
                divisor = n * h.positions(width)
            out[:, s] = (w / divisor if divisor else 0 * w)[:, None]
        return out


def _width(f):
    return f.shape[1] if f.shape[1] is not None else tf.shape(f)[1]


def for_output(label, sep=" "):
    """`` for output 'a'`` in a message, or nothing for a single output."""
    return "" if label in (None, "output") else f"{sep}for output {label!r}"


def checked_reduction(reduction):
    """``reduction`` checked: one of ``REDUCTIONS`` (ValueError otherwise)."""
    if reduction in (None, "none", "auto"):
        raise ValueError(
            f"reduction={reduction!r} leaves one loss per sample; curvature is of "
            f"one number. Use one of {', '.join(map(repr, REDUCTIONS))}."
        )
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}; got "
            f"{reduction!r}."
        )
    return reduction


def _needs_classes(loss):
    if loss.classes == 1:
        raise ValueError(
            f"softmax cross-entropy{for_output(loss.label)} needs the number of "
            "classes, the length of the output's last axis; it is 1 or unknown "
            "here (a softmax over one class is constant). For a yes/no output use "
            '"sigmoid_cross_entropy"; for a callable pass '
            'OutputLoss("softmax_cross_entropy", classes=k).'
        )


def _refuse_probabilities(loss, probability):
    if probability is None:
        return
    where = "the model's output" if loss.label == "output" else f"output {loss.label!r}"
    raise ValueError(
        f"{where} is made by a {probability}, so it holds probabilities, but "
        f"{loss.name} curvature is taken at the logits (with respect to "
        "probabilities the cross-entropy's Hessian is not positive semi-definite). "
        "Build the model with no activation on that output (it outputs logits), "
        "pass the loss with from_logits=True (e.g. keras.losses."
        "SparseCategoricalCrossentropy(from_logits=True)), and apply the "
        f"{probability} to its predictions yourself."
    )


def unknown_loss(about):
    """The ValueError for a loss that is none of those known (``about``: it)."""
    return ValueError(
        f"loss must be one of {', '.join(map(repr, NAMES))}, a Keras loss "
        f"(object or name) or a callable loss(y_true, y_pred); got {about}."
    )
