"""Keras's own loss of a compiled model, one value per sample
(notebook 09-matrix-free).

DP-SGD clips each sample's gradient of the loss the model trains on. That
loss is Keras's: ``model.compute_loss`` - the loss ``compile`` built, with
every output and its ``loss_weights``, plus ``model.losses`` (``add_loss``,
activity and weight regularizers) - or a model's own ``compute_loss``. A
sample's loss is that computation on a batch of that one sample, as
jax_privacy takes it; :class:`KerasLoss` computes it, never a second
description of the loss:

- ``loss(y, prediction)``: the compiled loss of each sample of a batch, by
  Keras's ``CompileLoss`` on each sample (``tf.vectorized_map``), its cached
  logits carried along. The layer rules' fast paths (ghost norms,
  book-keeping) start their backward pass from it.
- ``loss.of_sample(x_i, y_i, prediction_i)``: the whole of Keras's loss of a
  one-sample batch, ``model.losses`` of its forward pass included: the
  general path, by autodiff per sample, where the model adds losses of its
  own or computes its loss itself.

Weight regularizers belong to no sample: they are left out of each sample's
loss and their gradient is added once to each update (``penalty``), unless
the model's own ``compute_loss`` decides what it adds (then all of it is
clipped).
"""

import numpy as np

from ..core._tf import keras, tf
from ..core.batch import n_samples, take
from ..core.formulation import quiet_function
from ..core.internals import (
    cached_logits,
    compile_loss,
    compute_loss,
    with_cached_logits,
)


class LossCouplesSamples(ValueError):
    """Keras's loss of a batch is not the mean or the sum of its samples'."""


class KerasLoss:
    """The loss a compiled Keras model trains on, one value per sample.

    ``KerasLoss(model)`` reads what ``model.compile`` built when it is made;
    :meth:`check` then proves on a few samples that the batch's loss is the
    mean (or, with ``reduction="sum"`` losses, the sum) of its samples' and
    learns whether the model adds losses in its forward pass. Introduced in
    ``09-matrix-free``.

    Attributes:
        compiled: ``model._compile_loss`` when this was made: a later
            ``model.compile`` makes another, which ``make_private``'s fit
            follows.
        own_compute_loss: the model's class defines ``compute_loss``.
        reads_forward: each sample's loss needs its own forward pass
            (``of_sample``): the model adds losses while it runs, or computes
            its loss itself, or the general path was asked for.
        aggregation: "mean" or "sum", from :meth:`check`: how Keras's loss of
            a batch combines its samples' (what the step divides by).
    """

    def __init__(self, model, general=False):
        self.model = model
        self.compiled = compile_loss(model)
        self.own_compute_loss = type(model).compute_loss is not keras.Model.compute_loss
        self.general = bool(general)
        self.reads_forward = self.general or self.own_compute_loss
        self.reads_forward |= self.compiled is None
        self.aggregation = "mean"
        self.checked = False
        self._eager = None  # __call__'s tf.function, for eager calls

    @property
    def penalty_outside(self):
        """Whether the weight regularizers' gradient is added once to each
        update, outside the clipping (Keras's ``compute_loss``), rather than
        inside each sample's clipped loss (a model's own)."""
        return not self.own_compute_loss

    def penalty(self):
        """The weight regularizers' loss (a scalar tensor, 0.0 with none):
        ``sum(v.regularizer(v))`` over the trainable weights, as Keras adds
        it to ``model.losses``."""
        terms = [
            tf.cast(v.regularizer(v), tf.float32)
            for v in self.model.trainable_weights
            if getattr(v, "regularizer", None) is not None
        ]
        return tf.add_n(terms) if terms else tf.constant(0.0)

    # -- per-sample values ------------------------------------------------------

    def __call__(self, y, prediction):
        """``(n,)``: Keras's compiled loss of each sample of a batch."""
        if self.compiled is None:
            raise ValueError("the model was compiled without a loss")
        logits = [cached_logits(p) for p in tf.nest.flatten(prediction)]
        has = tuple(t is not None for t in logits)
        kept = [t for t in logits if t is not None]
        if tf.executing_eagerly():  # vectorized_map would trace every call
            if self._eager is None:
                # one per KerasLoss: TensorFlow would count every instance's
                # first trace as a retrace of one function, and warn
                self._eager = quiet_function(self._values, reduce_retracing=True)
            return self._eager(y, prediction, kept, has)
        return self._values(y, prediction, kept, has)

    def _values(self, y, prediction, kept, has):
        """:meth:`__call__` in a graph: ``kept`` the cached logits of the
        outputs whose ``has`` is True."""
        flat = tf.nest.flatten(prediction)

        def one(row):
            y_i, p_i, l_i = row
            l_i = iter(l_i)
            leaves = []
            for p, cached in zip(p_i, has, strict=True):
                p = p[None]
                if cached:  # what Keras's cross-entropy reads instead of p
                    p = with_cached_logits(p, next(l_i)[None])
                leaves.append(p)
            one_y = tf.nest.map_structure(lambda t: t[None], y_i)
            one_prediction = tf.nest.pack_sequence_as(prediction, leaves)
            # its per-output loss trackers are not updated once per sample
            with keras.StatelessScope():
                return tf.cast(self.compiled(one_y, one_prediction), flat[0].dtype)

        rows = (t.shape.rank and t.shape[0] for t in tf.nest.flatten((y, flat)))
        if all(r == 1 for r in rows):
            # one sample (the per-sample gradients' own vectorized_map): its
            # loss as it is. A vectorized_map nested in theirs would have XLA
            # take the batch's values as compile-time constants: one compile
            # per batch (issue 63)
            return one(tf.nest.map_structure(lambda t: t[0], (y, flat, kept)))[None]
        return tf.vectorized_map(one, (y, flat, kept))

    def of_sample(self, x, y, prediction):
        """Keras's loss of a one-sample batch ``x``, ``y`` whose forward pass
        gave ``prediction`` (a scalar): the compiled loss plus the losses the
        forward pass added, less the weight penalty (:attr:`penalty_outside`);
        or the model's own ``compute_loss``, all of it."""
        if self.own_compute_loss:
            return compute_loss(self.model, x, y, prediction, training=True)
        total = tf.constant(0.0)
        if self.compiled is not None:
            with keras.StatelessScope():
                total += tf.cast(self.compiled(y, prediction), tf.float32)
        for term in self.model.losses:
            total += tf.reduce_sum(tf.cast(term, tf.float32))
        return total - self.penalty()

    # -- what may be clipped ----------------------------------------------------

    def check(self, x, y, training=False):
        """On the first few samples of ``x``, ``y``: learn whether the model
        adds losses while it runs (then :attr:`reads_forward`), and prove
        that Keras's loss of the batch is the mean or the sum of the samples'
        losses (:attr:`aggregation`); a :class:`LossCouplesSamples` error,
        saying what to do, when it is neither (a loss that couples samples,
        or heads of different reductions): clipping each sample's gradient
        would not bound its influence on that loss."""
        rows = min(3, int(n_samples(x)))
        x, y = take(x, 0, rows), take(y, 0, rows)
        penalties = sum(
            getattr(v, "regularizer", None) is not None
            for v in self.model.trainable_weights
        )
        prediction = self.model(x, training=training)
        if len(self.model.losses) > penalties:
            self.reads_forward = True  # add_loss, activity regularizers
        batch = float(compute_loss(self.model, x, y, prediction, training=True))
        if self.penalty_outside:
            batch -= float(self.penalty())
        each = []
        for i in range(rows):
            x_i, y_i = take(x, i, i + 1), take(y, i, i + 1)
            prediction_i = self.model(x_i, training=training)
            each.append(float(self.of_sample(x_i, y_i, prediction_i)))
        each = np.asarray(each)
        scale = max(np.abs(each).sum(), 1e-12)
        close = {
            "mean": abs(batch - each.mean()) <= 1e-4 * scale,
            "sum": abs(batch - each.sum()) <= 1e-4 * scale,
        }
        if close["mean"] or close["sum"]:
            self.aggregation = "mean" if close["mean"] else "sum"
            self.checked = True
            return
        raise LossCouplesSamples(
            f"Keras's loss of {rows} samples is {batch:.6g}, but the losses of "
            f"each sample alone are {np.round(each, 6).tolist()} (mean "
            f"{each.mean():.6g}, sum {each.sum():.6g}): the batch's loss is "
            "neither their mean nor their sum, so it couples the samples "
            "(a loss over the whole batch, a mask that normalizes across "
            "samples, or heads with different reductions), and clipping each "
            "sample's gradient would not bound its influence. Give every "
            "output a loss that is a mean (or a sum) of per-sample terms, the "
            "same reduction for every head."
        )
