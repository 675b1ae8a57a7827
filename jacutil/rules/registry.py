"""The registry: which rule writes the blocks of which layer type.

A rule is a class built from one layer. It says which of the layer's
variables it writes blocks for (``variables``), runs the layer forward
keeping what its backward step needs, and maps the per-sample signal
``delta[i, k, ...] = d y[i, k] / d (layer output)[i, ...]`` to its blocks
and to the signal of the layer below. Rules are looked up by the layer's
exact type: a subclass may compute something else, so it goes through
autodiff (``jacutil.rules.autodiff``) unless it registers a rule itself.
"""

from ..core._tf import tf

RULES = {}  # layer type -> rule class


class NoRule(Exception):
    """Raised by a rule's constructor when its layer is configured beyond it."""


def register(*layer_types):
    """Class decorator: ``@register(keras.layers.Dense)`` makes the rule known."""

    def add(rule):
        for layer_type in layer_types:
            RULES[layer_type] = rule
        return rule

    return add


class LogitsSignal:
    """A signal at the logits ``z`` of a softmax or sigmoid, not at its
    output ``y``: what a Keras loss gives when it reads ``y``'s logits
    (``y._keras_logits``, or the input of a ``Softmax``/``Sigmoid`` op)."""

    def __init__(self, delta):
        self.delta = delta


class Rule:
    """Base of every rule: one layer, its variables, forward and backward.

    ``forward(a)`` returns ``(y, saved)``; ``backward(saved, delta, wanted,
    need_signal)`` returns ``(blocks, delta_below)``, where ``blocks`` maps
    the column position of each wanted variable (``wanted``: id of the
    variable -> position) to its (n, l, size) block of columns and
    ``delta_below`` is the signal at the layer's input (None when not needed).

    The signal ``delta`` is ``(n, l, *output_shape)``, one row per sample, unless
    the rule says it takes a signal shared by every sample
    (``shared_signal``): then it may be ``(1, l, *output_shape)``.
    """

    name = "rule"
    shared_signal = False  # backward() takes delta of shape (1, l, ...)
    runs_user_code = False  # calls code that is not ours (autograph matters)
    takes_logits_signal = False  # backward() takes a LogitsSignal

    def __init__(self, layer):
        self.layer = layer
        self.variables = []

    def forward(self, a):
        return self.layer(a, training=False), a

    def backward(self, saved, delta, wanted, need_signal):
        raise NotImplementedError

    def describe(self):
        return self.name


def rule_for(layer):
    """The rule for ``layer``, or ``(None, reason)`` when it has none."""
    rule = RULES.get(type(layer))
    if rule is None:
        return None, f"no rule for {type(layer).__name__}"
    try:
        return rule(layer), None
    except NoRule as reason:
        return None, str(reason)


def rows(delta):
    """(n, l, *shape) -> (n * l, *shape): one row per sample and output."""
    return tf.reshape(delta, tf.concat([[-1], tf.shape(delta)[2:]], 0))


def per_output(rows_, n_samples, n_outputs):
    """(n * l, *shape) -> (n, l, *shape): the inverse of :func:`rows`."""
    shape = tf.concat([[n_samples, n_outputs], tf.shape(rows_)[1:]], 0)
    return tf.reshape(rows_, shape)
