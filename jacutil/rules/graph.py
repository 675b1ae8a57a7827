"""The Keras graph, read once: a model's calls as nodes and their wiring.

A chain of layers is a graph of one path (:func:`chain_nodes`,
:func:`chain_layers`). A functional model with branches (residual blocks,
several inputs or outputs, nested models opened inline) is walked into nodes
in topological order (:func:`graph_nodes`); its :class:`Wiring` says which
tensors each step reads and writes. The rules' plan
(``jacutil.rules.plan``) and the peers (``jacutil.peers.network``) both
read models here.
"""

import itertools
import weakref
from collections import Counter
from dataclasses import dataclass

from ..core._grouped import convolutions_by_group
from ..core._tf import keras, tf
from ..core.internals import made_by, sublayers, takes_training


def is_exact_keras(model):
    """Whether ``model`` is a plain ``keras.Sequential`` or functional model,
    or a subclass of one whose ``call`` is still Keras's: a model built
    from ``super().__init__(inputs=..., outputs=...)``, as KerasHub's
    backbones and tasks are. Another subclass's ``call`` may differ from
    its layers. (A plan is proved against the model's own call before use
    either way: ``jacutil.rules.plan.Plan.check``.)"""
    kind = type(model)
    if kind is keras.Sequential:
        return True
    if kind.__name__ == "Functional" and kind.__module__.startswith("keras."):
        return True
    with_call = next((c for c in kind.__mro__ if "call" in c.__dict__), None)
    return (
        with_call is not None
        and with_call.__name__ == "Functional"
        and with_call.__module__.startswith("keras.")
    )


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
        kwargs: its keyword arguments (``training`` is dropped, and so is
            ``mask=None`` or a nest of Nones, which Keras passes to a layer
            that takes a mask where there is none: the call without it is
            the same).
        inputs: its symbolic inputs (Keras tensors), in the order the values
            are given to :meth:`__call__` (None: one input, wherever it is).
    """

    def __init__(self, operation, args=None, kwargs=None, inputs=None):
        self.operation = operation
        self.args = args  # None: called with the tensor alone
        self.kwargs = dict(kwargs or {})
        self.kwargs.pop("training", None)  # the model's call sets it (below)
        if "mask" in self.kwargs and no_mask(self.kwargs["mask"]):
            del self.kwargs["mask"]  # what Keras passes where there is no mask
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
        """The arguments besides the input tensors, in words ("" if none)."""
        others = [repr(a) for a in self.args or () if not _all_symbolic(a)]
        others += [f"{key}={value!r}" for key, value in self.kwargs.items()]
        return ", ".join(others)

    def __call__(self, *values):
        """The operation's output: the call replayed in inference mode on
        ``values``, one ``(n, *input_shape)`` tensor per symbolic input (in
        the order of ``inputs``)."""
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


def no_mask(mask):
    """Whether a ``mask`` argument says nothing: None, or a nest of Nones (a
    model of several inputs, none masked)."""
    return all(m is None for m in tf.nest.flatten(mask))


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
    whose graph (:func:`graph_nodes`, nested models opened) is one path: one
    input, each call taking the tensor before it, the last one's the output.
    """
    if type(model) is keras.Sequential:
        nodes = []
        for layer in model.layers:
            inner = chain_nodes(layer) if is_exact_keras(layer) else [Node(layer)]
            if inner is None:
                return None
            nodes += [n for n in inner if not isinstance(n.operation, _INPUT)]
        return nodes
    if not is_exact_keras(model):
        return None
    try:
        nodes, wiring = graph_nodes(model)
    except NotAGraph:
        return None
    return nodes if wiring.is_path() else None


def chain_layers(model):
    """The model's layers from input to output, or None unless it is a chain
    of layers each called with its input alone (see :func:`chain_nodes`)."""
    nodes = chain_nodes(model)
    if nodes is None or any(
        not isinstance(n.operation, keras.Layer) or n.extra_arguments() for n in nodes
    ):
        return None
    return [n.operation for n in nodes]


_OPENED = weakref.WeakKeyDictionary()  # composite layer -> (inputs, output)


def _opened_graph(layer, keras_node):
    """``(inputs, output)``: the symbolic graph of a composite layer's
    ``call`` on inputs like its node's, or None where it cannot be made."""
    outer_inputs = keras_node.input_tensors
    fresh = [keras.Input(batch_shape=t.shape, dtype=t.dtype) for t in outer_inputs]
    by_id = {id(t): f for t, f in zip(outer_inputs, fresh, strict=True)}
    arguments = keras_node.arguments
    kwargs = {k: v for k, v in arguments.kwargs.items() if k != "training"}
    if takes_training(layer):
        kwargs["training"] = False
    try:
        inner = layer.call(
            *_filled(arguments.args, lambda t: by_id[id(t)]),
            **_filled(kwargs, lambda t: by_id[id(t)]),
        )
    except Exception:  # noqa: BLE001 (its call needs values: it stays whole)
        return None
    if not _symbolic(inner):
        return None
    return fresh, inner


def _composite(layer):
    """Whether ``layer`` is one to open (:meth:`_GraphWalk.open_layer`)."""
    from .merge import MERGE_RULES
    from .registry import RULES

    return (
        isinstance(layer, keras.Layer)
        and not isinstance(layer, keras.Model)
        and not type(layer).__module__.startswith("keras.")
        and type(layer) not in RULES
        and type(layer) not in MERGE_RULES
        and bool(sublayers(layer))
    )


def calls_of_layer(layer):
    """The calls of ``layer`` in functional graphs (its Keras nodes)."""
    from ..core.internals import calls_of

    return calls_of(layer)


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
        """The wiring of ``n_steps`` in a chain: step j reads tensor j and
        writes tensor j + 1."""
        inputs = tuple((j,) for j in range(n_steps))
        return cls(inputs, tuple(range(1, n_steps + 1)), (0,), (n_steps,))

    def is_path(self):
        """Whether the steps are one path: one input, each step reading the
        tensor before it, the last step's the only output (a ``bool``)."""
        tensors = self.model_inputs + self.outputs
        return (
            len(self.model_inputs) == 1
            and self.model_outputs == tensors[-1:]
            and self.inputs == tuple((key,) for key in tensors[:-1])
        )

    def producers(self):
        """``{key: step}``: the step that writes each tensor (inputs have none)."""
        return {key: j for j, key in enumerate(self.outputs)}

    def readers(self):
        """``{key: count}``: how many step inputs and model outputs read each tensor."""
        return Counter(itertools.chain(*self.inputs, self.model_outputs))


def graph_nodes(model, shared=False):
    """The calls of an exact Keras model (:func:`is_exact_keras`) as a graph,
    nested models opened inline: ``(nodes, wiring)``, the :class:`Node` of each
    call in topological order (inputs first) and the :class:`Wiring` between
    them, the keys the ids of the Keras tensors.

    With ``shared``, a layer called twice gives a node per call
    (:func:`jacutil.rules.plan.plan_for` takes it only when none of its
    variables is differentiated); else it is refused, as every reader that
    takes a node's layer for its own variables needs.

    Raises:
        NotAGraph: a layer is used twice (without ``shared``), a nested model
            is used twice, a layer gives several outputs, or the model's
            inputs and outputs cannot be read.
    """
    nodes, wiring = _GraphWalk(model).run()
    if not shared and len({id(n.operation) for n in nodes}) != len(nodes):
        raise NotAGraph("a layer is used more than once")
    return nodes, wiring


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
        done = set()  # ids of the Keras nodes emitted (a layer used twice: two)
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
        """The tensor ``tensor`` stands for, past the bounds of nested models
        and of composite layers opened (:meth:`open_layer`)."""
        while True:
            tensor = self.canonical(tensor)
            operation, keras_node, _ = made_by(tensor)
            if isinstance(operation, keras.Model) and is_exact_keras(operation):
                self.open(operation, keras_node)
            elif not self.open_layer(operation, keras_node):
                return tensor

    def open_layer(self, layer, keras_node):
        """Open a composite layer: one of neither Keras nor a rule, whose
        ``call`` uses layers of its own (KerasHub's ``TransformerEncoder``,
        your own block). Its ``call`` runs on symbolic inputs like its
        node's, so that its sublayers and ``keras.ops`` record a graph, wired
        in as a nested model's; their rules then apply. Whether it was
        opened (a ``bool``): a layer called twice, with several outputs, or
        whose ``call`` cannot run on Keras tensors stays whole (autodiff).
        The plan's check proves the forward pass the same."""
        if not _composite(layer) or id(layer) in self.opened:
            return False
        outer_inputs, outer_outputs = keras_node.input_tensors, keras_node.outputs
        if len(outer_outputs) != 1 or len(calls_of_layer(layer)) != 1:
            return False
        if layer not in _OPENED:  # once: each opening adds calls to its sublayers
            _OPENED[layer] = _opened_graph(layer, keras_node)
        if _OPENED[layer] is None:
            return False
        fresh, inner = _OPENED[layer]
        self.opened.add(id(layer))
        for f, outer in zip(fresh, outer_inputs, strict=True):
            self.alias[id(f)] = outer
        self.alias[id(outer_outputs[0])] = inner
        return True

    def open(self, model, keras_node):
        """Wire a nested model's inputs and outputs to the tensors of its call."""
        if id(model) in self.opened:
            raise NotAGraph("a layer is used more than once")
        self.opened.add(id(model))
        arguments = keras_node.arguments
        extra = [repr(a) for a in arguments.args if not _all_symbolic(a)]
        extra += [
            f"{key}={value!r}" for key, value in arguments.kwargs.items()
            if key != "training" and not (key == "mask" and no_mask(value))
            and value is not None
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
            if inner is not outer:  # on its own inputs (KerasHub's tasks): as is
                self.alias[id(inner)] = outer
        for inner, outer in zip(inner_outputs, outer_outputs, strict=True):
            self.alias[id(outer)] = inner
