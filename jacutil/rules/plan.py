"""The plan: which rule runs each step of a model's graph, checked before use.

:func:`plan_for` reads the model's graph (``jacutil.rules.graph``), gives
each node its rule and marks the wanted variables; :meth:`Plan.check` proves
the plan against autodiff (``jacutil.rules.verify``) before its walks
(``jacutil.rules.walk``) give any number.
"""

import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from ..core._tf import keras
from ..core.batch import signature_key
from ..core.formulation import XLA_ERRORS, first_line, pfor_log
from ..core.precision import as_float64, float64_copy
from ..core.target import resolve_target
from .autodiff import AutodiffRule
from .graph import NotAGraph, Wiring, chain_nodes, graph_nodes, is_exact_keras
from .merge import MERGE_RULES
from .registry import Wanted, rule_for
from .verdicts import CheckReport, prove_layers
from .verify import disagreement, first_difference, relative_error, spread_samples
from .walk import (
    rules_squared_columns,
    rules_squared_norms,
    rules_tensor,
    rules_weighted_sums,
)

# Left to the compiled per-sample stage: pfor unrolls their time loop
# (jacutil.core.formulation), and attention's products need XLA in TF 2.21.
NOT_IN_A_CHAIN = (
    keras.layers.RNN, keras.layers.LSTM, keras.layers.GRU,
    keras.layers.SimpleRNN, keras.layers.Bidirectional,
    keras.layers.MultiHeadAttention, keras.layers.EinsumDense,
)  # fmt: skip


SAME_OUTPUTS = 0.01  # a float64 copy whose outputs differ more is another model


class UncheckedPlan(RuntimeError):
    """A plan was used for inputs it was not checked on (a bug in jacutil)."""


def _on_checked_inputs(walk, shape):
    """The :class:`Plan` method named after ``walk`` (``rules_tensor``:
    ``tensor``): ``walk(plan, x, signal)`` of a batch like one the plan was
    checked on, refusing any other. The one owner of that refusal."""

    def method(self, x, signal=None):
        if signature_key(x) not in self.checked:
            raise UncheckedPlan(
                "the layer rules were not checked on inputs of this shape: "
                "call plan.check(target, x) first"
            )
        return walk(self, x, signal)

    name = walk.__name__.removeprefix("rules_")
    method.__name__, method.__qualname__ = name, f"Plan.{name}"
    method.__doc__ = f"""
    :func:`{walk.__name__}` of a batch like one the plan was checked on.

    Args:
        x: a batch of n samples, of a shape the plan was checked on.
        signal: as for :func:`rules_tensor`.

    Returns:
        A tensor of shape {shape}.

    Raises:
        UncheckedPlan: the plan was not checked on inputs of this shape.
    """
    return method


@dataclass
class Plan:
    """The rule of each layer, and which of its variables are columns.

    A plan is used only on inputs it has been checked on: :meth:`check`
    compares its Jacobian with autodiff, sample by sample, once per input
    shape, and :meth:`tensor` refuses any other. No consumer can take the
    rules' numbers without that proof.
    """

    steps: list  # a Rule per node, in topological order (input to output)
    wanted: list  # per step: the Wanted variables it writes blocks for
    variables: list  # the Jacobian's m columns, in order (the walk places blocks)
    lowest: int  # the lowest step holding a wanted variable
    checked: set = field(default_factory=set)  # input signatures proved
    wiring: Wiring = None  # which tensors each step reads, writes; None: a chain
    model: object = None  # a weak reference to the Keras model, or None
    nodes: list = None  # the graph's Node of each step (its call, replayed)
    shared: frozenset = frozenset()  # ids of variables of a layer called twice
    report: CheckReport = field(default_factory=CheckReport)  # the last check

    def __post_init__(self):
        if self.wiring is None:
            self.wiring = Wiring.chain(len(self.steps))

    @property
    def top(self):
        """The step that writes the model's only output (None for several)."""
        outputs = self.wiring.model_outputs
        return self.wiring.producers().get(outputs[0]) if len(outputs) == 1 else None

    def needs_signal(self):
        """``{key: bool}`` over every tensor: whether it depends on a wanted
        variable (then its signal is needed below it)."""
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
        """``[(layer name, rule)]`` per step, e.g. ``("conv2d", "conv2d+relu")``."""
        return [(step.layer.name, step.describe()) for step in self.steps]

    def describe(self):
        """The rules in words: ``"layer rules: dense+relu, dense"`` (a ``str``)."""
        return "layer rules: " + ", ".join(rule for _, rule in self.layers())

    def check(self, target, x):
        """None when the rules agree with autodiff (``target``, a
        :class:`jacutil.core.target.Target`) on the samples of ``x`` (a checked
        batch), else why not (a ``str``). Agreement is recorded for ``x``'s
        input shape.

        Layer by layer first (:func:`jacutil.rules.verdicts.prove_layers`:
        each rule once per configuration, its verdict kept); where that
        fails, autodiff of the whole model on several samples. ``report``
        says which ran and how long it took."""
        self.report = report = CheckReport()
        start = time.perf_counter()
        with pfor_log():  # pfor's notes on our own autodiff rules: not the user's
            try:
                cheap = self.nodes is not None
                if cheap and prove_layers(self, spread_samples(x), target, report):
                    self.checked.add(signature_key(x))
                    return None
                report.whole_model = True
                start = time.perf_counter()
                reason = disagreement(self, target, x)
            except XLA_ERRORS as error:  # a layer's autodiff that XLA cannot compile
                reason = f"the layer rules could not run ({first_line(error)})"
            finally:
                if report.whole_model:
                    report.seconds += time.perf_counter() - start
        if reason is not None and target.dtype == np.float32:
            reason = self._in_float64(x) or reason
        if reason is None:
            self.checked.add(signature_key(x))
        return reason

    def _in_float64(self, x):
        """Why float32 rules and autodiff differ where a float64 copy of the
        model (same weights, same outputs to 1%) shows them equal:
        float32's rounding, named as such with both figures (a ``str``);
        else None (a copy that cannot be made or planned, computes
        something else, or disagrees too, says nothing)."""
        model = self.model() if self.model is not None else None
        if model is None:
            return None
        try:
            copy = float64_copy(model)
        except (TypeError, ValueError, NotImplementedError, KeyError):
            return None
        where = {id(v): j for j, v in enumerate(model.weights)}
        variables = [copy.weights[where[id(v)]] for v in self.variables]
        plan, _ = plan_for(copy, variables)
        x64, target32 = as_float64(x), resolve_target(model, self.variables)
        target64 = resolve_target(copy, variables)
        ours, theirs = target32.forward(x).numpy(), target64.forward(x64).numpy()
        if plan is None or relative_error(ours, theirs) > SAME_OUTPUTS:
            return None
        if disagreement(plan, target64, x64) is not None:
            return None
        what, error, i = first_difference(self, target32, x)
        _, error64, _ = first_difference(plan, target64, x64, largest=True)
        what = "Jacobian" if what == "jacobian" else "gradient norms"
        return (
            f"float32 rounding: the layer rules ({what}) differ from autodiff "
            f"by {error:.3g} (relative) on sample {i}, yet in float64 (the same "
            f"model and weights) they agree to {error64:.1g}. The model loses "
            "digits in float32 (inputs far from zero before a normalization, "
            "say): scale its inputs, or run it in float64 for precise Jacobians"
        )

    tensor = _on_checked_inputs(rules_tensor, "(n, l, m), or (n, r, m) with ``signal``")
    squared_norms = _on_checked_inputs(rules_squared_norms, "(n, r)")
    squared_columns = _on_checked_inputs(rules_squared_columns, "(m,)")
    weighted_sums = _on_checked_inputs(rules_weighted_sums, "one per variable (a list)")

    def weighs_sums(self):
        """Whether every step holding a wanted variable writes weighted sums
        (:meth:`jacutil.rules.registry.Rule.weighted_sums`), and no layer
        called twice holds one (its calls' sums would need the norms of
        their summed blocks)."""
        return not self.shared and all(
            step.weighs_sums
            for step, wanted in zip(self.steps, self.wanted, strict=True)
            if list(wanted)
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
    if not nodes:
        try:  # branches, several inputs or outputs: a graph
            nodes, wiring = graph_nodes(model, shared=True)
        except NotAGraph as reason:
            return None, str(reason)
    # a layer used twice (a tied embedding, KerasHub's ReversibleEmbedding)
    # is a step per call; where its variables are columns, each call's
    # blocks are summed (Plan.shared, jacutil.rules.walk)
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
            if id(v) in owner and steps[owner[id(v)][0]].layer is not step.layer:
                return None, "a variable is shared by two layers"
            owner.setdefault(id(v), []).append(j)
    missing = [v for v in variables if id(v) not in owner]
    if missing:
        return None, f"variable {missing[0].name!r} is not in a layer the rules can see"
    lowest = min(min(js) for js in owner.values())
    shared = frozenset(key for key, js in owner.items() if len(js) > 1)
    plan = Plan(steps, wanted, list(variables), lowest, wiring=wiring, nodes=nodes,
                shared=shared)  # fmt: skip
    plan.model = weakref.ref(model)
    return plan, None


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
        if rule is not None and several and not rule.several_inputs:
            rule, why = None, f"called with {node.n_inputs} tensors"
    extra = node.extra_arguments()
    replays = rule is not None and rule.several_inputs  # reads its own call
    if rule is not None and extra and not replays:
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
