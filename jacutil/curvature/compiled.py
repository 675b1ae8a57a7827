"""``G @ v`` and ``H @ v`` compiled once per model and loss
(notebook 11-curvature-and-uncertainty).

:class:`CurvatureProducts` extends the products with J of notebook 09
(:class:`jacutil.matrix_free.products.Products`) by two products, each one
compiled graph per input shape:

* ``ggn_chunk``: ``sum_i J_i.T H_i J_i v`` - one forward pass that carries
  the tangent ``J v`` (``ForwardAccumulator``), ``H`` applied to it at the
  outputs, and one backward pass started from ``H J v``. No J is formed.
* ``hvp_chunk``: the loss's Hessian times ``v`` - forward mode over the
  reverse-mode gradient (forward over reverse).

A recurrent layer that keeps its ``while_loop`` carries no tangent in TF 2.21
(``jacutil.core.formulation``): there both run reverse over reverse instead.
"""

import numpy as np

from ..core._shared import joined_gradients, or_zeros, sizes_of
from ..core._tf import tf
from ..core.batch import as_batch, n_samples, signature, signature_key, take
from ..core.formulation import kept_loops, new_ops, quiet_function, refuse_hidden_reads
from ..core.guards import require_connected
from ..core.target import watched
from ..matrix_free.products import Products


class CurvatureProducts(Products):
    """Compiled ``G @ v`` and ``H @ v`` of one model and loss.

    Kept per model, loss and variables by :func:`curvature_products`, so an
    operator made again on the same model traces nothing new.

    Args:
        target: what is differentiated (``jacutil.core.target``).
        loss: an :class:`jacutil.curvature.losses.OutputLoss`.
        chunk_size: samples per slice, or None for the whole batch.
        owner: the model, kept alive as long as these products.
    """

    def __init__(self, target, loss, chunk_size=None, owner=None):
        super().__init__(target, chunk_size, "forward", owner)
        self.loss = loss
        self.forward_mode = not kept_loops(target)

    def _tangents(self, tracked, v, build):
        """``build()`` under a forward accumulator carrying ``v``; returns
        ``(value, accumulator)``."""
        with tf.autodiff.ForwardAccumulator(tracked, self._split(v)) as accumulator:
            value = build()
        return value, accumulator

    def ggn_chunk(self, x, v):
        """``sum_i J_i.T H_i J_i v`` over one chunk ``x``, shape (m,)."""
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
        hjv = self.loss.hessian_product_tf(tf.stop_gradient(y), jv)
        grads = tape.gradient(y, tracked, output_gradients=hjv)
        require_connected(grads, tracked)
        return joined_gradients(grads, sizes_of(self.variables), y.dtype)

    def hvp_chunk(self, x, t, v):
        """The Hessian of one chunk's summed loss times ``v``, shape (m,);
        ``t``: the targets as ``OutputLoss.targets`` gives them (n, l)."""
        self.trace_count += 1
        tracked = [watched(w) for w in self.variables]

        def gradient():
            with tf.GradientTape() as inner:
                inner.watch(tracked)
                value = self.loss.value_tf(self.target.forward(x), t)
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

    def _compiled(self, kind, x, t=None):
        key = (kind, signature_key(x))
        if key not in self._functions:
            vector = tf.TensorSpec([self.n_params], self.target.dtype)
            if kind == "ggn":
                specs = [signature(x), vector]
                method = self.ggn_chunk
            else:
                specs = [
                    signature(x),
                    tf.TensorSpec([None, t.shape[1]], t.dtype),
                    vector,
                ]
                method = self.hvp_chunk
            self._functions[key] = quiet_function(method, input_signature=specs)
        return self._functions[key]

    def ggn(self, x, v):
        """``G @ v`` for a checked batch ``x``, summed over its chunks (m,)."""
        self._check_shapes()
        v = tf.constant(self._vector(v, self.n_params, "v", "one number per parameter"))
        total = np.zeros(self.n_params, self.target.dtype)
        for a, b in self._chunks(x):
            total += self._compiled("ggn", x)(take(x, a, b), v).numpy()
        return total

    def hvp(self, x, t, v):
        """``H @ v`` of the loss summed over batch ``x`` with targets ``t`` (m,)."""
        self._check_shapes()
        v = tf.constant(self._vector(v, self.n_params, "v", "one number per parameter"))
        total = np.zeros(self.n_params, self.target.dtype)
        for a, b in self._chunks(x):
            function = self._compiled("hvp", x, t)
            total += function(take(x, a, b), tf.constant(t[a:b]), v).numpy()
        return total

    def outputs(self, x):
        """The model's outputs on a checked batch, as rows (n, l), NumPy."""
        parts = [self.target.forward(take(x, a, b)).numpy() for a, b in self._chunks(x)]
        return np.concatenate(parts)


def curvature_products(model, loss, *, variables=None, chunk_size=None):
    """The model's :class:`CurvatureProducts` for ``loss``, cached per model.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        loss: an :class:`jacutil.curvature.losses.OutputLoss`.
        variables: the variables (default: the trainable ones).
        chunk_size: samples per slice, or None.

    Returns:
        A :class:`CurvatureProducts`.
    """
    from ..core.cache import curvature_for

    return curvature_for(
        model,
        variables,
        (loss.name, loss.classes, chunk_size),
        lambda target: CurvatureProducts(target, loss, chunk_size, owner=model),
    )


def checked_batch(products, x):
    """``x`` as a checked batch of ``products``' target, and its n."""
    batch = as_batch(x, products.target)
    return batch, int(n_samples(batch))
