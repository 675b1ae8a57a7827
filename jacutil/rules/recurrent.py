"""LSTM, GRU and SimpleRNN: back-propagation through time, per sample and output.

Each step of a recurrent layer is ``state_t = cell(x_t @ K, state_{t-1})``,
with the recurrent kernel R applied to ``h_{t-1}``. The forward pass keeps
what every step's backward needs (per sample: the gates and their slopes);
the backward pass walks the steps from the last, carrying the signal at the
state for every sample and output at once, and writes each step's signal at
``x_t @ K`` and at ``h_{t-1} @ R``. The blocks are then the outer-product
rule summed over the steps (``jacutil.rules.blocks``): K from the inputs
x_t, R (and a bias after it) from the previous states h_{t-1}. Each block
``sum_t a_t^T delta_t`` is one batched matrix product over the time axis,
the signal laid out (n, l, T, q) as J's rows want it: no step's block is
formed, and nothing is transposed. Their squared norms (DP clipping) take
the Gram route ``sum_{t,s} (a_t . a_s)(delta_t . delta_s)`` where the cost
model of ``jacutil.rules.blocks.gram_is_cheaper`` says it is cheaper than
the block. The loop over steps is unrolled while traced, so the sequence
length must be known (it is, per input shape).

Keras's steps, with ``s = recurrent_activation`` and ``a = activation``:

    LSTM       z = x K + h R + b = (i, f, g, o);
               c' = s(f) c + s(i) a(g);  h' = s(o) a(c')
    GRU        (reset_after) x K + b_x = (xz, xr, xh);  h R + b_h = (hz, hr, hh);
               z = s(xz + hz); r = s(xr + hr); n = a(xh + r hh);  h' = z h + (1 - z) n
    SimpleRNN  h' = a(x K + h R + b)
"""

from ..core._tf import keras, tf
from .activations import Activation
from .blocks import gram_is_cheaper, gram_norms, times_transpose
from .registry import Blocks, NoRule, Rule, register


def _with_slope(activation, z):
    y, slope = activation.forward(z)
    return y, (tf.ones_like(z) if slope is None else slope)


def _with_ones(a):
    """``a`` (n, T, p) with a column of ones appended: a bias's rows."""
    return tf.concat([a, tf.ones_like(a[..., :1])], -1)


def _summed_outer(a, delta):
    """(n, l, p, q): ``sum_t a[i, t]^T delta[i, k, t]``, one batched matrix
    product over the time axis from ``a`` (n, T, p) and ``delta`` (n, l, T, q)."""
    return tf.matmul(a[:, None], delta, transpose_a=True)


class _Recurrent(Rule):
    """The loop over steps; subclasses write one step forward and backward."""

    def __init__(self, layer):
        super().__init__(layer)
        if layer.go_backwards or layer.stateful or layer.return_state:
            raise NoRule(
                "a recurrent layer that runs backwards, keeps or returns state"
            )
        try:
            steps = layer.input.shape[1]
        except (AttributeError, ValueError):
            steps = None
        if steps is None:
            raise NoRule("a recurrent layer over sequences of unknown length")
        self.cell = layer.cell
        self.act = Activation(self.cell.activation)
        kinds = {self.act.kind}
        if hasattr(self.cell, "recurrent_activation"):
            self.gate = Activation(self.cell.recurrent_activation)
            kinds.add(self.gate.kind)
        if kinds - {"tanh", "sigmoid", "relu", "linear"}:
            raise NoRule("a recurrent activation without a formula")
        self.bias = self.cell.bias if self.cell.use_bias else None
        self.variables = [self.cell.kernel, self.cell.recurrent_kernel]
        self.variables += [self.bias] if self.bias is not None else []

    def _forward(self, a):
        n_samples, units = tf.shape(a)[0], self.cell.units
        inputs = tf.tensordot(a, self.cell.kernel, 1)  # x_t @ K for every t
        if self.bias is not None:
            inputs = inputs + self.input_bias()
        state = self.initial(tf.zeros([n_samples, units], a.dtype))
        saved, outputs = [], []
        for t in range(a.shape[1]):
            h_before = state[0]
            state, kept = self.step(inputs[:, t], state)
            saved.append((h_before, kept))
            outputs.append(state[0])
        y = tf.stack(outputs, 1) if self.layer.return_sequences else state[0]
        return y, (a, saved)

    def _signals(self, kept, delta):
        """The backward recursion: ``(a, states, by_input, by_state)``, the
        input (n, T, features), the states before each step (n, T, u) and the
        signal at the gates from the input and from the state, (n, l, T, g * u)
        each (one tensor when the cell's two signals are the same)."""
        a, saved = kept
        sequences = self.layer.return_sequences
        carry = self.initial(0.0 if sequences else delta)
        by_input, by_state = [None] * len(saved), [None] * len(saved)
        for t in reversed(range(len(saved))):
            if sequences:
                carry = (carry[0] + delta[:, :, t], *carry[1:])
            kept_t = tuple(k[:, None] for k in saved[t][1])
            by_input[t], by_state[t], carry = self.step_back(kept_t, carry)
        shared = all(s is i for s, i in zip(by_state, by_input, strict=True))
        by_input = tf.stack(by_input, 2)  # (n, l, T, gates): J's rows first
        by_state = by_input if shared else tf.stack(by_state, 2)
        states = tf.stack([s[0] for s in saved], 1)  # h_{t-1}: (n, T, u)
        return a, states, by_input, by_state

    def _backward(self, kept, delta, wanted, need_signal):
        a, states, by_input, by_state = self._signals(kept, delta)
        blocks = Blocks()
        for inputs, signal, kernel, bias in self.products(
            a, states, by_input, by_state
        ):
            with_kernel = kernel in wanted
            with_bias = bias is not None and bias in wanted
            n_samples, n_outputs = tf.shape(signal)[0], tf.shape(signal)[1]
            if with_kernel:
                if with_bias:
                    inputs = _with_ones(inputs)
                size = inputs.shape[-1] * signal.shape[-1]
                block = _summed_outer(inputs, signal)
                key = (kernel, bias) if with_bias else kernel
                blocks[key] = tf.reshape(block, [n_samples, n_outputs, size])
            elif with_bias:
                blocks[bias] = tf.reduce_sum(signal, 2)
        blocks.update(self.own_blocks(by_input, by_state, wanted))
        return blocks, self._below(by_input, need_signal)

    def _backward_norms(self, kept, delta, wanted, need_signal):
        """Each kernel's squared norm by the Gram matrices of the T steps
        where ``T (p + q) <= p q`` (:func:`gram_is_cheaper`), from its block
        otherwise; a bias alone is ``|sum_t delta_t|^2``."""
        a, states, by_input, by_state = self._signals(kept, delta)
        squared = tf.zeros(tf.shape(by_input)[:2], by_input.dtype)
        for inputs, signal, kernel, bias in self.products(
            a, states, by_input, by_state
        ):
            with_kernel = kernel in wanted
            with_bias = bias is not None and bias in wanted
            if with_kernel:
                if with_bias:
                    inputs = _with_ones(inputs)
                steps, p, q = inputs.shape[1], inputs.shape[-1], signal.shape[-1]
                if gram_is_cheaper(steps, p, q):
                    squared += gram_norms(inputs, signal)
                else:
                    block = _summed_outer(inputs, signal)
                    squared += tf.reduce_sum(tf.square(block), [2, 3])
            elif with_bias:
                squared += tf.reduce_sum(tf.square(tf.reduce_sum(signal, 2)), -1)
        for _, block in self.own_blocks(by_input, by_state, wanted).items():
            squared += tf.reduce_sum(tf.square(block), -1)
        return squared, self._below(by_input, need_signal)

    def _below(self, by_input, need_signal):
        """The signal at the layer's input, (n, l, T, features), or None."""
        return times_transpose(by_input, self.cell.kernel) if need_signal else None

    def step(self, x_k, state):
        """One step forward: from ``x_k``, the step's input times the kernel
        (and input bias), (n, gates * u), and the ``state`` before it (a tuple,
        ``h`` (n, u) first), ``(state, kept)``: the state after the step and
        what :meth:`step_back` needs, each a tuple of (n, ...) tensors."""
        raise NotImplementedError

    def step_back(self, kept, carry):
        """One step backward: from what :meth:`step` kept (each with an axis
        for l: (n, 1, ...)) and the ``carry``, the signal at the state after
        the step (a tuple of (n, l, u) tensors), ``(by_input, by_state,
        carry)``: the signal at the step's gates from the input and from the
        state, (n, l, gates * u) each, and the signal at the state before it."""
        raise NotImplementedError

    def products(self, a, states, by_input, by_state):
        """``(inputs, signal, kernel, bias)`` for each block that is a sum over
        the steps of outer products: K from the input ``a`` (n, T, features)
        and the signal from it, R (and the bias after it: LSTM, SimpleRNN)
        from the ``states`` before each step (n, T, u) and the signal from
        the state; signals (n, l, T, g * u)."""
        cell = self.cell
        return [
            (a, by_input, cell.kernel, None),
            (states, by_state, cell.recurrent_kernel, self.bias),
        ]

    def own_blocks(self, by_input, by_state, wanted):
        """Blocks that are not an outer product (a GRU's two-row bias)."""
        return Blocks()

    def input_bias(self):
        """The bias added to every step's input, (gates * u,), or None."""
        return self.bias

    def initial(self, h):
        """The state's parts, ``h`` first, before the first step (or the carry
        before the last) from ``h``: a zero state (n, u), a signal (n, l, u) or
        ``0.0``."""
        return (h,)


@register(keras.layers.LSTM)
class LSTMRule(_Recurrent):
    name = "lstm (BPTT)"

    def initial(self, h):
        return (h, h if isinstance(h, float) else tf.zeros_like(h))

    def step(self, x_k, state):
        h, c = state
        z = x_k + tf.matmul(h, self.cell.recurrent_kernel)
        zi, zf, zg, zo = tf.split(z, 4, axis=-1)
        (i, di), (f, df) = _with_slope(self.gate, zi), _with_slope(self.gate, zf)
        (g, dg), (o, do) = _with_slope(self.act, zg), _with_slope(self.gate, zo)
        gates = (g * di, c * df, i * dg)  # dz_i, dz_f, dz_g per unit of dc
        c = f * c + i * g
        ac, dac = _with_slope(self.act, c)
        return (o * ac, c), (f, o * dac, tf.concat([*gates, ac * do], -1))

    def step_back(self, kept, carry):
        f, o_dac, gates = kept
        dh, dc = carry
        dc = dc + dh * o_dac
        dz = tf.concat([dc, dc, dc, dh], -1) * gates  # (n, l, 4u)
        dh = times_transpose(dz, self.cell.recurrent_kernel)
        return dz, dz, (dh, dc * f)


@register(keras.layers.GRU)
class GRURule(_Recurrent):
    """A GRU (``reset_after=True``), by backpropagation through time;
    ``reset_after=False`` raises :class:`NoRule`."""

    name = "gru (BPTT)"

    def __init__(self, layer):
        super().__init__(layer)
        if not self.cell.reset_after:
            raise NoRule("a GRU with reset_after=False")

    def input_bias(self):
        return self.bias[0]

    def step(self, x_k, state):
        (h,) = state
        units = self.cell.units
        recurrent = tf.matmul(h, self.cell.recurrent_kernel)
        if self.bias is not None:
            recurrent = recurrent + self.bias[1]
        (z, dz), (r, dr) = (
            _with_slope(self.gate, x_k[:, k * units : (k + 1) * units]
                        + recurrent[:, k * units : (k + 1) * units])
            for k in range(2)
        )  # fmt: skip
        hh = recurrent[:, 2 * units :]
        n, dn = _with_slope(self.act, x_k[:, 2 * units :] + r * hh)
        # per unit of dh: the signal at (xz, xr, xh) before the r * hh term
        at_input = tf.concat([(h - n) * dz, (1 - z) * dn * hh * dr, (1 - z) * dn], -1)
        return (z * h + (1 - z) * n,), (z, r, at_input)

    def step_back(self, kept, carry):
        z, r, at_input = kept
        (dh,) = carry
        units = self.cell.units
        by_input = tf.concat([dh, dh, dh], -1) * at_input  # (n, l, 3u)
        by_state = tf.concat(
            [by_input[..., : 2 * units], by_input[..., 2 * units :] * r], -1
        )
        dh = dh * z + times_transpose(by_state, self.cell.recurrent_kernel)
        return by_input, by_state, (dh,)

    def products(self, a, states, by_input, by_state):
        """K and R apart (the bias is :meth:`own_blocks`)."""
        cell = self.cell
        return [
            (a, by_input, cell.kernel, None),
            (states, by_state, cell.recurrent_kernel, None),
        ]

    def own_blocks(self, by_input, by_state, wanted):
        """The bias (2, 3u): its input row, then its recurrent row."""
        blocks = Blocks()
        if self.bias is not None and self.bias in wanted:
            sums = [tf.reduce_sum(by_input, 2), tf.reduce_sum(by_state, 2)]
            blocks[self.bias] = tf.concat(sums, -1)
        return blocks


@register(keras.layers.SimpleRNN)
class SimpleRNNRule(_Recurrent):
    name = "simple_rnn (BPTT)"

    def step(self, x_k, state):
        (h,) = state
        h, slope = _with_slope(self.act, x_k + tf.matmul(h, self.cell.recurrent_kernel))
        return (h,), (slope,)

    def step_back(self, kept, carry):
        (slope,) = kept
        dz = carry[0] * slope
        return dz, dz, (times_transpose(dz, self.cell.recurrent_kernel),)
