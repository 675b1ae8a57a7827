"""EinsumDense: a Dense on reshaped tensors (see ``jacutil.rules.blocks``).

``z = einsum(equation, a, W) + b`` is linear in W. Its axes are the samples,
the positions T (in the input and the output, not in the kernel), the
contracted axes P (input and kernel) and the kernel's output axes Q (kernel
and output): with ``a`` laid out (n, T, p) and the signal at z (n, l, T, q)
the kernel's block is the outer product summed over positions, its squared
norm the Gram matrices' ``sum_{t,s} (a_t . a_s)(delta_t . delta_s)`` where
cheaper - the ghost norms of linear layers in a sequence by Li et al. 2022
("Large language models can be strong differentially private learners") and
Opacus's ``compute_linear_norm_sample``. The bias's block is the signal
summed over the output axes it does not hold.

LoRA (``enable_lora``: ``W + s A @ B`` over the kernel's last axis e, an
output axis) is two such maps: A's (e replaced by the rank r) takes the
signal ``s delta @ B.T`` at the input ``a``; B's (r, e) takes ``u = s a A``
at the positions T and the other output axes Q \\ e.
"""

import math
import re

from ..core._tf import keras, tf
from .activations import Activation
from .blocks import outer_blocks, times_transpose, weighted_rows
from .dense import as_dtype_of, lora_factors, outer_norms, outer_sums, refuse_adapted
from .registry import Blocks, NoRule, Rule, register

_FREE = "ZYXWVUTSRQPONMLKJIHGFEDCBA"  # letters for "..." and the LoRA rank


def _parse(equation):
    """``(input, kernel, output)`` specs of an equation ``"ab...,bc->a...c"``."""
    found = re.fullmatch(r"([a-zA-Z.]+),([a-zA-Z]+)->([a-zA-Z.]+)", equation)
    if found is None:
        raise NoRule(f"EinsumDense equation {equation!r}: not 'input,kernel->output'")
    return found.groups()


class LinearView:
    """One ``z = einsum(ins, a, W)`` as a Dense: which axes are T, P and Q.

    ``ins`` and ``outs`` name every axis, the samples' first; ``ker`` the
    kernel's. :meth:`rows` lays out the input (n, T, p), :meth:`signal` the
    signal at z (n, l, T, q); :meth:`in_kernel_order` puts their (n, l, p * q)
    outer product in the kernel's own order; :meth:`below` is the signal at
    the input.
    """

    def __init__(self, ins, ker, outs):
        self.ins, self.ker, self.outs = ins, ker, outs
        self.positions = [c for c in ins[1:] if c in outs and c not in ker]
        self.contracted = [c for c in ker if c in ins and c not in outs]
        self.produced = [c for c in ker if c in outs and c not in ins]
        order = self.contracted + self.produced
        self.to_kernel = [order.index(c) for c in ker]  # from (P, Q) to ker

    def sizes(self, letters, spec, shape, offset=0):
        """The sizes in ``shape`` (of a tensor named by ``spec``, ``offset``
        axes ahead) of the axes ``letters``."""
        return [shape[spec.index(c) + offset] for c in letters]

    def rows(self, a):
        """(n, T, p): ``a`` (n, *ins[1:]) with its positions, then contracted axes."""
        perm = [0] + [self.ins.index(c) for c in self.positions + self.contracted]
        width = math.prod(self.sizes(self.contracted, self.ins, a.shape))
        return tf.reshape(tf.transpose(a, perm), [tf.shape(a)[0], -1, width])

    def signal(self, delta):
        """(n, l, T, q): ``delta`` (n, l, *outs[1:])."""
        letters = self.positions + self.produced
        perm = [0, 1] + [self.outs.index(c) + 1 for c in letters]
        width = math.prod(self.sizes(self.produced, self.outs, delta.shape, 1))
        shape = [tf.shape(delta)[0], tf.shape(delta)[1], -1, width]
        return tf.reshape(tf.transpose(delta, perm), shape)

    def kernel_matrix(self, kernel):
        """(p, q): the kernel with its contracted axes first."""
        perm = [self.ker.index(c) for c in self.contracted + self.produced]
        p = math.prod(self.sizes(self.contracted, self.ker, kernel.shape))
        return tf.reshape(tf.transpose(kernel, perm), [p, -1])

    def in_kernel_order(self, flat, kernel_shape):
        """``flat`` (..., p * q) in (P, Q) order, in the kernel's flat order."""
        if self.to_kernel == sorted(self.to_kernel):
            return flat
        lead = flat.shape.rank - 1
        sizes = self.sizes(self.contracted + self.produced, self.ker, kernel_shape)
        grid = tf.reshape(flat, tf.concat([tf.shape(flat)[:-1], sizes], 0))
        perm = list(range(lead)) + [lead + k for k in self.to_kernel]
        return tf.reshape(tf.transpose(grid, perm), tf.shape(flat))

    def below(self, delta, kernel, a):
        """(n, l, *ins[1:]): the signal at the input ``a``, ``delta @ W.T``."""
        # one 2-D product: a broadcasting batch matmul crashes oneDNN
        rows = times_transpose(self.signal(delta), self.kernel_matrix(kernel))
        letters = self.positions + self.contracted
        sizes = [tf.shape(delta)[0], tf.shape(delta)[1]]
        sizes += [a.shape[k] or tf.shape(a)[k] for k in
                  (self.ins.index(c) for c in letters)]  # fmt: skip
        perm = [0, 1] + [letters.index(c) + 2 for c in self.ins[1:]]
        below = tf.transpose(tf.reshape(rows, sizes), perm)
        return tf.ensure_shape(below, [None, None, *a.shape[1:]])


@register(keras.layers.EinsumDense)
class EinsumDenseRule(Rule):
    """``y = act(einsum(equation, a, W) + b)`` by :class:`LinearView`; with
    LoRA, the blocks of W0 (frozen), A and B. Raises :class:`NoRule` for a
    quantized layer and for an equation whose samples are not the first axis
    of input and output, that sums an input or kernel axis away, or keeps
    an axis in input, kernel and output; LoRA whose kernel's last axis is
    contracted."""

    name = "einsum_dense"
    weighs_sums = True

    def __init__(self, layer):
        super().__init__(layer)
        refuse_adapted(layer, "EinsumDense", lora=True)
        self.equation = layer.equation
        ins, ker, outs = _parse(self.equation)
        self.specs = (ins, ker, outs)
        said = f"EinsumDense {self.equation!r}"
        named_in, named_out = ins.replace(".", ""), outs.replace(".", "")
        samples = ins[0] if not ins.startswith("...") else "."
        if samples != outs[0] or samples in ker:
            raise NoRule(f"{said}: the samples are not the first axis of both")
        for c in named_in:
            if c not in named_out and c not in ker:
                raise NoRule(f"{said}: input axis {c!r} is summed away")
            if c in named_out and c in ker:
                raise NoRule(f"{said}: axis {c!r} is in input, kernel and output")
        for c in ker:
            if c not in named_in and c not in named_out:
                raise NoRule(f"{said}: kernel axis {c!r} is summed away")
        self.activation = Activation(layer.activation)
        self.runs_user_code = self.activation.runs_user_code
        self.takes_logits_signal = self.activation.makes_logits
        self.bias = layer.bias
        self.lora = lora_factors(layer)
        if self.lora is not None and ker[-1] not in named_out:
            raise NoRule(f"{said}: LoRA on a kernel whose last axis is contracted")
        kernel = layer.kernel if self.lora is None else self.lora[0]
        self.kernel = kernel
        extra = [self.lora[1], self.lora[2]] if self.lora is not None else []
        self.variables = [kernel] + ([self.bias] if self.bias is not None else [])
        self.variables += extra
        self.views = None  # by the input's rank, on the first forward

    def describe(self):
        """``"einsum_dense"``, ``+lora`` and the activation (a ``str``)."""
        lora = "+lora" if self.lora is not None else ""
        return f"{self.name} {self.equation}{lora}{self.activation.describe()}"

    def _views(self, rank):
        """``(view of W, view of A, view of B, u's spec)``: the equation with
        "..." spelled out for an input of ``rank`` axes."""
        ins, ker, outs = self.specs
        used = set(ins + ker + outs)
        free = [c for c in _FREE if c not in used]
        elided = "".join(free[: rank - len(ins.replace("...", ""))])
        rank_letter = free[-1]
        ins, outs = ins.replace("...", elided), outs.replace("...", elided)
        kernel_view = LinearView(ins, ker, outs)
        if self.lora is None:
            return kernel_view, None, None, None
        e = ker[-1]
        a_view = LinearView(ins, ker[:-1] + rank_letter, outs.replace(e, rank_letter))
        low = outs.replace(e, "")
        low = "".join(c for c in low if c in ins or c in ker) + rank_letter
        u_spec = f"{ins},{ker[:-1] + rank_letter}->{low}"
        b_view = LinearView(low, rank_letter + e, outs)
        return kernel_view, a_view, b_view, u_spec

    def _forward(self, a):
        if self.views is None:
            self.views = self._views(a.shape.rank)
        z = tf.einsum(self.equation, a, self.layer.kernel)
        if self.bias is not None:
            z = z + self.bias
        y, slope = self.activation.forward(z)
        return y, (a, slope)

    def _terms(self, a, delta, wanted):
        """``[(variable, view, rows (n, T, p), signal (n, l, T, q))]``."""
        kernel_view, a_view, b_view, u_spec = self.views
        terms = []
        if self.kernel in wanted:
            terms.append((self.kernel, kernel_view, a, delta))
        _, factor_a, factor_b, scale = self.lora or (None,) * 4
        if self.lora is not None and factor_a in wanted:
            e = self.specs[1][-1]
            factor = as_dtype_of(factor_b, delta)
            signal = scale * _contract(delta, factor, kernel_view.outs, e)
            terms.append((factor_a, a_view, a, signal))
        if self.lora is not None and factor_b in wanted:
            low = scale * tf.einsum(u_spec, a, as_dtype_of(factor_a, a))
            terms.append((factor_b, b_view, low, delta))
        return [(v, view, view.rows(x), view.signal(d)) for v, view, x, d in terms]

    def _bias_block(self, delta):
        """(n, l, bias size): the signal summed over the axes the bias lacks."""
        outs = self.views[0].outs
        kept = self.layer.bias_axes
        axes = [k + 1 for k, c in enumerate(outs) if k and c not in kept]
        summed = tf.reduce_sum(delta, axes) if axes else delta
        return tf.reshape(summed, [tf.shape(delta)[0], tf.shape(delta)[1], -1])

    def _at_z(self, slope, delta):
        return self.activation.backward(slope, delta)

    def _below(self, a, delta):
        return self.views[0].below(delta, self.layer.kernel, a)

    def _backward(self, saved, delta, wanted, need_signal):
        a, slope = saved
        delta = self._at_z(slope, delta)
        blocks = Blocks()
        for variable, view, rows, signal in self._terms(a, delta, wanted):
            block = outer_blocks(rows, signal)
            blocks[variable] = view.in_kernel_order(block, variable.shape)
        if self.bias is not None and self.bias in wanted:
            blocks[self.bias] = self._bias_block(delta)
        return blocks, (self._below(a, delta) if need_signal else None)

    def _backward_norms(self, saved, delta, wanted, need_signal):
        """Each term's Gram ghost norm where cheaper (else its block's), and
        the bias block's squares."""
        a, slope = saved
        delta = self._at_z(slope, delta)
        parts = [outer_norms(rows, signal)
                 for _, _, rows, signal in self._terms(a, delta, wanted)]  # fmt: skip
        if self.bias is not None and self.bias in wanted:
            parts.append(tf.reduce_sum(tf.square(self._bias_block(delta)), -1))
        squared = tf.add_n(parts) if parts else None
        return squared, (self._below(a, delta) if need_signal else None)

    def _weighted_sums(self, saved, delta, wanted, weights):
        """``sum_i w_i`` of each block: one product per term (rows of weight 0
        zeroed first, so a NaN there stays out)."""
        a, slope = saved
        delta = self._at_z(slope, delta)[:, 0]
        weighted, a = weighted_rows(weights, delta, a)
        weighted = weighted[:, None]
        sums = Blocks()
        for variable, view, rows, signal in self._terms(a, weighted, wanted):
            flat = outer_sums(rows, signal[:, 0])
            sums[variable] = view.in_kernel_order(flat, variable.shape)
        if self.bias is not None and self.bias in wanted:
            sums[self.bias] = tf.reduce_sum(self._bias_block(weighted)[:, 0], 0)
        return sums


def _contract(delta, factor_b, outs, e):
    """``delta`` (n, l, *outs[1:]) with its axis ``e`` times ``factor_b.T``
    (B is (r, e)): the rank in e's place."""
    axis = outs.index(e) + 1
    moved = tf.experimental.numpy.moveaxis(delta, axis, -1)
    product = tf.tensordot(moved, tf.transpose(factor_b), 1)
    return tf.experimental.numpy.moveaxis(product, -1, axis)
