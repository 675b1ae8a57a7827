"""The plan (which rule runs each layer) and the Jacobian it computes.

One forward pass through the layers keeps what each rule needs; then, from
the outputs down, each layer's rule turns the per-sample signal into its
blocks of columns and the signal of the layer below, and stops below the
lowest layer that holds a wanted variable. No tape over the whole model and
no pfor, except inside a layer that has no rule and holds wanted variables.

A chain of layers is a graph of one path. A functional model with branches
(residual blocks, several inputs or outputs, nested models opened inline) is
walked into nodes in topological order (:func:`graph_nodes`); its
:class:`Wiring` says which tensors each step reads and writes. The forward
pass fills a map tensor -> value; the backward pass starts each output with
its rows of the identity, sums the signals of a tensor read by several steps,
and skips the branches that hold no wanted variable.
"""

from dataclasses import dataclass, field

import numpy as np

from ..core._grouped import convolutions_by_group
from ..core._shared import joined_gradients, size_of, sizes_of
from ..core._tf import keras, tf
from ..core.batch import n_samples, signature_key, take
from ..core.formulation import pfor_log
from ..core.internals import calls_of, made_by, takes_training
from ..core.target import watched
from .autodiff import AutodiffRule
from .merge import MERGE_RULES
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
    """One call in a model: an operation (a Keras layer, or a ``keras.ops``
    call such as ``h * 2`` or ``a + b``) and the arguments it was called with.

    Calling the node replays that call on tensors, in inference mode: each
    symbolic input is replaced by its value, every other argument is kept.

    Args:
        operation: a Keras layer or operation.
        args: the positional arguments it was called with (None: the input
            tensor alone).
        kwargs: its keyword arguments (``training`` is dropped).
        inputs: its symbolic inputs (Keras tensors), in the order the values
            are given to :meth:`__call__` (None: one input, wherever it is).
    """

    def __init__(self, operation, args=None, kwargs=None, inputs=None):
        self.operation = operation
        self.args = args  # None: called with the tensor alone
        self.kwargs = dict(kwargs or {})
        self.kwargs.pop("training", None)  # the model's call sets it (below)
        self.inputs = None if inputs is None else list(inputs)

    @property
    def name(self):
        """The operation's name (a ``str``)."""
        return self.operation.name

    @property
    def n_inputs(self):
        """How many tensors the call takes (an ``int``)."""
        return 1 if self.inputs is None else len(self.inputs)

    def extra_arguments(self):
        """The arguments besides the input tensors, in words ("" if none).

        Returns:
            A ``str``.
        """
        others = [repr(a) for a in self.args or () if not _all_symbolic(a)]
        others += [f"{key}={value!r}" for key, value in self.kwargs.items()]
        return ", ".join(others)

    def __call__(self, *values):
        """Replay the call on ``values``, in inference mode.

        Args:
            *values: the input tensors, one per symbolic input (in the order
                of ``inputs``), each of shape ``(n, *input_shape)``.

        Returns:
            The operation's output tensor.
        """
        if self.args is None:
            args, kwargs = values, dict(self.kwargs)
        else:
            if self.inputs is None:
                value_of = lambda _: values[0]  # noqa: E731
            else:
                by_id = {id(t): v for t, v in zip(self.inputs, values, strict=True)}
                value_of = lambda t: by_id[id(t)]  # noqa: E731
            args = _filled(self.args, value_of)
            kwargs = _filled(self.kwargs, value_of)
        if takes_training(self.operation):
            kwargs["training"] = False
        with convolutions_by_group():  # see jacutil.core._grouped
            return self.operation(*args, **kwargs)


def _symbolic(value):
    return isinstance(value, keras.KerasTensor)


def _all_symbolic(value):
    """Whether ``value`` is a Keras tensor, or a list of them (a merge's input)."""
    leaves = tf.nest.flatten(value)
    return bool(leaves) and all(_symbolic(leaf) for leaf in leaves)


def _filled(arguments, value_of):
    """``arguments`` with every symbolic tensor ``t`` replaced by ``value_of(t)``."""
    if _symbolic(arguments):
        return value_of(arguments)
    if isinstance(arguments, dict):
        return {key: _filled(value, value_of) for key, value in arguments.items()}
    if isinstance(arguments, (list, tuple)):
        return type(arguments)(_filled(value, value_of) for value in arguments)
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
        operation, _, tensor_index = made_by(tensor)
        if isinstance(operation, _INPUT):
            break
        nodes = calls_of(operation)
        if len(nodes) != 1 or len(nodes[0].input_tensors) != 1:
            return None  # shared layers or several inputs
        if tensor_index != 0 or len(nodes[0].outputs) != 1:
            return None  # one output of several
        arguments = nodes[0].arguments
        chain.append(
            Node(operation, arguments.args, arguments.kwargs, nodes[0].input_tensors)
        )
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


class NotAGraph(Exception):
    """The model's graph is beyond the plan (the message says why)."""


@dataclass(frozen=True)
class Wiring:
    """Which tensors each step reads and writes, as keys of a map tensor -> value.

    Args:
        inputs: per step, the keys of its inputs, in the order its rule takes them.
        outputs: per step, the key of its output.
        model_inputs: the keys of the batch's inputs, in ``tf.nest.flatten``
            order (a dict's keys sorted), as ``jacutil.core.batch`` arranges x.
        model_outputs: the keys of the model's outputs, in ``tf.nest.flatten``
            order: the rows of the Jacobian (``jacutil.core.outputs``).
    """

    inputs: tuple
    outputs: tuple
    model_inputs: tuple
    model_outputs: tuple

    @classmethod
    def chain(cls, n_steps):
        """Step j reads tensor j and writes tensor j + 1.

        Args:
            n_steps: the number of steps.

        Returns:
            A :class:`Wiring`.
        """
        inputs = tuple((j,) for j in range(n_steps))
        return cls(inputs, tuple(range(1, n_steps + 1)), (0,), (n_steps,))

    def producers(self):
        """``{key: step}``: the step that writes each tensor (inputs have none).

        Returns:
            A ``dict``.
        """
        return {key: j for j, key in enumerate(self.outputs)}

    def readers(self):
        """``{key: count}``: how many step inputs and model outputs read each tensor.

        Returns:
            A ``dict``.
        """
        count = {}
        for key in [k for keys in self.inputs for k in keys] + list(self.model_outputs):
            count[key] = count.get(key, 0) + 1
        return count


def graph_nodes(model):
    """The calls of a functional model as a graph, nested models opened inline.

    Args:
        model: an exact Keras model (:func:`is_exact_keras`).

    Returns:
        ``(nodes, wiring)``: the :class:`Node` of each call in topological
        order (inputs first) and the :class:`Wiring` between them, the keys
        the ids of the Keras tensors.

    Raises:
        NotAGraph: a layer is used twice or gives several outputs, or the
            model's inputs and outputs cannot be read.
    """
    return _GraphWalk(model).run()


def _declared(model, nest, flat):
    """A model's inputs (or outputs) in ``tf.nest.flatten`` order: from the
    nest it declares, or (a Sequential never called) its flat list."""
    for attribute in (nest, flat):
        try:
            return tf.nest.flatten(getattr(model, attribute))
        except (AttributeError, ValueError) as error:
            reason = error
    raise NotAGraph(f"its {flat} are not known ({reason})")


class _GraphWalk:
    """Walks a model's graph from its outputs to its inputs (:func:`graph_nodes`)."""

    def __init__(self, model):
        self.inputs = _declared(model, "input", "inputs")
        self.outputs = _declared(model, "output", "outputs")
        self.alias = {}  # id of a Keras tensor -> the tensor it stands for
        self.opened = set()  # ids of the nested models opened
        self.model_input_ids = {id(t) for t in self.inputs}

    def run(self):
        outputs = [self.resolve(t) for t in self.outputs]
        nodes, inputs, written = [], [], []
        done, used = set(), {}  # ids of the Keras nodes emitted; op id -> node id
        stack = [(t, False) for t in reversed(outputs)]
        while stack:
            tensor, ready = stack.pop()
            operation, keras_node, _ = made_by(tensor)
            if isinstance(operation, _INPUT):
                if id(tensor) not in self.model_input_ids:
                    raise NotAGraph(f"input {tensor.name!r} is not the model's")
                continue
            if id(keras_node) in done:
                continue
            sources = [self.resolve(t) for t in keras_node.input_tensors]
            if not ready:
                stack.append((tensor, True))
                stack += [(t, False) for t in reversed(sources)]
                continue
            if used.setdefault(id(operation), id(keras_node)) != id(keras_node):
                raise NotAGraph("a layer is used more than once")
            if len(keras_node.outputs) != 1:
                raise NotAGraph(f"layer {operation.name!r} gives several outputs")
            done.add(id(keras_node))
            arguments = keras_node.arguments
            nodes.append(
                Node(
                    operation, arguments.args, arguments.kwargs,
                    keras_node.input_tensors,
                )
            )  # fmt: skip
            inputs.append(tuple(id(t) for t in sources))
            written.append(id(tensor))
        wiring = Wiring(
            tuple(inputs),
            tuple(written),
            tuple(id(t) for t in self.inputs),
            tuple(id(t) for t in outputs),
        )
        return nodes, wiring

    def canonical(self, tensor):
        while id(tensor) in self.alias:
            tensor = self.alias[id(tensor)]
        return tensor

    def resolve(self, tensor):
        """The tensor ``tensor`` stands for, past the bounds of nested models."""
        while True:
            tensor = self.canonical(tensor)
            operation, keras_node, _ = made_by(tensor)
            if not (isinstance(operation, keras.Model) and is_exact_keras(operation)):
                return tensor
            self.open(operation, keras_node)

    def open(self, model, keras_node):
        """Wire a nested model's inputs and outputs to the tensors of its call."""
        if id(model) in self.opened:
            raise NotAGraph("a layer is used more than once")
        self.opened.add(id(model))
        arguments = keras_node.arguments
        extra = [repr(a) for a in arguments.args if not _all_symbolic(a)]
        extra += [
            f"{key}={value!r}" for key, value in arguments.kwargs.items()
            if value is not None and key != "training"
        ]  # fmt: skip
        if extra:
            raise NotAGraph(f"model {model.name!r} is called with {', '.join(extra)}")
        try:
            inner_inputs, inner_outputs = list(model.inputs), list(model.outputs)
        except (AttributeError, ValueError) as error:
            raise NotAGraph(f"model {model.name!r} has no graph ({error})") from None
        outer_inputs, outer_outputs = keras_node.input_tensors, keras_node.outputs
        if len(inner_inputs) != len(outer_inputs) or len(inner_outputs) != len(
            outer_outputs
        ):
            raise NotAGraph(f"model {model.name!r} is called with other inputs")
        for inner, outer in zip(inner_inputs, outer_inputs, strict=True):
            self.alias[id(inner)] = outer
        for inner, outer in zip(inner_outputs, outer_outputs, strict=True):
            self.alias[id(outer)] = inner


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
        steps: a rule (:class:`jacutil.rules.registry.Rule`) per node, in
            topological order (input to output).
        wanted: per step, the :class:`jacutil.rules.registry.Wanted` variables
            it writes blocks for.
        variables: the Jacobian's m columns' variables, in order.
        lowest: the lowest step holding a wanted variable.
        checked: the input signatures the plan was proved on.
        wiring: which tensors each step reads and writes (a :class:`Wiring`);
            None for a chain, each step reading the one before.
    """

    steps: list  # a Rule per node, in topological order
    wanted: list  # per step: the Wanted variables it writes blocks for
    variables: list  # the Jacobian's columns, in order (the engine places blocks)
    lowest: int  # the lowest step holding a wanted variable
    checked: set = field(default_factory=set)  # input signatures proved
    wiring: Wiring = None  # None: a chain

    def __post_init__(self):
        if self.wiring is None:
            self.wiring = Wiring.chain(len(self.steps))

    @property
    def top(self):
        """The step that writes the model's only output (None for several)."""
        outputs = self.wiring.model_outputs
        return self.wiring.producers().get(outputs[0]) if len(outputs) == 1 else None

    def needs_signal(self):
        """``{key: bool}``: whether a tensor depends on a wanted variable (then
        its signal is needed below it).

        Returns:
            A ``dict`` over every tensor's key.
        """
        depends = dict.fromkeys(self.wiring.model_inputs, False)
        for j, keys in enumerate(self.wiring.inputs):
            below = any(depends.get(key, False) for key in keys)
            depends[self.wiring.outputs[j]] = below or bool(self.wanted[j])
        return depends

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

    def squared_columns(self, x, signal):
        """:func:`rules_squared_columns` of a batch like one the plan was checked on.

        Args:
            x: a batch of n samples, of a shape the plan was checked on.
            signal: as for :func:`rules_tensor`.

        Returns:
            A tensor of shape (m,).

        Raises:
            UncheckedPlan: the plan was not checked on inputs of this shape.
        """
        self._refuse_unchecked(x)
        return rules_squared_columns(self, x, signal)

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
    nodes, wiring = chain_nodes(model), None
    if not nodes or any(is_exact_keras(node.operation) for node in nodes):
        try:  # branches, several inputs or outputs, nested models: a graph
            nodes, wiring = graph_nodes(model)
        except NotAGraph as reason:
            return None, str(reason)
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
    lowest = min(owner.values())
    return Plan(steps, wanted, list(variables), lowest, wiring=wiring), None


def _step_for(node, dtype):
    """The rule of one node, or ``(None, reason)`` when the plan cannot take it."""
    layer = node.operation
    several = node.n_inputs > 1
    if not isinstance(layer, keras.Layer):  # keras.ops between layers
        kind = type(layer).__name__
        why = f"{kind}, an operation between layers"
        return AutodiffRule(node, why, several_inputs=several), None
    if layer.weights and layer.compute_dtype != dtype:
        return None, f"layer {layer.name!r} computes in {layer.compute_dtype}"
    if getattr(layer, "mask_zero", False) or isinstance(layer, keras.layers.Masking):
        return None, f"layer {layer.name!r} makes a mask (the rules ignore masks)"
    if type(layer) in MERGE_RULES:
        rule, why = rule_for(layer, MERGE_RULES)
        if rule is not None and not _takes_its_inputs_as_a_list(node):
            rule, why = None, "called with more than the list of its inputs"
    else:
        rule, why = rule_for(layer)
        if rule is not None and several:
            rule, why = None, f"called with {node.n_inputs} tensors"
    extra = node.extra_arguments()
    if rule is not None and extra:
        rule, why = None, f"called with {extra}, which its rule does not read"
    if rule is None and isinstance(layer, NOT_IN_A_CHAIN):
        return None, f"layer {layer.name!r} is a {type(layer).__name__} ({why})"
    if rule is None:
        rule = AutodiffRule(node, why, several_inputs=several)
    return rule, None


def _takes_its_inputs_as_a_list(node):
    """Whether a merge layer's node is ``layer([t_1, ..., t_k])``, the list in the
    order of the node's inputs (what a merge rule takes)."""
    args = node.args or ()
    if len(args) != 1 or node.kwargs or not isinstance(args[0], (list, tuple)):
        return False
    return node.inputs is not None and [id(t) for t in args[0]] == [
        id(t) for t in node.inputs
    ]


def rules_tensor(plan, x, signal=None):
    """(n, l, m) Jacobian of batch ``x`` by the plan's rules (use
    :meth:`Plan.tensor`, which refuses inputs the plan was not checked on).

    ``signal(y)``, when given, returns the signal to start from instead of
    the identity: ``(n, r, *output_shape)``, giving (n, r, m) - with r = 1 and
    the derivative of a per-sample loss, the per-sample gradients. It may be
    a :class:`LogitsSignal` (the derivative at the top layer's logits). A
    model of several outputs takes :class:`OutputRows` (a signal on the l
    rows), not a function.

    Args:
        plan: a :class:`Plan`.
        x: a batch of n samples: a tensor, or a list or dict of them as
            ``jacutil.core.batch.as_batch`` arranges several inputs.
        signal: None, a function from the output, shape
            ``(n, *output_shape)``, to the signal, or :class:`OutputRows`.

    Returns:
        A tensor of shape (n, l, m), or (n, r, m) with ``signal``.

    Raises:
        LogitsNotOnRules: a :class:`LogitsSignal` and a top rule that cannot
            start from it; or (:class:`SignalOnSeveralOutputs`) a signal
            function on a model of several outputs.
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
        x: a batch of n samples, as for :func:`rules_tensor`.
        signal: a function from the output to the signal, or
            :class:`OutputRows`, as for :func:`rules_tensor`.

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


def rules_squared_columns(plan, x, signal):
    """(m,): the squares of ``J_i.T s_ir`` summed over samples i and signal
    rows r - G's exact diagonal when the rows are the columns of a square
    root of each ``H_i`` (notebook 11) - without the blocks where the rules
    know how (:meth:`Rule.backward_squares`). Use :meth:`Plan.squared_columns`,
    which refuses unchecked inputs.

    Args:
        plan: a :class:`Plan`.
        x: a batch of n samples, as for :func:`rules_tensor`.
        signal: None (the identity), a function from the output to the
            signal, or :class:`OutputRows`, as for :func:`rules_tensor`.

    Returns:
        A tensor of shape (m,).
    """
    squares = Blocks()

    def add(step, saved, delta, wanted, need_signal):
        found, below = step.backward_squares(saved, delta, wanted, need_signal)
        squares.update(found)
        return below

    _, _, dtype = _walk_backward(plan, x, signal, add)
    shaped = Blocks((key, column[None, None]) for key, column in squares.items())
    return tf.reshape(place_blocks(shaped, plan.variables, 1, 1, dtype), [-1])


def _walk_backward(plan, x, signal, visit):
    """The forward pass, then the steps from the outputs down, in reverse
    topological order: ``visit(step, saved, delta, wanted, need_signal)`` for
    each step above a wanted variable, returning the signal below (a list for
    a step of several inputs). Where a tensor feeds several steps, their
    signals are summed.

    Returns:
        ``(n, l or r, dtype)``.
    """
    wiring = plan.wiring
    leaves = tf.nest.flatten(x)
    if len(leaves) != len(wiring.model_inputs):
        raise ValueError(
            f"the plan takes {len(wiring.model_inputs)} inputs; got {len(leaves)}"
        )
    values = dict(zip(wiring.model_inputs, leaves, strict=True))
    saved = []
    for step, keys, key in zip(plan.steps, wiring.inputs, wiring.outputs, strict=True):
        inputs = [values[k] for k in keys]
        values[key], kept = step.forward(inputs if step.several_inputs else inputs[0])
        saved.append(kept)
    outputs = [values[key] for key in wiring.model_outputs]
    n_samples = tf.shape(leaves[0])[0]
    signals, n_outputs, at_logits = _starting_signals(plan, outputs, signal)
    depends = plan.needs_signal()
    for j in reversed(range(len(plan.steps))):
        step, key = plan.steps[j], wiring.outputs[j]
        delta = signals.pop(key, None)
        if not depends[key] or delta is None:
            continue  # nothing wanted at or below it, or no output reads it
        delta = signal_for(step, delta, plan.wanted[j], n_samples)
        if at_logits and j == plan.top:
            delta = LogitsSignal(delta)
        need = [depends[k] for k in wiring.inputs[j]]
        if step.several_inputs:
            below = visit(step, saved[j], delta, plan.wanted[j], need)
        else:
            below = [visit(step, saved[j], delta, plan.wanted[j], need[0])]
        for k, part, needed in zip(wiring.inputs[j], below, need, strict=True):
            if needed and part is not None:
                signals[k] = part if k not in signals else signals[k] + part
    return n_samples, n_outputs, outputs[0].dtype


@dataclass(frozen=True)
class OutputRows:
    """A signal on the l output rows of every sample, in the order of
    ``jacutil.core.outputs`` (each output flattened, in ``tf.nest.flatten``
    order): ``rows`` of shape (1 or n, r, l).

    Args:
        rows: the signal, shape ``(1 or n, r, l)``.
    """

    rows: object


def _starting_signals(plan, outputs, signal):
    """``({key: signal}, r, at_logits)``: each model output's starting signal."""
    at_logits = False
    if signal is None or isinstance(signal, OutputRows):
        sizes = [int(np.prod(y.shape[1:], dtype=np.int64)) for y in outputs]
        if signal is None:  # one identity for every sample, broadcast where needed
            rows = tf.eye(sum(sizes), dtype=outputs[0].dtype)[None]
            n_outputs = sum(sizes)
        else:
            rows = signal.rows
            n_outputs = tf.shape(rows)[1]
        parts = tf.split(rows, sizes, axis=2) if len(sizes) > 1 else [rows]
        deltas = [
            tf.reshape(part, tf.concat([tf.shape(part)[:2], y.shape[1:]], 0))
            for part, y in zip(parts, outputs, strict=True)
        ]
    else:
        if len(outputs) != 1:
            raise SignalOnSeveralOutputs(
                f"a signal function on a model of {len(outputs)} outputs"
            )
        delta = signal(outputs[0])
        at_logits = isinstance(delta, LogitsSignal)
        if at_logits:
            delta = delta.delta
            top = plan.top
            only_reader = plan.wiring.readers().get(plan.wiring.model_outputs[0]) == 1
            if top is None or not only_reader:
                raise LogitsNotOnRules("the output is not written by one layer")
            if not plan.steps[top].takes_logits_signal:
                raise LogitsNotOnRules(plan.steps[top].describe())
        deltas, n_outputs = [delta], tf.shape(delta)[1]
    signals = {}
    for key, delta in zip(plan.wiring.model_outputs, deltas, strict=True):
        signals[key] = delta if key not in signals else signals[key] + delta
    return signals, n_outputs, at_logits


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


class SignalOnSeveralOutputs(LogitsNotOnRules):
    """A signal function on a model of several outputs: the rules start a
    function's signal at one output only (:class:`OutputRows` start anywhere).
    Like :class:`LogitsNotOnRules`, it sends the caller to autodiff."""


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
    squared = rules_squared_norms(plan, chosen, OutputRows(w[:, None]))[:, 0].numpy()
    sources = [watched(v) for v in target.variables]
    for row, i in enumerate(picked):
        with tf.GradientTape() as tape:
            target.watch(tape)
            y = target.forward(take(x, i, i + 1))[0]
            score = tf.reduce_sum(tf.cast(w[row], y.dtype) * y)
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
