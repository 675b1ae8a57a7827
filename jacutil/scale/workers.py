"""A Dask scheduler and worker processes on 127.0.0.1 (notebook 10-beyond-one-machine).

``with LocalWorkers(2) as workers:`` starts ``dask scheduler`` and ``n`` times
``dask worker`` as separate processes - the same commands a cluster runs on
its machines - listening on the loopback address only, on free ports. Each
worker runs under a nanny that restarts it if it dies. Leaving the ``with``
block (or ``close()``) stops every process it started, whatever happened.
A scheduler or worker that does not come up within ``start_timeout`` seconds,
or a port that is taken, is an error that says which and shows its log.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

HOST = "127.0.0.1"
MARKER = "JACUTIL_LOCAL_WORKERS"  # in the environment of every process started


class WorkerStartError(RuntimeError):
    """The scheduler or a worker did not start."""


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    Returns:
        An ``int``: the port number.
    """
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def _port_taken(port):
    with socket.socket() as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return True
    return False


def _stop(process, grace=5.0):
    """Stop a process and everything it started (its own session)."""
    if process.poll() is None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
    try:  # the nanny's worker may outlive it for a moment: its group too
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_all(processes, logs=None):
    """Stop every process; then remove the folder of their logs, if given."""
    for process in reversed(processes):
        _stop(process)
    if logs is not None:
        shutil.rmtree(logs, ignore_errors=True)


class LocalWorkers:
    """A Dask scheduler and ``n_workers`` worker processes on this machine.

    ``threads``: TensorFlow threads per worker (default: the cores shared
    out). ``port``: the scheduler's (default: a free one). ``python``: the
    interpreter that runs them. ``client`` is the connected
    ``dask.distributed.Client``. Introduced in ``10-beyond-one-machine``.

    Use it as a context manager, or call :meth:`close`.

    Args:
        n_workers: the worker processes (at least 1).
        threads: TensorFlow threads per worker (default: the cores shared out).
        port: the scheduler's port (default: a free one).
        start_timeout: seconds to wait for the scheduler and each worker.
        python: the interpreter that runs them.

    Raises:
        ValueError: ``n_workers`` is below 1.
        jacutil.scale.workers.WorkerStartError: the scheduler or a worker
            did not start (the message holds the tail of its log).
    """

    def __init__(
        self,
        n_workers=2,
        *,
        threads=None,
        port=None,
        start_timeout=60.0,
        python=sys.executable,
    ):
        if int(n_workers) < 1:
            raise ValueError(f"n_workers must be at least 1; got {n_workers}.")
        self.n_workers = int(n_workers)
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.n_workers)
        self.port = port or free_port()
        self.address = f"tcp://{HOST}:{self.port}"
        self.start_timeout = float(start_timeout)
        self.python = python
        self.processes = []
        self.client = None
        self._logs = Path(tempfile.mkdtemp(prefix="jacutil-workers-"))
        self._finalizer = weakref.finalize(
            self, _stop_all, self.processes, self._logs
        )
        try:
            self._start()
        except BaseException:
            self.close()  # the error holds the tail of the log
            raise

    def _spawn(self, name, arguments):
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        env["TF_NUM_INTRAOP_THREADS"] = str(self.threads)
        env["TF_NUM_INTEROP_THREADS"] = "1"
        env[MARKER] = self.address  # inherited by the nanny's worker: see leftovers()
        command = [self.python, *arguments]
        with open(self._logs / f"{name}.log", "wb") as log:  # the child keeps it
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own group: close() stops its children
            )
        process.name = name
        self.processes.append(process)
        return process

    def _log_tail(self, name, lines=12):
        path = self._logs / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.strip().splitlines()[-lines:]) or "(empty)"

    def _fail(self, what, process=None):
        name = process.name if process else "scheduler"
        raise WorkerStartError(
            f"{what}. The last lines of its log ({name}.log, removed with "
            "the processes):\n"
            f"{self._log_tail(name)}"
        )

    def _start(self):
        from distributed import Client

        if _port_taken(self.port):
            raise WorkerStartError(
                f"port {self.port} on {HOST} is taken by another program: pass "
                "another port=, or leave it out to take a free one."
            )
        deadline = time.monotonic() + self.start_timeout
        scheduler = self._spawn(
            "scheduler",
            [
                "-m",
                "distributed.cli.dask_scheduler",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--no-dashboard",
                "--dashboard-address",
                f"{HOST}:0",
            ],
        )
        while not _port_taken(self.port):
            self._check_alive(deadline, "the Dask scheduler")
            time.sleep(0.05)
        for i in range(self.n_workers):
            self._spawn(
                f"worker-{i}",
                [
                    "-m",
                    "distributed.cli.dask_worker",
                    self.address,
                    "--host",
                    HOST,
                    "--nthreads",
                    "1",
                    "--nworkers",
                    "1",
                    "--name",
                    f"worker-{i}",
                    "--no-dashboard",
                    "--dashboard-address",
                    f"{HOST}:0",
                    "--dashboard-address",
                    f"{HOST}:0",
                    "--nanny",
                    "--memory-limit",
                    "0",
                    "--death-timeout",
                    str(int(self.start_timeout) + 1),
                ],
            )
        wait = max(1.0, deadline - time.monotonic())
        self.client = Client(self.address, timeout=wait)
        while len(self.client.scheduler_info()["workers"]) < self.n_workers:
            self._check_alive(deadline, f"{self.n_workers} Dask workers")
            time.sleep(0.1)
        del scheduler

    def _check_alive(self, deadline, what):
        for process in self.processes:
            if process.poll() is not None:
                self._fail(
                    f"{process.name} exited with code {process.returncode} "
                    f"while starting {what}",
                    process,
                )
        if time.monotonic() > deadline:
            waiting = [p for p in self.processes if p.name != "scheduler"]
            self._fail(
                f"{what} did not start within start_timeout={self.start_timeout:g} "
                "seconds (a slow machine: raise it)",
                waiting[-1] if waiting else None,
            )

    def worker_pids(self):
        """``{worker address: pid}`` of the worker processes (not their nannies).

        Returns:
            A dict from address (``str``) to pid (``int``); a worker that is
            dying or restarting is left out.
        """
        pids = self.client.run(os.getpid, on_error="return")
        # a worker that is dying or restarting answers with an error: skipped
        return {address: pid for address, pid in pids.items() if isinstance(pid, int)}

    def kill_busy_worker(self, timeout=60.0):
        """A fault drill: ``SIGKILL`` a worker process that holds a chunk.

        Waits up to ``timeout`` seconds for a worker with tasks, kills it as
        an out-of-memory killer or a lost machine would, and returns
        ``(address, pid, keys it held)``. Its nanny starts a new worker; the
        scheduler gives the chunks it held to a live one.

        Args:
            timeout: seconds to wait for a worker with tasks.

        Returns:
            ``(address, pid, keys)``: the worker's address (``str``), its pid
            and a list of the task keys it held.

        Raises:
            TimeoutError: no worker held a chunk within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = {w: k for w, k in self.client.processing().items() if k}
            pids = self.worker_pids()
            for address, keys in busy.items():
                if address in pids:
                    os.kill(pids[address], signal.SIGKILL)
                    return address, pids[address], list(keys)
            time.sleep(0.005)
        raise TimeoutError(f"no worker held a chunk within {timeout:g} seconds.")

    def close(self):
        """Stop the client, the workers and the scheduler, and remove their
        logs; idempotent."""
        if self.client is not None:
            try:
                self.client.close(timeout=5)
            except Exception:  # noqa: BLE001 - closing: the processes go anyway
                pass
            self.client = None
        _stop_all(self.processes, self._logs)
        self.processes.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "running" if self.client else "closed"
        return (
            f"LocalWorkers({self.n_workers} workers x {self.threads} threads, "
            f"{self.address}, {state})"
        )


def leftovers(address=None):
    """Processes that a LocalWorkers (any, or the one at ``address``) started
    and that still run: after ``close()``, none (``make test`` checks).

    Args:
        address: the scheduler address of one LocalWorkers (default: any).

    Returns:
        A list of ``psutil.Process``.
    """
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "name"]):
        try:
            marker = process.environ().get(MARKER)
            if marker and address in (None, marker) and process.status() != "zombie":
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def client_of(workers):
    """The ``dask.distributed.Client`` of a :class:`LocalWorkers` or a Client.

    Args:
        workers: a running :class:`LocalWorkers`, or a Client.

    Returns:
        The ``dask.distributed.Client``.

    Raises:
        TypeError: ``workers`` is neither (or is closed).
    """
    client = getattr(workers, "client", workers)
    if client is None or not hasattr(client, "submit"):
        raise TypeError(
            "workers must be a running jacutil.scale.distributed.LocalWorkers or a "
            f"dask.distributed.Client; got {workers!r}."
        )
    return client
