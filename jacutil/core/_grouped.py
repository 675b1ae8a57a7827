"""Grouped convolutions, one group at a time, while jacutil runs a model.

Keras runs a grouped convolution (``Conv2D(groups=2)``: the input has more
channels than the kernel) in a nested ``tf.function(jit_compile=True)`` that
reads the kernel variable inside. In TF 2.21 pfor's converter of its filter
gradient fails (InvalidArgumentError), TensorFlow has no CPU gradient for it
outside XLA, and in a graph ``ForwardAccumulator`` carries no tangent into a
variable read inside a nested function (silent zeros). One ordinary
convolution per group, its kernel read outside, has none of these problems
and gives the same numbers: every call of a Keras model by jacutil
(``jacutil.core.target``) runs inside :func:`convolutions_by_group`.
"""

import contextlib
import threading

from ._tf import keras, tf
from .internals import keras_backend_nn

_BY_GROUP = {"depth": 0, "conv": None, "module": None}
_BY_GROUP_LOCK = threading.Lock()


def _conv_by_group(conv):
    """Keras's backend ``conv``, a grouped one run as one conv per group."""

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
        pairs = zip(tf.split(inputs, groups, axis), tf.split(kernel, groups, -1),
                    strict=True)  # fmt: skip
        return tf.concat([conv(a, k, *options) for a, k in pairs], axis)

    return by_group


@contextlib.contextmanager
def convolutions_by_group():
    """Inside the block, Keras runs grouped convolutions one group at a time.

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
