"""Stage 3: the Jacobian compiled with tf.function and XLA (notebook 03-compiled)."""

import numpy as np

from ._tf import tf
from .batch import as_batch, n_samples, pad_with_last, signature, signature_key, take
from .formulation import batch_tensor, per_sample_tensor, quiet_function
from .guards import note_trace
from .outputs import output_layout
from .target import resolve_target

METHODS = ("per_sample", "batch")


def bucket_size(n_samples, block_size):
    """Padded batch size for XLA: the next power of two, capped at block_size."""
    return min(block_size, 1 << max(0, int(n_samples - 1).bit_length()))


class CompiledJacobian:
    """A reusable, compiled ``jac(x)``; see :func:`compiled_jacobian`.

    ``trace_count`` counts the traces of the underlying ``tf.function`` (one
    per input shape: a new number of samples does not retrace),
    ``compiled_shapes`` the batch sizes that XLA has seen (one compile each),
    and ``formulation`` says how the last trace computes the Jacobian.
    """

    def __init__(self, target, method, jit_compile, block_size, owner=None):
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
        self._owner = owner  # keeps the model alive as long as jac
        self._functions = {}  # input signature -> tf.function

    def _build(self, x):
        """A ``tf.function`` for batches like ``x``: any n, the same features."""

        def traced(x):
            self.trace_count += 1  # Python side effect: runs once per trace
            note_trace(self.target.variables, (self.method, self.jit_compile))
            return self._jacobian(x)

        return quiet_function(
            traced, input_signature=[signature(x)], jit_compile=self.jit_compile
        )

    def _jacobian(self, x):
        method = batch_tensor if self.method == "batch" else per_sample_tensor
        J, self.formulation = method(self.target, x, self.jit_compile)
        return J

    def tensor(self, x, pad_to=None):
        """The Jacobian of a checked batch as a tensor, padded to ``pad_to`` rows.

        Padding gives XLA the same shape every time. The padded rows are
        copies of the last sample, and they are cut off again.
        """
        key = signature_key(x)
        if key not in self._functions:
            self._functions[key] = self._build(x)
        n_rows = n_samples(x)
        if pad_to is not None and pad_to > n_rows:
            x = pad_with_last(x, pad_to)
        if self.jit_compile:
            self.compiled_shapes.add(int(n_samples(x)))
        return self._run(key, x)[:n_rows]

    def _run(self, key, x):
        try:
            return self._functions[key](x)
        except tf.errors.InvalidArgumentError as error:
            if not (self.jit_compile and "XLA" in str(error)):
                raise
        # XLA cannot compile this formulation (tf.map_fn's TensorList): use
        # the same graph without XLA for these shapes.
        function = self._functions[key]
        self._functions[key] = quiet_function(
            function.python_function, input_signature=function.input_signature
        )
        result = self._functions[key](x)
        self.formulation += ", without XLA (XLA cannot compile it)"
        return result

    def __call__(self, x):
        """Return the (n_samples, n_outputs, n_params) Jacobian of ``x``."""
        x = as_batch(x, self.target)
        output_layout(self.target, x)  # checks the outputs, once per shape
        if not self.jit_compile:
            return self.tensor(x).numpy()
        n_rows = int(n_samples(x))
        if n_rows <= self.block_size:
            return self.tensor(x, bucket_size(n_rows, self.block_size)).numpy()
        blocks = [
            self.tensor(take(x, i, i + self.block_size), self.block_size).numpy()
            for i in range(0, n_rows, self.block_size)
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
    ``jac.trace_count``); a new per-sample shape (another sequence length)
    traces once more. With ``jit_compile=True`` XLA compiles once per
    concrete shape, so the batch is padded to a power of two up to
    ``block_size`` and larger batches run in blocks of ``block_size``: at most
    ``log2(block_size) + 1`` compiles, whatever the sizes (``jac.compiled_shapes``).

    ``method`` is ``"per_sample"`` (``tf.vectorized_map``, linear in n) or
    ``"batch"`` (``tape.jacobian`` over the batch, quadratic in n).
    ``jac.formulation`` says how the model is vectorized (recurrent layers
    are unrolled; see ``jacutil.formulation``).

    ``jac(x)`` returns (n_samples, n_outputs, n_params). Introduced in
    ``03-compiled``.
    """
    target = resolve_target(model, variables, training)
    return CompiledJacobian(target, method, jit_compile, block_size, owner=model)
