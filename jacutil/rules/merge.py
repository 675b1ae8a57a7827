"""Rules of the merge layers: several inputs, no variables, one signal per input.

``Add``, ``Subtract``, ``Average``, ``Multiply``, ``Maximum``, ``Minimum`` and
``Concatenate`` (any axis but the samples') join the branches of a functional
model. Each rule takes the list of its inputs (``several_inputs``) and gives
back the list of their signals, None where one is not needed. Merges of
inputs of different shapes (Keras broadcasts them) have no rule here: the
engine runs them by autodiff.

The rules are kept in their own table, :data:`MERGE_RULES`, by exact layer
type: ``jacutil.testing.check_rule`` proves rules of one input, and these are
proved with the plan they sit in (``tests/test_rules_graphs.py``), as every
plan is before use (``jacutil.rules.plan.Plan.check``).
"""

import math

from ..core._tf import keras, tf
from .registry import NoRule, Rule, register

MERGE_RULES = {}  # merge layer type -> rule class


def merge_rule(layer_type):
    """Class decorator: the rule of the merge layers of exact type ``layer_type``."""
    return register(layer_type, table=MERGE_RULES)


def _input_shapes(layer):
    """Each input's per-sample shape, as the layer was called in its model."""
    try:
        inputs = tf.nest.flatten(layer.input)
    except (AttributeError, ValueError) as error:  # not called, or called twice
        raise NoRule(f"{layer.name!r}: its inputs are not known ({error})") from None
    return [tuple(t.shape[1:]) for t in inputs]


class MergeRule(Rule):
    """A merge layer: the list of its inputs in, the list of their signals out.

    Args:
        layer: the merge layer (built and called once in its model).
    """

    several_inputs = True
    shared_signal = True  # no per-sample data below (Multiply: broadcast)
    same_shapes = True  # inputs of one shape only (no broadcasting)

    def __init__(self, layer):
        super().__init__(layer)
        if layer.weights:
            raise NoRule(f"{layer.name!r} holds variables")
        shapes = _input_shapes(layer)
        if self.same_shapes and len(set(shapes)) > 1:
            raise NoRule(f"its inputs have different shapes {shapes} (broadcast)")
        self.n_inputs = len(shapes)

    def _forward(self, a):
        y = self.layer(list(a))
        return y, self._saved(list(a), y)

    def _saved(self, inputs, y):
        """What ``_signals`` needs of the inputs and output (nothing by default)."""
        return None

    def _backward(self, saved, delta, wanted, need_signal):
        if not any(need_signal):
            return {}, None
        below = self._signals(saved, delta)
        pairs = zip(below, need_signal, strict=True)
        return {}, [signal if needed else None for signal, needed in pairs]

    def _signals(self, saved, delta):
        """The signal at each input (a list), from ``delta`` at the output."""
        raise NotImplementedError


@merge_rule(keras.layers.Add)
class AddRule(MergeRule):
    """``y = a_1 + ... + a_k``: each input gets the signal as it is."""

    name = "add"

    def _signals(self, saved, delta):
        return [delta] * self.n_inputs


@merge_rule(keras.layers.Subtract)
class SubtractRule(MergeRule):
    """``y = a_1 - a_2``."""

    name = "subtract"

    def _signals(self, saved, delta):
        return [delta, -delta]


@merge_rule(keras.layers.Average)
class AverageRule(MergeRule):
    """``y = (a_1 + ... + a_k) / k``."""

    name = "average"

    def _signals(self, saved, delta):
        return [delta / self.n_inputs] * self.n_inputs


@merge_rule(keras.layers.Multiply)
class MultiplyRule(MergeRule):
    """``y = a_1 * ... * a_k``: input i gets the signal times the others' product."""

    name = "multiply"

    def _saved(self, inputs, y):
        return inputs

    def _signals(self, saved, delta):
        below = []
        for i in range(len(saved)):
            others = [a for j, a in enumerate(saved) if j != i]
            below.append(delta * math.prod(others)[:, None])
        return below


class _ExtremumRule(MergeRule):
    """``y = max`` (or ``min``) of the inputs, element by element: the signal
    goes to the first input that attains it, as TensorFlow's gradient of
    ``maximum(maximum(a_1, a_2), a_3)`` sends it on ties."""

    def _saved(self, inputs, extremum):
        taken = tf.zeros_like(extremum, dtype=tf.bool)
        masks = []
        for a in inputs:
            mask = tf.logical_and(tf.equal(a, extremum), tf.logical_not(taken))
            taken = tf.logical_or(taken, mask)
            masks.append(tf.cast(mask, a.dtype))
        return masks

    def _signals(self, saved, delta):
        return [delta * mask[:, None] for mask in saved]


@merge_rule(keras.layers.Maximum)
class MaximumRule(_ExtremumRule):
    """``y = max(a_1, ..., a_k)``."""

    name = "maximum"


@merge_rule(keras.layers.Minimum)
class MinimumRule(_ExtremumRule):
    """``y = min(a_1, ..., a_k)``."""

    name = "minimum"


@merge_rule(keras.layers.Concatenate)
class ConcatenateRule(MergeRule):
    """``y = concat(a_1, ..., a_k)`` on one axis: each input gets its slice."""

    name = "concatenate"
    same_shapes = False

    def __init__(self, layer):
        super().__init__(layer)
        rank = len(_input_shapes(layer)[0]) + 1
        self.axis = layer.axis % rank
        if self.axis == 0:
            raise NoRule("it concatenates along the samples")

    def _saved(self, inputs, y):
        return [
            a.shape[self.axis] if a.shape[self.axis] is not None
            else tf.shape(a)[self.axis]
            for a in inputs
        ]  # fmt: skip

    def _signals(self, saved, delta):
        return tf.split(delta, tf.stack(saved), axis=self.axis + 1, num=len(saved))
