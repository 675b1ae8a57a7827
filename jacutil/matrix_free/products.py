"""Products with J without forming J (notebook 09-matrix-free).

A Gauss-Newton or trust-region step needs only ``J @ v`` (:func:`jvp`,
forward mode) and ``J.T @ u`` (:func:`vjp`, reverse mode);
:func:`jacobian_operator` is J as a SciPy ``LinearOperator`` that uses them.

Memory is one forward (and backward) pass over a chunk of samples, never
n*l*m numbers. Each product is compiled once per model and input shape;
parameters are in ``flat_params`` order.
"""

import contextlib

import numpy as np

from ..core import cache
from ..core._shared import joined_gradients, or_zeros, sizes_of
from ..core._tf import tf
from ..core.arguments import check_chunk_size
from ..core.batch import as_batch, n_samples, signature, signature_key, take
from ..core.cache import PerSignature
from ..core.data import inputs_of, read_data
from ..core.formulation import (
    new_ops,
    quiet_function,
    recurrent_layers,
    refuse_hidden_reads,
    refuse_kept_loops,
    refuse_shape_preserving_max_pools,
    unrolled,
)
from ..core.outputs import output_layout
from ..core.planner import plan_chunks, run_chunks, sum_chunks
from ..core.second_order import ensure_second_order
from ..core.target import resolve_target, watched


class Products:
    """Compiled ``jvp`` and ``vjp`` of one model; see :func:`products`.

    ``jvp(x, v)`` and ``vjp(x, u)`` take a batch and return NumPy arrays;
    ``trace_count`` counts traces (one per product and input shape). The
    arguments as :func:`products`, with ``target`` (``jacutil.core.target``)
    for the model and ``owner``, the model, kept alive as long as these.
    """

    def __init__(self, target, chunk_size=None, mode="forward", owner=None):
        if mode not in ("forward", "double_backward"):
            raise ValueError(
                f'mode must be "forward" or "double_backward"; got {mode!r}.'
            )
        ensure_second_order()  # both JVPs differentiate gradient ops
        self.mode = mode
        self.target = target
        self._owner = owner
        self.variables = self.target.variables
        self.n_params = self.target.n_params
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.chunk_size = check_chunk_size(chunk_size)
        self.trace_count = 0
        self._functions = PerSignature()

    # -- checks -------------------------------------------------------------

    def _check_shapes(self):
        now = [tuple(v.shape) for v in self.variables]
        if now != self.shapes:
            raise ValueError(
                "the model's variables changed shape since these products were "
                f"made ({self.shapes} -> {now}); make new ones for the new model."
            )

    def _vector(self, v, length, name, what):
        v = np.asarray(v)
        if v.ndim != 1 or v.shape[0] != length:
            raise ValueError(
                f"{name} has shape {v.shape}; it must be a flat vector of length "
                f"{length:,} ({what})."
            )
        if not np.issubdtype(v.dtype, np.floating):
            raise TypeError(f"{name} has dtype {v.dtype}; pass floating-point numbers.")
        return v.astype(self.target.dtype, copy=False)

    # -- the products -------------------------------------------------------

    def _split(self, v):
        parts = tf.split(v, sizes_of(self.variables))
        return [tf.reshape(p, s) for p, s in zip(parts, self.shapes, strict=True)]

    @contextlib.contextmanager
    def _traced(self):
        """What every product is traced in: recurrent layers unrolled (forward
        mode cannot carry tangents through a while_loop's variable reads, TF
        2.21; ``jacutil.core.formulation``)."""
        with unrolled(recurrent_layers(self.target)):
            yield

    def forward_chunk(self, x, v):
        """``J @ v`` for one chunk ``x``, by forward mode: one forward pass that
        carries the tangent ``v`` (split per variable) beside the values.
        Traced once per chunk shape by ``jvp``; notebook 09 shows it."""
        self.trace_count += 1
        tracked = [watched(w) for w in self.variables]
        with self._traced(), new_ops() as created:
            with tf.autodiff.ForwardAccumulator(tracked, self._split(v)) as accumulator:
                y = self.target.forward(x)
        refuse_hidden_reads(created, tracked)
        return or_zeros(accumulator.jvp(y), y)

    def _jvp_double_backward(self, x, v):
        """``J @ v`` by reverse mode twice: ``d/du (J.T u) . v`` at any u."""
        self.trace_count += 1
        tracked = [watched(w) for w in self.variables]
        with self._traced(), new_ops() as created, tf.GradientTape() as outer:
            u = tf.zeros_like(self.target.forward(x))  # J.T u is linear in u
            outer.watch(u)
            with tf.GradientTape() as inner:
                inner.watch(tracked)
                y = self.target.forward(x)
            grads = inner.gradient(y, tracked, output_gradients=u)
            terms = [
                tf.reduce_sum(g * t)
                for g, t in zip(grads, self._split(v), strict=True)
                if g is not None
            ]
            score = tf.add_n(terms) if terms else tf.zeros([], y.dtype)
        refuse_shape_preserving_max_pools(created)
        return or_zeros(outer.gradient(score, u), y)

    def reverse_chunk(self, x, u):
        """``J.T @ u`` for one chunk ``x``, by reverse mode: one backward pass
        started from ``u`` (the outputs' cotangents). Traced once per chunk
        shape by ``vjp``; notebook 09 shows it."""
        self.trace_count += 1
        tracked = [watched(w) for w in self.variables]
        with self._traced(), tf.GradientTape() as tape:
            tape.watch(tracked)
            y = self.target.forward(x)
        grads = tape.gradient(y, tracked, output_gradients=u)
        return joined_gradients(grads, sizes_of(self.variables), y.dtype)

    def _function(self, kind, x):
        method = {
            "jvp": self.forward_chunk,
            "jvp_double_backward": self._jvp_double_backward,
            "vjp": self.reverse_chunk,
        }[kind]
        second = tf.TensorSpec(
            [None, None] if kind == "vjp" else [self.n_params], self.target.dtype
        )
        return self._functions.get(
            (kind, signature_key(x)),
            lambda: quiet_function(method, input_signature=[signature(x), second]),
        )

    def _chunks(self, x):
        return plan_chunks(int(n_samples(x)), chunk_size=self.chunk_size)

    def jvp(self, x, v):
        """``J @ v`` as (n, l) for the samples ``x``; ``v`` is a flat
        parameter direction of length m (else a ValueError)."""
        if self.mode == "forward":
            refuse_kept_loops(self.target)
        self._check_shapes()
        x = as_batch(x, self.target)
        layout = output_layout(self.target, x)
        v = tf.constant(self._vector(v, self.n_params, "v", "one number per parameter"))
        kind = "jvp" if self.mode == "forward" else "jvp_double_backward"
        function = self._function(kind, x)
        return run_chunks(
            self._chunks(x), lambda a, b: function(take(x, a, b), v),
            shape=(int(n_samples(x)), layout.n_outputs), dtype=self.target.dtype,
        )  # fmt: skip

    def vjp(self, x, u):
        """``J.T @ u`` as (m,) for the samples ``x``; ``u`` holds one weight
        per sample and output, shape (n, l) or (n * l,) (else a ValueError)."""
        self._check_shapes()
        x = as_batch(x, self.target)
        layout = output_layout(self.target, x)
        rows = int(n_samples(x))
        u = np.asarray(u)
        if u.shape not in ((rows, layout.n_outputs), (rows * layout.n_outputs,)):
            raise ValueError(
                f"u has shape {u.shape}; it must be ({rows}, {layout.n_outputs}) - one "
                "weight per sample and output - or flat, of length "
                f"{rows * layout.n_outputs}."
            )
        u = self._vector(u.reshape(-1), rows * layout.n_outputs, "u", "n * l").reshape(
            rows, layout.n_outputs
        )
        function = self._function("vjp", x)
        total = sum_chunks(
            self._chunks(x), lambda a, b: function(take(x, a, b), tf.constant(u[a:b]))
        )
        return total.astype(self.target.dtype)


def products(model, *, variables=None, training=False, chunk_size=None, mode="forward"):
    """Reusable, compiled ``jvp`` and ``vjp`` of ``model`` (a :class:`Products`).

    ``chunk_size`` runs the batch in slices of that many samples (memory of
    one slice's forward and backward pass); None runs it whole. ``mode``:
    ``"forward"`` (``ForwardAccumulator``) or ``"double_backward"`` (the JVP
    as the gradient of a VJP) for ``jvp``; ``model``, ``variables`` and
    ``training`` as :func:`jacutil.vectorized_jacobian`. Returns a
    :class:`Products` ``p``: ``p.jvp(x, v)`` (m,) -> (n, l) and ``p.vjp(x, u)``
    (n, l) -> (m,). Introduced in ``09-matrix-free``.
    """
    target = resolve_target(model, variables, training)
    return Products(target, chunk_size, mode, owner=model)


def products_for(model, options):
    """The model's :class:`Products` for the keyword arguments ``options``
    of :func:`products`, kept in :mod:`jacutil.core.cache` as long as the
    model lives: the same compiled products for repeated calls."""
    options = dict(options)
    variables = options.pop("variables", None)
    training = options.pop("training", False)
    target = resolve_target(model, variables, training)
    key = (tuple(sorted(options.items())), training, *map(id, target.variables))
    return cache.kept("products", model, key, lambda: Products(target, **options))


def jvp(model, x, v, **options):
    """``J @ v`` for a flat parameter direction ``v``, without forming J.

    Forward mode: one forward pass carrying tangents. Introduced in
    ``09-matrix-free``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        x: the n samples.
        v: a direction in parameter space, shape (m,), ``flat_params`` order.
        **options: as in :func:`products` (``variables``, ``training``,
            ``chunk_size``, ``mode``).

    Returns:
        A NumPy array of shape (n, l): ``J[i] @ v`` for each sample.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, jvp
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> jvp(model, x, np.ones(8)).shape  # v: (m,) -> (n, l)
        (4, 2)
    """
    return products_for(model, options).jvp(x, v)


def vjp(model, x, u, **options):
    """``J.T @ u`` for weights ``u`` on every sample's outputs, without forming J.

    Reverse mode: one ``tape.gradient`` with ``output_gradients=u``.
    Introduced in ``09-matrix-free``.

    Arguments as :func:`jvp`, ``u`` of shape (n, l) or flat (n * l,).
    Returns a NumPy array of shape (m,): the sum over i and k of
    ``u[i, k] * J[i, k]``.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, vjp
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> vjp(model, x, np.ones((4, 2))).shape  # u: (n, l) -> (m,)
        (8,)
    """
    return products_for(model, options).vjp(x, u)


def jacobian_operator(model, x, **options):
    """``J`` as a ``scipy.sparse.linalg.LinearOperator`` of shape (n*l, m), float64.

    Row ``i*l + k`` is sample i, output k (as ``J.reshape(n*l, m)`` and the
    SciPy bridge). ``matvec`` is a JVP, ``rmatvec`` a VJP, ``matmat`` one JVP
    per column; nothing of size n*l*m is formed. The operator reads the
    model's variables when it is applied, so it follows the model's current
    parameters. Introduced in ``09-matrix-free``.

    Arguments as :func:`jvp` (or ``products=`` ones already made); ``x`` may
    also be a dataset of ``model.fit``'s batches, as ``jacutil.jacobian``
    reads it.
    """
    from scipy.sparse.linalg import LinearOperator

    prods = options.pop("products", None)
    if prods is not None and options:
        raise TypeError(
            f"jacobian_operator got products= and {', '.join(sorted(options))}: "
            "the products already fix the variables, chunk size, mode and "
            "training. Pass these options to jacutil.matrix_free.products(...) "
            "when you make the products, or leave products= out."
        )
    prods = prods or products(model, **options)
    x = read_data(x, inputs=inputs_of(model))[0]  # a dataset: its x, in order
    batch = as_batch(x, prods.target)
    rows = int(n_samples(batch))
    n_outputs = output_layout(prods.target, batch).n_outputs

    def matvec(v):
        return prods.jvp(batch, np.ravel(v)).reshape(-1).astype(np.float64)

    def rmatvec(u):
        return prods.vjp(batch, np.ravel(u)).astype(np.float64)

    def matmat(V):
        return np.stack([matvec(V[:, j]) for j in range(V.shape[1])], axis=1)

    return LinearOperator(
        (rows * n_outputs, prods.n_params),
        matvec=matvec,
        rmatvec=rmatvec,
        matmat=matmat,
        dtype=np.float64,
    )
