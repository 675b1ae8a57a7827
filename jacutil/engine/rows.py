"""The Jacobian's rows, chunk by chunk: slices of the batch through the
compiled Jacobian (:mod:`jacutil.engine.compiled`), on the planner's chunks
(:mod:`jacutil.core.planner`). Stage 4 teaches it (notebook 04-chunked)."""

from ..core._shared import is_path
from ..core.batch import as_batch, n_samples, take
from ..core.data import (
    BatchesOfShapes,
    inputs_of,
    is_data_source,
    read_data,
    rows_by_shape,
    stream_rows,
)
from ..core.outputs import output_layout
from ..core.planner import (
    XLA_FACTOR,
    bytes_per_sample,
    chunk_size_for,
    plan_chunks,
    run_chunks,
)
from ..core.resume import check_key, run_record
from .compiled import bucket_size, compiled_for


def chunked_jacobian(
    model,
    x,
    *,
    chunk_size=None,
    memory_budget=None,
    out=None,
    progress=True,
    variables=None,
    training=False,
    jit_compile=False,
    method="per_sample",
    key=None,
    steps=None,
):
    """Per-sample Jacobian computed chunk by chunk into a preallocated array.

    Slices of ``chunk_size`` samples run through the compiled Jacobian (the
    same compiled function on every call for a given model, so nothing is
    retraced) and are written into ``out``: a NumPy array, or a memory-mapped
    ``.npy`` from ``np.lib.format.open_memmap`` for a Jacobian larger than
    memory. With ``jit_compile`` a short last chunk is padded to the next
    power of two, so XLA compiles at most two shapes per chunk size.

    ``out`` may also be a path (``"J.npy"``): the rows go into that ``.npy``
    file and a ledger beside it records each finished chunk, so a run that is
    interrupted and called again with the same arguments skips what is done;
    with other weights or ``x`` it is refused (``jacutil.core.resume``, notebook
    ``10-beyond-one-machine``). Without ``chunk_size`` a new file takes the
    one from ``memory_budget``, a resumed file its own. When the first chunk
    is the whole batch and no ``out`` is given, it is returned after one copy
    out of TensorFlow. Introduced in ``04-chunked``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        x: the n samples (an array, or a list or dict of arrays), or what
            ``model.predict`` takes: a ``tf.data.Dataset`` (batched or not,
            ``padded_batch`` too), a ``keras.utils.PyDataset`` or a generator,
            read once by Keras's data adapter
            (:func:`jacutil.core.data.read_data`).
        chunk_size: samples per chunk; None: the largest chunk whose working
            memory fits ``memory_budget``.
        memory_budget: bytes, when ``chunk_size`` is None; by default the
            planner's (:func:`jacutil.core.planner.memory_budget_for`: 64 MiB
            where all the rows fit in it, else half the memory free now).
        out: None, an array of shape (n, l, m) (a memmap too), or a ``.npy``
            path for a resumable run.
        progress: show a progress bar over samples.
        variables: the variables to differentiate (default: trainable ones).
        training: run the model in training mode.
        jit_compile: compile with XLA.
        method: as in :func:`jacutil.compiled_jacobian`.
        key: with ``out=path``, a name you choose for what a plain function
            (not a Keras model) computes, kept in the ledger, since no
            fingerprint can see inside a function.
        steps: the batches of a dataset or generator to read (as in
            ``model.predict``); needed where its length is not known.

    Returns:
        ``out`` (created when not given), shape (n, l, m); for a path, the
        file opened read-only.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, chunked_jacobian
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> chunked_jacobian(model, x, chunk_size=3, progress=False).shape
        (4, 2, 8)
    """

    def group(x, y, sample_weight):  # a batch, or batches of one shape
        return chunked_jacobian(
            model, x, chunk_size=chunk_size, memory_budget=memory_budget,
            progress=False, variables=variables, training=training,
            jit_compile=jit_compile, method=method,
        )  # fmt: skip

    if is_data_source(x) and out is not None and not is_path(out):  # streamed
        return stream_rows(x, group, out, steps=steps, inputs=inputs_of(model),
                           progress=progress)  # fmt: skip
    try:  # a dataset: its x, in order
        x = read_data(x, repeatable=is_path(out), steps=steps,
                      inputs=inputs_of(model))[0]  # fmt: skip
    except BatchesOfShapes as shapes:  # padded_batch: one group at a time
        return rows_by_shape(shapes, group, out, resumable=is_path(out))
    jac = compiled_for(model, variables, training, jit_compile, method, x)
    target = jac.target
    x = as_batch(x, target)
    n_rows = int(n_samples(x))
    n_outputs = output_layout(target, x).n_outputs
    sizes = (n_outputs, target.n_params, target.dtype.itemsize)
    activations = jac.activation_elements(x)
    xla = XLA_FACTOR if jit_compile else 1

    def chunk_for(budget):
        return chunk_size_for(
            budget / xla, *sizes, activations=activations, method=method
        )

    # all rows in one piece; the batch method's activations span the batch
    across = n_rows if method == "batch" else 1
    working = xla * n_rows * bytes_per_sample(*sizes, activations * across)
    plan = plan_chunks(
        n_rows, chunk_size=chunk_size, memory_budget=memory_budget,
        chunk_for=chunk_for, working=working,
    )  # fmt: skip
    check_key(key, model, out)
    record = run_record(jac, model, x, key) if is_path(out) else None

    def compute(start, stop):  # XLA pads a short last chunk to a whole one at most
        whole = stop - start if stop < n_rows else max(stop - start, plan.chunk_size)
        return chunk_rows(jac, x, whole, start)

    shape = (n_rows, n_outputs, target.n_params)
    return run_chunks(
        plan, compute, out, shape=shape, dtype=target.dtype, record=record,
        progress=progress,
    )  # fmt: skip


def chunk_rows(jac, x, chunk_size, start):
    """Rows ``start..`` of J (one chunk of c = ``chunk_size`` samples of the
    batch ``x``) as a (c, l, m) tensor from ``jac`` (``compiled_for``); under
    XLA a short last chunk is padded to its own power of two (one more
    compile), not a full one."""
    stop = min(start + chunk_size, int(n_samples(x)))
    pad_to = bucket_size(stop - start, chunk_size) if jac.jit_compile else None
    return jac.tensor(take(x, start, stop), pad_to)
