"""Where the chunks run: one interface, two backends (notebook 10-beyond-one-machine).

An executor does five things, and :func:`jacutil.distributed_jacobian` needs
no more: ``share(value, name=None)`` (data that many tasks read: the model),
``submit(fn, *args, name=None)`` (one chunk's task; ``name`` a readable start
of its key, ``jacobian-chunk-000017``), ``wait(pending, seconds)`` (the finished ones),
``cancel(futures)`` and ``n_workers()``. :func:`as_arrived` turns them into
the loop that collects chunks, with its two clocks and its lost-workers rule.

- :class:`DaskExecutor` (the default, for a ``dask.distributed.Client`` or a
  :class:`jacutil.LocalWorkers`): a worker that dies has its chunks rerun
  elsewhere. Every task reaches the scheduler as two functions of Python's
  standard library, ``pickle.loads`` and ``operator.call``, and bytes, so
  the scheduler unpickles nothing of ours: it needs neither jacutil nor
  TensorFlow.
- :class:`ProcessExecutor`: ``concurrent.futures.ProcessPoolExecutor`` on
  this machine, for many cores and no cluster. A process that dies breaks
  the pool (Python's rule): the run stops with :class:`WorkersLostError`,
  and the chunks that arrived are kept.
"""

import concurrent.futures
import contextlib
import operator
import os
import pickle
import shutil
import tempfile
import time
import uuid
import weakref
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from .workers import client_of, remove_dead_owners_folders

INTERFACE = ("share", "submit", "wait", "cancel", "n_workers")
POLL_SECONDS = 0.5  # how often the collecting loop looks at its clocks
FETCH_SECONDS = 10.0  # the first limit on fetching one finished chunk
WORKERS_LOST_AFTER = 30.0  # seconds with no worker at all: the run stops


class _StoppedRun:
    """A run that stopped early: ``done`` holds the chunks that arrived (their
    rows are kept: in ``out``, in memory, or on disk, where the run resumes)."""

    def __init__(self, message, done=(), out=None):
        super().__init__(message)
        self.done = sorted(done)
        self.out = out


class ChunkTimeoutError(_StoppedRun, TimeoutError):
    """No chunk arrived within ``timeout``, or the run passed its ``deadline``
    (``done`` and ``out`` as in :class:`_StoppedRun`)."""


class WorkerMismatchError(RuntimeError):
    """A worker cannot import jacutil, or runs other versions of jacutil,
    TensorFlow, Keras or NumPy than the driver (its chunks would fail, or
    differ)."""


# What each worker is asked, as source for the builtin eval: the scheduler
# and the workers unpickle nothing of ours to answer it.
PACKAGES = ("jacutil", "tensorflow", "keras", "numpy")
VERSIONS = f"tuple(__import__(name).__version__ for name in {PACKAGES!r})"


def check_workers(client):
    """Ask every worker of ``client`` (a ``dask.distributed.Client``) for its
    versions of ``PACKAGES`` before a run, and refuse a cluster where one
    differs from the driver (:class:`WorkerMismatchError`, naming each worker
    that cannot import them or has other versions, and what it has).
    Introduced in ``10-beyond-one-machine``.
    """
    mine = eval(VERSIONS)  # noqa: S307 - our own constant expression
    found = client.run(eval, VERSIONS, on_error="return")
    wrong = {}
    for address, theirs in sorted(found.items()):
        if isinstance(theirs, BaseException):
            wrong[address] = f"cannot import them ({type(theirs).__name__}: {theirs})"
        elif tuple(theirs) != mine:
            wrong[address] = ", ".join(
                f"{name} {t} (driver: {m})"
                for name, t, m in zip(PACKAGES, theirs, mine, strict=True)
                if t != m
            )
    if wrong:
        listed = "; ".join(f"{a}: {what}" for a, what in wrong.items())
        raise WorkerMismatchError(
            f"{len(wrong)} of {len(found)} workers cannot run this driver's "
            f"chunks: {listed}. Install the driver's versions of "
            f"{', '.join(PACKAGES)} on those machines (docs/cluster.md), or "
            "stop those workers."
        )


class WorkersLostError(_StoppedRun, RuntimeError):
    """Every worker was lost (or a process pool broke) before the run ended."""


class DaskExecutor:
    """Chunks as tasks on the Dask cluster of ``client`` (a
    ``dask.distributed.Client``), each rerun up to ``retries`` times after an
    error of its own (``Client.submit``'s; a lost worker's chunks are rerun
    anyway).

    Tasks carry readable keys (``jacobian-chunk-000017-<run>``), so Dask's
    dashboard and its logs say what runs. Introduced in
    ``10-beyond-one-machine``.
    """

    def __init__(self, client, retries=0):
        self.client, self.retries = client, check_retries(retries)
        self.run = uuid.uuid4().hex[:8]  # keys of one executor never collide

    def _key(self, name):
        return None if name is None else f"{name}-{self.run}-{uuid.uuid4().hex[:8]}"

    def share(self, value, name=None):
        """A ``distributed.Future`` of picklable ``value``: a task that
        unpickles it on a worker (run again if every worker holding it dies);
        ``name`` starts its key (``jacobian-model``)."""
        return self.client.submit(
            pickle.loads, pickle.dumps(value), pure=False, key=self._key(name)
        )

    def submit(self, fn, *args, name=None):
        """A ``distributed.Future`` of ``fn(*args)`` on a worker; ``fn`` and
        ``args`` are futures of :meth:`share` (or small plain values: ints,
        strings); ``name`` starts its key (``jacobian-chunk-000017``)."""
        return self.client.submit(
            operator.call,
            fn,
            *args,
            pure=False,
            key=self._key(name),
            retries=self.retries,
        )

    def wait(self, pending, seconds):
        """The set of futures among ``pending`` that finished within ``seconds``."""
        from distributed import wait

        try:
            return set(
                wait(list(pending), timeout=seconds, return_when="FIRST_COMPLETED").done
            )
        except TimeoutError:
            return set()

    def cancel(self, futures):
        """Cancel tasks that have not finished."""
        self.client.cancel(list(futures))

    def n_workers(self):
        """The workers connected to the scheduler now."""
        return len(self.client.nthreads())

    def threads(self):
        """``{worker address: threads}``."""
        return dict(self.client.nthreads())


class ProcessExecutor:
    """Chunks in a ``concurrent.futures.ProcessPoolExecutor`` on this machine.

    ``max_workers`` processes (default: one per 2 cores) are started with
    ``spawn`` (a forked TensorFlow is not safe), each with ``threads``
    TensorFlow threads (default: the cores shared out); the first chunk in each
    imports TensorFlow (seconds). An existing ``pool`` is used as it is, and
    left open by :meth:`close`. Use it as a context manager, or call
    :meth:`close`. Introduced in ``10-beyond-one-machine``.
    """

    def __init__(self, max_workers=None, *, threads=None, pool=None):
        cores = os.cpu_count() or 1
        self._owned = pool is None
        if pool is None:
            import multiprocessing

            self.max_workers = int(max_workers or max(1, cores // 2))
            if self.max_workers < 1:
                raise ValueError(f"max_workers must be at least 1; got {max_workers}.")
            threads = int(threads or max(1, cores // self.max_workers))
            # before TensorFlow is imported in the process: exec, a builtin,
            # so that the initializer itself imports nothing of ours
            setup = (
                "import os; os.environ['TF_NUM_INTRAOP_THREADS'] = "
                f"'{threads}'; os.environ['TF_NUM_INTEROP_THREADS'] = '1'; "
                "os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')"
            )
            pool = concurrent.futures.ProcessPoolExecutor(
                self.max_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=exec,
                initargs=(setup,),
            )
        else:
            self.max_workers = pool._max_workers
        self.pool = pool
        # results travel as files: a process killed while it sends a large
        # result through the pool's pipe leaves half a message there, and the
        # pool then waits for the rest forever (CPython's ProcessPoolExecutor)
        remove_dead_owners_folders()
        self.results = Path(tempfile.mkdtemp(prefix=f"jacutil-pool-{os.getpid()}-"))
        self._remove = weakref.finalize(self, shutil.rmtree, self.results, True)

    def share(self, value, name=None):
        """``value`` itself: it travels with each task."""
        return value

    def submit(self, fn, *args, name=None):
        """A ``concurrent.futures.Future`` of ``fn(*args)`` in a process of the
        pool (``name`` is unused)."""
        inner = self.pool.submit(result_in_file, str(self.results), fn, *args)
        outer = concurrent.futures.Future()
        outer.inner = inner

        def arrived(done):
            path = None if done.cancelled() or done.exception() else done.result()
            try:
                if outer.cancelled():
                    return
                if done.cancelled():
                    outer.cancel()
                elif path is None:
                    outer.set_exception(done.exception())
                else:
                    outer.set_result(pickle.loads(Path(path).read_bytes()))
            finally:
                if path is not None:
                    Path(path).unlink(missing_ok=True)

        inner.add_done_callback(arrived)
        return outer

    def wait(self, pending, seconds):
        """The futures among ``pending`` that finished within ``seconds``."""
        return concurrent.futures.wait(
            pending, timeout=seconds, return_when=concurrent.futures.FIRST_COMPLETED
        ).done

    def cancel(self, futures):
        """Cancel tasks that have not started."""
        for future in futures:
            getattr(future, "inner", future).cancel()
            future.cancel()

    def n_workers(self):
        """The pool's processes (a broken pool has none)."""
        return 0 if getattr(self.pool, "_broken", False) else self.max_workers

    def threads(self):
        """One thread per process: a pool runs one task at a time in each."""
        return {}

    def close(self):
        """Stop the processes (if this executor started them) and remove the
        results' folder; idempotent."""
        if self._owned:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self._remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"ProcessExecutor({self.max_workers} processes)"


def result_in_file(folder, fn, *args):
    """In a pool's process: ``fn(*args)`` pickled into a file of ``folder``
    (written under a temporary name, then renamed); returns its path, a
    message short enough to go through a pipe in one write."""
    data = pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)
    path = Path(folder) / f"{os.getpid()}-{uuid.uuid4().hex}.pickle"
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
    return str(path)


def executor_for(workers, *, retries=0):
    """The executor behind ``workers``: a :class:`jacutil.LocalWorkers`, a
    ``dask.distributed.Client`` (None: the current client,
    :func:`~jacutil.scale.workers.client_of`), a
    ``concurrent.futures.ProcessPoolExecutor``, or an executor (ours, or any
    object with the methods in ``INTERFACE``; ``threads()`` optional); else
    ``TypeError``. ``retries``: times a failed chunk is run again (Dask only:
    a ``ValueError`` for other executors). A Dask cluster is checked by
    :func:`check_workers`.
    """
    retries = check_retries(retries)
    if isinstance(workers, DaskExecutor):
        return DaskExecutor(workers.client, retries) if retries else workers
    is_pool = isinstance(workers, concurrent.futures.ProcessPoolExecutor)
    has_interface = all(callable(getattr(workers, n, None)) for n in INTERFACE)
    if retries and (is_pool or has_interface):
        raise ValueError(
            f"retries={retries} asks Dask to run a failed chunk again; "
            f"{type(workers).__name__} does not. Use a Dask client or "
            "LocalWorkers, or leave retries out."
        )
    if has_interface:
        return workers  # ours, or any object with the five methods
    if is_pool:
        return ProcessExecutor(pool=workers)
    try:
        client = client_of(workers)
    except TypeError:
        if workers is None:
            raise
        raise TypeError(
            "workers must be a running jacutil.LocalWorkers, a "
            "dask.distributed.Client, a concurrent.futures.ProcessPoolExecutor "
            f"or a jacutil.scale.executors executor; got {workers!r}."
        ) from None
    check_workers(client)
    return DaskExecutor(client, retries)


def check_retries(retries):
    """``retries`` as a whole number of at least 0 (None: 0)."""
    if retries is None:
        return 0
    if isinstance(retries, bool) or not isinstance(retries, int | np.integer):
        raise TypeError(f"retries must be a whole number; got {retries!r}.")
    if retries < 0:
        raise ValueError(f"retries must be 0 or more; got {retries}.")
    return int(retries)


def as_arrived(executor, futures, *, timeout=None, deadline=None):
    """Each future of ``futures`` with its result, in the order they finish.

    Two clocks: ``timeout`` is the longest wait for the next chunk (it starts
    again at each arrival), ``deadline`` the whole run's. When either passes,
    or no worker has been connected for ``WORKERS_LOST_AFTER`` seconds (a
    nanny restarts a killed worker within seconds; a lost cluster does not
    come back), the rest are cancelled and the error says which.

    No wait here is without a limit: a result is fetched for at most
    ``FETCH_SECONDS`` (doubled at each try of the same chunk; less where a
    clock ends sooner), because a Dask future can be finished on a worker
    that has just died (Dask then runs it again); a fetch that runs out puts
    the chunk back among those still to come. A chunk's own error is raised
    as the worker raised it; a pool's process that died is a
    :class:`WorkersLostError` too (the caller adds what arrived).
    """
    pending = set(futures)
    tries = dict.fromkeys(pending, 0)
    started = last = time.monotonic()
    without_workers = None
    try:
        while pending:
            arrived = 0
            with connection_kept():
                finished = executor.wait(pending, POLL_SECONDS)
            for future in finished:
                limit = FETCH_SECONDS * 2 ** tries[future]
                now = time.monotonic()
                if timeout is not None:
                    limit = min(limit, last + timeout - now)
                if deadline is not None:
                    limit = min(limit, started + deadline - now)
                fetched, value = _fetch(future, max(limit, POLL_SECONDS))
                if not fetched:
                    tries[future] += 1
                    continue
                pending.discard(future)
                arrived += 1
                yield future, value
            now = time.monotonic()
            if arrived:
                last = now
            if not pending:
                break
            if timeout is not None and now - last > timeout:
                raise ChunkTimeoutError(
                    f"no chunk arrived within timeout={timeout:g} seconds "
                    f"({len(pending)} chunks were still to come)"
                )
            if deadline is not None and now - started > deadline:
                raise ChunkTimeoutError(
                    f"the run passed its deadline={deadline:g} seconds with "
                    f"{len(pending)} chunks still to come"
                )
            with connection_kept():
                connected = executor.n_workers()
            if arrived or connected > 0:
                without_workers = None
            elif without_workers is None:
                without_workers = now
            elif now - without_workers > WORKERS_LOST_AFTER:
                raise WorkersLostError(
                    f"no worker has been connected for {WORKERS_LOST_AFTER:g} "
                    f"seconds ({len(pending)} chunks still to come): every "
                    "worker was lost (killed, out of memory, its machine gone)"
                )
    finally:
        if pending:
            executor.cancel(pending)


def _fetch(future, seconds):
    """``(True, result)`` of a finished future, or ``(False, None)`` when its
    result could not be fetched within ``seconds`` (its worker died: Dask
    runs the chunk again)."""
    waited = (TimeoutError, concurrent.futures.TimeoutError)
    try:
        with connection_kept():
            error = future.exception(timeout=seconds)
    except waited:
        return False, None
    if isinstance(error, BrokenProcessPool):
        raise WorkersLostError(
            f"a process of the pool died ({error}): killed, or out of memory. "
            "A process pool cannot rerun its chunk elsewhere (Dask workers can)"
        ) from None
    if error is not None:
        return True, future.result()  # raises the chunk's own error
    try:
        with connection_kept():
            return True, future.result(timeout=seconds)
    except waited:
        return False, None


@contextlib.contextmanager
def connection_kept():
    """Turn a lost connection to the cluster (Dask's ``CommClosedError``, an
    ``OSError``; or a future cancelled by someone else: Dask cancels them all
    when its scheduler goes) into :class:`WorkersLostError`; a timeout passes
    through."""
    try:
        yield
    except (TimeoutError, concurrent.futures.TimeoutError):
        raise
    except (OSError, concurrent.futures.CancelledError) as error:
        raise WorkersLostError(
            f"the connection to the cluster was lost ({type(error).__name__}: "
            f"{error}): its scheduler stopped (killed, or its machine gone) or "
            "the network failed, and the chunks still to come went with it. "
            "Start the cluster again (LocalWorkers, or docs/cluster.md)"
        ) from None
