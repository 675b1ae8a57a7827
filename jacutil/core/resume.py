"""Out-of-core results that survive an interrupted run (notebook 10-beyond-one-machine).

A Jacobian written chunk by chunk into ``J.npy`` keeps a small ledger beside
it, ``J.npy.progress.json``: the fingerprint of what is being computed (the
model's architecture and weights, ``x``, the options) and the chunks whose
rows are on disk. The ledger is rewritten atomically (a temporary file,
``fsync``, ``os.replace``) only after the chunk's rows have been flushed, so
whenever the run stops - a kernel restart, ``SIGKILL``, a pre-empted machine -
every chunk it lists is complete. Run again with the same arguments, the
finished chunks are skipped; with other weights or data, the fingerprint
differs and the run is refused, never mixed.

Nothing on disk is trusted unchecked: before a run resumes (and before it
returns the finished file) the ``.npy`` header, shape, dtype and size must
match the ledger. One run writes a file at a time (:func:`writer_lock`), and
each run stamps a random token in its ledger, which a worker checks before it
writes, so a worker that sees another file at the same path fails loudly.

A running sum (the normal equations ``JtJ``, ``Jtr``) is kept the same way in
one ``.npz`` checkpoint: the partial sums and the next chunk, added in the same
order after a resume, so the total is the same to the last bit.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import warnings
from pathlib import Path

import numpy as np

from ._shared import ceil_div, is_path, size_of
from ._tf import keras, tf

LEDGER_SUFFIX = ".progress.json"
LOCK_SUFFIX = ".lock"
# what every ledger holds ("key" too, None for a Keras model)
LEDGER_KEYS = ("fingerprint", "shape", "dtype", "chunk_size", "n_chunks")
LEDGER_KEYS += ("done", "token")


class ResumeMismatch(ValueError):
    """The file on disk was started by a different computation, or was
    changed outside the run."""


class FileBusy(RuntimeError):
    """Another run is writing the same file."""


class RunFileError(RuntimeError):
    """A worker sees another file at ``out`` than the run's."""


def _architecture(layer):
    """Layer types and settings, without the names Keras numbers per session."""
    config = {}
    try:
        with warnings.catch_warnings():  # a lambda's "unsafe to reload": not reloaded
            warnings.simplefilter("ignore")
            config = layer.get_config()
        config = {k: v for k, v in config.items() if k != "name"}
        config.pop("layers", None)  # the sub-layers come below
    except Exception:  # noqa: BLE001 - any layer without a config: its type alone
        pass
    parts = [type(layer).__name__, json.dumps(config, sort_keys=True, default=str)]
    parts += [_architecture(sub) for sub in getattr(layer, "layers", [])]
    return "(" + ",".join(parts) + ")"


def fingerprint(model, variables, x, **options):
    """A digest (32 hex characters) of what a chunked run computes: any change
    gives another one.

    It covers the model's layer types and settings, every weight (BatchNorm
    statistics too), the ``variables`` differentiated (by position in
    ``model.weights``, or by value when not the model's), every input array
    of ``x`` and ``options`` (anything else that changes the result). What a
    plain function computes is not covered: ``key=`` names it.
    """
    digest = hashlib.blake2b(digest_size=16)

    def add(array):
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(memoryview(array).cast("B"))

    digest.update(_architecture(model).encode())
    weights = list(getattr(model, "weights", None) or [])
    for weight in weights:
        add(np.asarray(weight))
    position = {id(w): i for i, w in enumerate(weights)}
    for v in variables:
        if id(v) in position:
            digest.update(f"weight {position[id(v)]};".encode())
        else:  # not the model's own
            digest.update(b"variable;")
            add(np.asarray(v))
    for leaf in tf.nest.flatten(x):
        add(np.asarray(leaf))
    digest.update(json.dumps(options, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def check_key(key, model, out, example="J.npy"):
    """The ``key=`` of a resumable run: it goes with ``out=`` a ``.npy`` path,
    a plain function (not a Keras model) must give one, and it is a string.
    ``out=True`` stands for a path; ``example`` is the file name the message
    suggests.
    """
    if out is not True and not is_path(out):
        if key is not None:
            raise ValueError(
                "key= names a resumable run, so it goes with out= a .npy path; "
                f"out is {type(out).__name__}. Leave key out, or pass "
                f"out={example!r}."
            )
        return
    if key is None and not isinstance(model, keras.Layer):
        raise TypeError(
            "a resumable run (out=path) of a plain function needs key=: a name "
            "you choose for what the function computes, such as key='tanh-v1'. "
            "jacutil fingerprints a Keras model's layers and weights, but "
            "cannot see inside a function, so without key= a file started by "
            "another function of the same variables would be resumed as this "
            "one's. Give each function its own key (a new one when you change "
            "it), or pass a Keras model."
        )
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key= must be a string; got {type(key).__name__}.")


def run_record(jac, model, x, key=None):
    """What identifies a resumable run of ``jac`` (``compiled_for``) on
    ``model`` and ``x``, for the ledger: a dict of its :func:`fingerprint`,
    ``key`` (as in :func:`check_key`) and options."""
    check_key(key, model, True)
    options = {"method": jac.method, "jit_compile": jac.jit_compile}
    options["training"] = jac.target.training
    digest = fingerprint(model, jac.target.variables, x, **options)
    return {"fingerprint": digest, "key": key, "options": options}


def what_differs(earlier, now, keys):
    """In words, what a file's record ``earlier`` holds that this run's
    ``now`` does not, among ``keys`` (each option by name); None when they
    match."""
    was = earlier.get("options")
    if was is not None and was != now.get("options"):
        return ", ".join(
            f"{name}={was.get(name)!r} (this run: {name}={value!r})"
            for name, value in now["options"].items()
            if was.get(name) != value
        )
    for key in keys:
        if key != "options" and earlier.get(key) != now.get(key):
            if key == "fingerprint":
                return "other model weights, inputs x or options"
            return f"{key} {earlier.get(key)!r} (this run: {now.get(key)!r})"
    return None


def resumed_chunk_size(name, earlier, now, keys, asked, afresh):
    """The chunk size of an earlier run (record ``earlier``) that this run
    (``now``, compared on ``keys``, asking for ``asked`` or None) may resume;
    else ResumeMismatch naming ``name`` and how to start ``afresh``."""
    what = what_differs(earlier, now, keys)
    if what is not None:
        raise ResumeMismatch(
            f"{name} was started with {what}, so its finished chunks cannot be "
            "mixed with this run's. Resume it with the same model weights, x "
            f"and options; to start afresh, {afresh}, or write to another path."
        )
    if asked is not None and asked != earlier["chunk_size"]:
        raise ResumeMismatch(
            f"{name} was started with chunk_size={earlier['chunk_size']}; "
            f"this run asks for {asked}. Pass chunk_size={earlier['chunk_size']} "
            f"(or leave it out) to resume it, or {afresh} to start afresh."
        )
    return earlier["chunk_size"]


def _temporary(path):
    """A temporary name beside ``path`` that no other process or call uses."""
    return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def write_atomically(path, write, before_replace=None):
    """``write(file)`` of the open binary file into a temporary file, fsynced,
    then swapped in as ``path``: all or nothing. ``before_replace()`` runs
    just before the swap; an error it raises leaves no file."""
    path = Path(path)
    temporary = _temporary(path)
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def writer_lock(path):
    """Hold ``<path>.lock`` while this run writes the ``.npy`` at ``path``: a
    second writer (process or thread) is refused. The lock is ``flock``'s, so
    it dies with its process: a killed run can be resumed at once. FileBusy
    while another writer holds the lock.
    """
    lock = Path(str(path) + LOCK_SUFFIX)
    while True:
        try:
            descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:
            raise PermissionError(
                f"cannot write in {lock.parent}: {Path(path).name} and its "
                "ledger go there. Choose a folder you may write to."
            ) from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            name = Path(path).name
            raise FileBusy(
                f"another run is writing {name} right now (it holds {lock.name}); "
                "two writers would mix their chunks. Wait for that run to end "
                "(then call again: this one resumes where it stopped), stop it, "
                "or write to another path."
            ) from None
        try:  # still the file at that path? A run that ended may have removed it
            same = os.stat(lock).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(descriptor)
    try:
        yield
    finally:
        # removed while held: a run that opened it meanwhile sees (above) that
        # it is gone, and locks the file now at that path instead
        lock.unlink(missing_ok=True)
        os.close(descriptor)


def check_out(out, shape, dtype, what="Jacobian", layout=""):
    """``out`` as given, if it is an array that can hold this Jacobian of
    ``shape`` (n, l, m) and ``dtype``; TypeError or ValueError otherwise.
    ``what`` names it in the message (the NTK's ``"Theta"``), with ``layout``
    after its shape, e.g. ``" (sample-major)"``.
    """
    if not isinstance(out, np.ndarray):
        raise TypeError(
            "out must be a NumPy array, an np.memmap or the path of a .npy "
            f"file; got {type(out).__name__}."
        )
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(
            f"out has shape {out.shape} and dtype {out.dtype}; this {what} needs "
            f"shape {shape}{layout} and dtype {dtype}. Make it with "
            f"np.empty({shape}, '{dtype}') or "
            f"np.lib.format.open_memmap(path, mode='w+', dtype='{dtype}', "
            f"shape={shape})."
        )
    return out


def _npy_header(path):
    """``(shape, fortran_order, dtype, offset of the data)`` of a ``.npy`` file."""
    with open(path, "rb") as file:
        major, _ = np.lib.format.read_magic(file)
        read_header = (
            np.lib.format.read_array_header_1_0
            if major == 1
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran_order, dtype = read_header(file)
        return shape, fortran_order, dtype, file.tell()


def file_problem(path, shape, dtype):
    """What is wrong with the ``.npy`` at ``path`` (its header, its size in
    bytes) as rows of ``shape`` and ``dtype``: a sentence, or None."""
    shape, dtype = tuple(shape), np.dtype(dtype)
    try:
        found_shape, fortran_order, found_dtype, offset = _npy_header(path)
    except FileNotFoundError:
        return "the file does not exist"
    except (ValueError, OSError) as error:
        return f"its .npy header cannot be read ({error})"
    if found_shape != shape or found_dtype != dtype or fortran_order:
        order = " in Fortran order" if fortran_order else ""
        return (
            f"its header says shape {found_shape} and dtype {found_dtype}{order}; "
            f"the run writes shape {shape} and dtype {dtype}"
        )
    expected = offset + size_of(shape) * dtype.itemsize
    found = os.path.getsize(path)
    if found != expected:
        return f"it has {found:,} bytes where its header needs {expected:,} bytes"
    return None


def _read_ledger(path):
    """The ledger at ``path`` as a dict, or ResumeMismatch that says what to do."""
    ledger = Path(path)
    data = Path(str(path).removesuffix(LEDGER_SUFFIX)).name
    try:
        state = json.loads(ledger.read_text())
        missing = [key for key in LEDGER_KEYS if key not in state]
        if missing:
            raise KeyError(", ".join(missing))
        state["done"] = _runs_to_chunks(state["done"])
        state["chunk_size"] = int(state["chunk_size"])
        if state["chunk_size"] < 1 or int(state["n_chunks"]) < 1:
            raise ValueError(
                f"chunk_size {state['chunk_size']} and n_chunks "
                f"{state['n_chunks']}: each must be at least 1"
            )
    except (ValueError, KeyError, TypeError) as error:
        what = f"no {error}" if isinstance(error, KeyError) else str(error)
        raise ResumeMismatch(
            f"{ledger.name} is not a readable ledger ({what}): it was changed "
            "or cut short outside the run, or written by an older jacutil, so "
            f"which rows of {data} are done cannot be told. To start afresh, "
            f"delete {data} and {ledger.name}, or write to another path."
        ) from None
    return state


class Ledger:
    """Which chunks of the ``.npy`` at ``path`` are complete, and ``record``:
    what the file holds (fingerprint, key, shape, dtype); see the module
    docstring."""

    def __init__(self, path, record):
        self.data_path = Path(path)
        self.path = Path(str(path) + LEDGER_SUFFIX)
        self.record = record
        self.n_chunks = None
        self.done = set()
        self.token = None  # this run's, kept by a resumed run

    @property
    def complete(self):
        """Whether every chunk is finished (a ``bool``)."""
        return len(self.done) == self.n_chunks

    def todo(self):
        """The indices of the chunks still to compute, increasing."""
        return [k for k in range(self.n_chunks) if k not in self.done]

    def rows_done(self, chunk_size):
        """How many rows (samples) the finished chunks of ``chunk_size`` hold."""
        n_rows = self.record["shape"][0]
        return sum(min(chunk_size, n_rows - k * chunk_size) for k in self.done)

    def load(self, chunk_size):
        """Load the finished chunks and token of an earlier run of the same
        computation, and return its chunk size (None: no earlier run).
        ResumeMismatch where it computed something else, or with a chunk size
        other than ``chunk_size`` (None: any)."""
        if not self.path.exists():
            return None
        earlier = _read_ledger(self.path)
        name = self.data_path.name
        afresh = f"delete {name} and {self.path.name}"
        resumed_chunk_size(name, earlier, self.record, self.record, chunk_size, afresh)
        self.done = set(earlier["done"])
        self.token = earlier["token"]
        return earlier["chunk_size"]

    def save(self, chunk_size):
        """Record the finished chunks (of ``chunk_size``) once their rows are
        flushed."""
        state = {**self.record, "chunk_size": chunk_size, "n_chunks": self.n_chunks}
        state["token"] = self.token
        state["done"] = _chunks_to_runs(self.done)
        write_atomically(self.path, lambda f: f.write(json.dumps(state).encode()))

    def check_file(self):
        """The ``.npy`` is the one this ledger describes, or ResumeMismatch."""
        problem = file_problem(
            self.data_path, self.record["shape"], self.record["dtype"]
        )
        if problem is not None:
            name = self.data_path.name
            raise ResumeMismatch(
                f"{name} does not match its ledger {self.path.name}: {problem}. "
                "The file was changed or truncated outside the run (a copy cut "
                "short, a full disk, another program), so its rows cannot be "
                f"trusted. To start afresh, delete {name} and {self.path.name}, "
                "or write to another path."
            )


def finished_chunks(path):
    """``(finished, of)`` chunks of the resumable ``.npy`` at ``path``, from its
    ledger; ``(0, None)`` before the ledger exists."""
    ledger = Path(str(path) + LEDGER_SUFFIX)
    try:
        state = json.loads(ledger.read_text())
        return len(_runs_to_chunks(state["done"])), state["n_chunks"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return 0, None


def recorded_chunk_size(path):
    """The chunk size in the ledger of the resumable ``.npy`` at ``path``;
    ResumeMismatch when the ledger is unreadable."""
    return _read_ledger(Path(str(path) + LEDGER_SUFFIX))["chunk_size"]


def _chunks_to_runs(chunks):
    """{0, 1, 2, 5} -> [[0, 3], [5, 6]]: chunks finish mostly in order."""
    runs = []
    for k in sorted(chunks):
        if runs and runs[-1][1] == k:
            runs[-1][1] = k + 1
        else:
            runs.append([k, k + 1])
    return runs


def _runs_to_chunks(runs):
    return [k for start, stop in runs for k in range(start, stop)]


def open_rows(path, shape, dtype, record, chunk_size, default_chunk_size):
    """The ledger of the ``.npy`` at ``path``, resumed if the file exists and
    matches it; otherwise a new file of ``shape`` and ``dtype`` (its rows not
    yet written) with a new token. Call it holding :func:`writer_lock`.
    ``record`` identifies the run (:func:`run_record`); ``chunk_size`` is the
    one asked for, or None (the earlier run's, else ``default_chunk_size``).
    Returns ``(ledger, chunk_size)``: a :class:`Ledger` and an int.
    """
    path = Path(path)
    record = {**record, "shape": list(shape), "dtype": str(np.dtype(dtype))}
    ledger = Ledger(path, record)
    if path.exists() and not ledger.path.exists():
        raise ResumeMismatch(
            f"{path} exists but has no {ledger.path.name}: it was not written by "
            "a resumable run. Delete it or choose another path."
        )
    earlier = ledger.load(chunk_size)
    chunk_size = earlier or chunk_size or default_chunk_size
    ledger.n_chunks = ceil_div(shape[0], chunk_size)
    if ledger.done and path.exists():
        ledger.check_file()  # before any of its rows is trusted
    else:  # nothing finished: a new file
        ledger.done = set()
        ledger.token = secrets.token_hex(8)
        ledger.save(chunk_size)
        new = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        del new  # the header is written; the rows stay a sparse file until then
    return ledger, chunk_size


def write_rows(path, start, rows):
    """Write ``rows`` (c, l, m) as rows ``start..`` of the ``.npy`` at ``path``
    and flush them, through a mapping of those rows only."""
    shape, _, dtype, offset = _npy_header(path)
    if rows.shape[1:] != shape[1:] or rows.dtype != dtype:
        raise ValueError(
            f"rows of shape {rows.shape[1:]} and dtype {rows.dtype} do not fit "
            f"{path}, whose rows have shape {shape[1:]} and dtype {dtype}."
        )
    row_bytes = size_of(shape[1:]) * dtype.itemsize
    part = np.memmap(
        path, dtype, "r+", offset=offset + start * row_bytes, shape=rows.shape
    )
    part[:] = rows
    part.flush()
    del part


class SumCheckpoint:
    """Running sums over chunks, saved atomically after each chunk to the
    ``.npz`` at ``path``; ``record`` (JSON-able) says what the sums are of,
    and another record is refused."""

    def __init__(self, path, record):
        self.path = Path(path)
        self.record = json.dumps(record, sort_keys=True, default=str)

    def load(self):
        """``(next_chunk, sums)`` where an earlier run stopped, or
        ``(0, None)``; ResumeMismatch for sums of another computation."""
        if not self.path.exists():
            return 0, None
        with np.load(self.path) as saved:
            if str(saved["record"]) != self.record:
                raise ResumeMismatch(
                    f"{self.path} holds sums of a different computation (other "
                    "parameters, data or chunk size). Delete it to start afresh, "
                    "or use another checkpoint path."
                )
            count = sum(name.startswith("sum") for name in saved.files)
            return int(saved["next_chunk"]), tuple(
                saved[f"sum{i}"] for i in range(count)
            )

    def save(self, next_chunk, sums):
        """Save ``sums`` (a tuple of arrays) before chunk ``next_chunk``."""
        arrays = {f"sum{i}": s for i, s in enumerate(sums)}

        def write(file):
            np.savez(file, record=self.record, next_chunk=next_chunk, **arrays)

        write_atomically(self.path, write)
