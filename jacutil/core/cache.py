"""The compiled functions of each model, kept as long as the model lives.

Every cache of compiled functions lives here, and nowhere else - one weak
registry, filled by factories that the callers pass in, so the core imports
nothing above it. The compiled Jacobian (``jacutil.engine.compiled.compiled_for``),
its forward-mode twin (``jacutil.matrix_free.forward.forward_for``), the
products with J (``jacutil.matrix_free.products.products_for``), the
per-sample loss gradients (``jacutil.fitting.loss_gradients.gradients_for``)
and the curvature products (``jacutil.curvature.compiled.curvature_for``)
each keep their entries here under their own ``kind``. Ownership is explicit
and weak:

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

CACHED_PER_MODEL = 8  # entries kept per model and kind (the newest)

_caches = {}  # kind -> WeakKeyDictionary(owner -> {key: entry})


def owner_of(model):
    """``(owner, extra)``: what an entry is keyed on weakly (the model, or a
    bound method's object), and what the key adds (the method's function)."""
    if hasattr(model, "__self__") and hasattr(model, "__func__"):
        return model.__self__, (model.__func__,)
    return model, ()


def _entries(kind, owner):
    """The owner's entries of ``kind`` (a new dict, not kept, when the owner
    cannot be a weak key)."""
    cache = _caches.setdefault(kind, weakref.WeakKeyDictionary())
    try:
        return cache.setdefault(owner, {})
    except TypeError:
        return {}


def find(kind, model, key):
    """The entry of ``kind`` kept for ``model`` under ``key`` (a tuple), or
    None."""
    owner, extra = owner_of(model)
    try:
        return _caches.get(kind, {}).get(owner, {}).get((*key, *extra))
    except TypeError:
        return None


def entries(kind, model):
    """What is kept of ``kind`` for ``model`` now (a new dict: key -> entry)."""
    owner, _ = owner_of(model)
    try:
        return dict(_caches.get(kind, {}).get(owner, {}))
    except TypeError:
        return {}


def kept(kind, model, key, make, still_valid=None):
    """The entry of ``kind`` for ``model`` and ``key``, made by ``make()``
    when none is kept (the newest ``CACHED_PER_MODEL`` per model are kept).
    ``kind`` names the cache (``"compiled"``, ``"products"``, ...); ``model``
    is a Keras model, a callable or a bound method (its owner); ``key``, a
    hashable tuple of what the entry depends on besides the owner.
    ``still_valid(entry)`` is False for an entry that must be built again (a
    new function at a dead one's address, say).
    """
    owner, extra = owner_of(model)
    entries = _entries(kind, owner)
    key = (*key, *extra)
    found = entries.get(key)
    if found is not None and still_valid is not None and not still_valid(found):
        del entries[key]
    if key not in entries:
        while len(entries) >= CACHED_PER_MODEL:
            del entries[next(iter(entries))]
        entries[key] = make()
    return entries[key]


class PerSignature:
    """An entry's compiled functions, one per key (the shapes and dtypes of
    its inputs, and what else the trace depends on): every per-shape table
    of ``tf.function`` s is one of these. It is held by an entry of the
    registry above (a model's curvature products, its KFAC replay, ...), so
    it lives and dies with the model, like the entry.
    """

    def __init__(self):
        self._functions = {}

    def get(self, key, build):
        """The function kept under ``key``, made by ``build()`` the first time."""
        if key not in self._functions:
            self._functions[key] = build()
        return self._functions[key]

    def __len__(self):
        return len(self._functions)


def clear():
    """Forget every compiled function of every model."""
    for cache in _caches.values():
        cache.clear()
