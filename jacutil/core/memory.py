"""Peak memory of a call, and a measured model of it (notebooks 02, 04).

TensorFlow allocates outside Python's allocator, so ``tracemalloc`` does not see
its tensors. We sample the process's *anonymous* resident memory (RSS minus the
pages of mapped files) from a background thread while the call runs and report
the peak above a baseline. Pages of a memory-mapped ``.npy`` are the kernel's
file cache, written back and dropped when memory is short, so they are not
counted.

With oneDNN (on by default on x86 CPUs) TensorFlow keeps the memory that it
grew in a pool and reuses it: a second call at the same size measures almost
nothing, and resident memory never falls back. Measure each size once, on its
first call, in increasing order, above a baseline taken before the first.
"""

import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import psutil

from ._tf import tf
from .batch import as_batch
from .formulation import quiet_function, recurrent_layers, unrolled
from .target import resolve_target


@dataclass
class MemoryUse:
    """A call's ``result``, its wall time in ``seconds``, and ``peak``: the
    highest anonymous RSS during the call minus ``baseline``, in bytes (at
    least 0)."""

    result: object
    baseline: int
    peak: int
    seconds: float


def rss():
    """The process's resident set size now, in bytes (mapped files included)."""
    return psutil.Process().memory_info().rss


def peak_rss():
    """This process's own peak resident set size, in bytes: ``VmHWM`` of
    ``/proc/self/status`` (Linux), which starts afresh at ``exec``. Not
    ``getrusage``'s ``ru_maxrss``: a child started by fork and exec keeps its
    parent's, so a fresh process started from a 4 GiB pytest worker reports
    4 GiB (CI of 2026-12-07). Elsewhere ``ru_maxrss`` (a fresh shell's
    child is small)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # not on Windows

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def anonymous_rss(process=None):
    """Resident memory that only swap could free: RSS less file-backed pages,
    in bytes, of ``process`` (default: this one)."""
    info = (process or psutil.Process()).memory_info()
    return info.rss - info.shared


def peak_memory(fn, *args, interval=0.002, baseline=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` and measure its peak resident memory (a
    :class:`MemoryUse`), sampled every ``interval`` seconds.

    Memory that TensorFlow keeps pooled from an earlier call is not counted
    again, so for a sweep of sizes pass the level from before the first size
    as ``baseline`` (bytes of anonymous RSS; default: now).
    """
    process = psutil.Process()
    if baseline is None:
        baseline = anonymous_rss(process)
    highest = [anonymous_rss(process)]
    done = threading.Event()

    def sample():
        while not done.is_set():
            highest[0] = max(highest[0], anonymous_rss(process))
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    finally:
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
    highest[0] = max(highest[0], anonymous_rss(process))
    return MemoryUse(result, baseline, max(0, highest[0] - baseline), seconds)


@dataclass(frozen=True)
class MemoryModel:
    """Peak bytes of a Jacobian of n samples: ``a*n**2 + b*n + c``.

    ``quadratic`` (a) is zero for the per-sample path; ``linear`` (b) holds the
    rows of the result and their working copies; ``constant`` (c) the rest.

    >>> MemoryModel(quadratic=0.0, linear=100.0, constant=50.0).largest_n(1050)
    10
    """

    quadratic: float
    linear: float
    constant: float = 0.0

    def predict(self, n_samples):
        """Predicted peak bytes for ``n_samples`` (a number or an array): a
        float array of its shape."""
        n = np.asarray(n_samples, dtype=float)
        return self.quadratic * n**2 + self.linear * n + self.constant

    def largest_n(self, n_bytes):
        """The largest number of samples whose predicted peak fits ``n_bytes``
        (0 when not even the constant fits)."""
        a, b, c = self.quadratic, self.linear, self.constant - n_bytes
        if c > 0:
            return 0
        if a == 0:
            return int(-c // b) if b > 0 else np.iinfo(np.int64).max
        return int((-b + np.sqrt(b * b - 4 * a * c)) / (2 * a))

    @classmethod
    def fit(cls, sizes, peaks, *, quadratic):
        """Least-squares fit, with non-negative terms, of measured ``peaks`` (bytes).

        Relative errors are minimised, so small sizes count as much as large
        ones. ``quadratic=False`` fits ``b*n + c`` only. ``sizes``: the
        numbers of samples measured, shape (k,), k >= 2, one peak each
        (else a ValueError).
        """
        from scipy.optimize import nnls

        n = np.asarray(sizes, dtype=float)
        peaks = np.asarray(peaks, dtype=float)
        if n.shape != peaks.shape or len(n) < 2:
            raise ValueError(
                "fit needs at least two sizes and one measured peak per size; "
                f"got {len(n)} sizes and {len(peaks)} peaks."
            )
        columns = [n**2, n, np.ones_like(n)] if quadratic else [n, np.ones_like(n)]
        weights = 1 / np.maximum(peaks, 1.0)
        terms, _ = nnls(np.stack(columns, axis=1) * weights[:, None], peaks * weights)
        return cls(*terms) if quadratic else cls(0.0, *terms)


# Measured on question_mlp() (10 -> 64 -> 32 -> 2, float32, 2,850 parameters),
# TensorFlow 2.21 with oneDNN, 2-core x86 CPU, 2026-11-30: the first call at
# each n, sizes increasing, peak above the level before the first size
# (notebook 02-vectorized re-measures them and shows the fit).
# Each sweep ran in a fresh process (measure_in_fresh_process).
# vectorized_jacobian, n = 50, 100, 200, 400, 700 (9, 22, 83, 314, 881 MiB);
# it predicted 1.83 GiB at n = 1,000, where 1.75 GiB was then measured.
BATCH_JACOBIAN = MemoryModel(quadratic=1955.0, linear=0.0, constant=4.5e6)
# per_sample_jacobian, n = 1,000, 3,000, 10,000, 20,000 (95, 274, 830, 2,099
# MiB): about 4.2 times the 22,800 bytes of one sample's rows of the result.
PER_SAMPLE_JACOBIAN = MemoryModel(quadratic=0.0, linear=95658.0, constant=2.6e6)


# Operations that allocate nothing new (views, reads, bookkeeping).
NO_ALLOCATION = frozenset(
    "Placeholder Const ReadVariableOp VarHandleOp Identity IdentityN Reshape "
    "Squeeze ExpandDims StopGradient PreventGradient Shape ShapeN Size Rank "
    "NoOp".split()
)


def activation_elements(model, x, *, variables=None, training=False, unroll=True):
    """Elements of one sample's forward pass: the ``A`` of the chunk memory model.

    Traces the forward pass of one sample like ``x`` and adds up the
    floating-point outputs of its operations, views and reads left out
    (``jacutil.engine.rows`` turns it into bytes). With ``unroll`` (the
    per-sample method) recurrent layers are traced unrolled, and every read
    of a variable after its first counts too: an unrolled layer gets one
    block of gradients per time step. Returns an ``int``; ``model``,
    ``variables`` and ``training`` as :func:`jacutil.vectorized_jacobian`.
    Introduced in ``04-chunked``.
    """
    target = resolve_target(model, variables, training, x)
    return count_activations(target, as_batch(x, target), unroll=unroll)


def count_activations(target, x, *, unroll=True):
    """:func:`activation_elements` of a resolved target and a checked batch."""
    spec = tf.nest.map_structure(lambda t: tf.TensorSpec([1, *t.shape[1:]], t.dtype), x)
    rnns = recurrent_layers(target) if unroll else []
    with unrolled(rnns):
        forward = quiet_function(target.forward, autograph=False)  # as Keras
        graph = forward.get_concrete_function(spec).graph
    total, read = 0, set()
    for op in graph.get_operations():
        size = sum(
            t.shape.num_elements()
            for t in op.outputs
            if t.dtype.is_floating and t.shape.is_fully_defined()
        )
        if op.type == "ReadVariableOp":
            handle = op.inputs[0].ref()
            total += size if (unroll and handle in read) else 0
            read.add(handle)
        elif op.type not in NO_ALLOCATION:
            total += size
    return int(total)


def predicted_bytes(n_samples, method="batch"):
    """Predicted peak bytes of a Jacobian of ``n_samples`` on the question's network.

    ``method="batch"``: ``vectorized_jacobian`` (``tape.jacobian`` over the
    whole batch), quadratic in n. ``method="per_sample"``:
    ``per_sample_jacobian``, linear in n. Introduced in ``02-vectorized``.
    """
    models = {"batch": BATCH_JACOBIAN, "per_sample": PER_SAMPLE_JACOBIAN}
    if method not in models:
        raise ValueError(f"method must be one of {sorted(models)}; got {method!r}.")
    return float(models[method].predict(n_samples))


def available_bytes(safety=0.5):
    """Bytes this process may still use: a fraction ``safety`` of what is free."""
    return int(safety * psutil.virtual_memory().available)
