"""Element-wise activations: how a signal passes back through ``act(z)``.

For an element-wise ``y = act(z)`` the signal at ``z`` is the signal at ``y``
times the slope ``act'(z)``. The slope has a formula for the common
functions; for any other known element-wise function it comes from autodiff
of the function itself (one gradient of ``sum(act(z))``, exact because each
output depends on its own input only). Softmax mixes a sample's units, so it
has its own rule; a function we do not know is not assumed element-wise: its
signal passes by autodiff row by row (:func:`jacutil.rules.autodiff.tiled_vjp`).
"""

from ..core._tf import keras, tf
from .autodiff import tiled_vjp
from .registry import LogitsSignal

# act'(z), written with z and y = act(z)
FORMULAS = {
    "relu": lambda z, y: tf.cast(z > 0, z.dtype),
    "tanh": lambda z, y: 1 - y * y,
    "sigmoid": lambda z, y: y * (1 - y),
}
ELEMENTWISE = (
    "elu", "selu", "gelu", "silu", "swish", "softplus", "softsign", "exponential",
    "hard_sigmoid", "hard_silu", "hard_swish", "leaky_relu", "relu6", "mish",
    "log_sigmoid", "celu", "hard_tanh", "tanh_shrink", "soft_shrink",
    "hard_shrink", "squareplus", "sparse_plus",
)  # fmt: skip
TF_ELEMENTWISE = {
    "relu": (tf.nn.relu,),
    "tanh": (tf.nn.tanh, tf.math.tanh, tf.tanh),
    "sigmoid": (tf.nn.sigmoid, tf.math.sigmoid, tf.sigmoid),
    "elementwise": (
        tf.nn.elu, tf.nn.selu, tf.nn.gelu, tf.nn.softplus, tf.nn.softsign,
        tf.nn.silu, tf.nn.swish, tf.nn.relu6, tf.nn.leaky_relu, tf.math.exp,
        tf.math.log_sigmoid,
    ),
}  # fmt: skip


def _keras(name):
    return getattr(keras.activations, name, None)


def kind_of(function):
    """The kind of an activation ``function`` (Keras's, TensorFlow's, any, or
    None): ``"linear"``, a FORMULAS name, ``"elementwise"``, ``"softmax"``,
    ``"log_softmax"`` or ``"unknown"``."""
    if function is None or function is _keras("linear"):
        return "linear"
    for name in FORMULAS:
        if function is _keras(name) or function in TF_ELEMENTWISE[name]:
            return name
    if any(function is _keras(name) for name in ELEMENTWISE):
        return "elementwise"
    if function in TF_ELEMENTWISE["elementwise"]:
        return "elementwise"
    if function is _keras("softmax") or function is tf.nn.softmax:
        return "softmax"
    if function is _keras("log_softmax") or function is tf.nn.log_softmax:
        return "log_softmax"
    return "unknown"


class Activation:
    """``y = function(z)`` forward, and its signal backward, by kind (None:
    linear)."""

    def __init__(self, function):
        self.function = function
        self.kind = kind_of(function)

    def forward(self, z):
        """``(y, saved)`` of the pre-activations ``z`` ``(n, *shape)``: y of
        their shape, and what :meth:`backward` needs (an element-wise
        function's slope)."""
        if self.kind == "linear":
            return z, None
        if self.kind == "elementwise":
            with tf.GradientTape() as tape:
                tape.watch(z)
                y = self.function(z)
            return y, tape.gradient(y, z)
        y = self.function(z)
        if self.kind in FORMULAS:
            return y, FORMULAS[self.kind](z, y)
        return y, (z, y)

    @property
    def runs_user_code(self):
        """Whether the function is not one jacutil knows (a ``bool``)."""
        return self.kind == "unknown"

    @property
    def makes_logits(self):
        """Whether a Keras loss reads ``z`` instead of ``y`` (then the signal
        may come as a :class:`LogitsSignal`)."""
        return self.kind in ("softmax", "sigmoid")

    def backward(self, saved, delta):
        """The signal at z from ``delta`` at y (or a
        :class:`jacutil.rules.registry.LogitsSignal`; TypeError for a function
        that makes no logits): ``(n, l, *shape)`` both."""
        if isinstance(delta, LogitsSignal):
            if not self.makes_logits:
                raise TypeError(f"a signal at logits for {self.describe()}")
            return delta.delta
        if self.kind == "linear":
            return delta
        if self.kind in FORMULAS or self.kind == "elementwise":
            return delta * saved[:, None]
        z, y = saved
        if self.kind == "softmax":
            y = y[:, None]
            return y * (delta - tf.reduce_sum(delta * y, -1, keepdims=True))
        if self.kind == "log_softmax":
            return delta - tf.exp(y[:, None]) * tf.reduce_sum(delta, -1, keepdims=True)
        return tiled_vjp(self.function, z, delta)

    def describe(self):
        """The activation as a rule's name shows it, a ``str`` (``"+relu"``; ``""``
        for linear)."""
        name = getattr(self.function, "__name__", type(self.function).__name__)
        if self.kind == "linear":
            return ""
        if self.kind == "elementwise":
            return f"+{name} (slope by autodiff)"
        if self.kind == "unknown":
            return f"+{name} (signal by autodiff)"
        return f"+{self.kind}"
