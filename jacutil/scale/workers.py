"""A Dask scheduler and worker processes on 127.0.0.1, over TLS (notebook
10-beyond-one-machine).

``with LocalWorkers(2) as workers:`` starts ``dask scheduler`` and ``n`` times
``dask worker`` as separate processes - the same commands a cluster runs on
its machines - listening on the loopback address only, on free ports, with
no dashboard (Dask's HTTP port answers ``/health`` only). Each worker runs
under a nanny that restarts it if it dies.

TLS: Dask's protocol is pickle, so whoever connects can run code on a
worker. Every LocalWorkers writes a new certificate and key into its temporary
folder (readable by you only; :mod:`jacutil.scale.credentials`), and the
scheduler, the workers and its client all require them: ``address`` is
``tls://127.0.0.1:PORT`` and ``security`` connects a second client
(``Client(workers.address, security=workers.security)``). A client without
them is refused.

Leaving the ``with`` block (or ``close()``) stops every process it started,
whatever happened, and removes the folder (logs and key). So does the end of
the Python process that started them, however it ends - a normal exit
without ``close()``, ``SIGTERM`` (Slurm, ``timeout``, a stopped Jupyter
kernel), ``SIGKILL`` (an out-of-memory killer): within ``STOP_BOUND``
seconds (10; measured: under one) every process is gone and the folder
removed. How: each child (the scheduler and each nanny) watches a pipe whose
write end the driver holds, in ``jacutil/scale/parent_watch.py`` (its module
docstring says how). A process that the driver forked without ``exec``
(``multiprocessing`` with ``fork``) holds the write end too: the processes
then stop when it ends as well.

Dask alone does not do this: ``--idle-timeout`` counts tasks, not clients;
``--death-timeout`` bounds a worker's first connection only; the scheduler
knows nothing of the process that started it.
"""

import gc
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
# Loaded by Dask as a file: the scheduler never imports jacutil (TensorFlow).
PARENT_WATCH = str(Path(__file__).with_name("parent_watch.py"))
FD_VARIABLE = "JACUTIL_PARENT_FD"  # as in parent_watch.py (not imported here)
FOLDER_VARIABLE = "JACUTIL_REMOVE_ON_EXIT"
HTTP_ROUTES = '["distributed.http.health"]'  # read by Dask from the environment
DASHBOARD_ROUTES = '["distributed.http.health", "distributed.http.statics"]'

STOP_BOUND = 10.0  # seconds from the driver's end to nothing left (measured: 0.5)


class WorkerStartError(RuntimeError):
    """The scheduler or a worker did not start."""


def free_port():
    """A TCP port (``int``) on 127.0.0.1 that nothing listens on right now."""
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


def _close_fds(fds):
    while fds:  # each once: the list forgets them
        try:
            os.close(fds.pop())
        except OSError:
            pass


def _stop_all(processes, logs=None, pipe=()):
    """Stop every process; then remove the folder of their logs, if given,
    and close ``pipe`` (the driver's write end: nothing left to watch)."""
    for process in reversed(processes):
        _stop(process)
    if logs is not None:
        shutil.rmtree(logs, ignore_errors=True)
    _close_fds(pipe)


class LocalWorkers:
    """A Dask scheduler on ``port`` (default: a free one) and ``n_workers``
    worker processes on this machine, each with ``threads`` TensorFlow threads
    (default: the cores shared out), run by ``python``; each must start within
    ``start_timeout`` seconds (else :class:`WorkerStartError`, with the tail of
    its log).

    ``client`` is the connected ``dask.distributed.Client``; ``address`` the scheduler's
    (``tls://127.0.0.1:PORT``); ``security`` the ``distributed.Security``
    that a second client needs. ``dashboard=True`` opens Dask's dashboard
    on 127.0.0.1 (``dashboard_link``; it needs ``bokeh``: ``pip install
    bokeh``): plain HTTP without a key, so every user of this machine can
    read it while it runs (task names, workers' memory; not the logs nor
    the call stacks, which stay off). Introduced in ``10-beyond-one-machine``.

    Use it as a context manager, or call :meth:`close`. If the Python
    process that made it ends without either (a normal exit, ``SIGTERM``,
    ``SIGKILL``), its processes stop and its folder is removed within
    ``STOP_BOUND`` seconds (the module docstring says how).
    """

    def __init__(
        self,
        n_workers=2,
        *,
        threads=None,
        port=None,
        start_timeout=60.0,
        python=sys.executable,
        dashboard=False,
    ):
        if int(n_workers) < 1:
            raise ValueError(f"n_workers must be at least 1; got {n_workers}.")
        self.dashboard_link = None
        if dashboard:
            _check_bokeh(python)
            self.dashboard_link = f"http://{HOST}:{free_port()}/status"
        self.n_workers = int(n_workers)
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.n_workers)
        self.port = port or free_port()
        self.address = f"tls://{HOST}:{self.port}"
        self.start_timeout = float(start_timeout)
        self.python = python
        self.processes = []
        self.client = None
        self.security = None
        remove_dead_owners_folders()
        self._logs = Path(tempfile.mkdtemp(prefix=f"jacutil-workers-{os.getpid()}-"))
        # Nothing is written: the children's watchdogs see the end of file
        # when this write end closes, however this process ends. os.pipe()
        # makes both ends non-inheritable: only pass_fds hands out the read end.
        read_end, write_end = os.pipe()
        self._watch_fd = read_end
        self._pipe = [write_end]
        self._finalizer = weakref.finalize(
            self, _stop_all, self.processes, self._logs, self._pipe
        )
        try:
            from .credentials import security_from, write_credentials

            write_credentials(self._logs / "credentials")
            self.security = security_from(self._logs / "credentials")
            self._start()
        except BaseException:
            self.close()  # the error holds the tail of the log
            raise
        finally:
            os.close(read_end)  # the children hold it

    def _spawn(self, name, arguments):
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        env["TF_NUM_INTRAOP_THREADS"] = str(self.threads)
        env["TF_NUM_INTEROP_THREADS"] = "1"
        env[MARKER] = self.address  # inherited by the nanny's worker: see leftovers()
        # Dask always serves HTTP (with --no-dashboard too): /health only, not
        # the scheduler's info pages (logs, call stacks) nor /metrics.
        for role in ("SCHEDULER", "WORKER"):
            env[f"DASK_DISTRIBUTED__{role}__HTTP__ROUTES"] = HTTP_ROUTES
        if name == "scheduler" and self.dashboard_link:  # its pages' images
            env["DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES"] = DASHBOARD_ROUTES
        env[FD_VARIABLE] = str(self._watch_fd)  # for parent_watch.py
        env.pop(FOLDER_VARIABLE, None)
        if name == "scheduler":  # its watchdog removes the folder
            env[FOLDER_VARIABLE] = str(self._logs)
        command = [self.python, *arguments]
        with open(self._logs / f"{name}.log", "wb") as log:  # the child keeps it
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(self._watch_fd,),  # the pipe's read end only
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
        credentials = self._logs / "credentials"
        tls = [
            "--tls-ca-file",
            str(credentials / "ca.pem"),
            "--tls-cert",
            str(credentials / "cert.pem"),
            "--tls-key",
            str(credentials / "key.pem"),
        ]
        self._spawn(
            "scheduler",
            [
                *"-m distributed.cli.dask_scheduler --protocol tls --host".split(),
                HOST,
                "--port",
                str(self.port),
                *tls,
                *self._dashboard_arguments(),
                "--preload",
                PARENT_WATCH,
            ],
        )
        while not _port_taken(self.port):
            self._check_alive(deadline, "the Dask scheduler")
            time.sleep(0.05)
        for i in range(self.n_workers):
            self._spawn(
                f"worker-{i}",
                [
                    *"-m distributed.cli.dask_worker".split(),
                    self.address,
                    *"--protocol tls --host".split(),
                    HOST,
                    *tls,
                    *"--nthreads 1 --nworkers 1 --name".split(),
                    f"worker-{i}",
                    "--no-dashboard",
                    "--dashboard-address",
                    f"{HOST}:0",
                    *"--nanny --memory-limit 0 --death-timeout".split(),
                    str(int(self.start_timeout) + 1),
                    "--preload-nanny",
                    PARENT_WATCH,
                ],
            )
        wait = max(1.0, deadline - time.monotonic())
        # A Client left unclosed (one whose start failed) is closed by its
        # __del__; collected inside this Client's start, in its new loop
        # thread, it waits for a lock that start holds (LoopRunner._lock, one
        # for the class) and both wait forever. Collect such garbage now.
        gc.collect()
        self.client = Client(self.address, security=self.security, timeout=wait)
        while len(self.client.scheduler_info()["workers"]) < self.n_workers:
            self._check_alive(deadline, f"{self.n_workers} Dask workers")
            time.sleep(0.1)

    def _dashboard_arguments(self):
        if self.dashboard_link is None:
            return ["--no-dashboard", "--dashboard-address", f"{HOST}:0"]
        port = self.dashboard_link.split(":")[2].split("/")[0]
        return ["--dashboard", "--dashboard-address", f"{HOST}:{port}"]

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
        """``{worker address: pid}`` of the worker processes (not their
        nannies); a worker that is dying or restarting (it answers with an
        error) is left out."""
        pids = self.client.run(os.getpid, on_error="return")
        return {address: pid for address, pid in pids.items() if isinstance(pid, int)}

    def kill_busy_worker(self, timeout=60.0):
        """A fault drill: ``SIGKILL`` a worker process that holds a chunk.

        Waits up to ``timeout`` seconds for a worker with tasks (else
        ``TimeoutError``), kills it as an out-of-memory killer or a lost
        machine would, and returns ``(address, pid, list of the task keys it
        held)``. Its nanny starts a new worker; the scheduler gives the chunks
        it held to a live one.
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
        folder (logs and TLS key); idempotent."""
        if self.client is not None:
            try:
                self.client.close(timeout=5)
            except Exception:  # noqa: BLE001 - closing: the processes go anyway
                pass
            self.client = None
        _stop_all(self.processes, self._logs, self._pipe)
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


def _check_bokeh(python):
    """Dask's dashboard is a bokeh app: refuse before starting without it."""
    found = subprocess.run(
        [python, "-c", "import bokeh"], capture_output=True, check=False
    )
    if found.returncode != 0:
        raise ImportError(
            "dashboard=True needs bokeh, which Dask's dashboard is made with, "
            f"and {python} cannot import it: pip install bokeh (or leave "
            "dashboard out)."
        )


def leftovers(address=None):
    """Processes that a LocalWorkers (any, or the one at ``address``) started
    and that still run, as a list of ``psutil.Process``: after ``close()``,
    none (``make test`` checks)."""
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


def leftover_folders(since=None):
    """Temporary folders of LocalWorkers and process pools
    (``jacutil-workers-<pid>-…``, ``jacutil-pool-<pid>-…``) whose process has
    ended, changed since ``since`` (a ``time.time()``; None: all), as a list
    of ``pathlib.Path``: after a run, however it ended, none (``make test``
    checks the folders of its own run)."""
    import psutil

    found = []
    for path in Path(tempfile.gettempdir()).glob("jacutil-*-*-*"):
        kind, _, rest = path.name.removeprefix("jacutil-").partition("-")
        pid = rest.partition("-")[0]
        if kind in ("workers", "pool") and pid.isdigit():
            try:
                recent = since is None or path.stat().st_mtime >= since
            except FileNotFoundError:  # removed meanwhile
                continue
            if recent and not psutil.pid_exists(int(pid)):
                found.append(path)
    return found


def remove_dead_owners_folders():
    """Remove the folders :func:`leftover_folders` finds that were left before
    this process started: their owner was killed with every process it had
    (SIGKILL, a lost machine), so no watchdog could remove them. Folders left
    since this process started stay, for ``make test``'s check to see.
    Returns the list of removed ``pathlib.Path``."""
    import psutil

    started = psutil.Process().create_time()
    removed = []
    for path in leftover_folders():
        try:
            if path.stat().st_mtime < started:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except FileNotFoundError:
            continue
    return removed


def client_of(workers):
    """The ``dask.distributed.Client`` of a :class:`LocalWorkers` or a Client;
    for None, the current one, as Dask's own functions use it (inside
    ``with Client(...)`` or ``with LocalWorkers(...)``, or the last one made).
    ``TypeError`` when ``workers`` is neither (or is closed), or is None and
    no client is current."""
    if workers is None:
        try:
            from distributed import default_client

            return default_client()
        except (ImportError, ValueError):
            raise TypeError(
                "no workers were given and no Dask client is current: pass "
                "workers= a jacutil.LocalWorkers or a dask.distributed.Client, "
                "or call inside `with LocalWorkers(2):` or `with Client(...):`."
            ) from None
    client = getattr(workers, "client", workers)
    if client is None or not hasattr(client, "submit"):
        raise TypeError(
            "workers must be a running jacutil.scale.distributed.LocalWorkers or a "
            f"dask.distributed.Client; got {workers!r}."
        )
    return client
