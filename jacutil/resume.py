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

A running sum (the normal equations ``JtJ``, ``Jtr``) is kept the same way in
one ``.npz`` checkpoint: the partial sums and the next chunk, added in the same
order after a resume, so the total is the same to the last bit.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from ._tf import tf

LEDGER_SUFFIX = ".progress.json"


class ResumeMismatch(ValueError):
    """The file on disk was started by a different computation."""


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
    """A digest of what a chunked run computes: any change gives another one.

    It covers the model's layer types and settings, every weight (trainable
    or not: BatchNorm statistics change the outputs too), the variables
    differentiated, every input array, and ``options`` (chunk size, method...).
    """
    digest = hashlib.blake2b(digest_size=16)

    def add(array):
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(memoryview(array).cast("B"))

    digest.update(_architecture(model).encode())
    for weight in getattr(model, "weights", None) or variables:
        add(np.asarray(weight))
    digest.update(str([tuple(v.shape) for v in variables]).encode())
    for leaf in tf.nest.flatten(x):
        add(np.asarray(leaf))
    digest.update(json.dumps(options, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _write_atomically(path, write):
    """``write(file)`` into a temporary file, then swap it in: all or nothing."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


class Ledger:
    """Which chunks of ``path`` are complete; see the module docstring."""

    def __init__(self, path, n_chunks, record):
        self.data_path = Path(path)  # the .npy whose chunks it records
        self.path = Path(str(path) + LEDGER_SUFFIX)
        self.n_chunks = n_chunks
        self.record = record  # what the file holds: fingerprint, shape, ...
        self.done = set()

    @property
    def complete(self):
        return len(self.done) == self.n_chunks

    def todo(self):
        return [k for k in range(self.n_chunks) if k not in self.done]

    def load(self, chunk_size):
        """The finished chunks of an earlier run of the same computation.

        ``chunk_size``: the one asked for, or None to take the earlier one.
        Returns the chunk size to use.
        """
        if not self.path.exists():
            return chunk_size
        earlier = json.loads(self.path.read_text())
        name = self.data_path.name
        for key, value in self.record.items():
            if earlier.get(key) != value:
                what = (
                    "other model weights, inputs x or options"
                    if key == "fingerprint"
                    else f"{key} {earlier.get(key)!r} (this run: {value!r})"
                )
                raise ResumeMismatch(
                    f"{name} was started with {what}, so its finished chunks "
                    "cannot be mixed with this run's. Resume it with the same "
                    f"model weights, x and options; to start afresh, delete "
                    f"{name} and {self.path.name}, or write to another path."
                )
        if chunk_size is not None and chunk_size != earlier["chunk_size"]:
            raise ResumeMismatch(
                f"{name} was started with chunk_size={earlier['chunk_size']}; "
                f"this run asks for {chunk_size}. Pass chunk_size="
                f"{earlier['chunk_size']} (or leave it out) to resume it, "
                "or delete both files to start afresh."
            )
        self.done = set(_runs_to_chunks(earlier["done"]))
        return earlier["chunk_size"]

    def save(self, chunk_size):
        """Record the finished chunks: call after their rows are flushed."""
        state = {**self.record, "chunk_size": chunk_size, "n_chunks": self.n_chunks}
        state["done"] = _chunks_to_runs(self.done)
        _write_atomically(self.path, lambda f: f.write(json.dumps(state).encode()))


def finished_chunks(path):
    """``(finished, of)`` chunks of the resumable ``.npy`` at ``path``, from its
    ledger; ``(0, None)`` before the ledger exists."""
    ledger = Path(str(path) + LEDGER_SUFFIX)
    try:
        state = json.loads(ledger.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return 0, None
    return len(_runs_to_chunks(state["done"])), state["n_chunks"]


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


def open_rows(path, shape, dtype, record, chunk_size, n_rows_of):
    """The ledger of the ``.npy`` at ``path``, resumed if the file exists;
    otherwise a new file of ``shape`` and ``dtype`` (its rows not yet written).

    ``n_rows_of(chunk_size)`` gives the number of chunks. Returns
    ``(ledger, chunk_size)``.
    """
    path = Path(path)
    ledger = Ledger(path, None, {**record, "shape": list(shape), "dtype": str(dtype)})
    if path.exists() and not ledger.path.exists():
        raise ResumeMismatch(
            f"{path} exists but has no {ledger.path.name}: it was not written by "
            "a resumable run. Delete it or choose another path."
        )
    chunk_size = ledger.load(chunk_size)
    ledger.n_chunks = n_rows_of(chunk_size)
    if not (ledger.done and path.exists()):  # nothing finished: a new file
        ledger.done = set()
        ledger.save(chunk_size)
        new = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        del new  # the header is written; the rows stay a sparse file until then
    return ledger, chunk_size


def write_rows(path, start, rows):
    """Write ``rows`` as rows ``start..`` of the ``.npy`` at ``path`` and flush
    them to disk, through a mapping of those rows only (by the process that
    computed them: this one, or a worker that sees the same file)."""
    with open(path, "rb") as file:
        major, _ = np.lib.format.read_magic(file)
        read_header = (
            np.lib.format.read_array_header_1_0
            if major == 1
            else np.lib.format.read_array_header_2_0
        )
        shape, _, dtype = read_header(file)
        offset = file.tell()
    if rows.shape[1:] != shape[1:] or rows.dtype != dtype:
        raise ValueError(
            f"rows of shape {rows.shape[1:]} and dtype {rows.dtype} do not fit "
            f"{path}, whose rows have shape {shape[1:]} and dtype {dtype}."
        )
    row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
    part = np.memmap(
        path, dtype, "r+", offset=offset + start * row_bytes, shape=rows.shape
    )
    part[:] = rows
    part.flush()
    del part


class SumCheckpoint:
    """Running sums over chunks, saved atomically after each chunk."""

    def __init__(self, path, record):
        self.path = Path(path)
        self.record = json.dumps(record, sort_keys=True, default=str)

    def load(self, zeros):
        """``(next_chunk, sums)``: where an earlier run stopped, or (0, zeros)."""
        if not self.path.exists():
            return 0, zeros
        with np.load(self.path) as saved:
            if str(saved["record"]) != self.record:
                raise ResumeMismatch(
                    f"{self.path} holds sums of a different computation (other "
                    "parameters, data or chunk size). Delete it to start afresh, "
                    "or use another checkpoint path."
                )
            return int(saved["next_chunk"]), tuple(
                saved[f"sum{i}"] for i in range(len(zeros))
            )

    def save(self, next_chunk, sums):
        arrays = {f"sum{i}": s for i, s in enumerate(sums)}

        def write(file):
            np.savez(file, record=self.record, next_chunk=next_chunk, **arrays)

        _write_atomically(self.path, write)


def kill_part_way(script, progress, at_least=1, timeout=120.0):
    """A drill: run ``script`` in a fresh Python and ``SIGKILL`` it - no
    clean-up, as a lost machine - once ``progress()`` (chunks finished) reaches
    ``at_least``. Returns ``progress()`` after the kill."""
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    try:
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            if progress() >= at_least:
                process.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    return progress()
