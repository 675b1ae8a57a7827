"""LayerNormalization on its last axes, and BatchNormalization in inference
mode on the last axis.

Both are ``y = gamma * xhat + beta``; their blocks are ``delta * xhat`` and
``delta`` summed over every position but the normalized axes. BatchNorm in
inference mode is a fixed affine map (its moving statistics are constants),
so its signal below is ``delta * gamma / sqrt(var + eps)``; LayerNorm's
``xhat`` depends on the whole sample, so its signal is the usual
normalization backward, per sample and output.

``LayerNormalization(rms_scaling=True)`` (RMSNorm as Keras writes it:
``y = gamma * a / sqrt(var(a) + eps)``, the variance centered, the output
not, no beta) has the block ``delta * a / sqrt(var + eps)`` and the signal
``inv * (g - (a - mean) inv * mean(g * a inv))`` for ``g = gamma * delta``.

``RMSNormalization`` (Zhang and Sennrich 2019, as Llama and Gemma use it) is
``y = scale * a / sqrt(mean(a^2) + eps)``, the same with ``a`` for the
centered.

Their blocks are as small as gamma and beta, so the squared norms per
sample are those gradients' squares, formed directly (as Opacus's norm
samplers of ``nn.LayerNorm`` and BackPACK's ``BatchL2Grad`` of BatchNorm):
no (n, l, size) block is placed.
"""

from ..core._shared import size_of
from ..core._tf import keras, tf
from .blocks import sum_positions
from .registry import Blocks, NoRule, Rule, register


def _last_axes(layer, axis, most=None):
    """How many (at least 1) of the layer input's last axes ``axis`` (an int
    or a list) names; :class:`NoRule` for other axes than the last ones, or
    more than ``most`` (None: any but the samples' axis)."""
    axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    if axes == [-1]:
        return 1
    try:
        rank = len(layer.input.shape)
    except (AttributeError, ValueError):
        rank = None
    count = len(axes)
    last = list(range(rank - count, rank)) if rank else None
    limit = (rank or 0) - 1 if most is None else most
    if not last or sorted(a % rank for a in axes) != last or count > limit:
        which = "the last one" if most == 1 else "the last ones"
        raise NoRule(f"normalization over axis {axis}, not {which}")
    return count


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

    def _gradients(self, xhat, delta, wanted):
        """``[(variable, (n, l, size))]`` for the wanted of gamma and beta:
        ``delta * xhat`` and ``delta`` summed over the positions."""
        found = []
        if self.gamma is not None and self.gamma in wanted:
            width = size_of(self.gamma)
            found.append((self.gamma, sum_positions(delta * xhat[:, None], width)))
        if self.beta is not None and self.beta in wanted:
            found.append((self.beta, sum_positions(delta, size_of(self.beta))))
        return found

    def _backward_norms(self, saved, delta, wanted, need_signal):
        """The gradients of gamma and beta are small: their squares summed,
        and the signal below from :meth:`_below` - no block placed."""
        found = self._gradients(saved[0], delta, wanted)
        squared = None
        if found:
            squared = tf.add_n([tf.reduce_sum(tf.square(g), -1) for _, g in found])
        return squared, (self._below(saved, delta) if need_signal else None)

    def _backward(self, saved, delta, wanted, need_signal):
        xhat, _ = saved
        below = self._below(saved, delta) if need_signal else None
        return Blocks(self._gradients(xhat, delta, wanted)), below

    def _below(self, saved, delta):
        """The signal at the layer's input, (n, l, *input_shape)."""
        raise NotImplementedError

    def scaled(self, delta):
        return delta if self.gamma is None else delta * self.gamma


def divided_below(g, xhat, along, inverse, axes):
    """``inverse * (g - along * mean(g * xhat))`` over ``axes``: the signal
    below a division by the input's own spread, ``inverse`` = 1 / spread
    (n, ...), ``xhat`` and ``along`` (n, ...), ``g`` (n, l, ...)."""
    mean_gx = tf.reduce_mean(g * xhat[:, None], axes, keepdims=True)
    return inverse[:, None] * (g - along[:, None] * mean_gx)


@register(keras.layers.LayerNormalization)
class LayerNormRule(_Affine):
    """``y = gamma * (a - mean) / sqrt(var + eps) + beta`` over the last axes;
    with ``rms_scaling``, ``y = gamma * a / sqrt(var + eps)``. Axes other
    than the last ones raise :class:`NoRule`."""

    name = "layer_norm"

    def __init__(self, layer):
        super().__init__(layer)
        self.rms = bool(getattr(layer, "rms_scaling", False))
        # Keras builds gamma when scale or rms_scaling, beta when center and not
        self.gamma, self.beta = layer.gamma, layer.beta
        self.variables = [v for v in (self.gamma, self.beta) if v is not None]
        self.axes = list(range(-_last_axes(layer, layer.axis), 0))

    def describe(self):
        """``"layer_norm"``, or ``"layer_norm (rms)"`` (a ``str``)."""
        return self.name + (" (rms)" if self.rms else "")

    def _forward(self, a):
        mean, variance = tf.nn.moments(a, axes=self.axes, keepdims=True)
        inverse = tf.math.rsqrt(variance + self.layer.epsilon)
        if self.rms:  # scaled, not centered: keep the centered for the signal
            xhat = a * inverse
            return self._affine(xhat), (xhat, (inverse, (a - mean) * inverse))
        xhat = (a - mean) * inverse
        return self._affine(xhat), (xhat, inverse)

    def _below(self, saved, delta):
        xhat, inverse = saved
        g = self.scaled(delta)
        if self.rms:
            inverse, centered = inverse
            return divided_below(g, xhat, centered, inverse, self.axes)
        mean_g = tf.reduce_mean(g, self.axes, keepdims=True)
        below = divided_below(g, xhat, xhat, inverse, self.axes)
        return below - inverse[:, None] * mean_g


@register(keras.layers.RMSNormalization)
class RMSNormRule(_Affine):
    """``y = scale * a / sqrt(mean(a^2) + eps)`` over the last axes; others
    raise :class:`NoRule`."""

    name = "rms_norm"

    def __init__(self, layer):
        super(_Affine, self).__init__(layer)  # its gamma is called scale
        self.gamma, self.beta = layer.scale, None
        self.variables = [self.gamma]
        self.axes = list(range(-_last_axes(layer, layer.axis), 0))

    def _forward(self, a):
        epsilon = keras.config.epsilon() if self.layer.epsilon is None else (
            self.layer.epsilon)  # fmt: skip
        mean_square = tf.reduce_mean(tf.square(a), self.axes, keepdims=True)
        inverse = tf.math.rsqrt(mean_square + epsilon)
        xhat = a * inverse
        return self._affine(xhat), (xhat, inverse)

    def _below(self, saved, delta):
        xhat, inverse = saved
        return divided_below(self.scaled(delta), xhat, xhat, inverse, self.axes)


@register(keras.layers.BatchNormalization)
class BatchNormRule(_Affine):
    """Inference mode: the moving mean and variance, on the last axis; another
    axis raises :class:`NoRule`."""

    name = "batch_norm (inference)"

    def __init__(self, layer):
        super().__init__(layer)
        _last_axes(layer, layer.axis, most=1)

    def _forward(self, a):
        layer = self.layer
        inverse = tf.math.rsqrt(layer.moving_variance + layer.epsilon)
        xhat = (a - layer.moving_mean) * inverse
        return self._affine(xhat), (xhat, inverse)

    def _below(self, saved, delta):
        return self.scaled(delta) * saved[1]
