"""Wall-clock timing with the first call reported apart (every notebook, the bench)."""

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class Timing:
    """``first``: seconds of the first call (trace, compile); ``times``: seconds
    of each later call, a list of ``float``; ``median`` of those."""

    first: float
    times: list

    @property
    def median(self):
        """The median of ``times``, in seconds (a ``float``)."""
        return float(np.median(self.times))

    def as_dict(self):
        """``{first, times, median}``: a timing as the bench's results store it."""
        return {"first": self.first, "times": self.times, "median": self.median}


def first_call(fn, *args, **kwargs):
    """``(value, seconds)`` of one call ``fn(*args, **kwargs)``: what ``fn``
    returned, and the call's wall-clock seconds."""
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def repeat_times(fn, *args, repeats=5, **kwargs):
    """Wall-clock seconds of ``repeats`` calls ``fn(*args, **kwargs)``, a list
    of floats in call order."""
    return [first_call(fn, *args, **kwargs)[1] for _ in range(repeats)]


def time_call(fn, *args, repeats=5, **kwargs):
    """Time ``fn(*args, **kwargs)``: the first call apart, then ``repeats`` more,
    as a :class:`Timing`.

    >>> timing = time_call(sum, [1, 2, 3], repeats=3)
    >>> len(timing.times), timing.median >= 0
    (3, True)
    """
    first = first_call(fn, *args, **kwargs)[1]
    return Timing(first, repeat_times(fn, *args, repeats=repeats, **kwargs))
