"""Wall-clock timing with the first call reported apart (every notebook)."""

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class Timing:
    """``first``: the first call (trace, compile); ``median`` of the rest."""

    first: float
    times: list

    @property
    def median(self):
        return float(np.median(self.times))


def time_call(fn, *args, repeats=5, **kwargs):
    """Time ``fn(*args, **kwargs)``: the first call apart, then ``repeats`` more."""
    start = time.perf_counter()
    fn(*args, **kwargs)
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return Timing(first, times)
