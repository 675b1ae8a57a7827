"""Memory sweeps for the notebooks (02, 04, 08): each size's peak measured in
a fresh Python process, so memory that TensorFlow pooled in an earlier call
is not hidden (see :mod:`jacutil.core.memory`). Also one chunked run into a
memory-mapped file, measured in a fresh process (04)."""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import psutil

from ..core._shared import count_params, size_of
from ..core.memory import anonymous_rss, peak_memory, peak_rss
from ..engine.rows import chunked_jacobian
from ..stages.vectorized import per_sample_jacobian, vectorized_jacobian
from . import models

# Models that measure_in_fresh_process can build: name -> (model, inputs).
SWEEP_MODELS = {
    "question_mlp": ("question_mlp", "regression_data"),
    "small_cnn": ("small_cnn", "image_data"),
    "sequence_lstm": ("sequence_lstm", "sequence_data"),
}


def _sweep(method, sizes, n_samples=None, model_name="question_mlp"):
    """Peaks of one sweep, run in this process from a clean start (see below)."""
    build, data = (getattr(models, f) for f in SWEEP_MODELS[model_name])
    model = build()
    largest = n_samples or max(sizes)
    x = data(largest)
    x = x[0] if isinstance(x, tuple) else x
    if method == "chunked":
        n_outputs = size_of(model(x[:1]).shape[1:])
        n_params = count_params(model.trainable_variables)
        shape = (largest, n_outputs, n_params)
        folder = tempfile.TemporaryDirectory()
        out = np.lib.format.open_memmap(
            f"{folder.name}/J.npy", mode="w+", dtype="float32", shape=shape
        )

        def run(chunk_size):
            chunked_jacobian(model, x, chunk_size=chunk_size, out=out, progress=False)

        run(1)  # warm-up: the trace
    else:
        stage = {"batch": vectorized_jacobian, "per_sample": per_sample_jacobian}

        def run(n):
            stage[method](model, x[:n])

        run(2)  # warm-up: the trace
    start = anonymous_rss()
    return [peak_memory(run, n, baseline=start).peak for n in sizes]


def _reset_peak_rss():
    """Start this process's VmHWM afresh from its current RSS (Linux 4.0+:
    ``/proc/self/clear_refs``); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _to_disk(path, x_path, memory_budget, seed):
    """What :func:`chunked_to_disk_in_fresh_process` runs in the new process."""
    model = models.question_mlp(seed=seed)
    x = np.load(x_path)
    n_outputs = size_of(model(x[:1]).shape[1:])
    shape = (len(x), n_outputs, count_params(model.trainable_variables))
    out = np.lib.format.open_memmap(path, mode="w+", dtype="float32", shape=shape)
    chunked_jacobian(model, x[:2], out=out[:2], progress=False)  # the trace
    _reset_peak_rss()  # else the peak below is measured from an earlier one
    before = psutil.Process().memory_info()
    use = peak_memory(
        chunked_jacobian, model, x, memory_budget=memory_budget, out=out, progress=False
    )
    after = psutil.Process().memory_info()
    out.flush()
    peak = max(0, peak_rss() - before.rss)  # the kernel's high-water mark
    file_pages = max(0, after.shared - before.shared)  # the file's, mapped
    return {
        "seconds": use.seconds,
        "peak": peak,
        "file_pages": file_pages,
        "working": max(peak - file_pages, use.peak),
        "file_bytes": int(out.nbytes),
    }


def chunked_to_disk_in_fresh_process(path, x, *, memory_budget, seed=0):
    """``chunked_jacobian`` of ``question_mlp(seed=seed)`` on ``x`` into a new
    memory-mapped ``.npy`` at ``path``, run and measured in a new process.

    The new process traces on two samples, then measures the run from there:
    ``peak``, how far its resident memory's high-water mark (VmHWM, the
    kernel's own, not sampled) rose; ``file_pages``, how much of that is the
    file's pages, mapped into the process (page cache, which the kernel
    writes back and drops when memory runs short, so RAM does not bound the
    file); ``working``, the rest, the memory the budget bounds (at least the
    anonymous peak sampled during the run); ``seconds``; ``file_bytes``.
    A dict, in bytes. Introduced in ``04-chunked``.
    """
    x_path = f"{path}.x.npy"
    np.save(x_path, np.asarray(x))
    try:
        arguments = ["-m", "jacutil.teaching.memory_sweeps", "to_disk"]
        arguments += [json.dumps([str(path), x_path, int(memory_budget), int(seed)])]
        return fresh_python(arguments, "the writing process failed")
    finally:
        os.remove(x_path)


def measure_in_fresh_process(method, sizes, *, n_samples=None, model="question_mlp"):
    """Peak bytes of each size, measured in a new Python process, sizes increasing.

    ``method``: ``"batch"`` (``vectorized_jacobian``), ``"per_sample"``
    (``per_sample_jacobian``), or ``"chunked"`` (``chunked_jacobian`` of
    ``n_samples`` into a memory-mapped file; ``sizes`` are chunk sizes), on
    ``model``, a name in :data:`SWEEP_MODELS` (``question_mlp()`` by
    default). A fresh process starts with an empty memory pool, and each
    peak is above the level before the first size: what the process had to
    grow to. Introduced in ``02-vectorized``.
    """
    sizes = sorted(int(n) for n in sizes)
    arguments = ["-m", "jacutil.teaching.memory_sweeps", method, json.dumps(sizes)]
    arguments += [str(int(n_samples or 0)), model]
    return fresh_python(arguments, "the measuring process failed")


def fresh_python(arguments, failure):
    """Run ``python ARGUMENTS`` in a new process; the JSON it printed last.

    A new process starts with an empty memory pool: what it grows is its own.
    A process that fails is a ``RuntimeError`` that starts with ``failure``
    and ends with the end of its stderr.
    """
    command = [sys.executable, *arguments]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{failure}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__" and sys.argv[1] == "to_disk":
    print(json.dumps(_to_disk(*json.loads(sys.argv[2]))))
elif __name__ == "__main__":
    _method, _sizes = sys.argv[1], json.loads(sys.argv[2])
    _n = int(sys.argv[3]) or None if len(sys.argv) > 3 else None
    _model = sys.argv[4] if len(sys.argv) > 4 else "question_mlp"
    print(json.dumps(_sweep(_method, _sizes, _n, _model)))
