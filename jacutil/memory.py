"""Peak memory of a call, from the process's real resident size (notebooks 02, 04).

TensorFlow allocates outside Python's allocator, so ``tracemalloc`` does not see
its tensors. We sample the resident set size (RSS) from a background thread
while the call runs and report the peak above the level before it started.
"""

import threading
import time
from dataclasses import dataclass

import psutil


@dataclass
class MemoryUse:
    """``peak``: highest RSS during the call, minus ``baseline`` (bytes)."""

    result: object
    baseline: int
    peak: int
    seconds: float


def rss():
    """The process's resident set size now, in bytes."""
    return psutil.Process().memory_info().rss


def peak_memory(fn, *args, interval=0.002, **kwargs):
    """Run ``fn(*args, **kwargs)`` and measure its peak resident memory.

    Returns a :class:`MemoryUse`. Memory that TensorFlow keeps cached from an
    earlier call is not counted again, so measure a size once, on a warm model.
    """
    process = psutil.Process()
    baseline = process.memory_info().rss
    highest = [baseline]
    done = threading.Event()

    def sample():
        while not done.is_set():
            highest[0] = max(highest[0], process.memory_info().rss)
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
    highest[0] = max(highest[0], process.memory_info().rss)
    return MemoryUse(result, baseline, highest[0] - baseline, seconds)
