"""The plan (which rule runs each layer) and the Jacobian it computes.

One forward pass through the layers keeps what each rule needs; then, from
the outputs down, each layer's rule turns the per-sample signal into its
blocks of columns and the signal of the layer below, and stops below the
lowest layer that holds a wanted variable. No tape over the whole model and
no pfor, except inside a layer that has no rule and holds wanted variables.
"""

from dataclasses import dataclass, field

import numpy as np

from ..core._grouped import convolutions_by_group
from ..core._shared import joined_gradients, size_of, sizes_of
from ..core._tf import keras, tf
from ..core.batch import n_samples, signature_key, take
from ..core.formulation import pfor_log
from ..core.target import watched
from .autodiff import AutodiffRule
from .registry import Blocks, LogitsSignal, Wanted, rule_for

# Left to the compiled per-sample stage: pfor unrolls their time loop
# (jacutil.core.formulation), and attention's products need XLA in TF 2.21.
NOT_IN_A_CHAIN = (
    keras.layers.RNN, keras.layers.LSTM, keras.layers.GRU,
    keras.layers.SimpleRNN, keras.layers.Bidirectional,
    keras.layers.MultiHeadAttention, keras.layers.EinsumDense,
)  # fmt: skip


def is_exact_keras(model):
    """A plain ``keras.Sequential`` or functional model, not a subclass.

    Args:
        model: anything.

    Returns:
        A ``bool``.
    """
    kind = type(model)
    if kind is keras.Sequential:
        return True
    return kind.__name__ == "Functional" and kind.__module__.startswith("keras.")


_INPUT = keras.layers.InputLayer


class Node:
    """One call in a chain: an operation (a Keras layer, or a ``keras.ops``
    call such as ``h * 2``) and the arguments it was called with.

    Calling the node replays that call on a tensor, in inference mode: the
    symbolic input is replaced by the tensor, every other argument is kept.

    Args:
        operation: a Keras layer or operation.
        args: the positional arguments it was called with (None: the input
            tensor alone).
        kwargs: its keyword arguments (``training`` is dropped).
    """

    def __init__(self, operation, args=None, kwargs=None):
        self.operation = operation
        self.args = args  # None: called with the tensor alone
        self.kwargs = dict(kwargs or {})
        self.kwargs.pop("training", None)  # the model's call sets it (below)

    @property
    def name(self):
        """The operation's name (a ``str``)."""
        return self.operation.name

    def extra_arguments(self):
        """The arguments besides the input tensor, in words ("" if none).

        Returns:
            A ``str``.
        """
        others = [repr(a) for a in self.args or () if not _symbolic(a)]
        others += [f"{key}={value!r}" for key, value in self.kwargs.items()]
        return ", ".join(others)

    def __call__(self, a):
        """Replay the call on ``a``, in inference mode.

        Args:
            a: the input tensor, shape ``(n, *input_shape)``.

        Returns:
            The operation's output tensor.
        """
        args = (a,) if self.args is None else _filled(self.args, a)
        kwargs = _filled(self.kwargs, a)
        if getattr(self.operation, "_call_has_training_arg", False):
            kwargs["training"] = False
        with convolutions_by_group():  # see jacutil.core._grouped
            return self.operation(*args, **kwargs)


def _symbolic(value):
    return isinstance(value, keras.KerasTensor)


def _filled(arguments, a):
    """``arguments`` with every symbolic tensor replaced by ``a``."""
    if _symbolic(arguments):
        return a
    if isinstance(arguments, dict):
        return {key: _filled(value, a) for key, value in arguments.items()}
    if isinstance(arguments, (list, tuple)):
        return type(arguments)(_filled(value, a) for value in arguments)
    return arguments


def chain_nodes(model):
    """The model's calls from input to output as :class:`Node` objects, or None if
    it is not a chain.

    An exact ``Sequential`` (nested ones are opened), or a functional model
    with one input and one output in which every operation is used once,
    takes one tensor and gives one.

    Args:
        model: a Keras model.

    Returns:
        A list of :class:`Node`, input to output, or None.
    """
    if type(model) is keras.Sequential:
        nodes = []
        for layer in model.layers:
            inner = chain_nodes(layer) if is_exact_keras(layer) else [Node(layer)]
            if inner is None:
                return None
            nodes += [n for n in inner if not isinstance(n.operation, _INPUT)]
        return nodes
    if not is_exact_keras(model) or len(model.inputs) != 1 or len(model.outputs) != 1:
        return None
    chain = []
    tensor = model.outputs[0]
    while True:
        operation, node_index, tensor_index = tensor._keras_history
        if isinstance(operation, _INPUT):
            break
        nodes = operation._inbound_nodes
        if len(nodes) != 1 or len(nodes[0].input_tensors) != 1:
            return None  # shared layers or several inputs
        if tensor_index != 0 or len(nodes[0].outputs) != 1:
            return None  # one output of several
        arguments = nodes[0].arguments
        chain.append(Node(operation, arguments.args, arguments.kwargs))
        tensor = nodes[0].input_tensors[0]
    return chain[::-1]


def chain_layers(model):
    """The model's layers from input to output, or None unless it is a chain
    of layers each called with its input alone (see :func:`chain_nodes`).

    Args:
        model: a Keras model.

    Returns:
        A list of Keras layers, input to output, or None.
    """
    nodes = chain_nodes(model)
    if nodes is None or any(
        not isinstance(n.operation, keras.Layer) or n.extra_arguments() for n in nodes
    ):
        return None
    return [n.operation for n in nodes]


class UncheckedPlan(RuntimeError):
    """A plan was used for inputs it was not checked on (a bug in jacutil)."""


@dataclass
class Plan:
    """The rule of each layer, and which of its variables are columns.

    A plan is used only on inputs it has been checked on: :meth:`check`
    compares its Jacobian with autodiff, sample by sample, once per input
    shape, and :meth:`tensor` refuses any other. No consumer can take the
    rules' numbers without that proof.

    Args:
        steps: a rule (:class:`jacutil.rules.registry.Rule`) per node, input to
            output.
        wanted: per step, the :class:`jacutil.rules.registry.Wanted` variables
            it writes blocks for.
        variables: the Jacobian's m columns' variables, in order.
        lowest: the lowest step holding a wanted variable.
        checked: the input signatures the plan was proved on.
    """

    steps: list  # a Rule per node, input to output
    wanted: list  # per step: the Wanted variables it writes blocks for
    variables: list  # the Jacobian's columns, in order (the engine places blocks)
    lowest: int  # the lowest step holding a wanted variable
    checked: set = field(default_factory=set)  # input signatures proved

    @property
    def user_code(self):
        """Whether code that is not ours runs (then autograph may matter)."""
        return any(step.runs_user_code for step in self.steps)

    def layers(self):
        """``[(layer name, rule)]``, e.g. ``("conv2d", "conv2d+relu")``.

        Returns:
            A list of ``(str, str)`` pairs, one per step.
        """
        return [(step.layer.name, step.describe()) for step in self.steps]

    def describe(self):
        """The rules in words: ``"layer rules: dense+relu, dense"``.

        Returns:
            A ``str``.
        """
        return "layer rules: " + ", ".join(rule for _, rule in self.layers())

    def check(self, target, x):
        """None when the rules agree with autodiff on ``x``'s samples, else
        why not. Agreement is recorded for ``x``'s input shape.

        Args:
            target: the :class:`jacutil.core.target.Target` (autodiff's side).
            x: a checked batch.

        Returns:
            None, or why the rules disagree (a ``str``).
        """
        with pfor_log():  # pfor's notes on our own autodiff rules: not the user's
            reason = disagreement(self, target, x)
        if reason is None:
            self.checked.add(signature_key(x))
        return reason

    def tensor(self, x, signal=None):
        """:func:`rules_tensor` of a batch like one the plan was checked on.

        Args:
            x: a batch of n samples, of a shape the plan was checked on.
            signal: as for :func:`rules_tensor`.

        Returns:
            A tensor of shape (n, l, m), or (n, r, m) with ``signal``.

        Raises:
            UncheckedPlan: the plan was not checked on inputs of this shape.
        """
        self._refuse_unchecked(x)
        return rules_tensor(self, x, signal)

    def squared_norms(self, x, signal):
        """:func:`rules_squared_norms` of a batch like one the plan was checked on.

        Args:
            x: a batch of n samples, of a shape the plan was checked on.
            signal: as for :func:`rules_tensor`.

        Returns:
            A tensor of shape (n, r).

        Raises:
            UncheckedPlan: the plan was not checked on inputs of this shape.
        """
        self._refuse_unchecked(x)
        return rules_squared_norms(self, x, signal)

    def _refuse_unchecked(self, x):
        if signature_key(x) not in self.checked:
            raise UncheckedPlan(
                "the layer rules were not checked on inputs of this shape: "
                "call plan.check(target, x) first"
            )


def plan_for(model, variables, training=False):
    """``(Plan, None)`` when the rules apply to ``model``, else ``(None, reason)``.

    The plan is not yet checked: :meth:`Plan.check` it on the inputs first.

    Args:
        model: a Keras model (anything else gets a reason).
        variables: the variables to differentiate (the columns).
        training: whether the model runs in training mode (the rules do not).

    Returns:
        ``(Plan, None)`` or ``(None, reason)``, the reason a ``str``.
    """
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
    nodes = chain_nodes(model)
    if not nodes:
        return (
            None,
            "not a single chain of layers (branches, several inputs or outputs)",
        )
    if len({id(node.operation) for node in nodes}) != len(nodes):
        return None, "a layer is used more than once"
    dtype = variables[0].dtype if variables else None
    steps = []
    for node in nodes:
        step, why = _step_for(node, dtype)
        if step is None:
            return None, why
        steps.append(step)
    columns = {id(v) for v in variables}
    wanted, owner = [], {}
    for j, step in enumerate(steps):
        wanted.append(Wanted(v for v in step.variables if id(v) in columns))
        for v in wanted[-1]:
            if id(v) in owner:
                return None, "a variable is shared by two layers"
            owner[id(v)] = j
    missing = [v for v in variables if id(v) not in owner]
    if missing:
        return None, f"variable {missing[0].name!r} is not in a layer the rules can see"
    return Plan(steps, wanted, list(variables), min(owner.values())), None


def _step_for(node, dtype):
    """The rule of one node, or ``(None, reason)`` when the plan cannot take it."""
    layer = node.operation
    if not isinstance(layer, keras.Layer):  # keras.ops between layers
        kind = type(layer).__name__
        return AutodiffRule(node, f"{kind}, an operation between layers"), None
    if layer.weights and layer.compute_dtype != dtype:
        return None, f"layer {layer.name!r} computes in {layer.compute_dtype}"
    if getattr(layer, "mask_zero", False) or isinstance(layer, keras.layers.Masking):
        return None, f"layer {layer.name!r} makes a mask (the rules ignore masks)"
    rule, why = rule_for(layer)
    extra = node.extra_arguments()
    if rule is not None and extra:
        rule, why = None, f"called with {extra}, which its rule does not read"
    if rule is None and isinstance(layer, NOT_IN_A_CHAIN):
        return None, f"layer {layer.name!r} is a {type(layer).__name__} ({why})"
    return (rule if rule is not None else AutodiffRule(node, why)), None


def rules_tensor(plan, x, signal=None):
    """(n, l, m) Jacobian of batch ``x`` by the plan's rules (use
    :meth:`Plan.tensor`, which refuses inputs the plan was not checked on).

    ``signal(y)``, when given, returns the signal to start from instead of
    the identity: ``(n, r, *output_shape)``, giving (n, r, m) - with r = 1 and
    the derivative of a per-sample loss, the per-sample gradients. It may be
    a :class:`LogitsSignal` (the derivative at the top layer's logits).

    Args:
        plan: a :class:`Plan`.
        x: a batch of n samples (a tensor).
        signal: None, or a function from the outputs, shape
            ``(n, *output_shape)``, to the signal.

    Returns:
        A tensor of shape (n, l, m), or (n, r, m) with ``signal``.

    Raises:
        LogitsNotOnRules: a :class:`LogitsSignal` and a top rule that cannot
            start from it.
    """
    blocks = Blocks()

    def write(step, saved, delta, wanted, need_signal):
        found, below = step.backward(saved, delta, wanted, need_signal)
        blocks.update(found)
        return below

    n_samples, n_outputs, dtype = _walk_backward(plan, x, signal, write)
    return place_blocks(blocks, plan.variables, n_samples, n_outputs, dtype)


def rules_squared_norms(plan, x, signal):
    """(n, r): the squared norm of each sample's ``J_i.T s_i`` for each of
    the r rows of its signal - per-sample gradient norms, squared, without
    the gradients where the rules know how (:meth:`Rule.backward_norms`).
    Use :meth:`Plan.squared_norms`, which refuses unchecked inputs.

    Args:
        plan: a :class:`Plan`.
        x: a batch of n samples (a tensor).
        signal: a function from the outputs to the signal, as for
            :func:`rules_tensor`.

    Returns:
        A tensor of shape (n, r).
    """
    total = []

    def add(step, saved, delta, wanted, need_signal):
        squared, below = step.backward_norms(saved, delta, wanted, need_signal)
        if squared is not None:
            total.append(squared)
        return below

    n_samples, n_outputs, dtype = _walk_backward(plan, x, signal, add)
    if not total:
        return tf.zeros([n_samples, n_outputs], dtype)
    return tf.add_n(total)


def _walk_backward(plan, x, signal, visit):
    """The forward pass, then the layers from the top down: ``visit(step,
    saved, delta, wanted, need_signal)`` for each, returning the signal below.

    Returns:
        ``(n, l or r, dtype)``.
    """
    a, saved = x, []
    for step in plan.steps:
        a, kept = step.forward(a)
        saved.append(kept)
    n_samples = tf.shape(a)[0]
    at_logits = False
    if signal is not None:
        delta = signal(a)
        at_logits = isinstance(delta, LogitsSignal)
        if at_logits:
            delta = delta.delta
            if not plan.steps[-1].takes_logits_signal:
                raise LogitsNotOnRules(plan.steps[-1].describe())
        n_outputs = tf.shape(delta)[1]
    else:
        out_shape = a.shape[1:]
        n_outputs = int(np.prod(out_shape, dtype=np.int64))
        # one identity for every sample, broadcast only where a rule needs it
        delta = tf.reshape(tf.eye(n_outputs, dtype=a.dtype), [1, n_outputs, *out_shape])
    for j in reversed(range(plan.lowest, len(plan.steps))):
        step = plan.steps[j]
        delta = signal_for(step, delta, plan.wanted[j], n_samples)
        if at_logits:
            delta, at_logits = LogitsSignal(delta), False
        delta = visit(step, saved[j], delta, plan.wanted[j], j > plan.lowest)
    return n_samples, n_outputs, a.dtype


def signal_for(step, delta, wanted, n_samples):
    """The signal a step takes: ``delta`` ``(1 or n, l, *output_shape)`` with one
    row per sample, unless the step takes a shared signal and writes no blocks.

    Args:
        step: the step's rule.
        delta: the signal, shape ``(1 or n, l, *output_shape)``.
        wanted: the step's wanted variables.
        n_samples: n.

    Returns:
        ``delta``, broadcast to ``(n, l, *output_shape)`` where it must be.
    """
    if wanted or not step.shared_signal:
        return tf.broadcast_to(delta, tf.concat([[n_samples], tf.shape(delta)[1:]], 0))
    return delta


def place_blocks(blocks, variables, n_samples, n_outputs, dtype):
    """(n, l, m): the blocks in the columns of ``variables``, in that order.

    Args:
        blocks: :class:`~jacutil.rules.registry.Blocks`, each (n, l, size), a
            joint block (kernel, bias) the kernel's columns then the bias's.
        variables: the Jacobian's columns, in order (m entries in all).
        n_samples, n_outputs: n and l.
        dtype: the Jacobian's dtype.

    Returns:
        The (n, l, m) Jacobian. A joint block lies whole where its variables
        are adjacent in ``variables`` (in its order) and is split otherwise;
        a variable without a block (the outputs do not use it) gets zeros.
    """
    position = {id(v): i for i, v in enumerate(variables)}
    at = {}  # position of the first variable -> (how many variables, block)
    for key, block in blocks.items():
        places = [position[id(v)] for v in key]
        if places == list(range(places[0], places[0] + len(places))):
            at[places[0]] = (len(key), block)
            continue
        parts = tf.split(block, [size_of(v) for v in key], axis=2)
        for place, part in zip(places, parts, strict=True):
            at[place] = (1, part)
    parts, i = [], 0
    while i < len(variables):
        if i in at:
            count, block = at[i]
            parts.append(block)
            i += count
        else:  # a variable the outputs do not use: zeros
            size = size_of(variables[i])
            parts.append(tf.zeros([n_samples, n_outputs, size], dtype))
            i += 1
    if not parts:
        return tf.zeros([n_samples, n_outputs, 0], dtype)
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=2)


class LogitsNotOnRules(Exception):
    """The loss reads logits that the top rule cannot start from."""


SAMPLES_CHECKED = 8  # samples on which the rules are proved, spread over the batch


def disagreement(plan, target, x, seed=0):
    """None if the rules agree with autodiff on several samples, else the reason.

    Up to ``SAMPLES_CHECKED`` samples, spread evenly over the batch, each
    compared alone: one vector-Jacobian product ``J_i.T @ w_i`` for random
    weights ``w_i`` of its outputs, by the rules and by a tape of its own.
    Any difference between the two Jacobians shows (almost surely) in it.
    The rules' norms of that product (:func:`rules_squared_norms`, which
    may not form it) are checked against its norm too.

    Args:
        plan: a :class:`Plan`.
        target: the :class:`jacutil.core.target.Target` (autodiff's side).
        x: a checked batch.
        seed: the seed of the random weights.

    Returns:
        None, or why the rules disagree (a ``str``).
    """
    rows = int(n_samples(x))
    picked = np.unique(np.linspace(0, rows - 1, min(rows, SAMPLES_CHECKED)).round())
    picked = [int(i) for i in picked]
    chosen = tf.nest.map_structure(lambda t: tf.gather(t, picked), x)
    J = rules_tensor(plan, chosen)  # (k, l, m)
    w = tf.random.stateless_normal(J.shape[:2], [seed, 1], dtype=J.dtype)
    hand = tf.einsum("ikm,ik->im", J, w).numpy()
    tolerance = (1e-4 if J.dtype == tf.float32 else 1e-9) * np.sqrt(J.shape[1])
    at_output = lambda y: tf.reshape(w, [len(picked), 1, *y.shape[1:]])  # noqa: E731
    squared = rules_squared_norms(plan, chosen, at_output)[:, 0].numpy()
    sources = [watched(v) for v in target.variables]
    for row, i in enumerate(picked):
        with tf.GradientTape() as tape:
            target.watch(tape)
            y = target.forward(take(x, i, i + 1))[0]
            score = tf.reduce_sum(w[row] * y)
        grads = tape.gradient(score, sources)
        auto = joined_gradients(grads, sizes_of(target.variables), J.dtype).numpy()
        scale = max(1.0, float(np.abs(auto).max(initial=0)))
        error = (
            float(np.abs(hand[row] - auto).max())
            if hand[row].shape == auto.shape
            else np.inf
        )
        if not error <= tolerance * scale:
            return (
                f"the layer rules differ from autodiff by {error:.3g} on sample "
                f"{i}: the model computes something its layers do not say"
            )
        expected = float(auto @ auto)  # the norms without the gradients, squared
        error = abs(float(squared[row]) - expected)
        if not error <= tolerance * max(1.0, expected):
            return (
                f"the layer rules' gradient norms differ from autodiff's by "
                f"{error:.3g} (squared) on sample {i}: a rule's norms are wrong"
            )
    return None
