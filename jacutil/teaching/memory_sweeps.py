"""Memory sweeps for the notebooks (02, 04, 08): each size's peak measured in
a fresh Python process, so memory that TensorFlow pooled in an earlier call
is not hidden (see :mod:`jacutil.core.memory`)."""

import json
import subprocess
import sys
import tempfile

import numpy as np

from ..core._shared import count_params, size_of
from ..core.memory import anonymous_rss, peak_memory
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


if __name__ == "__main__":
    _method, _sizes = sys.argv[1], json.loads(sys.argv[2])
    _n = int(sys.argv[3]) or None if len(sys.argv) > 3 else None
    _model = sys.argv[4] if len(sys.argv) > 4 else "question_mlp"
    print(json.dumps(_sweep(_method, _sizes, _n, _model)))
