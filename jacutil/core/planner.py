"""The planner: how much fits, in what chunks, into what output (notebook 04-chunked).

Every entry that loops over samples plans here, once: its arguments checked
(:mod:`jacutil.core.arguments`), a memory budget (:func:`memory_budget_for`)
turned into a chunk size by the working-memory model below
(:func:`chunk_size_for`), the chunks' bounds (:class:`Plan`), and one loop
that runs ``compute(start, stop)`` over them: rows into a new array, a given
array or memmap, or a resumable ``.npy`` (:func:`run_chunks`,
:func:`resumable_chunks`; the ledger and lock: :mod:`jacutil.core.resume`), or
a running sum (:func:`sum_chunks`: JᵀJ, Jᵀr, the Fishers, KFAC's factors).
An entry supplies only its bytes per sample and ``compute``.
"""

from dataclasses import dataclass, replace

import numpy as np
import tensorflow as tf
from tqdm.auto import tqdm

from ._shared import ceil_div, is_path
from .arguments import check_chunk_size, check_memory_budget
from .memory import available_bytes
from .resume import SumCheckpoint, check_out, open_rows, write_rows, writer_lock

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


SMALL_BYTES = 64 * 2**20  # working memory that never needs chunks


def memory_budget_for(memory_budget, working, look=False):
    """The memory budget of a call, in bytes: ``memory_budget`` (checked), or
    by default half the memory free now - looked up only when the predicted
    ``working`` memory (bytes) may not fit in ``SMALL_BYTES`` (or when
    ``look``: to explain the choice).

    Examples:
        >>> memory_budget_for(2**20, working=10 * 2**30)  # given: kept
        1048576
        >>> memory_budget_for(None, working=1000) == SMALL_BYTES  # small work
        True
    """
    if memory_budget is not None:
        return check_memory_budget(memory_budget)
    if working <= SMALL_BYTES and not look:
        return SMALL_BYTES  # fits, whatever is free: no need to look
    return max(1, available_bytes())


@dataclass(frozen=True)
class Plan:
    """``n_rows`` samples in chunks of ``chunk_size`` (the last may be shorter).

    Iterating gives each chunk's ``(start, stop)``; :func:`plan_chunks` makes
    one. ``asked`` is the chunk size the caller gave, or None (from the
    ``budget``, in bytes): a resumed file must have the one asked for, or
    keeps its own. ``working``: the predicted bytes of all rows in one piece.

    Examples:
        >>> plan = Plan(n_rows=5, chunk_size=2)
        >>> plan.n_chunks, list(plan), plan.chunk(2)
        (3, [(0, 2), (2, 4), (4, 5)], (4, 5))
    """

    n_rows: int
    chunk_size: int
    asked: int | None = None
    budget: int = 0
    working: int = 0

    @property
    def n_chunks(self):
        """How many chunks (an ``int``; 1: one call)."""
        return ceil_div(self.n_rows, self.chunk_size)

    def chunk(self, k):
        """``(start, stop)`` of chunk ``k``."""
        start = k * self.chunk_size
        return start, min(start + self.chunk_size, self.n_rows)

    def __iter__(self):
        return (self.chunk(k) for k in range(self.n_chunks))

    def __len__(self):
        return self.n_chunks

    def bounds(self, progress=False):
        """Each chunk's ``(start, stop)``, with a progress bar over chunks."""
        return tqdm(self, total=self.n_chunks, disable=not progress, unit="chunk")

    def __str__(self):
        return f"{self.n_chunks} chunk(s) of {self.chunk_size} samples"


def plan_chunks(
    n_rows, *, chunk_size=None, memory_budget=None, per_sample=0, chunk_for=None,
    working=None, look=False,
):  # fmt: skip
    """Check ``chunk_size`` and ``memory_budget``, and plan the chunks.

    An explicit ``chunk_size`` wins; otherwise the call's budget gives the
    chunk (:func:`memory_budget_for`, the one policy of every entry:
    ``memory_budget``, or by default ``SMALL_BYTES`` where all the ``working``
    memory fits in it, else half the memory free now): ``chunk_for(budget)``
    for a memory model that is not linear in the chunk (:func:`chunk_size_for`
    with ``method="batch"``), else ``budget // per_sample``; neither: one
    chunk. Always at least 1 sample and at most ``n_rows``. ``per_sample``:
    the bytes one sample costs (:func:`bytes_per_sample`); ``working``: of
    all the rows in one piece (default ``per_sample * n_rows``); ``look``:
    look up the free memory whatever the work (to explain the choice).
    Returns a :class:`Plan`; the checks are :mod:`jacutil.core.arguments`'.

    Examples:
        >>> plan_chunks(10, chunk_size=4).chunk_size
        4
        >>> plan = plan_chunks(10, memory_budget=3000, per_sample=1000)
        >>> plan.chunk_size, plan.n_chunks, plan.working
        (3, 4, 10000)
        >>> plan_chunks(10, chunk_size=0)
        Traceback (most recent call last):
        ValueError: chunk_size must be at least 1; got 0. ...
    """
    asked = check_chunk_size(chunk_size)
    working = per_sample * n_rows if working is None else working
    budget = memory_budget_for(memory_budget, working, look)
    if asked is not None:
        size = asked
    elif chunk_for is not None:
        size = chunk_for(budget)
    else:
        size = budget // per_sample if per_sample else n_rows
    size = max(1, min(int(size), n_rows))
    return Plan(n_rows, size, asked, budget, working)


def run_chunks(plan, compute, out=None, *, shape, dtype, record=None, progress=False):
    """``compute(start, stop)`` on each chunk of ``plan``, into ``out``.

    ``out`` is None (a new array; in one chunk, what ``compute`` returns,
    a tensor copied out once), an array or memmap of ``shape`` and ``dtype``
    (checked: :func:`jacutil.core.resume.check_out`), or a ``.npy`` path:
    a resumable run (:func:`resumable_chunks`, which needs ``record``).

    Args:
        plan: a :class:`Plan`.
        compute: ``compute(start, stop)``: the rows of samples
            ``start:stop``, an array or a tensor.
        out: None, an array, or a path.
        shape: the whole result's shape, ``n_rows`` first.
        dtype: its dtype.
        record: with a path, what identifies the run
            (:func:`jacutil.core.resume.run_record`).
        progress: show a progress bar over samples.

    Returns:
        ``out`` (created when not given); for a path, the file read-only.

    Examples:
        >>> plan = plan_chunks(5, chunk_size=2)
        >>> run_chunks(plan, lambda a, b: np.arange(a, b), shape=(5,), dtype=int)
        array([0, 1, 2, 3, 4])
    """
    if is_path(out):
        return resumable_chunks(out, plan, compute, shape, dtype, record, progress)
    if out is None and plan.n_chunks == 1:
        rows = compute(0, plan.n_rows)  # one chunk: one copy out of TensorFlow
        return rows.numpy() if hasattr(rows, "numpy") else rows
    out = np.empty(shape, dtype) if out is None else check_out(out, shape, dtype)
    with tqdm(total=plan.n_rows, disable=not progress, unit="sample") as bar:
        for start, stop in plan:
            # np.asarray: a view of TensorFlow's result, so each chunk is copied once
            out[start:stop] = np.asarray(compute(start, stop))
            bar.update(stop - start)
    return out


def sum_chunks(plan, compute, *, progress=False, checkpoint=None, record=None):
    """The sum over the chunks of ``plan`` of ``compute(start, stop)``.

    What every entry that accumulates over samples runs (G, the Fishers and
    their products, KFAC's factors, a Laplace precision, JᵀJ and Jᵀr): one
    chunk's working memory at a time, a progress bar over chunks, and the
    sum kept in float64 whatever the model's dtype. With a ``checkpoint``
    path, the sums (a tuple of arrays) are saved after each chunk
    (:class:`jacutil.core.resume.SumCheckpoint`, identified by ``record``),
    and a run called again goes on from the next chunk, to the same sums
    bit for bit (notebook 10).

    Args:
        plan: a :class:`Plan`.
        compute: ``compute(start, stop)``: the part of samples
            ``start:stop``: an array, a tensor, a number, or a structure
            (tuple, list, dict) of them, the same for every chunk.
        progress: show a progress bar over chunks.
        checkpoint: None, or a ``.npz`` path for the running sums.
        record: with a checkpoint, what identifies the run (JSON-able).

    Returns:
        The sum, of ``compute``'s structure, as float64 NumPy arrays.

    Examples:
        >>> plan = plan_chunks(5, chunk_size=2)
        >>> count, total = sum_chunks(plan, lambda a, b: (b - a, np.array([a, b])))
        >>> float(count), total.tolist()
        (5.0, [6.0, 11.0])
    """
    saved = None if checkpoint is None else SumCheckpoint(checkpoint, record)
    first, total = (0, None) if saved is None else saved.load()
    chunks = range(first, plan.n_chunks)
    for k in tqdm(chunks, disable=not progress, unit="chunk"):
        part = tf.nest.map_structure(
            lambda a: np.asarray(a, np.float64), compute(*plan.chunk(k))
        )
        total = part if total is None else tf.nest.map_structure(np.add, total, part)
        if saved is not None:
            saved.save(k + 1, total)
    return total


def resumable_chunks(
    path, plan, compute, shape, dtype, record, progress=False, *, for_plan=False
):
    """Chunks into the ``.npy`` at ``path``, skipping those an earlier run finished.

    What ``chunked_jacobian(..., out=path)`` runs (notebook 10 shows it): one
    writer at a time, each chunk on disk before the ledger records it, and the
    file checked again at the end. A file started earlier keeps its chunk size.

    Args:
        path: the ``.npy`` (and its ledger beside it).
        plan: a :class:`Plan`; ``compute``, ``shape``, ``dtype``: as in
            :func:`run_chunks`; ``record``: what identifies the run.
        progress: show a progress bar over samples.
        for_plan: ``compute(plan)`` gives the ``compute(start, stop)`` of
            the plan the run keeps (a resumed file's chunks): for rows that
            depend on the chunk size (the NTK's block-rows).

    Returns:
        The finished file, opened read-only.
    """
    with writer_lock(path):  # one writer at a time, for the whole run
        ledger, chunk_size = open_rows(
            path, shape, dtype, record, plan.asked, plan.chunk_size
        )
        plan = replace(plan, chunk_size=chunk_size)
        compute = compute(plan) if for_plan else compute
        done = ledger.rows_done(chunk_size)
        bar = tqdm(total=plan.n_rows, initial=done, disable=not progress, unit="sample")
        with bar:
            for k in ledger.todo():
                start, stop = plan.chunk(k)
                rows = np.asarray(compute(start, stop))
                write_rows(path, start, rows)  # on disk before the ledger says so
                ledger.done.add(k)
                ledger.save(chunk_size)
                bar.update(stop - start)
        ledger.check_file()  # not changed or cut short while the run wrote
        return np.load(path, mmap_mode="r")
