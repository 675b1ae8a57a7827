"""The compiled Jacobian: one ``tf.function`` per model, variables and
options, traced once per input signature, under XLA where asked; the layer
rules' checked plan or the autodiff formulations (the fallback ladder of
:class:`jacutil.core.formulation.Ladder`). Stage 3 teaches it (notebook
03-compiled); every path of the package runs on :func:`compiled_for`."""

import time
from collections import Counter
from contextlib import contextmanager

import numpy as np

from ..core import cache
from ..core.batch import (
    as_batch,
    n_samples,
    pad_with_last,
    signature,
    signature_key,
    take,
)
from ..core.formulation import Ladder, map_fn_jacobian, quiet_function
from ..core.guards import note_trace
from ..core.memory import count_activations
from ..core.outputs import output_layout
from ..core.target import resolve_target
from ..rules import plan_for
from .autodiff import batch_tensor, per_sample_tensor

METHODS = ("per_sample", "batch", "rules")


def bucket_size(n_samples, block_size):
    """The rows XLA pads a batch (or block) of ``n_samples`` to: the next
    power of two, capped at ``block_size`` (the largest batch compiled at
    once), and at least 2 (pfor fails on some graphs with one sample, TF 2.21).

    >>> [bucket_size(n, 64) for n in (1, 2, 3, 33, 100)]
    [2, 2, 4, 64, 64]
    """
    return max(2, min(block_size, 1 << max(0, int(n_samples - 1).bit_length())))


class CompiledJacobian:
    """A reusable, compiled ``jac(x)``; see :func:`compiled_jacobian`.

    ``trace_count`` counts the traces of the underlying ``tf.function`` (one
    per input shape: a new number of samples does not retrace),
    ``compiled_shapes`` the batch sizes that XLA has seen (one compile each),
    and ``formulation`` says how the last trace computes the Jacobian.
    With ``method="rules"``, ``plan`` holds each layer's rule
    (``jacutil.rules``), or is None and ``fallback`` says why the per-sample
    stage runs instead.

    Arguments as :func:`compiled_jacobian`, with ``target``
    (:class:`jacutil.core.target.Target`) for the model, ``owner`` an object
    kept alive as long as this one, and ``model`` the one whose layers the
    rules plan (default: ``owner``).
    """

    def __init__(self, target, method, jit_compile, block_size, owner=None, model=None):
        if method not in METHODS:
            raise ValueError(
                f"method must be one of {sorted(METHODS)}; got {method!r}."
            )
        if int(block_size) <= 0:
            raise ValueError(
                f"block_size must be a positive integer; got {block_size}."
            )
        self.target = target
        self.method = method
        self.jit_compile = jit_compile
        self.block_size = int(block_size)
        self.trace_count = 0
        self.compiled_shapes = set()
        self.formulation = None
        self.activations = {}  # input signature -> activation elements (chunked)
        self.spent = Counter()  # seconds, by what: see engine.choice.SPENT
        self._owner = owner
        self.ladder = Ladder(
            lambda key, mode, xla, x: self.build(x, mode, xla),
            self.checked_plan,
            eager=lambda key, x: self._jacobian(x, Ladder.RULES, False),
        )
        self.plan, self.fallback = None, None
        if method == "rules":
            model = owner if model is None else model
            self.plan, self.fallback = plan_for(
                model, target.variables, target.training
            )

    def activation_elements(self, x):
        """A, the floating-point elements of one sample's forward pass in the
        checked batch ``x`` (for the memory model of ``jacutil.engine.rows``),
        counted once per input shape."""
        key = signature_key(x)
        if key not in self.activations:
            start = time.perf_counter()
            self.activations[key] = count_activations(
                self.target, x, unroll=self.method == "per_sample"
            )
            self.spent["counting activations"] += time.perf_counter() - start
        return self.activations[key]

    def build(self, x, mode, jit_compile):
        """A ``tf.function`` for batches like ``x``: any n, the same features.

        Its input signature (``jacutil.core.batch.signature``) keeps the
        shapes and dtypes of ``x`` but makes the batch dimension ``None``, so
        one trace serves every number of samples; ``trace_count`` counts the
        traces. :meth:`tensor` has ``ladder`` build one per input signature
        and keep it. Introduced in notebook ``03-compiled``.

        Args:
            x: a checked batch (its per-sample shapes and dtypes count).
            mode: how it computes: ``"rules"``, ``"vectorized"`` or
                ``"tf.map_fn over samples"`` (:class:`jacutil.core.formulation.Ladder`).
            jit_compile: compile with XLA.

        Returns:
            A ``tf.function`` ``x -> J``, J of shape (n, l, m).
        """

        def traced(x):
            self.trace_count += 1  # Python side effect: runs once per trace
            note_trace(self.target.variables, (self.method, self.jit_compile))
            return self._jacobian(x, mode, jit_compile)

        return quiet_function(
            traced,
            input_signature=[signature(x)],
            jit_compile=jit_compile,
            # the rules' own code has no tensor-dependent Python control flow:
            # converting it with autograph costs most of the first call
            autograph=mode != Ladder.RULES,
        )

    def _jacobian(self, x, mode, jit_compile):
        if mode == Ladder.MAP_FN:
            reason = self.ladder.pfor_failed
            self.formulation = f"tf.map_fn over samples: pfor failed ({reason})"
            J = map_fn_jacobian(self.target, x)
        elif mode == Ladder.RULES:
            self.formulation = self.plan.describe()
            J = self.plan.tensor(x)
        else:
            method = batch_tensor if self.method == "batch" else per_sample_tensor
            J, self.formulation = method(self.target, x, jit_compile)
        if self.jit_compile and not jit_compile:
            self.formulation += ", without XLA (XLA cannot compile it)"
        return J

    def tensor(self, x, pad_to=None):
        """The Jacobian of a checked batch as a tensor, padded to ``pad_to`` rows.

        Padding gives XLA the same shape every time. The padded rows are
        copies of the last sample, and they are cut off again. ``ladder``
        runs the first way that works (:class:`jacutil.core.formulation.Ladder`).
        """
        key = signature_key(x)
        self.checked_plan(x)  # proves the layer rules on it, once per signature
        n_rows = n_samples(x)
        if n_rows == 1:  # pfor fails on some graphs with one sample (TF 2.21)
            pad_to = 2
        padded = pad_to is not None and pad_to > n_rows
        if padded:
            x = pad_with_last(x, pad_to)
        if self.jit_compile:
            self.compiled_shapes.add(int(n_samples(x)))
        with self.timed_call(self):
            J = self.ladder(key, (x,), Ladder.MODES if self.jit_compile else ())[0]
        return J[:n_rows] if padded else J

    def checked_plan(self, x):
        """The layer rules' plan, proved on batches like ``x`` - or None, and
        ``fallback`` says why (the check failed: the per-sample stage runs).

        The proof (:meth:`jacutil.rules.Plan.check`) runs once per input
        shape; every consumer of the rules takes the plan from here.
        """
        if self.plan is None or signature_key(x) in self.plan.checked:
            return self.plan
        start = time.perf_counter()
        reason = self.plan.check(self.target, x)
        self.spent["checking the rules"] += time.perf_counter() - start
        if reason is not None:
            self.plan, self.fallback = None, reason
            self.ladder.restart()
        return self.plan

    @contextmanager
    def timed_call(self, traced):
        """Time a call of a compiled function of ``traced`` (an object with a
        ``trace_count``) into ``spent``: as tracing and compiling (with its
        first run) where it traced, else as running; a check made inside
        counts as checking only."""
        start, traces = time.perf_counter(), traced.trace_count
        eager = set(traced.ladder.ran_eagerly)
        checking = self.spent["checking the rules"]
        try:
            yield
        finally:
            inside = self.spent["checking the rules"] - checking
            what = "tracing and compiling" if traced.trace_count > traces else "running"
            if what == "running" and traced.ladder.ran_eagerly != eager:
                what = "running eagerly (a first call: no trace)"
            self.spent[what] += time.perf_counter() - start - inside

    def __call__(self, x, *, copy=True):
        """Return the (n_samples, n_outputs, n_params) Jacobian of ``x``.

        ``copy=False`` returns a read-only view of TensorFlow's result
        instead of a copy (``.numpy()`` copies: at n = 10,000 on the
        question's network that copy costs longer than the Jacobian). A
        ValueError where ``x`` (an array, or a list or dict of arrays) or the
        model's outputs do not fit (see :func:`jacutil.core.batch.as_batch`).
        """
        x = as_batch(x, self.target)
        output_layout(self.target, x)  # checks the outputs, once per shape
        return self.of_batch(x, copy=copy)

    def of_batch(self, x, *, copy=True):
        """:meth:`__call__` of a batch already checked by ``as_batch``."""
        n_rows = int(n_samples(x))
        if not self.jit_compile or n_rows <= self.block_size:
            pad_to = bucket_size(n_rows, self.block_size) if self.jit_compile else None
            J = self.tensor(x, pad_to)
            return J.numpy() if copy else np.asarray(J)
        # Blocks, the last padded to its own power of two (not a full block),
        # each written straight into the result.
        out = None
        for start in range(0, n_rows, self.block_size):
            stop = min(start + self.block_size, n_rows)
            pad_to = bucket_size(stop - start, self.block_size)
            block = np.asarray(self.tensor(take(x, start, stop), pad_to))
            if out is None:
                out = np.empty((n_rows, *block.shape[1:]), block.dtype)
            out[start:stop] = block
        return out


def compiled_for(model, variables, training, jit_compile, method, x=None):
    """One compiled Jacobian per model, variables and options: no retracing.

    The key holds the variables themselves (their ids), so after
    ``layer.trainable = False`` the model gets a compiled Jacobian of its new
    columns. Arguments as :func:`compiled_jacobian`, and ``x``, a batch to
    build a model that is not built yet (optional). Kept in
    :mod:`jacutil.core.cache` (the newest ``CACHED_PER_MODEL`` per model) as
    long as the model lives.
    """
    if variables is None and getattr(model, "built", False):
        # the second call on a model: no checks to repeat, the key is at hand
        quick = (training, jit_compile, method, *map(id, model.trainable_variables))
        found = cache.find("compiled", model, quick)
        if found is not None:
            return found
    target = resolve_target(model, variables, training, x)
    key = (training, jit_compile, method, *map(id, target.variables))
    return cache.kept(
        "compiled",
        model,
        key,
        lambda: CompiledJacobian(target, method, jit_compile, 1024, model=model),
    )


def compiled_jacobian(
    model,
    *,
    jit_compile=False,
    variables=None,
    training=False,
    method="per_sample",
    block_size=1024,
):
    """A reusable ``jac(x)`` that computes the per-sample Jacobian in a graph.

    The ``tf.function`` has an input signature whose batch dimension is
    ``None``, so a new number of samples does not retrace it (see
    ``jac.trace_count``); a new per-sample shape (another sequence length)
    traces once more. With ``jit_compile=True`` XLA compiles once per
    concrete shape, so the batch is padded to a power of two up to
    ``block_size`` and larger batches run in blocks of ``block_size``: at most
    ``log2(block_size) + 1`` compiles, whatever the sizes (``jac.compiled_shapes``).
    ``jac.formulation`` says how the model is vectorized (recurrent layers
    are unrolled; see ``jacutil.core.formulation``). Introduced in
    ``03-compiled``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        jit_compile: compile with XLA.
        variables: the variables to differentiate (default: trainable ones).
        training: run the model in training mode.
        method: ``"per_sample"`` (``tf.vectorized_map``, linear in n),
            ``"batch"`` (``tape.jacobian`` over the batch, quadratic in n) or
            ``"rules"`` (each layer's hand-derived rule, ``jacutil.rules``;
            where they do not apply, ``jac.fallback`` says why and
            ``"per_sample"`` runs).
        block_size: with ``jit_compile``, the largest batch one call runs.

    Returns:
        A :class:`CompiledJacobian` ``jac``; ``jac(x)`` returns a NumPy
        array of shape (n, l, m).

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, compiled_jacobian
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> jac = compiled_jacobian(model)
        >>> jac(x).shape, jac(x[:3]).shape  # (n, l, m)
        ((4, 2, 8), (3, 2, 8))
        >>> jac.trace_count  # a new n does not retrace
        1
    """
    target = resolve_target(model, variables, training)
    return CompiledJacobian(target, method, jit_compile, block_size, owner=model)
