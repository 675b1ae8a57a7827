"""DP-SGD's Poisson sampling (notebook 09-matrix-free): each sample joins a
step's batch independently with probability q = batch_size / n, as the
accountant assumes; the batch is padded to a fixed size with rows of weight
0, so the compiled step traces once, not once per batch size."""

import math

import numpy as np


def check_batch_size(batch_size, n):
    """A ValueError unless the expected batch size is in [1, n]."""
    if not 1 <= batch_size <= n:
        raise ValueError(
            f"batch_size is {batch_size} but the data has {n} samples: the "
            "expected batch size is batch_size, and each sample joins a batch "
            f"with probability batch_size / n, which must be in (0, 1] (use "
            f"batch_size <= {n})."
        )


def steps_per_epoch(n, batch_size):
    """Poisson-sampled steps in an epoch of n samples: ``round(n / batch_size)``,
    at least 1 (an epoch sees each sample once in expectation)."""
    check_batch_size(batch_size, n)
    return max(1, round(n / batch_size))


def padded_size(batch_size, rate, physical_batch_size=None, max_physical=None):
    """The rows of a step's padded pass: ``physical_batch_size``, or the
    expected size plus two standard deviations of the Poisson size
    (exceeded in about 2% of the steps), at most ``max_physical``."""
    physical = physical_batch_size or batch_size + math.ceil(
        2 * math.sqrt(batch_size * (1 - rate))
    )
    return min(physical, max_physical) if max_physical else physical


def poisson_batch(sampler, n, rate, physical):
    """``(index, valid)`` of one Poisson-sampled step: each of the n samples
    drawn with probability ``rate`` by ``sampler.random(n)``, padded with
    sample 0 (``valid`` False) to a multiple of ``physical`` rows."""
    chosen = np.flatnonzero(sampler.random(n) < rate)
    size = physical * max(1, math.ceil(len(chosen) / physical))
    index = np.zeros(size, dtype=np.int64)  # padding: sample 0, weight 0
    index[: len(chosen)] = chosen
    return index, np.arange(size) < len(chosen)
