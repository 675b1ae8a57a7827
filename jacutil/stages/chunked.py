"""Stage 4: slices of the batch through the compiled Jacobian (notebook 04-chunked)."""

import numpy as np
from tqdm.auto import tqdm

from ..core._shared import is_path
from ..core.arguments import check_chunk_size
from ..core.batch import as_batch, n_samples, take
from ..core.data import read_data
from ..core.outputs import output_layout
from ..scale.resume import check_out, open_rows, run_record, write_rows, writer_lock
from .compiled import bucket_size, compiled_for

# Working memory of a chunk of c samples, in bytes (itemsize bytes a number;
# l outputs, m parameters; A: the activations of one sample's forward pass, as
# counted by jacutil.core.memory.activation_elements):
#
#   per_sample:  itemsize * c * l * (WORKING_MEMORY_FACTOR * m + ACTIVATION_FACTOR * A)
#   batch:       itemsize * (WORKING_MEMORY_FACTOR * l * m * c
#                            + ACTIVATION_FACTOR * l * A * c**2)
#
# The l*m term holds the chunk's rows, the per-variable blocks before they are
# joined and what TensorFlow's pool keeps; the A term the back-propagated
# signal of every output row through every layer (through the whole chunk,
# with the batch method: hence c**2). Fitted to peak resident memory measured
# in fresh processes (TensorFlow 2.21, oneDNN, 2-core x86, 2026-11-30) on nine
# models - the question's MLP, two CNNs, Conv1D stacks of 2, 6 and 12 layers,
# an unrolled LSTM, attention - at chunks from 8 to 16,000 samples: 4.2 and
# 0.9, times a margin of 1.2 (per_sample) to 1.25 (batch). With it the
# measured peak stayed at 0.5 to 1.0 of the budget (per_sample; batch up to
# 1.1), and chunks are at most about 2x smaller than the largest that fits.
# Notebook 04-chunked re-measures the first factor on the question's network.
WORKING_MEMORY_FACTOR = 5
ACTIVATION_FACTOR = 1.1
# XLA lays memory out itself: up to 1.74x the peak of the same graph without
# it (a wide CNN, batch method); the budget assumes the worst.
XLA_FACTOR = 1.75
DEFAULT_MEMORY_BUDGET = 256 * 2**20  # bytes, when neither size nor budget is given


def bytes_per_sample(n_outputs, n_params, itemsize, activations=0):
    """Estimated peak bytes that one sample costs while its rows are computed.

    ``activations``: elements of one sample's forward pass (``A`` above).

    Args:
        n_outputs: l.
        n_params: m.
        itemsize: bytes per number (8 for float64).
        activations: elements of one sample's forward pass.

    Returns:
        Bytes (int).
    """
    per_row = WORKING_MEMORY_FACTOR * n_params + ACTIVATION_FACTOR * activations
    return int(itemsize * n_outputs * per_row)


def chunk_size_for(
    memory_budget, n_outputs, n_params, itemsize, *, activations=0, method="per_sample"
):
    """The largest chunk whose working memory fits in ``memory_budget`` bytes.

    ``method="batch"`` (``tape.jacobian`` over the chunk) costs
    ``c**2`` times the activations of a row; see the constants above.

    Args:
        memory_budget: bytes.
        n_outputs: l.
        n_params: m.
        itemsize: bytes per number.
        activations: elements of one sample's forward pass.
        method: ``"per_sample"`` or ``"batch"``.

    Returns:
        Samples per chunk (int, at least 1); ValueError when one sample does
        not fit.
    """
    per_sample = bytes_per_sample(n_outputs, n_params, itemsize, activations)
    if memory_budget < per_sample:
        raise ValueError(
            f"memory_budget={memory_budget:,} bytes is smaller than one sample "
            f"needs ({per_sample:,} bytes for {n_outputs} outputs x {n_params:,} "
            "parameters and their activations). Raise the budget, or write the "
            "result to disk with out=np.lib.format.open_memmap(...)."
        )
    if method != "batch" or not activations:
        return int(memory_budget // per_sample)
    # a*c**2 + b*c = budget, with b the rows and a the activations across the chunk
    a = itemsize * n_outputs * ACTIVATION_FACTOR * activations
    b = itemsize * n_outputs * WORKING_MEMORY_FACTOR * n_params
    return max(1, int((-b + np.sqrt(b * b + 4 * a * memory_budget)) / (2 * a)))


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
    with other weights or ``x`` it is refused (``jacutil.scale.resume``, notebook
    ``10-beyond-one-machine``). Without ``chunk_size`` a new file takes the
    one from ``memory_budget``, a resumed file its own. When the first chunk
    is the whole batch and no ``out`` is given, it is returned after one copy
    out of TensorFlow. Introduced in ``04-chunked``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        x: the n samples (an array, or a list or dict of arrays), or a
            ``tf.data.Dataset`` / ``keras.utils.PyDataset`` of ``model.fit``'s
            batches, read once (:func:`jacutil.core.data.read_data`).
        chunk_size: samples per chunk; None: the largest chunk whose working
            memory fits ``memory_budget``.
        memory_budget: bytes (default 256 MiB), when ``chunk_size`` is None.
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
    x = read_data(x, repeatable=is_path(out))[0]  # a dataset: its x, in order
    jac = compiled_for(model, variables, training, jit_compile, method, x)
    target = jac.target
    if memory_budget is not None and memory_budget <= 0:
        raise ValueError(
            f"memory_budget must be a positive number of bytes; got {memory_budget}."
        )
    explicit = chunk_size is not None
    if explicit:
        chunk_size = check_chunk_size(chunk_size)

    x = as_batch(x, target)
    n_rows = int(n_samples(x))
    n_outputs = output_layout(target, x).n_outputs
    if chunk_size is None:
        budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
        chunk_size = chunk_size_for(
            budget / (XLA_FACTOR if jit_compile else 1),
            n_outputs,
            target.n_params,
            target.dtype.itemsize,
            activations=jac.activation_elements(x),
            method=method,
        )
    chunk_size = min(chunk_size, n_rows)

    def chunk(start):
        return chunk_rows(jac, x, chunk_size, start)

    shape = (n_rows, n_outputs, target.n_params)
    if is_path(out):
        record = run_record(jac, model, x, key)
        asked = chunk_size if explicit else None
        return resumable_chunks(jac, x, out, shape, record, asked, chunk_size, progress)
    if key is not None:
        raise ValueError(
            "key= names a resumable run, so it goes with out=path (a .npy "
            f"file); out is {type(out).__name__}. Leave key out, or pass "
            "out='J.npy'."
        )
    first = chunk(0)
    if out is None and chunk_size == n_rows:
        return first.numpy()  # one chunk: one copy out of TensorFlow
    if out is None:
        out = np.empty(shape, target.dtype)
    else:
        out = check_out(out, shape, target.dtype)
    # np.asarray: a view of TensorFlow's result, so each chunk is copied once
    out[:chunk_size] = np.asarray(first)
    del first
    with tqdm(total=n_rows, disable=not progress, unit="sample") as bar:
        bar.update(chunk_size)
        for start in range(chunk_size, n_rows, chunk_size):
            out[start : start + chunk_size] = np.asarray(chunk(start))
            bar.update(min(chunk_size, n_rows - start))
    return out


def chunk_rows(jac, x, chunk_size, start):
    """Rows ``start..`` of J (one chunk) as a tensor; under XLA a short last
    chunk is padded to its own power of two (one more compile), not a full one.

    Args:
        jac: a compiled Jacobian (``compiled_for``).
        x: the n samples, as a batch.
        chunk_size: c, samples per chunk.
        start: the chunk's first sample.

    Returns:
        A tensor of shape (c, l, m) (fewer rows for a short last chunk).
    """
    stop = min(start + chunk_size, int(n_samples(x)))
    pad_to = bucket_size(stop - start, chunk_size) if jac.jit_compile else None
    return jac.tensor(take(x, start, stop), pad_to)


def resumable_chunks(jac, x, path, shape, record, chunk_size, default, progress):
    """Chunks into the ``.npy`` at ``path``, skipping those an earlier run finished.

    What ``chunked_jacobian(..., out=path)`` runs (notebook 10 shows it): one
    writer at a time, each chunk on disk before the ledger records it, and the
    file checked again at the end."""
    with writer_lock(path):  # one writer at a time, for the whole run
        ledger, chunk_size = open_rows(
            path, shape, jac.target.dtype, record, chunk_size, default
        )
        done = ledger.rows_done(chunk_size)
        bar = tqdm(total=shape[0], initial=done, disable=not progress, unit="sample")
        with bar:
            for k in ledger.todo():
                start = k * chunk_size
                rows = np.asarray(chunk_rows(jac, x, chunk_size, start))
                write_rows(path, start, rows)  # on disk before the ledger says so
                ledger.done.add(k)
                ledger.save(chunk_size)
                bar.update(len(rows))
        ledger.check_file()  # not changed or cut short while the run wrote
        return np.load(path, mmap_mode="r")
