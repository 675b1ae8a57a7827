"""Conv1D, Conv2D, DepthwiseConv1D and DepthwiseConv2D: patches and one
matrix product per layer.

A convolution is a Dense layer applied at every output position to the
patch of input under the kernel: with the patches (:func:`kernel_offsets`,
strided slices, what ``tf.image.extract_patches`` gives, faster) the
kernel's block is the outer-product rule of ``jacutil.rules.blocks`` summed
over positions, for every sample at once.
Conv1D runs as a Conv2D of height 1. The signal below is the transposed
convolution of the signal, by autodiff of the (linear) convolution.

A grouped convolution (``groups=g``, cg = c_in / g input and q = c_out / g
output channels per group) is g convolutions side by side, run with no
Python loop over the groups: forward as
``jacutil.core._grouped.grouped_convolution`` (one depthwise convolution and
a sum; see its cost rule), the blocks of all groups as one batched product
of the kernel offsets, (n, T, kh * kw, g, cg), with the signal (n, l, T, g,
q), laid out in the kernel's (kh, kw, cg, c_out) order with c_out = j * q + t.
A depthwise convolution (kernel (kh, kw, c_in, m), output channel
``c * m + d``) is the grouped one with g = c_in, cg = 1, q = m: its kernel
read as (kh, kw, 1, c_in * m), the same rule.

The squared norms per sample need no patches: a kernel block holds one small
product per kernel offset, side by side, and its squared norm is the sum of
theirs. Nor any block where the T output positions are few: the Gram matrices
of the patches and of the signal, per group, where ``T (p + q) <= p q`` for
its (p, q) = (kh * kw * c_in / g, c_out / g) block
(``jacutil.rules.blocks.gram_norms``; BackPACK's ``BatchL2ConvND``,
``einsum("nmi,nki,nmj,nkj->n", ...)`` on the unfolded input, and the ghost
norms of Opacus's ``GradSampleModuleFastGradientClipping``).
"""

from ..core._grouped import grouped_convolution
from ..core._shared import size_of
from ..core._tf import keras, tf
from .blocks import (
    gram_is_cheaper,
    gram_norms,
    kernel_and_bias,
    positions_of,
    sum_norms,
    sum_positions,
    weighted_rows,
)
from .dense import KernelRule
from .registry import Blocks, LogitsSignal, NoRule, per_output, register, rows


@register(keras.layers.Conv1D, keras.layers.Conv2D)
class ConvRule(KernelRule):
    """``y = act(conv(a, W) + b)``, channels last, any strides, padding, dilation
    and groups; a channels_first, LoRA or quantized convolution raises
    :class:`NoRule`."""

    name = "conv"
    weighs_sums = True

    def __init__(self, layer, kind="convolution"):
        super().__init__(layer, kind)
        if layer.data_format != "channels_last":
            raise NoRule(f"a channels_first {kind}")
        self.kernel_variable = layer.kernel
        self.groups = getattr(layer, "groups", 1)
        self.filters = layer.kernel.shape[-1]
        self.flat = layer.rank == 1  # Conv1D: height 1
        self.causal = layer.padding == "causal"
        self.left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)  # causal
        self.padding = "VALID" if self.causal else layer.padding.upper()
        self.strides = [1, *([1] if self.flat else []), *layer.strides, 1]
        self.rates = [1, *([1] if self.flat else []), *layer.dilation_rate, 1]
        self.kronecker_factors = layer.rank == 2 and self.groups == 1

    def describe(self):
        """``"conv2d"`` and the activation, e.g. ``"conv2d+relu"`` (a ``str``)."""
        return f"conv{self.layer.rank}d" + self.activation.describe()

    def _kernel(self):
        """The kernel as a tensor (kh, kw, c_in / g, c_out), height 1 for 1-D."""
        kernel = self.layer.kernel
        return kernel[None] if self.flat else tf.convert_to_tensor(kernel)

    def _as_image(self, a):
        """(n, h, w, c) input, causal padding applied."""
        if self.flat:
            a = a[:, None]
        if self.causal:
            a = tf.pad(a, [[0, 0], [0, 0], [self.left, 0], [0, 0]])
        return a

    def _convolve(self, image):
        """The (grouped) convolution of the image, as
        ``jacutil.core._grouped.grouped_convolution``: no loop over many
        groups, ops with a CPU gradient, pfor converters and forward mode
        (Keras's grouped convolution has none of these); its input gradient
        runs with a dilation on CPU (``tf.nn.conv2d``'s does not)."""
        return grouped_convolution(
            image, self._kernel(), self.strides[1:3], self.padding, self.rates[1:3]
        )

    def pre_activation(self, a):
        """``conv(a, W) + b``: the output before the activation."""
        z = self._convolve(self._as_image(a))
        z = z + self.bias if self.bias is not None else z
        return z[:, 0] if self.flat else z

    def _patches(self, a):
        """The patches (n, h', w', kh * kw * c_in) of an ungrouped layer."""
        return self._image_patches(self._as_image(a))

    def _image_patches(self, image):
        kernel_size = self._kernel().shape[:2]
        strides, rates = self.strides[1:3], self.rates[1:3]
        return tf.concat(
            kernel_offsets(image, kernel_size, strides, rates, self.padding), -1
        )

    def _forward(self, a):
        image = self._as_image(a)
        z = self._convolve(image)
        if self.bias is not None:
            z = z + self.bias
        y, slope = self.activation.forward(z)
        return (y[:, 0] if self.flat else y), (image, slope)

    def _backward(self, saved, delta, wanted, need_signal):
        image, slope = saved
        delta = self._at_z(slope, delta)
        with_kernel = self.kernel_variable in wanted
        with_bias = self.bias is not None and self.bias in wanted
        blocks = Blocks()
        if self.groups == 1 and (with_kernel or with_bias):
            patches = self._image_patches(image) if with_kernel else None
            blocks = kernel_and_bias(
                patches, delta, self.kernel_variable, self.bias, wanted
            )
        elif with_kernel or with_bias:
            blocks = self._grouped_blocks(image, delta, with_kernel, with_bias)
        return blocks, (self._below(image, delta) if need_signal else None)

    def _grouped_blocks(self, image, delta, with_kernel, with_bias):
        """The blocks of every group as one batched product: the kernel
        offsets (n, T, kh * kw, g, cg) with the signal (n, l, T, g, q), in the
        kernel's (kh, kw, cg, c_out) order, c_out = j * q + t; the bias's
        columns after the kernel's in a joint block."""
        n_samples, n_rows = tf.shape(delta)[0], tf.shape(delta)[1]
        parts, keys = [], []
        if with_kernel:
            [(patches, signal)] = self._groups(image, delta)
            block = tf.einsum("ntkgc,nltgq->nlkcgq", patches, signal)
            size = size_of(self.kernel_variable)
            parts.append(tf.reshape(block, [n_samples, n_rows, size]))
            keys.append(self.kernel_variable)
        if with_bias:
            parts.append(sum_positions(delta, self.filters))
            keys.append(self.bias)
        block = parts[0] if len(parts) == 1 else tf.concat(parts, -1)
        return Blocks([(tuple(keys), block)])

    def _weighted_sums(self, saved, delta, wanted, weights):
        """The kernel's ``sum_i w_i`` of each sample's gradient as one
        gradient of the convolution with ``w * delta`` at its output (a
        filter backprop, as the ordinary backward pass's), the bias's
        ``sum_i w_i delta_i`` over positions; rows of weight 0 zeroed first."""
        image, slope = saved
        delta = self._at_z(slope, delta)[:, 0]  # (n, h', w', c_out)
        weighted, image = weighted_rows(weights, delta, image)
        sums = Blocks()
        if self.kernel_variable in wanted:
            with tf.GradientTape() as tape:
                z = self._convolve(image)
            kernel = tape.gradient(z, self.kernel_variable, output_gradients=weighted)
            sums[self.kernel_variable] = tf.reshape(kernel, [-1])
        if self.bias is not None and self.bias in wanted:
            sums[self.bias] = tf.reduce_sum(weighted, axis=[0, 1, 2])
        return sums

    def _gram_sizes(self, image, signal):
        """T output positions, and a group's (p, q) = (kh * kw * c_in / g,
        c_out / g): ghost norms per group (:meth:`_backward_norms`)."""
        patch = size_of(self._kernel().shape[:-1])
        positions = positions_of(signal.shape[1:])  # (r, *positions, c_out)
        return positions, patch, self.filters // self.groups

    def _at_z(self, slope, delta):
        """The signal at the pre-activations, (n, l, h', w', c_out)."""
        if self.flat and isinstance(delta, LogitsSignal):
            delta = LogitsSignal(delta.delta[:, :, None])
        elif self.flat:
            delta = delta[:, :, None]
        return self.activation.backward(slope, delta)

    def _groups(self, image, delta):
        """``[(patches, signal)]``: the patches of all groups at once, (n, T,
        kh * kw, g, cg) in the kernel's (kh, kw, c) order, and the signal (n,
        l, T, g, q) - one pair, whatever the groups (no loop over them)."""
        offsets, signal = self._offset_groups(image, delta)
        patches = tf.stack(offsets, 3)  # (n, h', w', kh * kw, c_in)
        shape = [tf.shape(patches)[0], -1, len(offsets), self.groups]
        return [(tf.reshape(patches, [*shape, image.shape[-1] // self.groups]), signal)]

    def _offset_groups(self, image, delta):
        """The :func:`kernel_offsets`, each (n, h', w', c_in), and the signal
        (n, l, T, g, q), its T = h' * w' positions flat, its channels by group."""
        kernel_size = self._kernel().shape[:2]
        offsets = kernel_offsets(image, kernel_size, self.strides[1:3],
                                 self.rates[1:3], self.padding)  # fmt: skip
        n_samples, n_rows = tf.shape(delta)[0], tf.shape(delta)[1]
        signal = tf.reshape(
            delta, [n_samples, n_rows, -1, self.groups, self.filters // self.groups]
        )
        return offsets, signal

    def _backward_norms(self, saved, delta, wanted, need_signal):
        """The blocks' squared norms without the blocks: where ``T (p + q) <=
        p q``, from the Gram matrices of the patches and of the signal per
        group (batched over the groups); else without the patches: a kernel
        block holds, for each kernel offset o, the product ``x_o.T @ delta``
        (c_in / g, c_out / g) of the input under o with the signal, so its
        squared norm is the sum of theirs - kh * kw small products per sample
        (batched over the groups), no (n, T, kh * kw * c_in) patches written."""
        image, slope = saved
        with_kernel = self.kernel_variable in wanted
        with_bias = self.bias is not None and self.bias in wanted
        signal = LogitsSignal.unwrapped(delta)
        ghost = not with_kernel or gram_is_cheaper(*self._gram_sizes(image, signal))
        delta = self._at_z(slope, delta)
        below = self._below(image, delta) if need_signal else None
        if not (with_kernel or with_bias):
            return None, below
        n_samples, n_rows = tf.shape(delta)[0], tf.shape(delta)[1]
        squared = tf.zeros([n_samples, n_rows], delta.dtype)
        if with_kernel and ghost:
            for patches, group_signal in self._groups(image, delta):
                squared += _gram_norms_by_group(patches, group_signal)
        elif with_kernel:
            offsets, group_signal = self._offset_groups(image, delta)
            shape = [n_samples, -1, self.groups, image.shape[-1] // self.groups]
            if self.groups == 1:  # a batched matmul, half the einsum's time
                shape = [n_samples, 1, -1, image.shape[-1]]
                group_signal = tf.reshape(delta, [n_samples, n_rows, -1, self.filters])
            for x in offsets:  # (n, T, g, cg): one small product per offset
                x = tf.reshape(x, shape)
                if self.groups == 1:  # (n, 1, T, c_in).T @ (n, r, T, q)
                    block = tf.matmul(x, group_signal, transpose_a=True)
                else:
                    block = tf.einsum("ntgc,nrtgq->nrgcq", x, group_signal)
                axes = list(range(2, block.shape.rank))  # (cg, q), by group or not
                squared += tf.reduce_sum(tf.square(block), axes)
        if with_bias:
            squared += sum_norms(delta)
        return squared, below

    def _below(self, image, delta):
        """The transposed convolution of the signal, (n, l, *input_shape): for
        every row at once where the strides are 1 (:meth:`_below_by_rows`),
        else by autodiff (the convolution is linear in its input)."""
        below = self._below_by_rows(image, delta)
        if below is None:
            n_samples, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
            shape = tf.concat([[n_samples * n_outputs], tf.shape(image)[1:]], 0)
            zeros = tf.zeros(shape, image.dtype)
            with tf.GradientTape() as tape:
                tape.watch(zeros)
                z = self._convolve(zeros)
            gradient = tape.gradient(z, zeros, rows(delta))
            below = per_output(gradient, n_samples, n_outputs)
        if self.causal:
            below = below[:, :, :, self.left :]
        return below[:, :, 0] if self.flat else below

    def _below_by_rows(self, image, delta):
        """The signal below for all l rows as one convolution of l groups, a
        row per group: the rows side by side in the channels (n, h', w',
        l * c_out), padded, then correlated with the kernel flipped in space
        and transposed (what a stride-1 convolution's input gradient is). On
        the small CNN's second convolution (l = 4 rows, n = 2,000) it took
        17 ms, measured alone, against 30 ms for the input gradient of n * l
        images. None where a
        stride is not 1, the layer has groups, or l is unknown while traced."""
        n_rows = delta.shape[1]
        if self.groups != 1 or n_rows is None or set(self.strides) != {1}:
            return None
        kernel = self._kernel()  # (kh, kw, c_in, c_out)
        flipped = tf.transpose(tf.reverse(kernel, [0, 1]), [0, 1, 3, 2])
        pads = [[0, 0]]
        same = self.padding == "SAME"
        for k, rate in zip(kernel.shape[:2], self.rates[1:3], strict=True):
            span = (k - 1) * rate + 1
            before = (span - 1) // 2 if same else 0  # stride 1: TensorFlow's split
            after = span - 1 - before if same else 0
            pads.append([span - 1 - before, span - 1 - after])
        pads.append([0, 0])
        n_samples = tf.shape(delta)[0]
        # (n, h', w', l, c_out); one row (a loss's signal): the same, reshaped
        side_by_side = delta if n_rows == 1 else tf.transpose(delta, [0, 2, 3, 1, 4])
        height, width = tf.shape(delta)[2], tf.shape(delta)[3]
        side_by_side = tf.reshape(
            side_by_side, [n_samples, height, width, n_rows * delta.shape[-1]]
        )
        below = tf.nn.convolution(
            tf.pad(side_by_side, pads),
            tf.tile(flipped, [1, 1, 1, n_rows]),  # group j: row j
            [1, 1],
            "VALID",
            dilations=self.rates[1:3],
        )  # (n, h, w, l * c_in)
        shape, c_in = tf.shape(below), image.shape[-1]
        if n_rows == 1:
            return tf.reshape(below, [n_samples, 1, shape[1], shape[2], c_in])
        below = tf.reshape(below, [n_samples, shape[1], shape[2], n_rows, c_in])
        return tf.transpose(below, [0, 3, 1, 2, 4])


def kernel_offsets(image, kernel_size, strides, rates, padding):
    """The input under each kernel position at every output position: a list
    of kh * kw tensors (n, h', w', c), in the kernel's (kh, kw) order - strided
    slices of the (``"SAME"``-padded) image. Concatenated on the last axis they
    are ``tf.image.extract_patches`` with the same arguments, which is slower
    on CPU (``python -m jacutil.bench.privacy_rows``; notebook 08-your-own-model).

    Args:
        image: (n, h, w, c), channels last.
        kernel_size, strides, rates: (kh, kw), (sh, sw), (dh, dw).
        padding: ``"VALID"`` or ``"SAME"`` (TensorFlow's split: the odd pixel
            after).
    """
    sizes = []
    for axis, (k, s, r) in enumerate(zip(kernel_size, strides, rates, strict=True)):
        size = image.shape[axis + 1]
        size = tf.shape(image)[axis + 1] if size is None else size
        span = (k - 1) * r + 1
        if padding == "SAME":
            out = -(-size // s)  # ceil
            total = (out - 1) * s + span - size
            total = max(total, 0) if isinstance(total, int) else tf.maximum(total, 0)
            sizes.append((out, [total // 2, total - total // 2]))
        else:
            sizes.append(((size - span) // s + 1, [0, 0]))
    if padding == "SAME":
        image = tf.pad(image, [[0, 0], sizes[0][1], sizes[1][1], [0, 0]])
    (out_h, _), (out_w, _) = sizes
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, strides, rates
    return [
        image[:, i * dh : i * dh + (out_h - 1) * sh + 1 : sh,
              j * dw : j * dw + (out_w - 1) * sw + 1 : sw]
        for i in range(kh)
        for j in range(kw)
    ]  # fmt: skip


@register(keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
class DepthwiseConvRule(ConvRule):
    """A depthwise convolution, kernel (kh, kw, c_in, m), output channel
    ``c * m + d``: :class:`ConvRule` with g = c_in groups of one input channel
    and q = m outputs, its kernel read as (kh, kw, 1, c_in * m) (the same
    numbers in the same order). Any strides, padding and dilation (both
    strides and dilation above 1, as Keras: the dilated convolution
    subsampled), bias and activation; channels_first, LoRA or quantized
    raise :class:`NoRule`."""

    name = "depthwise_conv"

    def __init__(self, layer):
        super().__init__(layer, "depthwise convolution")
        self.groups = layer.kernel.shape[-2]  # c_in
        self.filters = self.groups * layer.kernel.shape[-1]
        self.kronecker_factors = False

    def describe(self):
        """``"depthwise_conv2d"`` and the activation (a ``str``)."""
        return f"depthwise_conv{self.layer.rank}d" + self.activation.describe()

    def _kernel(self):
        kernel = self.layer.kernel
        kernel = tf.reshape(kernel, [*kernel.shape[:-2], 1, self.filters])
        return kernel[None] if self.flat else kernel


def _gram_norms_by_group(patches, signal):
    """(n, r): :func:`jacutil.rules.blocks.gram_norms` of every group at once,
    summed: the patches (n, T, kh * kw, g, cg) and the signal (n, r, T, g, q)."""
    if patches.shape[3] == 1:  # one group
        n_samples, width = tf.shape(patches)[0], tf.shape(patches)[1]
        size = patches.shape[2] * patches.shape[4]
        flat = tf.reshape(patches, [n_samples, width, size])
        return gram_norms(flat, signal[..., 0, :])
    patch_gram = tf.einsum("ntkgc,nskgc->ngts", patches, patches)
    signal_gram = tf.einsum("nrtgq,nrsgq->nrgts", signal, signal)
    return tf.reduce_sum(signal_gram * patch_gram[:, None], [2, 3, 4])
