"""``G @ v`` and ``H @ v`` compiled once per model and loss
(notebook 11-curvature-and-uncertainty).

:class:`CurvatureProducts` extends the products with J of notebook 09
(:class:`jacutil.matrix_free.products.Products`) by ``ggn_chunk`` (one
forward pass carrying ``J v``, H applied at the outputs, one backward pass:
no J formed) and ``hvp_chunk`` (forward over reverse), each one compiled
graph per loss and input shape. A recurrent layer that keeps its
``while_loop`` carries no tangent in TF 2.21 (``jacutil.core.formulation``):
there both run reverse over reverse instead. :func:`curvature_inputs` checks
what every curvature entry takes (x, y, sample_weight, the loss) once.
"""

from dataclasses import dataclass

import numpy as np

from ..core import cache
from ..core._shared import joined_gradients, or_zeros, sizes_of
from ..core._tf import tf
from ..core.arguments import check_chunk_size, refuse_non_finite
from ..core.batch import as_batch, n_samples, signature, signature_key, take
from ..core.data import read_data
from ..core.formulation import kept_loops, new_ops, quiet_function, refuse_hidden_reads
from ..core.guards import require_connected
from ..core.outputs import output_layout
from ..core.planner import sum_chunks
from ..core.target import resolve_target, variable_list, watched
from ..matrix_free.products import Products
from .losses import losses_for


class CurvatureProducts(Products):
    """Compiled ``G @ v`` and ``H @ v`` of one model, for any loss.

    Kept per model, variables and chunk size by :func:`curvature_products`;
    each product is compiled once per loss (``HeadLosses.key``) and input
    shape, so an operator made again on the same model traces nothing new.
    Arguments as :class:`jacutil.matrix_free.products.Products`.
    """

    def __init__(self, target, chunk_size=None, owner=None):
        super().__init__(target, chunk_size, "forward", owner)
        self.forward_mode = not kept_loops(target)

    def _tangents(self, tracked, v, build):
        """``build()`` under a forward accumulator carrying ``v``; returns
        ``(value, accumulator)``."""
        with tf.autodiff.ForwardAccumulator(tracked, self._split(v)) as accumulator:
            value = build()
        return value, accumulator

    def ggn_chunk(self, loss, x, w, v, t=None):
        """``sum_i J_i.T W_i H_i J_i v`` over one chunk ``x``, shape (m,).

        ``loss``: a ``HeadLosses``; ``w``: the weights (n, l); ``t``: the
        heads' targets, for a loss whose H depends on them (else None).
        """
        self.trace_count += 1
        tracked = [watched(w) for w in self.variables]
        with self._traced(), new_ops() as created, tf.GradientTape() as tape:
            tape.watch(tracked)
            if self.forward_mode:
                y, accumulator = self._tangents(
                    tracked, v, lambda: self.target.forward(x)
                )
                jv = or_zeros(accumulator.jvp(y), y)
            else:
                y = self.target.forward(x)
        if self.forward_mode:
            refuse_hidden_reads(created, tracked)
        else:
            jv = self._jvp_double_backward(x, v)
        hjv = w * loss.hessian_product_tf(tf.stop_gradient(y), jv, t)
        grads = tape.gradient(y, tracked, output_gradients=hjv)
        require_connected(grads, tracked)
        return joined_gradients(grads, sizes_of(self.variables), y.dtype)

    def hvp_chunk(self, loss, x, t, w, v):
        """The Hessian of one chunk's weighted loss times ``v``, shape (m,);
        ``t``: the heads' targets, one (n, .) tensor each; ``w``: (n, l)."""
        self.trace_count += 1
        tracked = [watched(w) for w in self.variables]

        def gradient():
            with tf.GradientTape() as inner:
                inner.watch(tracked)
                value = loss.value_tf(self.target.forward(x), t, w)
            grads = inner.gradient(value, tracked)
            require_connected(grads, tracked)
            return [or_zeros(g, w) for g, w in zip(grads, tracked, strict=True)]

        with self._traced(), new_ops() as created:
            if self.forward_mode:
                grads, accumulator = self._tangents(tracked, v, gradient)
                products = [
                    or_zeros(accumulator.jvp(g), g) for g in grads
                ]  # fmt: skip
            else:
                with tf.GradientTape() as outer:
                    outer.watch(tracked)
                    grads = gradient()
                    score = tf.add_n(
                        [
                            tf.reduce_sum(g * p)
                            for g, p in zip(grads, self._split(v), strict=True)
                        ]
                    )
                products = outer.gradient(score, tracked)
        if self.forward_mode:
            refuse_hidden_reads(created, tracked)
        return joined_gradients(products, sizes_of(self.variables), self.target.dtype)

    def _compiled(self, kind, loss, x, w, t=None):
        widths = None if t is None else tuple(a.shape[1] for a in t)
        key = (kind, loss.key, signature_key(x), w.shape[1], widths)

        def build():
            dtype = self.target.dtype
            specs = [
                signature(x),
                tf.TensorSpec([None, w.shape[1]], dtype),
                tf.TensorSpec([self.n_params], dtype),
            ]
            if t is not None:
                specs.append([tf.TensorSpec([None, k], dtype) for k in widths])
            if kind == "ggn":

                def method(x, w, v, t=None):
                    return self.ggn_chunk(loss, x, w, v, t)

            else:

                def method(x, w, v, t):
                    return self.hvp_chunk(loss, x, t, w, v)

            return quiet_function(method, input_signature=specs)

        return self._functions.get(key, build)

    def product(self, kind, loss, x, v, w, t):
        """``G @ v`` (``kind="ggn"``) or ``H @ v`` (``"hvp"``), (m,), for a
        checked batch ``x``, summed over its chunks; ``w``: the weights
        (n, l); ``t``: the heads' targets (one array each), or None."""
        self._check_shapes()
        v = tf.constant(self._vector(v, self.n_params, "v", "one number per parameter"))
        function = self._compiled(kind, loss, x, w, t)

        def part(a, b):
            args = [take(x, a, b), tf.constant(w[a:b]), v]
            if t is not None:
                args.append([tf.constant(part[a:b]) for part in t])
            return function(*args)

        return sum_chunks(self._chunks(x), part).astype(self.target.dtype)

    def outputs(self, x):
        """The model's outputs on a checked batch, as rows (n, l), NumPy."""
        parts = [self.target.forward(take(x, a, b)).numpy() for a, b in self._chunks(x)]
        return np.concatenate(parts)


def curvature_for(model, variables, options, make):
    """What ``make(target)`` builds for ``model`` (a Keras model, or a
    callable ``f(x)`` with ``variables``; None: the trainable ones), kept in
    :mod:`jacutil.core.cache` per variables and ``options`` (a hashable tuple
    of what else it depends on: the loss's key, the chunk size) as long as
    the model lives (notebook 11)."""
    target = resolve_target(model, variables, False)
    key = (options, *map(id, target.variables))
    return cache.kept("curvature", model, key, lambda: make(target))


def curvature_products(model, *, variables=None, chunk_size=None):
    """The model's :class:`CurvatureProducts` for ``variables`` (default:
    the trainable ones) and ``chunk_size`` (samples per slice, or None),
    cached per model (:func:`curvature_for`)."""
    return curvature_for(
        model,
        variables,
        ("products", chunk_size),
        lambda target: CurvatureProducts(target, chunk_size, owner=model),
    )


def products_operator(kind, model, x, loss, y, sample_weight, variables, chunk_size):
    """G (``kind="ggn"``) or the loss's Hessian (``"hvp"``) as a symmetric
    ``scipy.sparse.linalg.LinearOperator`` (m, m), float64, whose products
    (:meth:`CurvatureProducts.product`) read the variables when applied:
    what ``ggn_operator`` and ``hessian_operator`` return, from their
    arguments."""
    from scipy.sparse.linalg import LinearOperator

    chunk_size = check_chunk_size(chunk_size)
    variables = None if variables is None else variable_list(variables)
    products = curvature_products(model, variables=variables, chunk_size=chunk_size)
    given = curvature_inputs(model, products.target, x, loss, y, sample_weight)
    t = given.targets if kind == "hvp" or given.loss.needs_targets else None
    m = products.n_params

    def matvec(v):
        total = products.product(
            kind, given.loss, given.batch, np.ravel(v), given.weights, t
        )
        return total.astype(np.float64)

    return LinearOperator((m, m), matvec=matvec, rmatvec=matvec, dtype=np.float64)


@dataclass
class CurvatureInputs:
    """What a curvature entry computes from, checked.

    Args:
        batch: x as a checked batch.
        n: the number of samples.
        n_outputs: l, a sample's outputs.
        loss: the model's ``HeadLosses``.
        targets: the heads' targets, one (n, .) array each, or None.
        weights: each sample's weight per output, (n, l).
    """

    batch: object
    n: int
    n_outputs: int
    loss: object
    targets: list | None
    weights: np.ndarray

    def trivial_weights(self):
        """True when every weight is one (a plain sum)."""
        return bool(np.all(self.weights == 1))


def checked_sample_weight(sample_weight, n):
    """``sample_weight`` as (n,) non-negative finite floats, or None."""
    if sample_weight is None:
        return None
    w = np.asarray(sample_weight, dtype=np.float64)
    if w.shape not in ((n,), (n, 1)):
        raise ValueError(
            f"sample_weight has shape {w.shape}; it needs one weight per sample, "
            f"shape ({n},)."
        )
    refuse_non_finite(w, "sample_weight")
    if np.any(w < 0):
        raise ValueError(
            f"sample_weight holds {int(np.sum(w < 0))} negative weight(s); "
            "G = sum_i w_i J_i.T H_i J_i needs w_i >= 0."
        )
    return w.reshape(n)


def curvature_inputs(model, target, x, loss, y=None, sample_weight=None):
    """Check ``x``, ``y``, ``sample_weight`` and the loss for ``target``.

    The batch is checked first (``as_batch``: no empty x), NaN and infinity
    are refused in x and y, and the model's graph is traced once to find its
    heads and refuse a cross-entropy on probabilities.

    ``model`` is what the heads are kept for, ``target`` its
    :class:`jacutil.core.target.Target`; the rest as ``ggn_operator`` takes
    them. Returns a :class:`CurvatureInputs`.

    Raises:
        ValueError: a bad x, y, sample_weight or loss; a loss differentiated
            as given without y.
    """
    x, y, sample_weight = read_data(x, y, sample_weight)
    batch = as_batch(x, target)
    refuse_non_finite(batch, "x")
    n = int(n_samples(batch))
    n_outputs = output_layout(target, batch).n_outputs
    loss = losses_for(loss, model, call=target.call, spec=signature(batch))
    targets = None
    if y is not None:
        refuse_non_finite(y, "y")
        targets = loss.head_targets(y, n, n_outputs, target.dtype)
    elif loss.needs_targets:
        raise ValueError(
            "this loss is differentiated as given, so its Hessian may depend on "
            "the targets: pass y= (one array per output)."
        )
    weights = loss.row_weights(
        n, n_outputs, checked_sample_weight(sample_weight, n), targets, target.dtype
    )
    return CurvatureInputs(batch, n, n_outputs, loss, targets, weights)
