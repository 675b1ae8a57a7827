"""Chunks of the Jacobian on worker processes (notebook 10-beyond-one-machine).

Dask's distributed scheduler hands each chunk to a worker process and, when a
worker dies while it holds a chunk, gives that chunk to another: nothing is
lost and nothing is computed twice into the result. The model travels as its
Keras config and its weights (a Keras model does not pickle well), and each
worker rebuilds it once per set of weights. Results come back to this process,
which writes them - into memory, or into a resumable ``.npy`` with the same
ledger as :func:`jacutil.chunked_jacobian` (``jacutil.scale.resume``).

:class:`LocalWorkers` starts a scheduler and worker processes on this machine,
listening on 127.0.0.1 only; on a cluster, pass a ``dask.distributed.Client``
connected to its scheduler instead (``dask worker tcp://HOST:PORT`` on each
machine, with jacutil installed there). With ``out=path`` each worker writes
its rows into that file itself, so it must be on a file system that every
worker sees at the same path; a worker that sees another file there fails
(``jacutil.scale.resume.RunFileError``).
"""

import numpy as np
from tqdm.auto import tqdm

from ..core._shared import ceil_div, is_path
from ..core._tf import keras, tf
from ..core.batch import as_batch, n_samples, take
from ..core.cache import compiled_for
from ..core.outputs import output_layout
from ..fitting.scipy_bridge import LeastSquaresProblem
from ..stages.chunked import chunked_jacobian
from .resume import (
    check_out,
    check_run_file,
    fingerprint,
    open_rows,
    run_record,
    write_rows,
    writer_lock,
)
from .workers import LocalWorkers, WorkerStartError, client_of

__all__ = [
    "DistributedLeastSquares",
    "LocalWorkers",
    "WorkerStartError",
    "distributed_jacobian",
]

CHUNKS_PER_WORKER = 4  # default chunk size: n / (4 workers), for balance and retries


def check_sendable(model):
    """Refuse what workers cannot rebuild: anything but a ``keras.Model``.

    Args:
        model: what the caller wants computed on workers.

    Raises:
        TypeError: ``model`` is not a ``keras.Model`` (a plain function, a
            layer).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"workers rebuild a Keras model from its config; got "
            f"{type(model).__name__}. A function with explicit variables runs in "
            "one process: jacutil.chunked_jacobian(f, x, variables=...)."
        )


def model_spec(model, x):
    """What a worker needs to rebuild ``model``: its config and weights, and
    the outputs of the first sample of ``x``, to prove the rebuilt model is
    the same function.

    Args:
        model: a Keras model.
        x: the n samples.

    Returns:
        A dict: ``config`` (JSON), ``weights`` (arrays), ``key`` (a
        fingerprint) and ``probe`` (one sample and its outputs).
    """
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


def _spec_task(spec):
    return spec


def _send(client, spec):
    """The spec as the result of a task that holds it: every chunk depends on
    it, and if each worker that had it dies, the scheduler runs the task
    again (scattered data would be lost with the last worker holding it)."""
    return client.submit(_spec_task, spec, pure=False)


_rebuilt = {}  # on a worker: spec key -> model (the newest few)


def forget_models():
    """Drop the models this process rebuilt from specs (a worker's cache)."""
    _rebuilt.clear()


def _model_from(spec):
    """The model of ``spec``, rebuilt once per worker and set of weights."""
    model = _rebuilt.get(spec["key"])
    if model is None:
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
        _check_rebuilt(model, spec)
        while len(_rebuilt) >= 2:
            _rebuilt.pop(next(iter(_rebuilt)))
        _rebuilt[spec["key"]] = model
    return model


def rows_task(spec, x, options, path=None, start=0, token=None):
    """On a worker: the rows of one chunk, exactly as chunked_jacobian makes
    them; returned, or written into the ``.npy`` at ``path`` (a file that
    every worker sees) and flushed, when the driver keeps a ledger. Before
    anything, the file must be the run's: its ledger carries ``token``.

    Args:
        spec: the model, as :func:`model_spec` makes it.
        x: the chunk's c samples, NumPy arrays (:func:`as_numpy`).
        options: ``training``, ``jit_compile`` and ``method`` for
            :func:`jacutil.chunked_jacobian`.
        path: the run's ``.npy`` (shape (n, l, m)), or None to return the rows.
        start: the chunk's first row in that file.
        token: the run's token, from the ledger beside ``path``.

    Returns:
        The rows, shape (c, l, m), or None when they were written to ``path``.
    """
    if path is not None:
        check_run_file(path, token)
    model = _model_from(spec)
    rows = chunked_jacobian(
        model, x, chunk_size=int(n_samples(x)), progress=False, **options
    )
    if path is None:
        return rows
    write_rows(path, start, rows)
    return None


def _normal_equations_task(spec, x, y, chunk_size, training):
    """On a worker: ``J.T @ J`` and ``J.T @ r`` of one chunk."""
    model = _model_from(spec)
    problem = LeastSquaresProblem(
        model, x, y, None, training, chunk_size, None, "formed"
    )
    return problem.chunk_normal_equations(0)


def as_numpy(x):
    """``x`` (an array, or a list or dict of them) as NumPy arrays: what
    travels to a worker.

    Args:
        x: a tensor or array, or a nest of them.

    Returns:
        The same nest of NumPy arrays.
    """
    return tf.nest.map_structure(np.asarray, x)


def distributed_jacobian(
    model,
    x,
    workers,
    *,
    chunk_size=None,
    out=None,
    progress=True,
    training=False,
    jit_compile=False,
    method="rules",
    timeout=None,
    on_chunk=None,
):
    """Per-sample Jacobian with its chunks computed on Dask workers.

    ``workers``: a :class:`LocalWorkers` or a ``dask.distributed.Client``.
    Chunks of ``chunk_size`` samples (default: n / (4 x workers); a resumed
    file's own) are rows of the same compiled Jacobian as
    :func:`jacutil.chunked_jacobian`, so the result equals it bit for bit.
    ``out``: None (an array in memory), a NumPy array, or a ``.npy`` path that
    is resumable as in ``chunked_jacobian`` - the same ledger, so a run
    started in one process can be finished on workers. The workers write into
    that file themselves: it must be on a file system that every worker sees
    at the same path. A worker that dies mid-chunk has its chunk rerun
    elsewhere.
    ``timeout`` (seconds) bounds the wait for any one chunk; ``on_chunk(k)``
    is called after chunk ``k`` is written (and recorded).

    Returns ``out`` (an array, or the file opened read-only), shape
    (n_samples, n_outputs, n_params). Introduced in ``10-beyond-one-machine``.

    Args:
        model: a Keras model (workers rebuild it from its config).
        x: the n samples.
        workers: a :class:`LocalWorkers` or a ``dask.distributed.Client``.
        chunk_size: samples per chunk (default n / (4 x workers)).
        out: None, an array of shape (n, l, m), or a ``.npy`` path.
        progress: show a progress bar over samples.
        training: run the model in training mode.
        jit_compile: compile with XLA.
        method: as in :func:`jacutil.compiled_jacobian` (default ``"rules"``).
        timeout: seconds to wait for any one chunk.
        on_chunk: called with k after chunk k is written.

    Returns:
        ``out`` (an array, or the file opened read-only), shape (n, l, m).
    """
    client = client_of(workers)
    check_sendable(model)
    jac = compiled_for(model, None, training, jit_compile, method, x)
    x = as_batch(x, jac.target)
    n_rows = int(n_samples(x))
    shape = (n_rows, output_layout(jac.target, x).n_outputs, jac.target.n_params)
    dtype = jac.target.dtype
    asked = chunk_size
    if chunk_size is None:
        n_workers = max(1, len(client.scheduler_info()["workers"]))
        chunk_size = ceil_div(n_rows, CHUNKS_PER_WORKER * n_workers)
    options = {"training": training, "jit_compile": jit_compile, "method": method}
    wait = (n_rows, progress, timeout, on_chunk)
    if is_path(out):
        record = run_record(jac, model, x)
        with writer_lock(out):  # one writer at a time, for the whole run
            ledger, chunk_size = open_rows(out, shape, dtype, record, asked, chunk_size)
            where = (str(ledger.data_path.resolve()), ledger.token)
            todo = ledger.todo()
            futures = _submit(client, model, x, todo, chunk_size, options, where)
            _collect(futures, None, ledger, chunk_size, *wait)
            ledger.check_file()  # not changed or cut short while the run wrote
            return np.load(out, mmap_mode="r")
    out = np.empty(shape, dtype) if out is None else check_out(out, shape, dtype)
    todo = range(ceil_div(n_rows, chunk_size))
    futures = _submit(client, model, x, todo, chunk_size, options)
    _collect(futures, out, None, chunk_size, *wait)
    return out


def _submit(client, model, x, todo, chunk_size, options, where=None):
    """A task for each chunk in ``todo``: its rows returned, or, with ``where``
    (the file's path and the run's token), written by the worker."""
    spec = _send(client, model_spec(model, x))
    futures = {}
    for k in todo:
        start = k * chunk_size
        x_chunk = as_numpy(take(x, start, start + chunk_size))
        into = () if where is None else (where[0], start, where[1])
        task = client.submit(rows_task, spec, x_chunk, options, *into, pure=False)
        futures[task] = k
    return futures


def _collect(futures, out, ledger, chunk_size, n_rows, progress, timeout, on_chunk):
    """Each chunk as it arrives: its rows written into ``out``, or, when the
    workers wrote them into the file themselves, recorded in ``ledger``."""
    from distributed import as_completed

    done = 0 if ledger is None else ledger.rows_done(chunk_size)
    with tqdm(total=n_rows, initial=done, disable=not progress, unit="sample") as bar:
        for future in as_completed(futures, timeout=timeout):
            k = futures.pop(future)
            start = k * chunk_size
            rows = future.result()
            if ledger is None:
                out[start : start + chunk_size] = rows
            else:  # on disk and flushed by the worker
                ledger.done.add(k)
                ledger.save(chunk_size)
            bar.update(min(chunk_size, n_rows - start))
            if on_chunk is not None:
                on_chunk(k)


class DistributedLeastSquares(LeastSquaresProblem):
    """A :class:`jacutil.LeastSquaresProblem` whose normal equations are
    summed over chunks computed on Dask workers.

    ``levenberg_marquardt(problem)`` takes it unchanged: each step's
    ``JtJ`` and ``Jtr`` come from the workers, added in chunk order, so they
    equal the single-process sums bit for bit. Introduced in
    ``10-beyond-one-machine``.

    Args:
        model: a Keras model.
        x: the n samples.
        y: the targets, one per sample.
        workers: a :class:`LocalWorkers` or a ``dask.distributed.Client``.
        chunk_size: samples per chunk.
        training: run the model in training mode.
    """

    def __init__(self, model, x, y, workers, *, chunk_size=None, training=False):
        check_sendable(model)
        super().__init__(model, x, y, None, training, chunk_size, None, "formed")
        self.client = client_of(workers)
        self._rows_y = self.y.reshape(self.n_samples, self.n_outputs)

    def normal_equations(self, theta, checkpoint=None):
        """``(JtJ, Jtr)`` at ``theta``, summed over chunks run on the workers.

        Args:
            theta: the parameters, shape (m,).
            checkpoint: must be None (a lost worker's chunk is rerun instead).

        Returns:
            ``(JtJ, Jtr)``: float64 arrays of shape (m, m) and (m,).

        Raises:
            ValueError: a ``checkpoint`` was given.
        """
        if checkpoint is not None:
            raise ValueError(
                "checkpoint is not kept for distributed normal equations: a "
                "lost worker's chunk is already rerun; use "
                "LeastSquaresProblem.normal_equations(theta, checkpoint=...) "
                "in one process."
            )
        self.set_params(theta)
        spec = _send(self.client, model_spec(self.model, self.x))
        futures = []
        for k in range(self.n_chunks):
            start, stop = k * self.chunk_size, (k + 1) * self.chunk_size
            futures.append(
                self.client.submit(
                    _normal_equations_task,
                    spec,
                    as_numpy(take(self.x, start, stop)),
                    self._rows_y[start:stop],
                    self.chunk_size,
                    self._target.training,
                    pure=False,
                )
            )
        sums = (np.zeros((self.n_params, self.n_params)), np.zeros(self.n_params))
        for future in futures:  # in chunk order: the same sums as one process
            for total, part in zip(sums, future.result(), strict=True):
                total += part
        return sums
