"""The plan (which rule runs each layer) and the Jacobian it computes.

One forward pass through the layers keeps what each rule needs; then, from
the outputs down, each layer's rule turns the per-sample signal into its
blocks of columns and the signal of the layer below, and stops below the
lowest layer that holds a wanted variable. No tape over the whole model and
no pfor, except inside a layer that has no rule and holds wanted variables.
"""

from dataclasses import dataclass

import numpy as np

from .._tf import keras, tf
from ..batch import take
from ..target import watched
from .autodiff import AutodiffRule
from .dense import DenseRule
from .registry import rule_for

# Left to the compiled per-sample stage: pfor unrolls their time loop
# (jacutil.formulation), and attention's products need XLA in TF 2.21.
NOT_IN_A_CHAIN = (
    keras.layers.RNN, keras.layers.LSTM, keras.layers.GRU,
    keras.layers.SimpleRNN, keras.layers.Bidirectional,
    keras.layers.MultiHeadAttention, keras.layers.EinsumDense,
)  # fmt: skip


def is_exact_keras(model):
    """A plain ``keras.Sequential`` or functional model, not a subclass."""
    kind = type(model)
    if kind is keras.Sequential:
        return True
    return kind.__name__ == "Functional" and kind.__module__.startswith("keras.")


def chain_layers(model):
    """The model's layers from input to output, or None if it is not a chain.

    An exact ``Sequential`` (nested ones are opened), or a functional model
    with one input and one output whose every layer is used once and takes
    one tensor.
    """
    if type(model) is keras.Sequential:
        layers = []
        for layer in model.layers:
            inner = chain_layers(layer) if is_exact_keras(layer) else [layer]
            if inner is None:
                return None
            layers += [x for x in inner if not isinstance(x, keras.layers.InputLayer)]
        return layers
    if not is_exact_keras(model) or len(model.inputs) != 1 or len(model.outputs) != 1:
        return None
    chain = []
    tensor = model.outputs[0]
    while True:
        layer = tensor._keras_history.operation
        if isinstance(layer, keras.layers.InputLayer):
            break
        nodes = layer._inbound_nodes
        if len(nodes) != 1 or len(nodes[0].input_tensors) != 1:
            return None  # shared layers or several inputs
        chain.append(layer)
        tensor = nodes[0].input_tensors[0]
    return chain[::-1]


@dataclass
class Plan:
    """The rule of each layer, and which of its variables are columns."""

    steps: list  # a Rule per layer, input to output
    wanted: list  # per step: {id(variable): column position}
    variables: list  # the Jacobian's columns
    lowest: int  # the lowest step holding a wanted variable

    @property
    def user_code(self):
        """Whether code that is not ours runs (then autograph may matter)."""
        return any(
            isinstance(step, AutodiffRule) or "signal by autodiff" in step.describe()
            for step in self.steps
        )

    def layers(self):
        """``[(layer name, rule)]``, e.g. ``("conv2d", "conv2d+relu")``."""
        return [(step.layer.name, step.describe()) for step in self.steps]

    def describe(self):
        return "layer rules: " + ", ".join(rule for _, rule in self.layers())


def plan_for(model, variables, training=False):
    """``(Plan, None)`` when the rules apply to ``model``, else ``(None, reason)``."""
    if not isinstance(model, keras.Model):
        return None, "not a Keras model"
    if training:
        return None, "training=True (the rules run layers in inference mode)"
    if not is_exact_keras(model):
        return (
            None,
            f"{type(model).__name__} is a subclass: its call() may differ from "
            "its layers",
        )
    layers = chain_layers(model)
    if not layers:
        return (
            None,
            "not a single chain of layers (branches, several inputs or outputs)",
        )
    if len({id(layer) for layer in layers}) != len(layers):
        return None, "a layer is used more than once"
    dtype = variables[0].dtype if variables else None
    steps = []
    for layer in layers:
        if layer.weights and layer.compute_dtype != dtype:
            return None, f"layer {layer.name!r} computes in {layer.compute_dtype}"
        if getattr(layer, "mask_zero", False) or isinstance(
            layer, keras.layers.Masking
        ):
            return None, f"layer {layer.name!r} makes a mask (the rules ignore masks)"
        rule, why = rule_for(layer)
        if rule is None and isinstance(layer, NOT_IN_A_CHAIN):
            return None, f"layer {layer.name!r} is a {type(layer).__name__} ({why})"
        steps.append(rule if rule is not None else AutodiffRule(layer, why))
    position = {id(v): i for i, v in enumerate(variables)}
    wanted, owner = [], {}
    for j, step in enumerate(steps):
        wanted.append(
            {id(v): position[id(v)] for v in step.variables if id(v) in position}
        )
        for key in wanted[-1]:
            if key in owner:
                return None, "a variable is shared by two layers"
            owner[key] = j
    missing = [v for v in variables if id(v) not in owner]
    if missing:
        return None, f"variable {missing[0].name!r} is not in a layer the rules can see"
    return Plan(steps, wanted, list(variables), min(owner.values())), None


def rules_tensor(plan, x, signal=None):
    """(n, l, m) Jacobian of batch ``x`` by the plan's rules.

    ``signal(y)``, when given, returns the signal to start from instead of
    the identity: ``(n, r, *output_shape)``, giving (n, r, m) - with r = 1 and
    the derivative of a per-sample loss, the per-sample gradients.
    """
    a, saved = x, []
    for step in plan.steps:
        a, kept = step.forward(a)
        saved.append(kept)
    n_samples = tf.shape(a)[0]
    if signal is not None:
        delta = signal(a)
        n_outputs = tf.shape(delta)[1]
    else:
        out_shape = a.shape[1:]
        n_outputs = int(np.prod(out_shape, dtype=np.int64))
        # one identity for every sample, broadcast only where a rule needs it
        delta = tf.reshape(tf.eye(n_outputs, dtype=a.dtype), [1, n_outputs, *out_shape])
    blocks = {}
    for j in reversed(range(plan.lowest, len(plan.steps))):
        if plan.wanted[j] or not isinstance(plan.steps[j], DenseRule):
            delta = tf.broadcast_to(
                delta, tf.concat([[n_samples], tf.shape(delta)[1:]], 0)
            )
        found, delta = plan.steps[j].backward(
            saved[j], delta, plan.wanted[j], j > plan.lowest
        )
        blocks.update(found)
    parts = []
    for i, v in enumerate(plan.variables):
        if i not in blocks:  # a variable the outputs do not use: zeros
            size = int(np.prod(v.shape, dtype=np.int64))
            parts.append(tf.zeros([n_samples, n_outputs, size], a.dtype))
        elif blocks[i] is not None:  # None: joined with the block before
            parts.append(blocks[i])
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=2)


def disagreement(plan, target, x, seed=0):
    """None if the rules agree with autodiff on one sample, else the reason.

    Compares one vector-Jacobian product, ``J.T @ w`` for random weights w
    of the outputs, with the gradient of ``w . f(x)`` by autodiff: any
    difference between the two Jacobians shows (almost surely) in it.
    """
    one = take(x, 0, 1)
    J = rules_tensor(plan, one)[0]  # (l, m)
    w = tf.random.stateless_normal([J.shape[0]], [seed, 1], dtype=J.dtype)
    with tf.GradientTape() as tape:
        target.watch(tape)
        y = target.forward(one)[0]
        score = tf.reduce_sum(w * y)
    sources = [watched(v) for v in target.variables]
    grads = tape.gradient(score, sources)
    auto = np.concatenate(
        [
            np.zeros(int(np.prod(v.shape)))
            if g is None
            else np.ravel(tf.convert_to_tensor(g))
            for g, v in zip(grads, target.variables, strict=True)
        ]
    )
    hand = tf.linalg.matvec(J, w, transpose_a=True).numpy()
    scale = max(1.0, float(np.abs(auto).max(initial=0)))
    tolerance = (1e-4 if J.dtype == tf.float32 else 1e-9) * scale * np.sqrt(J.shape[0])
    error = float(np.abs(hand - auto).max()) if hand.shape == auto.shape else np.inf
    if error <= tolerance:
        return None
    return (
        f"the layer rules differ from autodiff by {error:.3g} on one sample: the "
        "model computes something its layers do not say"
    )
