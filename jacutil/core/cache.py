"""The compiled functions of each model, kept as long as the model lives.

Every cache of compiled functions lives here, and nowhere else: the compiled
Jacobian (``CompiledJacobian``), its forward-mode twin (``ForwardJacobian``)
and the products with J (``Products``). Ownership is explicit and weak:

The curvature products (``CurvatureProducts``, notebook 11) are kept per
model, loss and variables.

The per-sample loss gradients (``LossGradients``) are kept the same way, one
per model, loss function and variables; they hold the loss function weakly.

* the **owner** of an entry is the model - a Keras model, a plain callable
  (a function or lambda), or the object of a bound method - held by a
  ``weakref.WeakKeyDictionary``, so the cache never keeps it alive;
* an entry never holds its owner: its target calls the model through a weak
  reference (``jacutil.core.target``), and nothing else in it points back. When
  the last reference to the model goes, its entries go with it, and so do
  the arrays a lambda captured.

An owner that cannot be weakly referenced (a builtin, say) is not cached: each
call compiles afresh. ``clear()`` empties every cache (tests, notebooks that
rebuild models in a loop). Introduced in ``03-compiled``.
"""

import weakref

from ..stages.compiled import CompiledJacobian
from .target import resolve_target

CACHED_PER_MODEL = 8  # compiled Jacobians kept per model (the newest)

_compiled = weakref.WeakKeyDictionary()  # owner -> {key: CompiledJacobian}
_forward = weakref.WeakKeyDictionary()  # owner -> {key: ForwardJacobian}
_products = weakref.WeakKeyDictionary()  # owner -> {key: Products}
_gradients = weakref.WeakKeyDictionary()  # owner -> {key: LossGradients}
_curvature = weakref.WeakKeyDictionary()  # owner -> {key: CurvatureProducts}


def owner_of(model):
    """What an entry is keyed on: the model, or a bound method's object (and
    the method's function, as part of the key).

    Args:
        model: a Keras model, a callable or a bound method.

    Returns:
        ``(owner, extra)``: the object to key on weakly, and a tuple (empty,
        or the bound method's function) to add to the entry's key.
    """
    if hasattr(model, "__self__") and hasattr(model, "__func__"):
        return model.__self__, (model.__func__,)
    return model, ()


def _entries(cache, owner):
    """The owner's entries (a new dict, not kept, when it cannot be a weak key)."""
    try:
        return cache.setdefault(owner, {})
    except TypeError:
        return {}


def _keep(entries, key, make):
    if key not in entries:
        while len(entries) >= CACHED_PER_MODEL:
            del entries[next(iter(entries))]
        entries[key] = make()
    return entries[key]


def compiled_for(model, variables, training, jit_compile, method, x=None):
    """One compiled Jacobian per model, variables and options: no retracing.

    The key holds the variables themselves (their ids), so after
    ``layer.trainable = False`` the model gets a compiled Jacobian of its new
    columns.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables``.
        variables: the variables to differentiate, or None for the model's
            trainable variables.
        training: run the model in training mode.
        jit_compile: compile with XLA.
        method: the formulation (as for :class:`CompiledJacobian`).
        x: a batch, to build a model that is not built yet (optional).

    Returns:
        The model's :class:`jacutil.stages.compiled.CompiledJacobian` for these
        options, cached (the newest ``CACHED_PER_MODEL`` per model).
    """
    owner, extra = owner_of(model)
    if variables is None and getattr(model, "built", False):
        # the second call on a model: no checks to repeat, the key is at hand
        quick = (training, jit_compile, method, *map(id, model.trainable_variables))
        try:
            found = _compiled.get(owner, {}).get((*quick, *extra))
        except TypeError:
            found = None
        if found is not None:
            return found
    target = resolve_target(model, variables, training, x)
    key = (training, jit_compile, method, *map(id, target.variables), *extra)
    return _keep(
        _entries(_compiled, owner),
        key,
        lambda: CompiledJacobian(target, method, jit_compile, 1024, model=model),
    )


def forward_for(model, variables, training):
    """The forward-mode Jacobian of ``model``, compiled once per input shape.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables``.
        variables: the variables to differentiate, or None for the model's
            trainable variables.
        training: run the model in training mode.

    Returns:
        The model's :class:`jacutil.matrix_free.forward.ForwardJacobian`,
        cached.
    """
    from ..matrix_free.forward import COLUMNS_PER_PASS, ForwardJacobian

    owner, extra = owner_of(model)
    target = resolve_target(model, variables, training)
    key = (training, *map(id, target.variables), *extra)
    return _keep(
        _entries(_forward, owner),
        key,
        lambda: ForwardJacobian(target, COLUMNS_PER_PASS),
    )


def products_for(model, options):
    """The compiled ``jvp`` and ``vjp`` of ``model`` with these options.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables``.
        options: a mapping of keyword arguments for
            :class:`jacutil.matrix_free.products.Products`, with ``variables``
            and ``training`` among them (optional).

    Returns:
        The model's :class:`jacutil.matrix_free.products.Products`, cached.
    """
    from ..matrix_free.products import Products

    owner, extra = owner_of(model)
    options = dict(options)
    variables = options.pop("variables", None)
    training = options.pop("training", False)
    target = resolve_target(model, variables, training)
    key = (
        tuple(sorted(options.items())),
        training,
        *map(id, target.variables),
        *extra,
    )
    return _keep(
        _entries(_products, owner),
        key,
        lambda: Products(target, **options),
    )


def gradients_for(model, loss_fn, variables, training, x=None):
    """The compiled per-sample gradients of ``loss_fn`` on ``model``.

    Keyed by the loss function's identity: pass the same function each call
    (a new lambda each step compiles each step).

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables``.
        loss_fn: ``loss_fn(y, prediction)`` with one loss per sample.
        variables: the variables to differentiate, or None for the model's
            trainable variables.
        training: run the model in training mode.
        x: a batch, to build a model that is not built yet (optional).

    Returns:
        The model's :class:`jacutil.fitting.loss_gradients.LossGradients`
        for this loss, cached.
    """
    from ..fitting.loss_gradients import LossGradients

    owner, extra = owner_of(model)
    jac = compiled_for(model, variables, training, False, "rules", x)
    key = (id(loss_fn), training, *map(id, jac.target.variables), *extra)
    entries = _entries(_gradients, owner)
    found = entries.get(key)
    if found is not None and (found.loss_fn is not loss_fn or found.jac is not jac):
        del entries[key]  # a new function at a dead one's address, or new columns
    return _keep(entries, key, lambda: LossGradients(jac, loss_fn))


def curvature_for(model, variables, options, make):
    """The compiled ``G @ v`` and ``H @ v`` of ``model`` (notebook 11).

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables``.
        variables: the variables to differentiate, or None for the model's
            trainable variables.
        options: a hashable tuple of what else the products depend on (the
            loss's name and classes, the chunk size).
        make: ``make(target)`` builds the products when none is kept.

    Returns:
        The model's ``jacutil.curvature.compiled.CurvatureProducts``, cached.
    """
    owner, extra = owner_of(model)
    target = resolve_target(model, variables, False)
    key = (options, *map(id, target.variables), *extra)
    return _keep(_entries(_curvature, owner), key, lambda: make(target))


def clear():
    """Forget every compiled function of every model."""
    for cache in (_compiled, _forward, _products, _gradients, _curvature):
        cache.clear()
