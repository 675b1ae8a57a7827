"""peak_memory sees allocations that tracemalloc cannot."""

import numpy as np

from jacutil.core.memory import peak_memory


def test_peak_memory_sees_a_large_allocation():
    def allocate(n_bytes):
        block = np.ones(n_bytes // 8)  # touched, so resident
        return float(block.sum())

    use = peak_memory(allocate, 400 * 2**20)
    assert use.result == 400 * 2**20 / 8
    assert use.peak > 300 * 2**20
    assert use.seconds > 0


def test_peak_memory_of_nothing_is_small():
    assert peak_memory(lambda: None).peak < 50 * 2**20
