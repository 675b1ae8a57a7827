"""Dense with any activation: outer products (see ``jacutil.rules.blocks``).

Its squared norms per sample come from the Gram matrices of the positions
(``jacutil.rules.blocks.gram_norms``) where those are cheaper than the
kernel's block, as Opacus's ghost clipping of ``nn.Linear``
(``compute_linear_norm_sample``) and BackPACK's ``BatchL2Linear``.

LoRA (``layer.enable_lora(rank)``: the kernel is ``W + s A @ B``, s =
``lora_alpha / rank``, W frozen) is two more linear maps: with the input x
and the signal delta at the pre-activation, A's block is the outer product
of x and ``s delta @ B.T``, B's that of ``s x @ A`` and delta (Hu et al.
2021), each with its own Gram ghost norm, as the DP fine-tuning of LoRA
factors by Yu et al. 2022 ("Differentially private fine-tuning of language
models") with the ghost norms of Li et al. 2022.
"""

from ..core._tf import keras, tf
from .activations import Activation
from .blocks import (
    gram_is_cheaper,
    gram_norms,
    kernel_and_bias,
    outer_blocks,
    positions_of,
    sum_norms,
    times_transpose,
    weighted_rows,
)
from .registry import Blocks, LogitsSignal, NoRule, Rule, register


def refuse_adapted(layer, kind, lora=False):
    """Raise :class:`NoRule` for a quantized layer, and for a LoRA one unless
    ``lora`` (the rule writes its factors' blocks): its weights are not the
    plain variables whose blocks the rule writes."""
    if layer.quantization_mode:
        raise NoRule(f"a quantized {kind} ({layer.quantization_mode})")
    if getattr(layer, "lora_enabled", False) and not lora:
        raise NoRule(f"a LoRA {kind}")


def lora_factors(layer, names=("_kernel", "lora_kernel_a", "lora_kernel_b")):
    """``(base, a, b, scale)`` of a LoRA layer (its kernel is ``base + scale *
    a @ b`` over the last axis of ``a``, as Keras's ``kernel`` property; the
    variables' attribute ``names``), or None for a plain one."""
    if not getattr(layer, "lora_enabled", False):
        return None
    scale = layer.lora_alpha / layer.lora_rank
    return (*(getattr(layer, name) for name in names), scale)


def outer_norms(a, delta):
    """(n, r): the squared norms of :func:`~jacutil.rules.blocks.outer_blocks`
    of ``a`` (n, *positions, p) and ``delta`` (n, r, *positions, q), by the Gram
    matrices of the positions where cheaper, else from the blocks."""
    if gram_is_cheaper(positions_of(a.shape), a.shape[-1], delta.shape[-1]):
        return gram_norms(a, delta)
    return tf.reduce_sum(tf.square(outer_blocks(a, delta)), -1)


def outer_sums(a, weighted):
    """(p * q,): ``sum_i`` of the outer-product blocks of ``a`` (n, *positions,
    p) and the weighted signal ``weighted`` (n, *positions, q), one signal row
    (see :func:`~jacutil.rules.blocks.weighted_rows`): one product."""
    a = tf.reshape(a, [-1, a.shape[-1]])
    weighted = tf.reshape(weighted, [-1, weighted.shape[-1]])
    return tf.reshape(tf.matmul(a, weighted, transpose_a=True), [-1])


def as_dtype_of(variable, tensor):
    """The variable's value in ``tensor``'s dtype (LoRA factors are float32
    in a float64 layer)."""
    return tf.cast(variable, tensor.dtype)


class KernelRule(Rule):
    """``y = act(a W + b)``: the kernel, bias and activation that a Dense shares
    with a convolution (a Dense at every position), and their ghost norms;
    a subclass gives ``_gram_sizes``, ``_at_z``, ``_groups`` and ``_below``.
    ``kind`` names the layer in :class:`NoRule`'s words (a quantized layer
    raises it; a LoRA one unless ``lora``, the subclass writing its factors'
    blocks). KFAC's factors (notebook 11) read :meth:`input_rows`
    (A) and the signal at ``pre_activation`` (B).
    """

    def __init__(self, layer, kind, lora=False):
        super().__init__(layer)
        refuse_adapted(layer, kind, lora)
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
    """``y = act(a @ W + b)``, on the last axis of an input of any rank; with
    LoRA, ``W = W0 + s A @ B`` and the blocks of W0 (frozen), A and B; a
    quantized Dense raises :class:`NoRule`."""

    name = "dense"
    weighs_sums = True
    fast_under_xla = True  # its norms: |a|^2 |delta|^2, fused by XLA
    kronecker_factors = True

    def __init__(self, layer):
        super().__init__(layer, "Dense", lora=True)
        # an element-wise slope or a softmax broadcasts a shared signal;
        # autodiff of an unknown function needs one row per sample
        self.shared_signal = not self.runs_user_code
        self.lora = lora_factors(layer)
        if self.lora is not None:
            base, factor_a, factor_b, _ = self.lora
            bias = [self.bias] if self.bias is not None else []
            self.variables = [base, *bias, factor_a, factor_b]
            self.kronecker_factors = False  # KFAC factors one kernel

    def describe(self):
        """``"dense"`` and the activation, e.g. ``"dense+relu"`` (a ``str``);
        ``"dense+lora"`` with LoRA."""
        lora = "+lora" if self.lora is not None else ""
        return self.name + lora + self.activation.describe()

    def _lora_terms(self, a, delta, wanted):
        """``[(variable, input, signal)]``: each wanted LoRA factor (and the
        frozen W0) as an outer product of an input (n, *positions, p) and a
        signal (n, r, *positions, q) at its columns."""
        base, factor_a, factor_b, scale = self.lora
        terms = []
        if base in wanted:
            terms.append((base, a, delta))
        if factor_a in wanted:  # d z = a dA (s B): the signal s delta @ B.T
            terms.append((factor_a, a, scale * times_transpose(
                delta, as_dtype_of(factor_b, delta))))  # fmt: skip
        if factor_b in wanted:  # d z = (s a A) dB
            low = tf.tensordot(a, as_dtype_of(factor_a, a), 1)
            terms.append((factor_b, scale * low, delta))
        return terms

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
        if self.lora is None:
            blocks = kernel_and_bias(a, delta, self.layer.kernel, self.bias, wanted)
        else:
            blocks = kernel_and_bias(a, delta, None, self.bias, wanted)
            for variable, rows, signal in self._lora_terms(a, delta, wanted):
                blocks[variable] = outer_blocks(rows, signal)
        return blocks, (self._below(a, delta) if need_signal else None)

    def _backward_norms(self, saved, delta, wanted, need_signal):
        """:meth:`KernelRule._backward_norms`; with LoRA, each factor's (and
        W0's) Gram ghost norm (:func:`outer_norms`) and the bias's sum."""
        if self.lora is None:
            return super()._backward_norms(saved, delta, wanted, need_signal)
        a, slope = saved
        delta = self._at_z(slope, delta)
        parts = [outer_norms(rows, signal)
                 for _, rows, signal in self._lora_terms(a, delta, wanted)]  # fmt: skip
        if self.bias is not None and self.bias in wanted:
            parts.append(sum_norms(delta))
        squared = tf.add_n(parts) if parts else None
        return squared, (self._below(a, delta) if need_signal else None)

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
        plain = self.lora is None and a.shape.rank == 2
        if not plain or isinstance(delta, LogitsSignal):
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
        if self.lora is not None:
            return self._lora_sums(a, delta, wanted, weights)
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

    def _lora_sums(self, a, delta, wanted, weights):
        """:meth:`_weighted_sums` with LoRA: each term's one product."""
        sums = Blocks()
        weighted, zeroed = weighted_rows(weights, delta, a)
        if self.bias is not None and self.bias in wanted:
            sums[self.bias] = tf.reduce_sum(
                tf.reshape(weighted, [-1, weighted.shape[-1]]), 0
            )
        terms = self._lora_terms(zeroed, weighted[:, None], wanted)
        for variable, rows, signal in terms:
            sums[variable] = outer_sums(rows, signal[:, 0])
        return sums
