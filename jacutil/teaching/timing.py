"""Wall-clock timing with the first call reported apart (every notebook)."""

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class Timing:
    """``first``: the first call (trace, compile); ``median`` of the rest.

    Args:
        first: seconds of the first call.
        times: seconds of each later call, a list of ``float``.
    """

    first: float
    times: list

    @property
    def median(self):
        """The median of ``times``, in seconds (a ``float``)."""
        return float(np.median(self.times))


def time_call(fn, *args, repeats=5, **kwargs):
    """Time ``fn(*args, **kwargs)``: the first call apart, then ``repeats`` more.

    Args:
        fn: the function to time.
        *args: its positional arguments.
        repeats: the calls timed after the first.
        **kwargs: its keyword arguments.

    Returns:
        A :class:`Timing`.

    >>> timing = time_call(sum, [1, 2, 3], repeats=3)
    >>> len(timing.times), timing.median >= 0
    (3, True)
    """
    start = time.perf_counter()
    fn(*args, **kwargs)
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return Timing(first, times)
