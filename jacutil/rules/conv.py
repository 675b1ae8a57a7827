"""Conv1D and Conv2D: patches and one matrix product per layer.

A convolution is a Dense layer applied at every output position to the
patch of input under the kernel: with ``tf.image.extract_patches`` (the same
strides, padding and dilation) the kernel's block is the outer-product rule
of ``jacutil.rules.blocks`` summed over positions, for every sample at once.
Conv1D runs as a Conv2D of height 1. The signal below is the transposed
convolution of the signal, by autodiff of the (linear) convolution.

A grouped convolution (``groups=g``) is g convolutions side by side, each
from its slice of the input channels to its slice of the output channels:
the same patches and product per group, its columns interleaved in the
kernel's (kh, kw, c_in / g, c_out) order.

The squared norms per sample need no block where the T output positions
are few: the Gram matrices of the patches and of the signal, per group,
where ``T (p + q) <= p q`` for its (p, q) = (kh * kw * c_in / g, c_out / g)
block (``jacutil.rules.blocks.gram_norms``; BackPACK's ``BatchL2ConvND``,
``einsum("nmi,nki,nmj,nkj->n", ...)`` on the unfolded input, and the ghost
norms of Opacus's ``GradSampleModuleFastGradientClipping``).
"""

from ..core._shared import size_of
from ..core._tf import keras, tf
from .blocks import kernel_and_bias, positions_of
from .dense import KernelRule
from .registry import Blocks, LogitsSignal, NoRule, per_output, register, rows


@register(keras.layers.Conv1D, keras.layers.Conv2D)
class ConvRule(KernelRule):
    """``y = act(conv(a, W) + b)``, channels last, any strides, padding, dilation;
    a channels_first, LoRA or quantized convolution raises :class:`NoRule`."""

    name = "conv"

    def __init__(self, layer):
        super().__init__(layer, "convolution")
        if layer.data_format != "channels_last":
            raise NoRule("a channels_first convolution")
        self.groups = layer.groups
        self.flat = layer.rank == 1  # Conv1D: height 1
        self.causal = layer.padding == "causal"
        self.left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)  # causal
        self.padding = "VALID" if self.causal else layer.padding.upper()
        self.strides = [1, *([1] if self.flat else []), *layer.strides, 1]
        self.rates = [1, *([1] if self.flat else []), *layer.dilation_rate, 1]

    def describe(self):
        """``"conv2d"`` and the activation, e.g. ``"conv2d+relu"`` (a ``str``)."""
        return f"conv{self.layer.rank}d" + self.activation.describe()

    def _kernel(self):
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
        """One convolution per group (TF has no grouped-convolution gradient
        on CPU); ``tf.nn.convolution``, as Keras, whose input gradient also
        runs with a dilation on CPU (``tf.nn.conv2d``'s does not)."""
        pairs = zip(
            tf.split(image, self.groups, -1),
            tf.split(self._kernel(), self.groups, -1),
            strict=True,
        )
        strides, rates = self.strides[1:3], self.rates[1:3]
        return tf.concat(
            [
                tf.nn.convolution(a, k, strides, self.padding, dilations=rates)
                for a, k in pairs
            ],
            -1,
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
        kernel = self.layer.kernel
        per_group = [
            kernel_and_bias(patches, signal, kernel, self.bias, wanted)
            for patches, signal in self._groups(image, delta)
        ]
        width = self.layer.filters // self.groups
        blocks = Blocks(
            (key, _interleave([b[key] for b in per_group], width))
            for key in per_group[0].keys()
        )
        return blocks, (self._below(image, delta) if need_signal else None)

    def _gram_sizes(self, image, signal):
        """T output positions, and a group's (p, q) = (kh * kw * c_in / g,
        c_out / g): ghost norms per group (:meth:`KernelRule._backward_norms`)."""
        patch = size_of(self.layer.kernel.shape[:-1])
        positions = positions_of(signal.shape[1:])  # (r, *positions, c_out)
        return positions, patch, self.layer.filters // self.groups

    def _at_z(self, slope, delta):
        """The signal at the pre-activations, (n, l, h', w', c_out)."""
        if self.flat and isinstance(delta, LogitsSignal):
            delta = LogitsSignal(delta.delta[:, :, None])
        elif self.flat:
            delta = delta[:, :, None]
        return self.activation.backward(slope, delta)

    def _groups(self, image, delta):
        """Per group: its patches (n, h', w', kh * kw * c_in / g), in the
        kernel's (kh, kw, c) order, and its signal (n, l, h', w', c_out / g)."""
        kh, kw = self._kernel().shape[:2]
        pairs = zip(
            tf.split(image, self.groups, -1),
            tf.split(delta, self.groups, -1),
            strict=True,
        )
        for group, signal in pairs:
            patches = tf.image.extract_patches(
                group, [1, kh, kw, 1], self.strides, self.rates, self.padding
            )
            yield patches, signal

    def _below(self, image, delta):
        """The transposed convolution of the signal (by autodiff: the
        convolution is linear in its input), (n, l, *input_shape)."""
        n_samples, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
        shape = tf.concat([[n_samples * n_outputs], tf.shape(image)[1:]], 0)
        zeros = tf.zeros(shape, image.dtype)
        with tf.GradientTape() as tape:
            tape.watch(zeros)
            z = self._convolve(zeros)
        below = per_output(tape.gradient(z, zeros, rows(delta)), n_samples, n_outputs)
        if self.causal:
            below = below[:, :, :, self.left :]
        return below[:, :, 0] if self.flat else below


def _interleave(blocks, width):
    """One block from each group's (n, l, rows * width), the output channels
    of group j at columns j * width.. of each row (the kernel's order)."""
    if len(blocks) == 1:
        return blocks[0]
    n_samples, n_outputs = tf.shape(blocks[0])[0], tf.shape(blocks[0])[1]
    parts = [tf.reshape(b, [n_samples, n_outputs, -1, width]) for b in blocks]
    return tf.reshape(tf.stack(parts, 3), [n_samples, n_outputs, -1])
