"""Grouped convolutions without Keras's nested XLA function, while jacutil runs
a model; and :func:`grouped_convolution`, the one grouped convolution of the
layer rules.

Keras runs a grouped convolution (``Conv2D(groups=2)``: the input has more
channels than the kernel) in a nested ``tf.function(jit_compile=True)`` that
reads the kernel variable inside. In TF 2.21 pfor's converter of its filter
gradient fails (InvalidArgumentError), TensorFlow has no CPU gradient for it
outside XLA, and in a graph ``ForwardAccumulator`` carries no tangent into a
variable read inside a nested function (silent zeros). Every call of a Keras
model by jacutil (``jacutil.core.target``) runs inside
:func:`convolutions_by_group`, which runs a grouped convolution (rank 1 or 2,
channels last) as :func:`grouped_convolution`: the same numbers, its kernel
read outside any nested function, in ops that have none of these problems.

:func:`grouped_convolution` has no Python loop over the groups: with g groups
of cg input and q output channels, kernel ``K`` (kh, kw, cg, g * q), it is a
depthwise convolution of multiplier q (``tf.nn.depthwise_conv2d``, filter
``F[j * cg + c, t] = K[c, j * q + t]``; a CPU gradient, pfor converters for
its gradients, XLA, forward mode) followed by the sum over each group's cg
input channels; for cg = 1 (a depthwise layer) the sum is nothing. The cost
rule: that writes cg times the output (g * cg * q channels per position
before the sum), and the depthwise kernels are slower per multiply-add than
an ordinary convolution's, so where the groups are few (``groups <=
FEW_GROUPS``, 4) and cg > 1 it runs one ordinary convolution per group
instead - at most four ops. Channels-first and 3-D convolutions keep one
convolution per group (no depthwise op for them).
"""

import contextlib
import threading

from ._tf import keras, tf
from .internals import keras_backend_nn

_BY_GROUP = {"depth": 0, "conv": None, "module": None}
_BY_GROUP_LOCK = threading.Lock()

FEW_GROUPS = 4  # up to this many groups (of cg > 1 channels): one conv per group


def grouped_convolution(image, kernel, strides=(1, 1), padding="VALID",
                        dilations=(1, 1)):  # fmt: skip
    """The convolution of ``image`` (n, h, w, c_in), channels last, with
    ``kernel`` (kh, kw, c_in / g, c_out) in g = c_in / (its third axis) groups:
    group j's output channels ``j * q ..`` (q = c_out / g) read its input
    channels ``j * cg ..``, as Keras's ``Conv2D(groups=g)``.

    Args:
        image: (n, h, w, c_in), its channels known.
        kernel: (kh, kw, cg, c_out), a tensor (read the variable outside).
        strides, dilations: (sh, sw) and (dh, dw); both above 1 (or sh !=
            sw on an image higher than 1) runs the convolution at stride 1
            and subsamples, as Keras's depthwise convolution.
        padding: ``"VALID"`` or ``"SAME"`` (TensorFlow's split).

    Returns:
        (n, h', w', c_out): one ordinary convolution for g = 1, one per group
        for ``1 < g <= FEW_GROUPS`` and cg > 1, else one depthwise
        convolution and a sum (see the module).
    """
    strides, dilations = tuple(strides), tuple(dilations)
    channels, per_group = image.shape[-1], kernel.shape[-2]
    groups = channels // per_group
    if groups == 1:
        return tf.nn.convolution(image, kernel, strides, padding, dilations=dilations)
    if groups <= FEW_GROUPS and per_group > 1:
        pairs = zip(tf.split(image, groups, -1), tf.split(kernel, groups, -1),
                    strict=True)  # fmt: skip
        return tf.concat(
            [tf.nn.convolution(a, k, strides, padding, dilations=dilations)
             for a, k in pairs], -1,
        )  # fmt: skip
    if strides[0] != strides[1] and image.shape[1] == kernel.shape[0] == 1:
        strides = (strides[1], strides[1])  # height 1 (1-D): its stride is moot
    if strides[0] != strides[1] or (max(strides) > 1 and max(dilations) > 1):
        # not in one depthwise op: the stride-1 convolution, subsampled
        if padding == "SAME":
            image = tf.pad(image, _same_pads(image, kernel.shape[:2], strides,
                                             dilations))  # fmt: skip
        full = _depthwise_and_sum(image, kernel, groups, (1, 1), "VALID", dilations)
        return full[:, :: strides[0], :: strides[1]]
    return _depthwise_and_sum(image, kernel, groups, strides, padding, dilations)


def depthwise_filter(kernel, groups):
    """A grouped kernel (kh, kw, cg, g * q) as the depthwise filter
    (kh, kw, g * cg, q) whose output channel ``(j * cg + c) * q + t`` is
    group j's input channel c times its output channel t."""
    kh, kw, per_group, c_out = kernel.shape
    q = c_out // groups
    if per_group == 1:
        return tf.reshape(kernel, [kh, kw, groups, q])
    filters = tf.reshape(kernel, [kh, kw, per_group, groups, q])
    return tf.reshape(tf.transpose(filters, [0, 1, 3, 2, 4]),
                      [kh, kw, groups * per_group, q])  # fmt: skip


def _depthwise_and_sum(image, kernel, groups, strides, padding, dilations):
    per_group, c_out = kernel.shape[-2], kernel.shape[-1]
    out = tf.nn.depthwise_conv2d(
        image,
        depthwise_filter(kernel, groups),
        [1, *strides, 1],
        padding,
        dilations=dilations,
    )  # (n, h', w', g * cg * q)
    if per_group == 1:
        return out
    shape = tf.shape(out)
    out = tf.reshape(out, tf.concat([shape[:3], [groups, per_group, c_out // groups]],
                                    0))  # fmt: skip
    out = tf.reduce_sum(out, 4)
    return tf.reshape(out, tf.concat([shape[:3], [c_out]], 0))


def _same_pads(image, kernel_size, strides, dilations):
    """TensorFlow's "SAME" padding (the odd pixel after) as explicit pads."""
    pads = [[0, 0]]
    for axis, (k, s, d) in enumerate(zip(kernel_size, strides, dilations,
                                         strict=True)):  # fmt: skip
        size = image.shape[axis + 1]
        size = tf.shape(image)[axis + 1] if size is None else size
        span = (k - 1) * d + 1
        out = -(-size // s)
        total = (out - 1) * s + span - size
        total = max(total, 0) if isinstance(total, int) else tf.maximum(total, 0)
        pads.append([total // 2, total - total // 2])
    return [*pads, [0, 0]]


def _as_pair(value, rank):
    values = (value,) * rank if isinstance(value, int) else tuple(value)
    return (1, *values) if rank == 1 else values


def _conv_by_group(conv):
    """Keras's backend ``conv``, a grouped one run as :func:`grouped_convolution`
    (rank 1 or 2, channels last) or one conv per group (otherwise)."""

    def by_group(inputs, kernel, strides=1, padding="valid", data_format=None,
                 dilation_rate=1):  # fmt: skip
        options = (strides, padding, data_format, dilation_rate)
        kernel = tf.convert_to_tensor(kernel)  # read here, not in a nested function
        data_format = data_format or keras.config.image_data_format()
        axis = 1 if data_format == "channels_first" else -1
        channels, per_group = inputs.shape[axis], kernel.shape[-2]
        if channels is None or per_group is None or channels == per_group:
            return conv(inputs, kernel, *options)
        groups = channels // per_group
        rank = len(inputs.shape) - 2
        if axis == -1 and rank in (1, 2) and str(padding).upper() in ("VALID", "SAME"):
            inputs = tf.convert_to_tensor(inputs)
            image = inputs[:, None] if rank == 1 else inputs
            out = grouped_convolution(
                image, kernel[None] if rank == 1 else kernel,
                _as_pair(strides, rank), padding.upper(), _as_pair(dilation_rate, rank),
            )  # fmt: skip
            return out[:, 0] if rank == 1 else out
        pairs = zip(tf.split(inputs, groups, axis), tf.split(kernel, groups, -1),
                    strict=True)  # fmt: skip
        return tf.concat([conv(a, k, *options) for a, k in pairs], axis)

    return by_group


@contextlib.contextmanager
def convolutions_by_group():
    """Inside the block, Keras runs grouped convolutions without its nested
    XLA function (:func:`grouped_convolution`, see above).

    The same numbers, in a form whose gradients pfor vectorizes and whose
    tangents forward mode carries (see above). Thread-safe and reentrant:
    the first block in installs it, the last one out restores Keras's own.

    Yields:
        None.
    """
    with _BY_GROUP_LOCK:
        if _BY_GROUP["depth"] == 0:
            nn = _BY_GROUP["module"] = keras_backend_nn()  # where keras.ops finds conv
            _BY_GROUP["conv"] = nn.conv
            nn.conv = _conv_by_group(nn.conv)
        _BY_GROUP["depth"] += 1
    try:
        yield
    finally:
        with _BY_GROUP_LOCK:
            _BY_GROUP["depth"] -= 1
            if _BY_GROUP["depth"] == 0:
                _BY_GROUP["module"].conv = _BY_GROUP["conv"]
