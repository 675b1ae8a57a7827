"""Dense with any activation: outer products (see ``jacutil.rules.blocks``).

Its squared norms per sample come from the Gram matrices of the positions
(``jacutil.rules.blocks.gram_norms``) where those are cheaper than the
kernel's block, as Opacus's ghost clipping of ``nn.Linear``
(``compute_linear_norm_sample``) and BackPACK's ``BatchL2Linear``.
"""

from ..core._tf import keras, tf
from .activations import Activation
from .blocks import (
    gram_is_cheaper,
    gram_norms,
    kernel_and_bias,
    positions_of,
    sum_norms,
    times_transpose,
    weighted_rows,
)
from .registry import Blocks, LogitsSignal, NoRule, Rule, register


def refuse_adapted(layer, kind):
    """Raise :class:`NoRule` for a LoRA or quantized layer: its weights are not
    the plain variables whose blocks the rule writes."""
    if getattr(layer, "lora_enabled", False) or layer.quantization_mode:
        raise NoRule(f"a LoRA or quantized {kind}")


class KernelRule(Rule):
    """``y = act(a W + b)``: the kernel, bias and activation that a Dense shares
    with a convolution (a Dense at every position), and their ghost norms;
    a subclass gives ``_gram_sizes``, ``_at_z``, ``_groups`` and ``_below``.
    ``kind`` names the layer in :class:`NoRule`'s words (a LoRA or quantized
    layer raises it). KFAC's factors (notebook 11) read :meth:`input_rows`
    (A) and the signal at ``pre_activation`` (B).
    """

    def __init__(self, layer, kind):
        super().__init__(layer)
        refuse_adapted(layer, kind)
        self.activation = Activation(layer.activation)
        self.runs_user_code = self.activation.runs_user_code
        self.takes_logits_signal = self.activation.makes_logits
        self.bias = layer.bias if layer.use_bias else None
        self.variables = [layer.kernel] + ([self.bias] if self.bias is not None else [])

    def _backward_norms(self, saved, delta, wanted, need_signal):
        """Ghost norms: the Gram matrices of the T positions (per group) where
        ``T (p + q) <= p q`` for the kernel's (p, q) block, the blocks otherwise;
        a bias alone is ``|sum_t delta[t]|^2`` either way."""
        a, slope = saved
        with_kernel = self.layer.kernel in wanted
        with_bias = self.bias is not None and self.bias in wanted
        signal = LogitsSignal.unwrapped(delta)
        ghost = gram_is_cheaper(*self._gram_sizes(a, signal)) or not with_kernel
        if not (with_kernel or with_bias) or not ghost:
            return super()._backward_norms(saved, delta, wanted, need_signal)
        delta = self._at_z(slope, delta)
        squared = tf.zeros(tf.shape(delta)[:2], delta.dtype)
        if with_kernel:
            for patches, group_signal in self._groups(a, delta):
                squared += gram_norms(patches, group_signal)
        if with_bias:
            squared += sum_norms(delta)
        return squared, (self._below(a, delta) if need_signal else None)

    def input_rows(self, a):
        """The inputs as rows, one per sample and position, with a 1 for
        the bias: (n R, d_in + 1), KFAC's ``a_bar``."""
        rows = self._patches(a)
        rows = tf.reshape(rows, [-1, rows.shape[-1]])
        if self.bias is not None:
            rows = tf.concat([rows, tf.ones_like(rows[:, :1])], axis=1)
        return rows


@register(keras.layers.Dense)
class DenseRule(KernelRule):
    """``y = act(a @ W + b)``, on the last axis of an input of any rank; a LoRA
    or quantized Dense raises :class:`NoRule`."""

    name = "dense"
    weighs_sums = True
    fast_under_xla = True  # its norms: |a|^2 |delta|^2, fused by XLA
    kronecker_factors = True

    def __init__(self, layer):
        super().__init__(layer, "Dense")
        # an element-wise slope or a softmax broadcasts a shared signal;
        # autodiff of an unknown function needs one row per sample
        self.shared_signal = not self.runs_user_code

    def describe(self):
        """``"dense"`` and the activation, e.g. ``"dense+relu"`` (a ``str``)."""
        return self.name + self.activation.describe()

    def pre_activation(self, a):
        """``a @ W + b``: the output before the activation."""
        kernel = self.layer.kernel
        z = tf.tensordot(a, kernel, 1) if a.shape.rank > 2 else tf.matmul(a, kernel)
        return z + self.bias if self.bias is not None else z

    def _forward(self, a):
        y, slope = self.activation.forward(self.pre_activation(a))
        return y, (a, slope)

    def _patches(self, a):
        return a

    def _backward(self, saved, delta, wanted, need_signal):
        a, slope = saved
        delta = self._at_z(slope, delta)
        blocks = kernel_and_bias(a, delta, self.layer.kernel, self.bias, wanted)
        return blocks, (self._below(a, delta) if need_signal else None)

    def _gram_sizes(self, a, signal):
        """T, p and q for :func:`gram_is_cheaper` (a flat input: T = 1)."""
        return positions_of(a.shape), *self.layer.kernel.shape

    def _at_z(self, slope, delta):
        return self.activation.backward(slope, delta)

    def _groups(self, a, delta):
        return [(a, delta)]

    def _backward_squares(self, saved, delta, wanted, need_signal):
        """G's diagonal without the blocks, for a flat input: the kernel's
        entry (j, k) sums ``a_ij^2 delta_irk^2`` over samples i and signals r,
        so it is ``(a^2).T @ sum_r delta^2`` - one product (BackPACK's
        ``DiagGGN`` of ``nn.Linear`` does the same)."""
        a, slope = saved
        if a.shape.rank != 2 or isinstance(delta, LogitsSignal):
            return super()._backward_squares(saved, delta, wanted, need_signal)
        delta = self.activation.backward(slope, delta)
        by_unit = tf.reduce_sum(tf.square(delta), axis=1)  # (n or 1, q)
        by_unit = tf.broadcast_to(by_unit, [tf.shape(a)[0], by_unit.shape[-1]])
        squares = Blocks()
        if self.layer.kernel in wanted:
            kernel = tf.matmul(tf.square(a), by_unit, transpose_a=True)
            squares[self.layer.kernel] = tf.reshape(kernel, [-1])
        if self.bias is not None and self.bias in wanted:
            squares[self.bias] = tf.reduce_sum(by_unit, axis=0)
        return squares, (self._below(a, delta) if need_signal else None)

    def _weighted_sums(self, saved, delta, wanted, weights):
        """The kernel's ``a.T @ (w * delta)`` and the bias's ``sum_i w_i delta_i``
        over samples (and positions, for an input of higher rank): one
        product, as the ordinary backward pass's. Rows of weight 0 are
        zeroed first, so that a NaN in a skipped sample stays out."""
        a, slope = saved
        delta = self._at_z(slope, delta)[:, 0]  # (n, ..., q): one signal row
        weighted, a = weighted_rows(weights, delta, a)
        weighted = tf.reshape(weighted, [-1, weighted.shape[-1]])
        sums = Blocks()
        if self.layer.kernel in wanted:
            a = tf.reshape(a, [-1, a.shape[-1]])
            sums[self.layer.kernel] = tf.reshape(
                tf.matmul(a, weighted, transpose_a=True), [-1]
            )
        if self.bias is not None and self.bias in wanted:
            sums[self.bias] = tf.reduce_sum(weighted, axis=0)
        return sums

    def _below(self, a, delta):
        return times_transpose(delta, self.layer.kernel)
