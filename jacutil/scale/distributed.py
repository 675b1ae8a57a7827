"""Chunks of the Jacobian on worker processes (notebook 10-beyond-one-machine).

An executor (:mod:`jacutil.scale.executors`) runs each chunk: Dask's
scheduler by default - when a worker dies while it holds a chunk, another
gets it, and nothing is lost or computed twice into the result - or a
process pool on this machine. The model travels as its Keras config and its
weights (a Keras model does not pickle well), and each worker rebuilds it
once per set of weights.

The rows come back to this process (into memory or one resumable ``.npy``)
or go into a folder of chunk files that the workers write themselves
(:mod:`jacutil.scale.chunk_files`); ``x`` may stay on the workers too
(:mod:`jacutil.scale.dask_arrays`). :func:`distributed_jacobian` says how.

:class:`LocalWorkers` starts a scheduler and worker processes on this machine
(127.0.0.1, TLS); on a cluster, pass a ``dask.distributed.Client`` connected
to its scheduler instead (``docs/cluster.md``).
"""

import contextlib
import functools
import threading
import warnings
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..core._shared import ceil_div, is_path
from ..core._tf import keras, tf
from ..core.arguments import check_chunk_size
from ..core.batch import as_batch, n_samples, take
from ..core.outputs import output_layout
from ..core.planner import plan_chunks
from ..core.resume import (
    check_out,
    fingerprint,
    open_rows,
    run_record,
    write_rows,
    writer_lock,
)
from ..engine.compiled import compiled_for
from ..engine.rows import chunked_jacobian
from ..fitting.scipy_bridge import LeastSquaresProblem
from .chunk_files import open_chunk_folder, read_chunks, write_chunk
from .dask_blocks import as_dask_array, blocks_by_samples, first_sample, is_dask_input
from .executors import (
    ChunkTimeoutError,
    WorkersLostError,
    as_arrived,
    executor_for,
)
from .workers import LocalWorkers, WorkerStartError

__all__ = [
    "DistributedLeastSquares",
    "LocalWorkers",
    "WorkerStartError",
    "distributed_jacobian",
]

CHUNKS_PER_WORKER = 4  # default chunk size: n / (4 workers), for balance and retries
COMPILE_KEYS = ("training", "jit_compile", "method")  # what each chunk's task takes


def check_sendable(model):
    """Refuse what workers cannot rebuild: anything but a ``keras.Model``
    (``TypeError``)."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"workers rebuild a Keras model from its config; got "
            f"{type(model).__name__}. A function with explicit variables runs in "
            "one process: jacutil.chunked_jacobian(f, x, variables=...)."
        )


def model_spec(model, x):
    """What a worker needs to rebuild ``model``: a dict of its ``config``
    (JSON), ``weights``, ``key`` (a fingerprint) and ``probe`` (the first
    sample of ``x`` and its outputs, to prove the rebuilt model the same)."""
    try:
        config = model.to_json()
    except Exception as error:  # noqa: BLE001 - any reason: say what to do
        raise TypeError(
            f"{type(model).__name__} cannot be sent to workers: its config does "
            f"not serialize ({error}). Workers rebuild the model from "
            "model.to_json(); a subclassed model or custom layer needs "
            "get_config() and @keras.saving.register_keras_serializable() in a "
            "module that every worker can import."
        ) from error
    probe = as_numpy(take(x, 0, 1))
    return {
        "config": config,
        "weights": [np.asarray(w) for w in model.get_weights()],
        "key": fingerprint(model, model.trainable_variables, ()),
        "probe": (probe, [np.asarray(y) for y in tf.nest.flatten(model(probe))]),
    }


def _check_rebuilt(model, spec):
    """The rebuilt model must compute what the sender's does, or nothing goes."""
    probe, expected = spec["probe"]
    try:
        model.set_weights(spec["weights"])
        got = [np.asarray(y) for y in tf.nest.flatten(model(probe))]
    except ValueError:  # other weights than were sent
        got = []
    tolerance = 1e-4 if expected[0].dtype == np.float32 else 1e-9
    same = len(got) == len(expected) and all(
        a.shape == b.shape and np.allclose(a, b, rtol=tolerance, atol=tolerance)
        for a, b in zip(got, expected, strict=False)
    )
    if not same:
        raise TypeError(
            "the model rebuilt on a worker from model.to_json() computes other "
            "outputs than yours: its config does not describe it fully (a layer "
            "object used in two places becomes two layers; a custom layer's "
            "get_config() may miss a setting). Send a model whose config "
            "rebuilds it, or run jacutil.chunked_jacobian in one process."
        )


_rebuilt = {}  # on a worker: config -> [model, key of its weights, lock]


def forget_models():
    """Drop the models this process rebuilt from specs (a worker's cache)."""
    _rebuilt.clear()


@contextlib.contextmanager
def model_from(spec):
    """The Keras model of ``spec`` (:func:`model_spec`), with its weights,
    held for one task.

    Rebuilt once per worker and architecture (the newest two are kept), so a
    second call with new weights - each step of Levenberg-Marquardt - only
    sets them and reuses the compiled Jacobian; each time the weights change,
    the outputs of the probe are checked again. A lock holds the model for
    the whole task: two tasks in two threads of one worker never see each
    other's weights.
    """
    entry = _rebuilt.get(spec["config"])
    if entry is None:
        try:
            model = keras.models.model_from_json(spec["config"])
        except Exception as error:  # noqa: BLE001 - say what a worker lacks
            raise TypeError(
                f"a worker could not rebuild the model from its config ({error}). "
                "Custom layers must be decorated with "
                "@keras.saving.register_keras_serializable() in a module that "
                "every worker imports (installed on it, or sent with "
                "client.upload_file)."
            ) from error
        while len(_rebuilt) >= 2:
            _rebuilt.pop(next(iter(_rebuilt)))
        entry = _rebuilt[spec["config"]] = [model, None, threading.Lock()]
    with entry[2]:
        if entry[1] != spec["key"]:
            entry[1] = None  # until the new weights are in and checked
            _check_rebuilt(entry[0], spec)
            entry[1] = spec["key"]
        yield entry[0]


def rows_task(spec, x, start=0, *, options, folder=None, token=None):
    """On a worker: the rows of one chunk, exactly as chunked_jacobian makes
    them; returned, or written into their own file of the run's chunk
    ``folder`` (after checking that the folder carries the run's ``token``).

    Args:
        spec: the model, as :func:`model_spec` makes it.
        x: the chunk's c samples, NumPy arrays (:func:`as_numpy`).
        start: the chunk's first row.
        options: ``training``, ``jit_compile`` and ``method`` for
            :func:`jacutil.chunked_jacobian`.
        folder: the run's chunk folder, or None to return the rows.
        token: the run's token, from the folder's ``run.json``.

    Returns:
        The rows, shape (c, l, m), or None when they were written to ``folder``.
    """
    with model_from(spec) as model:
        rows = chunked_jacobian(
            model, x, chunk_size=int(n_samples(x)), progress=False, **options
        )
    if folder is None:
        return rows
    write_chunk(folder, start, rows, token)
    return None


def _normal_equations_task(spec, x, y, *, chunk_size, training):
    """On a worker: ``J.T @ J`` and ``J.T @ r`` of one chunk."""
    with model_from(spec) as model:
        problem = LeastSquaresProblem(
            model, x, y, None, training, chunk_size, None, "formed"
        )
        return problem.chunk_normal_equations(0)


def as_numpy(x):
    """``x`` (a tensor or array, or a nest of them) as NumPy arrays: what
    travels to a worker."""
    return tf.nest.map_structure(np.asarray, x)


class Prepared:
    """What the driver knows of a run before any chunk: the compiled
    Jacobian, the result's shape and dtype, one sample, and ``x`` (in
    memory) or ``dask_x`` (on the workers)."""

    def __init__(self, jac, x, dask_x, probe, n_rows):
        self.jac, self.x, self.dask_x, self.probe = jac, x, dask_x, probe
        self.n_rows = n_rows
        layout = output_layout(jac.target, probe)
        self.shape = (n_rows, layout.n_outputs, jac.target.n_params)
        self.dtype = jac.target.dtype

    def chunk(self, start, stop):
        """Samples ``start:stop`` of an in-memory ``x``, as NumPy arrays."""
        return as_numpy(take(self.x, start, stop))

    def record(self, model):
        """What identifies the run in a file (``resume.run_record``); a
        ``dask.array`` x by its Dask token (its graph and data)."""
        if self.dask_x is None:
            return run_record(self.jac, model, self.x)
        from dask.base import tokenize

        token = np.frombuffer(tokenize(self.dask_x).encode(), np.uint8)
        return run_record(self.jac, model, [token])


def prepare(model, x, client, training, jit_compile, method):
    """Check ``model`` and ``x`` on the driver (one sample of a ``dask.array``;
    ``client`` is None for a process pool) and compile the Jacobian that every
    chunk uses, as a :class:`Prepared`."""
    check_sendable(model)
    dask_x = None
    if is_dask_input(x):
        if client is None:
            raise TypeError(
                "x is a dask.array or Dask futures: its blocks stay on Dask "
                "workers, so workers must be a LocalWorkers or a "
                "dask.distributed.Client (other executors, a process pool "
                "among them, take NumPy arrays or an np.memmap)."
            )
        dask_x = as_dask_array(x, client)
        x = first_sample(dask_x, client)
    jac = compiled_for(model, None, training, jit_compile, method, x)
    x = as_batch(x, jac.target)
    probe = as_numpy(take(x, 0, 1))
    n_rows = int(dask_x.shape[0]) if dask_x is not None else int(n_samples(x))
    return Prepared(jac, None if dask_x is not None else x, dask_x, probe, n_rows)


def distributed_jacobian(
    model,
    x,
    workers=None,
    *,
    chunk_size=None,
    out=None,
    progress=True,
    training=False,
    jit_compile=False,
    method="rules",
    timeout=None,
    deadline=None,
    on_chunk=None,
    retries=0,
):
    """Per-sample Jacobian with its chunks computed on workers.

    ``workers``: a :class:`LocalWorkers`, a ``dask.distributed.Client``, a
    ``concurrent.futures.ProcessPoolExecutor`` or an executor
    (:mod:`jacutil.scale.executors`); None, the current Dask client (inside
    ``with LocalWorkers(...)`` or ``with Client(...)``). Chunks (default
    n / (4 x workers); a resumed run's own) are rows of the same compiled
    Jacobian as :func:`jacutil.chunked_jacobian`: the result equals it bit
    for bit with the same ``chunk_size``.

    ``x``: arrays, or a ``dask.array`` (or Dask futures) whose blocks are
    computed on the workers and never come to this process (one sample
    does, to check the model).

    ``out``: None (an array in memory), a NumPy array, a ``.npy`` path
    (resumable as in ``chunked_jacobian``, the same ledger, written by this
    process as rows arrive), or any other path: a folder of chunk files that
    the workers write themselves (:mod:`jacutil.scale.chunk_files`; it must
    be on a file system every worker sees at the same path), resumable too.

    The clocks ``timeout`` and ``deadline`` start when the chunks are sent,
    so the first wait includes a fresh worker's start (TensorFlow's import,
    the model's trace: seconds). When one passes, or every worker has been
    gone for ``executors.WORKERS_LOST_AFTER`` seconds, the run stops with
    :class:`ChunkTimeoutError` or :class:`WorkersLostError`; the chunks that
    arrived are kept (``error.out`` and ``error.done`` in memory; on disk,
    where calling again resumes) and those not started are cancelled.
    In a folder, ``error.done`` lists the chunk files complete at the stop.
    Introduced in ``10-beyond-one-machine``.

    ``model`` is a Keras model (workers rebuild it from its config); the other
    arguments are as in :func:`jacutil.chunked_jacobian` (default method
    ``"rules"``), with ``timeout`` (seconds for the next chunk, the first one
    included), ``deadline`` (seconds for the whole run), ``on_chunk`` (called
    with k after chunk k is written) and ``retries`` (times Dask reruns a chunk
    after an error of its own, as ``Client.submit``'s).

    Returns:
        An array of shape (n, l, m): ``out``, the ``.npy`` opened read-only,
        or, for a folder, a lazy ``dask.array`` of its chunk files
        (:func:`jacutil.scale.chunk_files.read_chunks` reads one back).
    """
    chunk_size = check_chunk_size(chunk_size)  # the stages' check and words
    options = {
        "training": training,
        "jit_compile": jit_compile,
        "method": method,
        "timeout": timeout,
        "deadline": deadline,
        "on_chunk": on_chunk,
    }
    executor = executor_for(workers, retries=retries)
    try:
        return _distributed(executor, model, x, chunk_size, out, progress, options)
    finally:
        if executor is not workers and hasattr(executor, "close"):
            executor.close()  # a wrapper made here (its pool stays open)


def _distributed(executor, model, x, chunk_size, out, progress, options):
    """:func:`distributed_jacobian` with its executor."""
    compile_options = {k: options[k] for k in COMPILE_KEYS}
    run = prepare(model, x, getattr(executor, "client", None), **compile_options)
    _warn_threads(executor)
    workers_now = max(1, executor.n_workers())
    plan = plan_chunks(  # by default, CHUNKS_PER_WORKER chunks a worker
        run.n_rows,
        chunk_size=chunk_size,
        chunk_for=lambda _: ceil_div(run.n_rows, CHUNKS_PER_WORKER * workers_now),
    )
    job = Job(executor, run, model, progress, options)
    if not is_path(out):
        shape, dtype = run.shape, run.dtype
        out = np.empty(shape, dtype) if out is None else check_out(out, shape, dtype)
        futures = job.submit(range(plan.n_chunks), plan.chunk_size)

        def write(k, rows):
            out[slice(*plan.chunk(k))] = rows

        job.collect(futures, write, 0, plan.chunk_size, out)
        return out
    with writer_lock(out):  # one writer at a time, for the whole run
        if Path(out).suffix == ".npy":
            return _into_file(job, out, plan)
        return _into_folder(job, out, plan)


def _into_file(job, path, plan):
    """Rows come back and this process writes them (one writer: no page of
    the file is shared between machines)."""
    run = job.run
    record = run.record(job.model)
    ledger, size = open_rows(
        path, run.shape, run.dtype, record, plan.asked, plan.chunk_size
    )
    futures = job.submit(ledger.todo(), size)

    def write(k, rows):
        write_rows(path, k * size, rows)
        ledger.done.add(k)
        ledger.save(size)

    kept = f"on disk in {Path(path).name}: {AGAIN}"
    job.collect(futures, write, ledger.rows_done(size), size, kept)
    ledger.check_file()  # not changed or cut short while the run wrote
    return np.load(path, mmap_mode="r")


def _into_folder(job, path, plan):
    """Each worker writes its chunk's own file; nothing comes back."""
    run = job.run
    record = run.record(job.model)
    folder = open_chunk_folder(
        path, run.shape, run.dtype, record, plan.asked, plan.chunk_size
    )
    where = {"folder": str(Path(path).resolve()), "token": folder.token}
    futures = job.submit(folder.todo(), folder.chunk_size, where)
    kept = f"in {Path(path).name}/: {AGAIN}"

    def on_disk():  # chunks that arrived late were still written: count files
        folder.end()
        return folder.complete()

    job.collect(futures, None, folder.rows_done(), folder.chunk_size, kept, on_disk)
    return read_chunks(path, lazy=True)


AGAIN = "call again with the same arguments to compute only the rest"


class Job:
    """One run of :func:`distributed_jacobian`: where its chunks run, what
    they compute, and how the driver waits for them."""

    def __init__(self, executor, run, model, progress, options):
        self.executor, self.run, self.model = executor, run, model
        self.progress, self.on_chunk = progress, options["on_chunk"]
        self.clocks = {"timeout": options["timeout"], "deadline": options["deadline"]}
        self.options = {key: options[key] for key in COMPILE_KEYS}

    def submit(self, todo, chunk_size, where=None):
        """A task for each chunk in ``todo``: ``rows_task(spec, samples, start)``,
        writing into a chunk folder when ``where`` says so."""
        executor, run = self.executor, self.run
        task = functools.partial(rows_task, options=self.options, **(where or {}))
        task = executor.share(task, name="jacobian-task")
        spec = executor.share(model_spec(self.model, run.probe), name="jacobian-model")
        if run.dask_x is not None:
            blocks = blocks_by_samples(run.dask_x, chunk_size)
            samples = executor.client.compute([blocks[k] for k in todo])
        else:
            samples = [
                executor.share(
                    run.chunk(k * chunk_size, (k + 1) * chunk_size),
                    name=f"jacobian-samples-{k:06d}",
                )
                for k in todo
            ]
        return {
            executor.submit(
                task, spec, part, k * chunk_size, name=f"jacobian-chunk-{k:06d}"
            ): k
            for k, part in zip(todo, samples, strict=True)
        }

    def collect(self, futures, write, done, chunk_size, kept, on_disk=None):
        """Each chunk as it arrives, written by ``write(k, rows)`` (None: the
        worker wrote it). A clock that passes, or workers lost, stop the run
        with an error saying where the arrived chunks are (``kept``: the array
        in memory, or a sentence); ``on_disk()``, when given, returns the
        chunks complete on disk, which the error counts instead."""
        n_rows, arrived = self.run.n_rows, set()
        bar = tqdm(total=n_rows, initial=done, disable=not self.progress, unit="sample")
        # closed on any error (a worker's too): the chunks still to come are cancelled
        arrivals = as_arrived(self.executor, futures, **self.clocks)
        try:
            for future, rows in arrivals:
                k = futures[future]
                if write is not None:
                    write(k, rows)
                arrived.add(k)
                bar.update(min(chunk_size, n_rows - k * chunk_size))
                if self.on_chunk is not None:
                    self.on_chunk(k)
        except (ChunkTimeoutError, WorkersLostError) as error:
            arrivals.close()  # cancel the rest before counting
            in_memory = isinstance(kept, np.ndarray)
            where = "in error.out (the chunks in error.done)" if in_memory else kept
            what = "that arrived"
            if on_disk is not None:
                arrived, what = set(on_disk()), "complete on disk"
            raise type(error)(
                f"{error}. The {len(arrived)} chunks {what} are kept {where}.",
                arrived,
                kept if in_memory else None,
            ) from None
        finally:
            arrivals.close()
            bar.close()


def _warn_threads(executor):
    threads = getattr(executor, "threads", dict)()
    busy = {a: t for a, t in threads.items() if t > 1}
    if busy:
        address, threads = next(iter(busy.items()))
        warnings.warn(
            f"{len(busy)} worker(s) run several threads (e.g. {address}: "
            f"{threads}): TensorFlow already uses every core for one chunk, so "
            "chunks at once compete for the same cores and run slower. Start "
            "workers with --nthreads 1 (docs/cluster.md).",
            stacklevel=3,
        )


class DistributedLeastSquares(LeastSquaresProblem):
    """A :class:`jacutil.LeastSquaresProblem` whose normal equations are
    summed over chunks computed on Dask workers.

    ``levenberg_marquardt(problem)`` takes it unchanged: each step's
    ``JtJ`` and ``Jtr`` come from the workers and are added in chunk order.
    Each chunk's J is the single process's bit for bit, but its products
    ``J.T @ J`` and ``J.T @ r`` are NumPy's (BLAS), whose order of summation
    depends on how many threads BLAS runs in that process: the sums equal
    the single-process sums to rounding (relative 1e-16 where they differ),
    not bit for bit. Introduced in ``10-beyond-one-machine``.

    ``workers``: a :class:`LocalWorkers` or a ``dask.distributed.Client``; the
    other arguments as in :func:`jacutil.least_squares_problem` (a Keras model).
    """

    def __init__(self, model, x, y, workers, *, chunk_size=None, training=False):
        check_sendable(model)
        super().__init__(model, x, y, None, training, chunk_size, None, "formed")
        self.executor = executor_for(workers)
        self._rows_y = self.y.reshape(self.n_samples, self.n_outputs)

    def normal_equations(self, theta, checkpoint=None):
        """``(JtJ, Jtr)`` at ``theta``, float64 (m, m) and (m,), summed over
        chunks run on the workers; ``checkpoint`` must be None (a lost
        worker's chunk is rerun instead: ``ValueError``)."""
        if checkpoint is not None:
            raise ValueError(
                "checkpoint is not kept for distributed normal equations: a "
                "lost worker's chunk is already rerun; use "
                "LeastSquaresProblem.normal_equations(theta, checkpoint=...) "
                "in one process."
            )
        self.set_params(theta)
        run = self.executor
        spec = run.share(model_spec(self.model, self.x))
        task = run.share(
            functools.partial(
                _normal_equations_task,
                chunk_size=self.chunk_size,
                training=self._target.training,
            )
        )
        futures = []
        for start, stop in self.plan:
            x_chunk = run.share(as_numpy(take(self.x, start, stop)))
            y_chunk = run.share(self._rows_y[start:stop])
            futures.append(run.submit(task, spec, x_chunk, y_chunk))
        with contextlib.closing(as_arrived(run, futures)) as arrivals:
            parts = dict(arrivals)
        sums = (np.zeros((self.n_params, self.n_params)), np.zeros(self.n_params))
        for future in futures:  # in chunk order: the same sums as one process
            for total, part in zip(sums, parts[future], strict=True):
                total += part
        return sums
