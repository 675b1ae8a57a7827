"""A layer without a rule keeps the model on the fast path: autodiff.

The signal passes back through it as a vector-Jacobian product of l rows per
sample, all at once: the layer's input repeated l times is one batch of
``n * l`` rows, and one gradient call gives every row's signal
(:func:`tiled_vjp`; exact because the layer treats each row on its own, as
every layer does in inference mode). Only a layer that holds wanted
variables needs each row's gradient apart: ``tf.vectorized_map`` of the same
product over the rows (:class:`AutodiffRule`). Every other layer keeps its
hand-derived rule.
"""

from ..core._grouped import convolutions_by_group
from ..core._shared import or_zeros
from ..core._tf import tf
from ..core.target import watched
from .registry import Blocks, Rule, per_output, rows


def repeat_rows(a, n_outputs):
    """``(n, *shape)`` -> ``(n * l, *shape)``: each sample repeated l times in a row.

    Args:
        a: a tensor of shape ``(n, *shape)``.
        n_outputs: l.

    Returns:
        A tensor of shape ``(n * l, *shape)``.
    """
    shape = tf.shape(a)
    tiled = tf.broadcast_to(
        a[:, None], tf.concat([shape[:1], [n_outputs], shape[1:]], 0)
    )
    return tf.reshape(tiled, tf.concat([[-1], shape[1:]], 0))


def tiled_vjp(function, a, delta):
    """The signal at ``a`` from the signal ``delta``, shape ``(n, l, *out)``,
    at ``function(a)``.

    Args:
        function: the function, applied to a batch.
        a: its input, shape ``(n, *in)``.
        delta: the signal at its output, shape ``(n, l, *out)``.

    Returns:
        The signal at ``a``, shape ``(n, l, *in)``.
    """
    n_samples, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
    a_rows = repeat_rows(a, n_outputs)
    with tf.GradientTape() as tape:
        tape.watch(a_rows)
        y = function(a_rows)
    below = tape.gradient(y, a_rows, output_gradients=rows(delta))
    if below is None:  # the output does not depend on the input
        below = tf.zeros_like(a_rows)
    return per_output(below, n_samples, n_outputs)


class AutodiffRule(Rule):
    """Any call: its signal and, when wanted, its own blocks by autodiff.

    ``call`` replays the layer's call in the model - a layer called with
    arguments of its own (``Clip()(h, limit=0.3)``), or an operation between
    layers (``keras.ops.tanh(h)``, ``h * 2``) - as a ``jacutil.rules.engine.Node``
    does; by default, the layer on its input alone.

    Args:
        call: a Keras layer, or a ``jacutil.rules.engine.Node``.
        why: why autodiff writes this layer, for :meth:`describe`.
    """

    name = "autodiff"
    runs_user_code = True

    def __init__(self, call, why=""):
        layer = getattr(call, "operation", call)
        super().__init__(layer)
        self.call = call if call is not layer else self._alone
        self.variables = list(getattr(layer, "weights", []))
        self.why = why

    def _alone(self, a):
        with convolutions_by_group():  # see jacutil.core._grouped
            return self.layer(a, training=False)

    def describe(self):
        """``"autodiff"``, with the reason when there is one.

        Returns:
            A ``str``.
        """
        return f"autodiff ({self.why})" if self.why else "autodiff"

    def _forward(self, a):
        return self.call(a), a

    def _backward(self, a, delta, wanted, need_signal):
        layer = self.call
        ours = [v for v in self.variables if v in wanted]
        if not ours:
            below = None
            if need_signal:
                below = tiled_vjp(layer, a, delta)
            return {}, below
        n_samples, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
        floating = a.dtype.is_floating
        tracked = [watched(v) for v in ours]

        def one_row(row):
            a_row, d_row = row
            with tf.GradientTape() as tape:
                if floating:
                    tape.watch(a_row)
                tape.watch(tracked)
                y = layer(a_row[None])
            sources = ([a_row] if floating else []) + tracked
            grads = tape.gradient(y, sources, output_gradients=d_row[None])
            return [or_zeros(g, s) for g, s in zip(grads, sources, strict=True)]

        grads = tf.vectorized_map(one_row, (repeat_rows(a, n_outputs), rows(delta)))
        below = per_output(grads[0], n_samples, n_outputs) if floating else None
        blocks = Blocks()
        for v, g in zip(ours, grads[1:] if floating else grads, strict=True):
            blocks[v] = tf.reshape(g, [n_samples, n_outputs, -1])
        return blocks, below if need_signal else None
