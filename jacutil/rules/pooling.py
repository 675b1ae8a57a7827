"""Weightless spatial layers: padding, cropping, up-sampling and pooling.

Each is a map of the input alone, so its rule writes no block, only the
signal below, for every sample and row at once:

- ``ZeroPadding1D/2D``: the signal cropped; ``Cropping1D/2D``: padded with
  zeros; ``UpSampling1D/2D`` (nearest): summed over each pixel's copies;
  ``GlobalAveragePooling1D/2D`` (``keepdims`` either way): spread evenly;
  ``AveragePooling1D/2D`` (valid or same, where Keras, as TensorFlow, leaves
  the padding out of the count): the pooling's own input gradient (linear,
  the same for every sample) of the signal's rows. These are linear and the
  same for every sample: they take one signal shared by every sample
  (``shared_signal``) and give one back.
- ``GlobalMaxPooling1D/2D`` and ``MaxPooling1D/2D`` with disjoint windows
  (``strides == pool_size``, the default; valid or same): the signal goes to
  each window's arg-max, a 0/1 mask (ties split as TensorFlow's gradient of
  ``reduce_max`` splits them) read once per sample as the layer's own
  gradient of the sum of its outputs, times the signal spread over each
  window - exactly autodiff's signal, without the n * l rows of
  :func:`jacutil.rules.autodiff.tiled_vjp`. Overlapping windows take that
  tiled product (TensorFlow's ``MaxPoolGrad`` on the tiled rows).

Channels-first layers, bilinear up-sampling and a layer called with a mask
raise :class:`NoRule` (autodiff passes their signal).
"""

from ..core._tf import keras, tf
from ..core.internals import calls_of
from .autodiff import tiled_vjp
from .graph import no_mask
from .registry import NoRule, Rule, per_output, register, rows

layers = keras.layers


def refuse_masks(layer):
    """Raise :class:`NoRule` where Keras passes ``layer`` a mask in the model
    (after ``Embedding(mask_zero=True)`` or ``Masking``): the rules read no
    mask."""
    for node in calls_of(layer):
        arguments = getattr(node, "arguments", None)
        kwargs = getattr(arguments, "kwargs", {}) or {}
        if not no_mask(kwargs.get("mask")):
            raise NoRule(f"{type(layer).__name__} called with a mask")


class SpatialRule(Rule):
    """A weightless layer, channels last, called without a mask; saves its
    input (its shape, or a max pooling's arg-max)."""

    name = "spatial"

    def __init__(self, layer):
        super().__init__(layer)
        if getattr(layer, "data_format", None) not in (None, "channels_last"):
            raise NoRule(f"a channels_first {type(layer).__name__}")
        refuse_masks(layer)

    def describe(self):
        """The layer's type in words, e.g. ``"max_pooling2d"`` (a ``str``)."""
        return self.name

    def _forward(self, a):
        return self.layer(a, training=False), a

    def _backward(self, a, delta, wanted, need_signal):
        if not need_signal:
            return {}, None
        # (n or 1, l, *input_shape): the static shape the rules below read
        return {}, tf.ensure_shape(self._below(a, delta), [None, None, *a.shape[1:]])


def _size(a, axis):
    size = a.shape[axis]
    return tf.shape(a)[axis] if size is None else size


@register(layers.ZeroPadding1D, layers.ZeroPadding2D)
class ZeroPaddingRule(SpatialRule):
    """The signal below: the signal without the padded margins."""

    shared_signal = True

    def describe(self):
        """``"zero_padding"`` (a ``str``)."""
        return "zero_padding"

    def _below(self, a, delta):
        pads = self.layer.padding
        pads = [pads] if isinstance(pads[0], int) else list(pads)
        index = [slice(None), slice(None)]
        for axis, (before, _) in enumerate(pads, start=1):
            index.append(slice(before, before + _size(a, axis)))
        return delta[tuple(index)]


@register(layers.Cropping1D, layers.Cropping2D)
class CroppingRule(SpatialRule):
    """The signal below: the signal padded with zeros where the layer crops."""

    shared_signal = True

    def describe(self):
        """``"cropping"`` (a ``str``)."""
        return "cropping"

    def _below(self, a, delta):
        crops = self.layer.cropping
        crops = [crops] if isinstance(crops[0], int) else list(crops)
        return tf.pad(delta, [[0, 0], [0, 0], *map(list, crops), [0, 0]])


@register(layers.UpSampling1D, layers.UpSampling2D)
class UpSamplingRule(SpatialRule):
    """Nearest up-sampling: the signal below sums each pixel's copies;
    bilinear raises :class:`NoRule`."""

    shared_signal = True

    def __init__(self, layer):
        super().__init__(layer)
        if getattr(layer, "interpolation", "nearest") != "nearest":
            raise NoRule(f"{layer.interpolation} up-sampling")
        size = layer.size
        self.sizes = [size] if isinstance(size, int) else list(size)

    def describe(self):
        """``"up_sampling"`` (a ``str``)."""
        return "up_sampling"

    def _below(self, a, delta):
        shape = [tf.shape(delta)[0], tf.shape(delta)[1]]
        for axis, k in enumerate(self.sizes, start=1):
            shape += [_size(a, axis), k]
        shape.append(delta.shape[-1])
        split = tf.reshape(delta, tf.stack(shape))
        axes = [3 + 2 * i for i in range(len(self.sizes))]
        return tf.reduce_sum(split, axes)


@register(layers.GlobalAveragePooling1D, layers.GlobalAveragePooling2D)
class GlobalAveragePoolingRule(SpatialRule):
    """The signal below: the signal spread evenly over the positions
    (``keepdims`` either way); called with a mask raises :class:`NoRule`."""

    shared_signal = True

    def describe(self):
        """``"global_average_pooling"`` (a ``str``)."""
        return "global_average_pooling"

    def _below(self, a, delta):
        spatial = a.shape.rank - 2
        positions = tf.cast(tf.reduce_prod(tf.shape(a)[1:-1]), delta.dtype)
        if not self.layer.keepdims:  # (n, l, c) -> (n, l, 1, ..., c)
            delta = tf.reshape(
                delta, tf.concat([tf.shape(delta)[:2], [1] * spatial, [-1]], 0)
            )
        shape = tf.concat([tf.shape(delta)[:2], tf.shape(a)[1:]], 0)
        return tf.broadcast_to(delta / positions, shape)


@register(layers.AveragePooling1D, layers.AveragePooling2D)
class AveragePoolingRule(SpatialRule):
    """The signal below: the pooling's input gradient of the signal's rows
    (one product for every row; 'same' leaves the padding out of the count,
    as the layer)."""

    shared_signal = True

    def describe(self):
        """``"average_pooling"`` (a ``str``)."""
        return "average_pooling"

    def _below(self, a, delta):
        n_rows, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
        shape = tf.concat([[n_rows * n_outputs], tf.shape(a)[1:]], 0)
        zeros = tf.zeros(shape, a.dtype)
        with tf.GradientTape() as tape:
            tape.watch(zeros)
            pooled = self.layer(zeros, training=False)
        gradient = tape.gradient(pooled, zeros, rows(delta))
        return per_output(gradient, n_rows, n_outputs)


def _arg_max_mask(layer, a):
    """(n, *input_shape): where each output's maximum is, as the layer's own
    gradient of the sum of its outputs (1 there, 0 elsewhere; a tie as
    TensorFlow's gradient splits it)."""
    with tf.GradientTape() as tape:
        tape.watch(a)
        total = tf.reduce_sum(layer(a, training=False))
    return tape.gradient(total, a)


@register(layers.GlobalMaxPooling1D, layers.GlobalMaxPooling2D)
class GlobalMaxPoolingRule(SpatialRule):
    """The signal below: at each channel's arg-max (``keepdims`` either way)."""

    shared_signal = True  # the mask is per sample: a shared signal broadcasts

    def describe(self):
        """``"global_max_pooling"`` (a ``str``)."""
        return "global_max_pooling"

    def _below(self, a, delta):
        spatial = a.shape.rank - 2
        if not self.layer.keepdims:
            delta = tf.reshape(
                delta, tf.concat([tf.shape(delta)[:2], [1] * spatial, [-1]], 0)
            )
        return _arg_max_mask(self.layer, a)[:, None] * delta


@register(layers.MaxPooling1D, layers.MaxPooling2D)
class MaxPoolingRule(SpatialRule):
    """The signal below: at each window's arg-max; disjoint windows (strides
    equal to the pool size) by a mask read once per sample, overlapping
    ones by the pooling's gradient on the tiled rows."""

    shared_signal = True

    def __init__(self, layer):
        super().__init__(layer)
        self.pool = list(layer.pool_size)
        self.disjoint = list(layer.strides) == self.pool

    def describe(self):
        """``"max_pooling"``, and how overlapping windows run (a ``str``)."""
        return "max_pooling" + ("" if self.disjoint else " (tiled)")

    def _below(self, a, delta):
        if not self.disjoint:
            n_samples = tf.shape(a)[0]
            delta = tf.broadcast_to(
                delta, tf.concat([[n_samples], tf.shape(delta)[1:]], 0)
            )
            return tiled_vjp(lambda t: self.layer(t, training=False), a, delta)
        spread = delta
        for axis, k in enumerate(self.pool, start=1):  # each window's pixels
            spread = tf.repeat(spread, k, axis=axis + 1)
        pads = [[0, 0], [0, 0]]
        index = [slice(None), slice(None)]
        for axis, k in enumerate(self.pool, start=1):
            size, out = _size(a, axis), _size(delta, axis + 1)
            covered = out * k
            if self.layer.padding == "same":  # TF's split: the odd pixel after
                before = (covered - size) // 2
                index.append(slice(before, before + size))
                pads.append([0, 0])
            else:  # valid: the pixels after the last window get nothing
                index.append(slice(None))
                pads.append([0, size - covered])
        pads.append([0, 0])
        spread = tf.pad(spread[tuple(index)], pads)
        mask = _arg_max_mask(self.layer, a)[:, None]
        return mask * spread
