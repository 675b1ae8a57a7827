"""LayerNormalization, and BatchNormalization in inference mode, on the last axis.

Both are ``y = gamma * xhat + beta``; their blocks are ``delta * xhat`` and
``delta`` summed over every position but the normalized axis. BatchNorm in
inference mode is a fixed affine map (its moving statistics are constants),
so its signal below is ``delta * gamma / sqrt(var + eps)``; LayerNorm's
``xhat`` depends on the whole sample, so its signal is the usual
normalization backward, per sample and output.
"""

from ..core._tf import keras, tf
from .blocks import sum_positions
from .registry import Blocks, NoRule, Rule, register


def _last_axis(layer, axis):
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    try:
        rank = len(layer.input.shape)
    except (AttributeError, ValueError):
        rank = None
    last = {-1} | ({rank - 1} if rank else set())
    if len(axes) != 1 or axes[0] not in last:
        raise NoRule(f"normalization over axis {axis}, not the last one")


class _Affine(Rule):
    """Shared by both: gamma (scale) and beta (center), each optional."""

    def __init__(self, layer):
        super().__init__(layer)
        self.gamma = layer.gamma if layer.scale else None
        self.beta = layer.beta if layer.center else None
        self.variables = [v for v in (self.gamma, self.beta) if v is not None]

    def _affine(self, xhat):
        y = xhat if self.gamma is None else xhat * self.gamma
        return y if self.beta is None else y + self.beta

    def blocks(self, xhat, delta, wanted):
        width = delta.shape[-1]
        blocks = Blocks()
        if self.gamma is not None and self.gamma in wanted:
            blocks[self.gamma] = sum_positions(delta * xhat[:, None], width)
        if self.beta is not None and self.beta in wanted:
            blocks[self.beta] = sum_positions(delta, width)
        return blocks

    def scaled(self, delta):
        return delta if self.gamma is None else delta * self.gamma


@register(keras.layers.LayerNormalization)
class LayerNormRule(_Affine):
    """``y = gamma * (a - mean) / sqrt(var + eps) + beta`` over the last axis.

    Args:
        layer: the Keras layer.

    Raises:
        NoRule: RMS scaling, or an axis other than the last.
    """

    name = "layer_norm"

    def __init__(self, layer):
        super().__init__(layer)
        if getattr(layer, "rms_scaling", False):
            raise NoRule("RMS scaling")
        _last_axis(layer, layer.axis)

    def _forward(self, a):
        mean, variance = tf.nn.moments(a, axes=[-1], keepdims=True)
        inverse = tf.math.rsqrt(variance + self.layer.epsilon)
        xhat = (a - mean) * inverse
        return self._affine(xhat), (xhat, inverse)

    def _backward(self, saved, delta, wanted, need_signal):
        xhat, inverse = saved
        blocks = self.blocks(xhat, delta, wanted)
        if not need_signal:
            return blocks, None
        g = self.scaled(delta)
        xhat = xhat[:, None]
        mean_g = tf.reduce_mean(g, -1, keepdims=True)
        mean_gx = tf.reduce_mean(g * xhat, -1, keepdims=True)
        return blocks, inverse[:, None] * (g - mean_g - xhat * mean_gx)


@register(keras.layers.BatchNormalization)
class BatchNormRule(_Affine):
    """Inference mode: the moving mean and variance, on the last axis.

    Args:
        layer: the Keras layer.

    Raises:
        NoRule: an axis other than the last.
    """

    name = "batch_norm (inference)"

    def __init__(self, layer):
        super().__init__(layer)
        _last_axis(layer, layer.axis)

    def _forward(self, a):
        layer = self.layer
        inverse = tf.math.rsqrt(layer.moving_variance + layer.epsilon)
        xhat = (a - layer.moving_mean) * inverse
        return self._affine(xhat), (xhat, inverse)

    def _backward(self, saved, delta, wanted, need_signal):
        xhat, inverse = saved
        below = self.scaled(delta) * inverse if need_signal else None
        return self.blocks(xhat, delta, wanted), below
