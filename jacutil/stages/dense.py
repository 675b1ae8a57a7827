"""The hand-derived path of ``07-benchmark``: the layer rules, Dense only.

A network of Dense layers (a chain, or a graph of them: residual ``Add``
skips, two heads) has its per-sample Jacobian written down by hand:
each kernel's columns are an outer product of the layer's input and the
back-propagated signal (``jacutil.rules.blocks``). That derivation is the
Dense rule (``jacutil.rules.dense.DenseRule``); this module adds no formula
of its own. It takes the rules' plan where every layer got the Dense rule
and the input is one flat (n_samples, n_features) array; any other model
runs the autodiff per-sample stage instead, and ``fallback`` says why.
"""

from ..core.batch import as_batch
from ..core.target import resolve_target, variable_list
from ..engine.compiled import compiled_jacobian
from ..rules import plan_for
from ..rules.dense import DenseRule
from .vectorized import per_sample_jacobian


def dense_plan(model, target):
    """``(plan, None)`` when the hand-derived path applies, else ``(None, reason)``.

    The plan is unchecked: :meth:`jacutil.rules.Plan.check` it on the inputs.

    Args:
        model: a Keras model.
        target: its :class:`jacutil.core.target.Target`.

    Returns:
        ``(Plan, None)`` or ``(None, reason)``, the reason a ``str``.
    """
    plan, reason = plan_for(model, target.variables, target.training)
    if plan is None:
        return None, reason
    if plan.shared:  # the rules sum its calls; the hand-derived path is a chain
        return None, "a layer is used more than once"
    for step in plan.steps:
        if not isinstance(step, DenseRule):
            kind = type(step.layer).__name__
            return None, f"layer {step.layer.name!r} is a {kind}, not a Dense"
    try:
        flat = len(model.inputs) == 1 and len(model.inputs[0].shape) == 2
    except (AttributeError, ValueError):
        flat = False
    if not flat:
        return None, "the input is not one flat (n_samples, n_features) array"
    return plan, None


class DenseJacobian:
    """A reusable, compiled, hand-derived ``jac(x)``: see ``compiled_dense_jacobian``.

    It is ``compiled_jacobian(model, method="rules")`` kept to Dense networks
    (``plan``), or ``compiled_jacobian(model)`` where they do not apply.
    ``fallback`` is None on the hand-derived path, or why it does not apply.
    Arguments as :func:`compiled_dense_jacobian` (``training``: the fallback runs).
    """

    def __init__(self, model, jit_compile, variables, training):
        variables = None if variables is None else variable_list(variables)
        options = dict(jit_compile=jit_compile, variables=variables, training=training)
        self._jac = compiled_jacobian(model, method="rules", **options)
        self.target = self._jac.target
        self.jit_compile = jit_compile
        self._reason = self._jac.fallback
        if self._reason is None:
            self._reason = dense_plan(model, self.target)[1]
        if self._reason is not None:
            self._jac = compiled_jacobian(model, **options)

    @property
    def fallback(self):
        """Why the hand-derived path does not run, or None (also set when the
        plan's check against autodiff fails on the first input of a shape)."""
        return self._reason or self._jac.fallback

    @property
    def plan(self):
        """The Dense rules' plan, or None on the fallback."""
        return None if self._reason else self._jac.plan

    @property
    def trace_count(self):
        """The traces of the underlying compiled function (an ``int``)."""
        return self._jac.trace_count

    def tensor(self, x):
        """The (n, l, m) Jacobian of the n samples ``x`` (an array) as a tensor
        (checked against autodiff first)."""
        return self._jac.tensor(as_batch(x, self.target))

    def __call__(self, x, *, copy=False):
        """Return the (n_samples, n_outputs, n_params) Jacobian of ``x``: by
        default a read-only view, not a copy, as in
        :meth:`jacutil.stages.compiled.CompiledJacobian.__call__`; with
        ``copy=True`` an array you may write to.
        """
        return self._jac(x, copy=copy)


def compiled_dense_jacobian(
    model, *, jit_compile=False, variables=None, training=False
):
    """Return a reusable, compiled ``jac(x)`` derived by hand for Dense networks.

    A ``tf.function`` with a ``None`` batch dimension, so a new n does not
    retrace (``jac.trace_count``); with ``jit_compile=True``, batches are
    padded as in ``compiled_jacobian``. ``jac(x)`` returns a read-only
    (n_samples, n_outputs, n_params) array in ``flat_params`` order;
    ``jac(x, copy=True)`` a writable one. A model that is not a network of
    Dense layers on a flat input gets the compiled per-sample autodiff stage
    instead (``jac.fallback`` says why); so does one whose rules differ from
    autodiff on the samples checked (up to 8, spread over the first batch of
    each input shape). Introduced in ``07-benchmark``.

    Args:
        model: a Keras model.
        jit_compile: compile with XLA.
        variables: the variables to differentiate (default: the model's
            trainable variables).
        training: run the model in training mode.

    Returns:
        A :class:`DenseJacobian`: ``jac(x)`` gives J of shape (n, l, m).
    """
    return DenseJacobian(model, jit_compile, variables, training)


def dense_jacobian(model, x, *, variables=None, training=False):
    """Per-sample Jacobian of a Dense network, derived by hand (no tape).

    Runs eagerly, once; reuse :func:`compiled_dense_jacobian` for speed.
    Any other model, or one whose rules differ from autodiff on the samples
    checked, falls back to :func:`per_sample_jacobian`.

    Returns J, an array of shape (n_samples, n_outputs, n_params), columns in
    ``flat_params`` order, for the n samples ``x`` (an array); other arguments
    as :func:`compiled_dense_jacobian`. Introduced in ``07-benchmark``.
    """
    variables = None if variables is None else variable_list(variables)
    target = resolve_target(model, variables, training, x)
    plan, _ = dense_plan(model, target)
    if plan is not None:
        x = as_batch(x, target)
        if plan.check(target, x) is None:
            return plan.tensor(x).numpy()
    return per_sample_jacobian(model, x, variables=variables, training=training)
