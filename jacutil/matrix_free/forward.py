"""The whole per-sample Jacobian by forward mode (notebook 09-matrix-free).

Reverse mode gets J one output row at a time: l backward passes per sample.
Forward mode gets it one parameter column at a time: a JVP along the unit
vector e_p gives column p for every sample and output at once, so m forward
passes in all, vectorized over the columns (``tf.vectorized_map`` of a
``ForwardAccumulator``). It wins when there are fewer parameters than
outputs (m <= l): small models with wide outputs, a few parameters of a
physical model fitted to long signals.
"""

import numpy as np

from ..core import cache
from ..core._shared import or_zeros, sizes_of
from ..core._tf import tf
from ..core.batch import as_batch, n_samples, signature, signature_key
from ..core.cache import PerSignature
from ..core.formulation import (
    new_ops,
    onednn_hazards,
    quiet_function,
    recurrent_layers,
    refuse_hidden_reads,
    refuse_kept_loops,
    unrolled,
)
from ..core.outputs import output_layout
from ..core.second_order import ensure_second_order
from ..core.target import resolve_target, watched

COLUMNS_PER_PASS = 64  # parameter columns vectorized together


class ForwardJacobian:
    """A reusable forward-mode ``jac(x)`` of ``target``, ``columns_per_pass``
    (c, positive) columns of J per pass; see :func:`forward_jacobian`.

    ``trace_count`` counts the traces (one per input shape); ``owner``, the
    model, is kept alive as long as this object (None: cached).
    """

    def __init__(self, target, columns_per_pass, owner=None):
        self.target = target
        self._owner = owner
        self.columns = int(columns_per_pass)
        if self.columns <= 0:
            raise ValueError(
                f"columns_per_pass must be positive; got {columns_per_pass}."
            )
        self.trace_count = 0
        self._functions = PerSignature()
        ensure_second_order()  # forward mode differentiates gradient ops

    def jvp_columns(self, x, tangents):
        """(n, l, c): the JVPs of batch x along the c rows of ``tangents``.

        With the unit vectors as tangents, c columns of J at once: what each
        pass of ``forward_jacobian`` compiles (notebook 09 shows it)."""
        self.trace_count += 1
        variables = self.target.variables
        tracked = [watched(v) for v in variables]
        sizes = sizes_of(variables)

        def along(tangent):
            parts = tf.split(tangent, sizes)
            shaped = [
                tf.reshape(p, v.shape) for p, v in zip(parts, variables, strict=True)
            ]
            with new_ops() as created:
                with tf.autodiff.ForwardAccumulator(tracked, shaped) as accumulator:
                    y = self.target.forward(x)
            refuse_hidden_reads(created, tracked)
            return or_zeros(accumulator.jvp(y), y)

        with unrolled(recurrent_layers(self.target)):
            columns = tf.vectorized_map(along, tangents)  # (c, n, l)
        return tf.transpose(columns, [1, 2, 0])

    def __call__(self, x):
        """J of the samples ``x`` by forward mode, c columns per pass: an
        (n, l, m) array in the variables' dtype. ``ForwardModeBlindSpot``
        where the model holds something TensorFlow 2.21's forward mode gets
        wrong in a graph (see :mod:`jacutil.core.formulation`)."""
        refuse_kept_loops(self.target)
        x = as_batch(x, self.target)
        n_outputs = output_layout(self.target, x).n_outputs
        m = self.target.n_params
        columns = min(self.columns, m)  # no JVPs along padding when m is small

        def build():
            specs = [signature(x), tf.TensorSpec([columns, m], self.target.dtype)]
            function = quiet_function(self.jvp_columns, input_signature=specs)
            graph = function.get_concrete_function().graph
            if onednn_hazards(graph.get_operations()):  # see core.formulation
                self.trace_count -= 1  # that trace never runs: the XLA one does
                function = quiet_function(
                    self.jvp_columns, input_signature=specs, jit_compile=True
                )
            return function

        function = self._functions.get(signature_key(x), build)
        out = np.empty((int(n_samples(x)), n_outputs, m), self.target.dtype)
        eye = np.eye(columns, m, dtype=self.target.dtype)
        for start in range(0, m, columns):
            stop = min(start + columns, m)
            tangents = np.roll(eye, start, axis=1)  # e_start, e_start+1, ...
            tangents[stop - start :] = 0  # past m: no column
            block = function(x, tf.constant(tangents))
            out[:, :, start:stop] = np.asarray(block)[:, :, : stop - start]
        return out


def forward_jacobian(
    model, x=None, *, variables=None, training=False, columns_per_pass=COLUMNS_PER_PASS
):
    """The (n, l, m) per-sample Jacobian by forward mode, one JVP per parameter.

    ``columns_per_pass`` JVPs run together in ``tf.vectorized_map``; each
    gives one column for every sample and output. Faster than the
    reverse-mode stages when m <= l (see notebook 09). Introduced in
    ``09-matrix-free``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        x: the n samples, or None for the reusable ``jac(x)`` (compiled once
            per input shape).
        variables: the variables to differentiate (default: trainable ones).
        training: run the model in training mode.
        columns_per_pass: JVPs (columns of J) per vectorized pass.

    Returns:
        A NumPy array of shape (n, l, m), or, without ``x``, ``jac``.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, forward_jacobian
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> forward_jacobian(model, x).shape  # (n, l, m)
        (4, 2, 8)
    """
    target = resolve_target(model, variables, training, x)
    jac = ForwardJacobian(target, columns_per_pass, owner=model)
    return jac if x is None else jac(x)


def forward_for(model, variables, training):
    """The model's :class:`ForwardJacobian` (arguments as
    :func:`forward_jacobian`), compiled once per input shape and kept in
    :mod:`jacutil.core.cache` as long as the model lives."""
    target = resolve_target(model, variables, training)
    key = (training, *map(id, target.variables))
    return cache.kept(
        "forward", model, key, lambda: ForwardJacobian(target, COLUMNS_PER_PASS)
    )
