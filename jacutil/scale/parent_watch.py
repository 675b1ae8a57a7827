"""A Dask preload: end this process when the driver that started it ends.

Not imported by ``jacutil``: :class:`jacutil.scale.workers.LocalWorkers`
passes this file's *path* to ``dask scheduler --preload`` and ``dask worker
--preload-nanny``, and Dask loads it as a file, without importing the
``jacutil`` package (nor TensorFlow): it uses the standard library only.

The driver makes a pipe, keeps its write end (never inherited by a child)
and gives each child the read end; ``JACUTIL_PARENT_FD`` names it. Nothing
is ever written: a thread blocks reading it, and the read returns (end of
file) when the kernel closes the driver's write end - whenever the driver
ends, however it ends (``close()``, normal exit, an exception, ``SIGTERM``,
``SIGKILL``). Then the thread removes ``JACUTIL_REMOVE_ON_EXIT`` (a folder,
given to the scheduler only: the logs and the TLS key), sends ``SIGTERM``
to its process group (a nanny's group holds its worker and resource
tracker; Dask closes gracefully) and ``SIGKILL`` after ``GRACE`` seconds to
what is left. Dask's own means do not cover this (see the module docstring
of ``jacutil.scale.workers``). Introduced in ``10-beyond-one-machine``.
"""

import os
import shutil
import signal
import stat
import threading
import time

FD_VARIABLE = "JACUTIL_PARENT_FD"
FOLDER_VARIABLE = "JACUTIL_REMOVE_ON_EXIT"
GRACE = 5.0  # seconds between SIGTERM and SIGKILL
THREAD_NAME = "jacutil-parent-watch"


def _signal_group(sig):
    """Signal this process's group if it leads one (LocalWorkers starts each
    child in its own session), else this process alone: never a shell's."""
    try:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), sig)
        else:
            os.kill(os.getpid(), sig)
    except OSError:
        pass


def _watch(fd, folder, grace):
    """Block until the driver's end of the pipe closes; then end this group."""
    while True:
        try:
            if not os.read(fd, 1):  # b"": end of file, the driver is gone
                break
        except InterruptedError:
            continue
        except OSError:
            return  # not a pipe from a driver (a bad descriptor): nothing to watch
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    _signal_group(signal.SIGTERM)
    time.sleep(grace)  # this process may be gone already: then so is the thread
    _signal_group(signal.SIGKILL)


def start(environ=None, grace=GRACE):
    """Start the watching thread once per process (a daemon thread) and
    return it; None unless ``JACUTIL_PARENT_FD`` in ``environ`` (default
    ``os.environ``; both variables are removed from it) names a pipe open in
    this process. ``grace``: seconds between ``SIGTERM`` and ``SIGKILL``."""
    environ = os.environ if environ is None else environ
    for thread in threading.enumerate():  # Dask may load this file twice
        if thread.name == THREAD_NAME:
            return thread
    # Taken out of the environment: a nanny's worker, started later, would
    # inherit the number without the descriptor (some other file there).
    fd, folder = environ.pop(FD_VARIABLE, ""), environ.pop(FOLDER_VARIABLE, None)
    if not fd:
        return None
    try:
        if not stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
            return None  # not the driver's pipe
    except (OSError, ValueError):
        return None
    thread = threading.Thread(
        target=_watch,
        args=(int(fd), folder, grace),
        name=THREAD_NAME,
        daemon=True,
    )
    thread.start()
    return thread


def dask_setup(server):
    """Dask's preload hook (after the server started): the thread runs."""
    start()


# At load: Dask loads a preload before the server starts (and before a nanny
# waits for its scheduler), so a driver that dies during the start is seen.
start()
