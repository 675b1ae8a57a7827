"""LSTM: back-propagation through time, per sample and output, by hand.

Keras's LSTM step, with ``s = recurrent_activation`` and ``a = activation``:

    z_t = x_t @ K + h_{t-1} @ R + b,   split into (i, f, g, o) pre-activations
    c_t = s(f) * c_{t-1} + s(i) * a(g),   h_t = s(o) * a(c_t)

The forward pass keeps every step's gates; the backward pass walks the steps
from the last, carrying the signal at h and at c for every sample and output
at once, and writes ``dz_t``. The blocks are the outer-product rule over the
time steps (``jacutil.rules.blocks``): K from the inputs x_t, R (and the bias
after it) from the previous states h_{t-1}. The loop over steps is unrolled
while traced, so the sequence length must be known (it is, per input shape).
"""

from .._tf import keras, tf
from .activations import Activation
from .blocks import kernel_and_bias
from .registry import NoRule, Rule, register


@register(keras.layers.LSTM)
class LSTMRule(Rule):
    name = "lstm (BPTT)"

    def __init__(self, layer):
        super().__init__(layer)
        if layer.go_backwards or layer.stateful or layer.return_state:
            raise NoRule("an LSTM that runs backwards, keeps state or returns it")
        try:
            steps = layer.input.shape[1]
        except (AttributeError, ValueError):
            steps = None
        if steps is None:
            raise NoRule("an LSTM over sequences of unknown length")
        cell = layer.cell
        self.cell = cell
        self.act = Activation(cell.activation)
        self.gate = Activation(cell.recurrent_activation)
        if {self.act.kind, self.gate.kind} - {"tanh", "sigmoid", "relu", "linear"}:
            raise NoRule("an LSTM activation without a formula")
        self.bias = cell.bias if cell.use_bias else None
        self.variables = [cell.kernel, cell.recurrent_kernel]
        self.variables += [self.bias] if self.bias is not None else []

    def _slope(self, activation, z):
        y, slope = activation.forward(z)
        return y, (tf.ones_like(z) if slope is None else slope)

    def forward(self, a):
        cell, units = self.cell, self.cell.units
        steps = a.shape[1]
        n_samples = tf.shape(a)[0]
        h = tf.zeros([n_samples, units], a.dtype)
        c = tf.zeros([n_samples, units], a.dtype)
        inputs = tf.tensordot(a, cell.kernel, 1)  # (n, T, 4u): x_t @ K for all t
        if self.bias is not None:
            inputs = inputs + self.bias
        saved, outputs = [], []
        for t in range(steps):
            z = inputs[:, t] + tf.matmul(h, cell.recurrent_kernel)
            zi, zf, zg, zo = tf.split(z, 4, axis=-1)
            (i, di), (f, df) = self._slope(self.gate, zi), self._slope(self.gate, zf)
            (g, dg), (o, do) = self._slope(self.act, zg), self._slope(self.gate, zo)
            h_before = h
            gates = (g * di, c * df, i * dg)  # dz_i, dz_f, dz_g per unit of dc
            c = f * c + i * g
            ac, dac = self._slope(self.act, c)
            h = o * ac
            # per sample (n, ...), so the backward pass, per output, multiplies less
            saved.append((h_before, f, o * dac, tf.concat([*gates, ac * do], -1)))
            outputs.append(h)
        y = tf.stack(outputs, 1) if self.layer.return_sequences else h
        return y, (a, saved)

    def backward(self, kept, delta, wanted, need_signal):
        a, saved = kept
        cell = self.cell
        sequences = self.layer.return_sequences
        dh = 0.0 if sequences else delta
        dc = 0.0
        dzs = [None] * len(saved)
        for t in reversed(range(len(saved))):
            f, o_dac, gates = (s[:, None] for s in saved[t][1:])
            if sequences:
                dh = dh + delta[:, :, t]
            dc = dc + dh * o_dac
            dz = tf.concat([dc, dc, dc, dh], -1) * gates  # (n, l, 4u)
            dzs[t] = dz
            dc = dc * f
            dh = _times_transpose(dz, cell.recurrent_kernel)
        by_step = tf.stack(dzs, 1)  # (n, T, l, 4u): steps first, no transpose
        states = tf.stack([s[0] for s in saved], 1)  # h_{t-1}: (n, T, u)
        blocks = {}
        for inputs, kernel, bias in (
            (a, cell.kernel, None),
            (states, cell.recurrent_kernel, self.bias),
        ):
            blocks.update(kernel_and_bias(inputs, by_step, kernel, bias, wanted, True))
        below = None
        if need_signal:
            below = _times_transpose(tf.stack(dzs, 2), cell.kernel)
        return blocks, below


def _times_transpose(delta, matrix):
    """``delta @ matrix.T`` over the last axis, as one 2-D product."""
    rows = tf.matmul(tf.reshape(delta, [-1, delta.shape[-1]]), matrix, transpose_b=True)
    return tf.reshape(rows, tf.concat([tf.shape(delta)[:-1], [matrix.shape[0]]], 0))
