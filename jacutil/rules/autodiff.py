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
from ..core.formulation import safe_vectorized_map
from ..core.target import watched
from .registry import Blocks, Rule, per_output, rows


def repeat_rows(a, n_outputs):
    """``(n, *shape)`` -> ``(n * l, *shape)``: each sample repeated l =
    ``n_outputs`` times in a row."""
    shape = tf.shape(a)
    tiled = tf.broadcast_to(
        a[:, None], tf.concat([shape[:1], [n_outputs], shape[1:]], 0)
    )
    return tf.reshape(tiled, tf.concat([[-1], shape[1:]], 0))


def tiled_vjp(function, a, delta):
    """The signal ``(n, l, *in)`` at ``a`` ``(n, *in)`` from the signal
    ``delta``, shape ``(n, l, *out)``, at ``function(a)`` (on a batch)."""
    return tiled_vjps(function, [a], delta, [True])[0]


def tiled_vjps(function, inputs, delta, need_signal):
    """:func:`tiled_vjp` of ``function(*inputs)``, inputs ``(n, *in_i)``: a
    list of the signal at each, ``(n, l, *in_i)``, or None where
    ``need_signal`` (per input) says it is not wanted or the input is not a
    float (ids)."""
    n_samples, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
    tiled = [repeat_rows(a, n_outputs) for a in inputs]
    sources = [
        t for t, needed in zip(tiled, need_signal, strict=True)
        if needed and t.dtype.is_floating
    ]  # fmt: skip
    with tf.GradientTape() as tape:
        tape.watch(sources)
        y = function(*tiled)
    grads = iter(tape.gradient(y, sources, output_gradients=rows(delta)))
    below = []
    for t, needed in zip(tiled, need_signal, strict=True):
        if not (needed and t.dtype.is_floating):
            below.append(None)
            continue
        grad = or_zeros(next(grads), t)  # zeros: the output does not use it
        below.append(per_output(grad, n_samples, n_outputs))
    return below


class AutodiffRule(Rule):
    """Any call: its signal and, when wanted, its own blocks by autodiff.

    ``call`` replays the layer's call in the model - a layer called with
    arguments of its own (``Clip()(h, limit=0.3)``), or an operation between
    layers (``keras.ops.tanh(h)``, ``h * 2``, ``a + b``) - as a
    ``jacutil.rules.graph.Node`` does; by default, the layer on its input alone.

    Args:
        call: a Keras layer, or a ``jacutil.rules.graph.Node``.
        why: why autodiff writes this layer, for :meth:`describe`.
        several_inputs: the call takes several tensors (``call(*inputs)``);
            then the rule takes the list of them (see :class:`Rule`).
    """

    name = "autodiff"

    def __init__(self, call, why="", several_inputs=False):
        layer = getattr(call, "operation", call)
        super().__init__(layer)
        # Keras's own layers and ops (ConvNeXt's LayerScale, an Add between
        # layers) need no autograph, which is most of a first trace's time
        self.runs_user_code = not type(layer).__module__.startswith("keras.")
        self.call = call if call is not layer else self._alone
        self.variables = list(getattr(layer, "weights", []))
        self.why = why
        self.several_inputs = several_inputs

    def _alone(self, a):
        with convolutions_by_group():  # see jacutil.core._grouped
            return self.layer(a, training=False)

    def describe(self):
        """``"autodiff"``, with the reason when there is one (a ``str``)."""
        return f"autodiff ({self.why})" if self.why else "autodiff"

    def _forward(self, a):
        y = self.call(*a) if self.several_inputs else self.call(a)
        return y, a

    def _backward(self, a, delta, wanted, need_signal):
        inputs = list(a) if self.several_inputs else [a]
        needed = list(need_signal) if self.several_inputs else [need_signal]
        below, blocks = self._signals_and_blocks(inputs, delta, wanted, needed)
        # (n, l, *input): the static shape that a reshape by tf.shape dropped,
        # which the rules below read (a Dense on positions needs its width)
        below = [
            b if b is None else tf.ensure_shape(b, [None, None, *x.shape[1:]])
            for b, x in zip(below, inputs, strict=True)
        ]
        return blocks, below if self.several_inputs else below[0]

    def _signals_and_blocks(self, inputs, delta, wanted, need_signal):
        """The signal at each input (None where not needed) and the blocks."""
        ours = [v for v in self.variables if v in wanted]
        if not ours:
            if not any(need_signal):
                return [None] * len(inputs), {}
            return tiled_vjps(self.call, inputs, delta, need_signal), {}
        n_samples, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
        watched_inputs = [
            i for i, (a, needed) in enumerate(zip(inputs, need_signal, strict=True))
            if needed and a.dtype.is_floating
        ]  # fmt: skip
        tracked = [watched(v) for v in ours]
        call = self.call

        def one_row(row):
            a_rows, d_row = row
            a_rows = [a_row[None] for a_row in a_rows]
            with tf.GradientTape() as tape:
                tape.watch([a_rows[i] for i in watched_inputs])
                tape.watch(tracked)
                y = call(*a_rows)
            sources = [a_rows[i] for i in watched_inputs] + tracked
            grads = tape.gradient(y, sources, output_gradients=d_row[None])
            return [or_zeros(g, s) for g, s in zip(grads, sources, strict=True)]

        tiled = [repeat_rows(a, n_outputs) for a in inputs]
        grads = safe_vectorized_map(one_row, (tiled, rows(delta)))
        below = [None] * len(inputs)
        for i, grad in zip(watched_inputs, grads, strict=False):
            shape = tf.concat([[n_samples, n_outputs], tf.shape(inputs[i])[1:]], 0)
            below[i] = tf.reshape(grad, shape)
        blocks = Blocks()
        for v, g in zip(ours, grads[len(watched_inputs) :], strict=True):
            blocks[v] = tf.reshape(g, [n_samples, n_outputs, -1])
        return below, blocks
