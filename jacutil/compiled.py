"""Stage 3: the Jacobian compiled with tf.function and XLA (notebook 03-compiled)."""

import numpy as np

from ._tf import tf
from .guards import note_trace
from .target import as_batch, resolve_target
from .vectorized import batch_tape_jacobian, per_sample_tape_jacobian

METHODS = {"per_sample": per_sample_tape_jacobian, "batch": batch_tape_jacobian}


def bucket_size(n_samples, block_size):
    """Padded batch size for XLA: the next power of two, capped at block_size."""
    return min(block_size, 1 << max(0, int(n_samples - 1).bit_length()))


class CompiledJacobian:
    """A reusable, compiled ``jac(x)``; see :func:`compiled_jacobian`.

    ``trace_count`` counts the traces of the underlying ``tf.function`` and
    ``compiled_shapes`` the batch sizes that XLA has seen (one compile each).
    """

    def __init__(self, target, method, jit_compile, block_size):
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
        self._function = None

    def _build(self, feature_shape):
        jacobian = METHODS[self.method]

        def traced(x):
            self.trace_count += 1  # Python side effect: runs once per trace
            note_trace(self.target.variables, (self.method, self.jit_compile))
            return jacobian(self.target, x)

        spec = tf.TensorSpec([None, *feature_shape], self.target.dtype)
        self._function = tf.function(
            traced, input_signature=[spec], jit_compile=self.jit_compile
        )
        self.target.feature_shape = tuple(feature_shape)

    def tensor(self, x, pad_to=None):
        """The Jacobian of a checked batch as a tensor, padded to ``pad_to`` rows.

        Padding with zero samples gives XLA the same shape every time; the
        padded rows are cut off again (each sample's rows depend on it alone).
        """
        if self._function is None:
            self._build(x.shape[1:])
        n_samples = x.shape[0]
        if pad_to is not None and pad_to > n_samples:
            padding = [[0, pad_to - n_samples]] + [[0, 0]] * (x.shape.rank - 1)
            x = tf.pad(x, padding)
        if self.jit_compile:
            self.compiled_shapes.add(int(x.shape[0]))
        return self._function(x)[:n_samples]

    def __call__(self, x):
        """Return the (n_samples, n_outputs, n_params) Jacobian of ``x``."""
        x = as_batch(x, self.target)
        if not self.jit_compile:
            return self.tensor(x).numpy()
        n_samples = x.shape[0]
        if n_samples <= self.block_size:
            return self.tensor(x, bucket_size(n_samples, self.block_size)).numpy()
        blocks = [
            self.tensor(x[i : i + self.block_size], self.block_size).numpy()
            for i in range(0, n_samples, self.block_size)
        ]
        return np.concatenate(blocks)


def compiled_jacobian(
    model,
    *,
    jit_compile=False,
    variables=None,
    training=False,
    method="per_sample",
    block_size=1024,
):
    """Return a reusable ``jac(x)`` that computes the per-sample Jacobian in a graph.

    The ``tf.function`` has an input signature whose batch dimension is
    ``None``, so a new number of samples does not retrace it (see
    ``jac.trace_count``). With ``jit_compile=True`` XLA compiles once per
    concrete shape, so the batch is padded to a power of two up to
    ``block_size`` and larger batches run in blocks of ``block_size``: at most
    ``log2(block_size) + 1`` compiles, whatever the sizes (``jac.compiled_shapes``).

    ``method`` is ``"per_sample"`` (``tf.vectorized_map``, linear in n) or
    ``"batch"`` (``tape.jacobian`` over the batch, quadratic in n).

    ``jac(x)`` returns (n_samples, n_outputs, n_params). Introduced in
    ``03-compiled``.
    """
    target = resolve_target(model, variables, training)
    return CompiledJacobian(target, method, jit_compile, block_size)
