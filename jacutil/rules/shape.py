"""Weightless layers: reshapes, inference-mode noise, activation layers.

Flatten and Reshape reshape the signal back to the layer's input; Dropout and
the other noise layers are the identity in inference mode; activation layers
pass the signal through their activation (``jacutil.rules.activations``).
Padding, cropping, up-sampling and pooling have theirs in
``jacutil.rules.pooling``; any other weightless layer needs no rule of its
own: autodiff passes its signal (``jacutil.rules.autodiff``).
"""

from ..core._tf import keras, tf
from .activations import Activation
from .registry import Rule, register

IDENTITY_AT_INFERENCE = tuple(
    getattr(keras.layers, name)
    for name in (
        "Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
        "GaussianNoise", "GaussianDropout", "AlphaDropout", "ActivityRegularization",
    )
    if hasattr(keras.layers, name)
)  # fmt: skip


@register(keras.layers.Flatten, keras.layers.Reshape)
class ReshapeRule(Rule):
    name = "reshape"

    def _forward(self, a):
        return self.layer(a, training=False), tf.shape(a)

    def _backward(self, shape, delta, wanted, need_signal):
        if not need_signal:
            return {}, None
        return {}, tf.reshape(
            delta, tf.concat([shape[:1], tf.shape(delta)[1:2], shape[1:]], 0)
        )


@register(*IDENTITY_AT_INFERENCE)
class IdentityRule(Rule):
    name = "identity (inference)"

    def _forward(self, a):
        return a, None

    def _backward(self, saved, delta, wanted, need_signal):
        return {}, delta


@register(keras.layers.Activation)
class ActivationRule(Rule):
    """A Keras ``Activation`` layer: its signal only, no blocks."""

    name = "activation"

    def __init__(self, layer):
        super().__init__(layer)
        self.activation = Activation(layer.activation)
        self.runs_user_code = self.activation.runs_user_code
        self.takes_logits_signal = self.activation.makes_logits

    def describe(self):
        """The activation's name, a ``str`` (``"relu"``, ``"linear"``)."""
        return self.activation.describe().lstrip("+") or "linear"

    def _forward(self, a):
        return self.activation.forward(a)

    def _backward(self, saved, delta, wanted, need_signal):
        return {}, self.activation.backward(saved, delta) if need_signal else None


@register(keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU)
class ElementwiseLayerRule(ActivationRule):
    """Element-wise layers with options (max_value, negative_slope, ...)."""

    name = "elementwise"

    def __init__(self, layer):
        Rule.__init__(self, layer)
        self.activation = Activation(lambda t: layer(t, training=False))
        self.activation.kind = "elementwise"
        self.runs_user_code = self.takes_logits_signal = False

    def describe(self):
        """The layer's class, e.g. ``"ReLU (slope by autodiff)"`` (a ``str``)."""
        return f"{type(self.layer).__name__} (slope by autodiff)"
