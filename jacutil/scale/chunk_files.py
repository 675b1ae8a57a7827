"""A Jacobian as a folder of files, one per chunk (notebook 10-beyond-one-machine).

For workers on several machines that share a file system (NFS, a parallel
file system) or an object store mounted as one::

    J/
      run.json                      what is computed and this run's token
      rows-000000000-000000250.npy  rows 0..250, written by the worker that
      rows-000000250-000000500.npy  computed them
      ...

Each chunk is its own file, written under a temporary name, flushed and
renamed into place, so no two machines ever write the same file or the same
page (an NFS client writes back whole pages: two nodes writing the rows on
either side of a page boundary of one file overwrite each other's), and a
file that has its final name is complete. ``run.json`` is written by the
driver, atomically; a worker writes only after it has read the run's token
there, so a worker that sees another folder at that path (node-local
scratch) fails loudly. Run again with the same arguments, the chunks whose
files are complete are skipped. :func:`read_chunks` reads the folder back as
one array (or a lazy ``dask.array``).
"""

import functools
import json
import os
import secrets
import socket
from pathlib import Path

import numpy as np

from ..core.planner import Plan
from ..core.resume import (
    ResumeMismatch,
    RunFileError,
    file_problem,
    resumed_chunk_size,
    write_atomically,
)

RUN_FILE = "run.json"
RECORD_KEYS = ("fingerprint", "key", "shape", "dtype")


def chunk_name(start, stop):
    """The file name of rows ``start..stop``: ``rows-<start>-<stop>.npy``."""
    return f"rows-{start:09d}-{stop:09d}.npy"


def _read_run(folder):
    path = Path(folder) / RUN_FILE
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ResumeMismatch(
            f"{path} cannot be read ({error}): it was changed or cut short "
            f"outside a run. To start afresh, delete the folder {folder}."
        ) from None


def _write_run(folder, state):
    text = json.dumps(state).encode()
    write_atomically(Path(folder) / RUN_FILE, lambda file: file.write(text))


class ChunkFolder:
    """The folder of a run at ``path``: its record, chunk size and token, from
    ``state`` (what ``run.json`` holds)."""

    def __init__(self, path, state):
        self.path = Path(path)
        self.state = state
        self.shape = tuple(state["shape"])
        self.dtype = np.dtype(state["dtype"])
        self.chunk_size = int(state["chunk_size"])
        self.plan = Plan(self.shape[0], self.chunk_size)  # its chunks' rows
        self.n_chunks = self.plan.n_chunks
        self.token = state["token"]

    def chunk_path(self, k):
        """The file of chunk ``k``."""
        return self.path / chunk_name(*self.plan.chunk(k))

    def problem(self, k):
        """What is wrong with chunk ``k``'s file (a sentence), or None."""
        start, stop = self.plan.chunk(k)
        return file_problem(
            self.chunk_path(k), (stop - start, *self.shape[1:]), self.dtype
        )

    def todo(self):
        """The chunks whose file is missing or not complete (a list of ints)."""
        return [k for k in range(self.n_chunks) if self.problem(k) is not None]

    def complete(self):
        """The chunks whose file is complete (a list of ints)."""
        return [k for k in range(self.n_chunks) if self.problem(k) is None]

    def end(self):
        """End this run: its workers write no chunk after this (a task still
        running when a clock passed finishes, but its file is refused), so
        :meth:`complete` then counts what the run left. Called by the driver,
        holding the folder's lock."""
        _write_run(
            self.path, {**_read_run(self.path), "token": None, "ended": self.token}
        )

    def rows_done(self):
        """The rows (samples) in complete chunk files."""
        todo = set(self.todo())
        return sum(b - a for k, (a, b) in enumerate(self.plan) if k not in todo)


def open_chunk_folder(path, shape, dtype, record, chunk_size, default_chunk_size):
    """The folder at ``path`` for this run: resumed if its ``run.json`` is the
    same computation's, made if it does not exist; a new token either way.
    Call it holding :func:`jacutil.core.resume.writer_lock` on ``path``.

    ``shape`` (n, l, m) and ``dtype`` are the Jacobian's, ``record`` what
    identifies the run (``resume.run_record``); ``chunk_size`` None takes the
    earlier run's, or ``default_chunk_size`` for a new folder. Returns a
    :class:`ChunkFolder`; ``ResumeMismatch`` when the folder holds another
    computation, another chunk size, or files that no run wrote.
    """
    path = Path(path)
    state = {**record, "shape": list(shape), "dtype": str(np.dtype(dtype))}
    try:
        earlier = _read_run(path)
    except FileNotFoundError:
        earlier = None
        if path.exists() and any(path.iterdir()):
            raise ResumeMismatch(
                f"{path} is a folder with files but no {RUN_FILE}: it was not "
                "written by a run. Empty it or choose another path."
            ) from None
    if earlier is not None:
        afresh = "delete the folder"
        chunk_size = resumed_chunk_size(
            path, earlier, state, RECORD_KEYS, chunk_size, afresh
        )
    state["chunk_size"] = int(chunk_size or default_chunk_size)
    state["token"] = secrets.token_hex(8)
    path.mkdir(parents=True, exist_ok=True)
    _write_run(path, state)
    return ChunkFolder(path, state)


def write_chunk(folder, start, rows, token):
    """On a worker: rows ``start..`` into their own file of ``folder``, after
    checking that the folder is the run's (its ``run.json`` carries
    ``token``). Written under a temporary name, flushed, and renamed only if
    the run has not ended meanwhile (:meth:`ChunkFolder.end`): else
    ``RunFileError`` (not the run's folder) or :class:`RunEndedError`.
    """
    folder = Path(folder)
    still_the_runs = functools.partial(_check_token, folder, token)
    still_the_runs()  # before writing: a wrong folder fails at once
    rows = np.ascontiguousarray(rows)
    path = folder / chunk_name(start, start + len(rows))
    write_atomically(
        path,
        lambda file: np.lib.format.write_array(file, rows),
        before_replace=still_the_runs,  # and again: the run may have ended since
    )
    descriptor = os.open(folder, os.O_RDONLY)  # the rename itself, on disk
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class RunEndedError(RuntimeError):
    """A worker's chunk arrived after its run ended (a clock passed, or its
    workers were lost): it is not written, so the folder keeps what the run
    counted."""


def _check_token(folder, token):
    """Raise unless ``folder``'s ``run.json`` carries ``token`` now."""
    try:
        state = _read_run(folder)
    except FileNotFoundError:
        problem = f"no {RUN_FILE} in it"
    except ResumeMismatch:
        problem = f"its {RUN_FILE} cannot be read"
    else:
        if state.get("ended") == token:
            raise RunEndedError(
                f"the run ended (a clock passed, or its workers were lost) "
                f"before this chunk could be written into {folder}; calling "
                "distributed_jacobian again computes it"
            )
        problem = None if state.get("token") == token else "another run's run.json"
    if problem is not None:
        raise RunFileError(
            f"the worker on {socket.gethostname()} sees another folder at "
            f"{folder} than the run's: {problem}. Workers write their chunks "
            "into the folder the driver made, so out= must be on a shared file "
            "system that every worker sees at the same path (not a node-local "
            "scratch directory), or out=None to send the rows back."
        )


def read_chunks(folder, *, lazy=False):
    """The Jacobian in a chunk folder (written by ``distributed_jacobian(...,
    out=folder)``), as one NumPy array of shape (n, l, m); with ``lazy``, a
    ``dask.array`` whose blocks are the chunk files (memory-mapped when
    computed). ``ResumeMismatch`` when a chunk is missing or incomplete (it
    says which, and how to finish the run)."""
    folder = Path(folder)
    try:
        chunks = ChunkFolder(folder, _read_run(folder))
    except FileNotFoundError:
        raise ResumeMismatch(
            f"{folder} has no {RUN_FILE}: it is not a chunk folder of "
            "distributed_jacobian (a single .npy is read with np.load)."
        ) from None
    missing = chunks.todo()
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ResumeMismatch(
            f"{len(missing)} of the {chunks.n_chunks} chunks in {folder} are "
            f"missing or incomplete (chunks {shown}): the run did not finish. "
            "Run distributed_jacobian again with the same arguments and "
            "out= this folder: it computes only those."
        )
    paths = [chunks.chunk_path(k) for k in range(chunks.n_chunks)]
    if not lazy:
        out = np.empty(chunks.shape, chunks.dtype)
        for path, (start, stop) in zip(paths, chunks.plan, strict=True):
            out[start:stop] = np.load(path, mmap_mode="r")
        return out
    import dask
    import dask.array as da

    blocks = [
        da.from_delayed(
            dask.delayed(np.load)(str(path), mmap_mode="r"),
            shape=(stop - start, *chunks.shape[1:]),
            dtype=chunks.dtype,
        )
        for path, (start, stop) in zip(paths, chunks.plan, strict=True)
    ]
    return da.concatenate(blocks)
