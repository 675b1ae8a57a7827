"""The memory model: its fit, its predictions, and what peak_memory counts."""

import numpy as np
import pytest

import jacutil as ju
from jacutil.core import memory
from jacutil.core.memory import MemoryModel, peak_memory
from jacutil.teaching import memory_sweeps


def test_fit_recovers_a_quadratic():
    sizes = [50, 100, 200, 400, 700]
    truth = MemoryModel(quadratic=2000.0, linear=30_000.0, constant=4e6)
    fitted = MemoryModel.fit(sizes, truth.predict(sizes), quadratic=True)
    np.testing.assert_allclose(
        [fitted.quadratic, fitted.linear, fitted.constant],
        [truth.quadratic, truth.linear, truth.constant],
        rtol=1e-6,
    )


def test_linear_fit_has_no_quadratic_term():
    sizes = [1000, 3000, 10_000]
    peaks = [95_000.0 * n + 2e6 for n in sizes]
    fitted = MemoryModel.fit(sizes, peaks, quadratic=False)
    assert fitted.quadratic == 0
    np.testing.assert_allclose([fitted.linear, fitted.constant], [95_000, 2e6])


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="at least two sizes"):
        MemoryModel.fit([100], [1e6], quadratic=True)


@pytest.mark.parametrize("model", [memory.BATCH_JACOBIAN, memory.PER_SAMPLE_JACOBIAN])
@pytest.mark.parametrize("n_bytes", [2**23, 2**30, 50 * 2**30])
def test_largest_n_is_the_largest_that_fits(model, n_bytes):
    n = model.largest_n(n_bytes)
    assert n > 0
    assert model.predict(n) <= n_bytes < model.predict(n + 1)


def test_largest_n_of_a_budget_below_the_constant():
    assert MemoryModel(1.0, 1.0, constant=100.0).largest_n(50) == 0


def test_stored_models_grow_as_they_should():
    batch = [memory.predicted_bytes(n, "batch") for n in (5000, 10_000)]
    per_sample = [memory.predicted_bytes(n, "per_sample") for n in (5000, 10_000)]
    assert 3.9 < batch[1] / batch[0] <= 4  # quadratic
    assert 1.9 < per_sample[1] / per_sample[0] <= 2  # linear
    # n = 10,000 through tape.jacobian: far beyond any laptop.
    assert batch[1] > 100 * 2**30


def test_unknown_method():
    with pytest.raises(ValueError, match="method must be one of"):
        memory.predicted_bytes(10, "loop")


def test_peak_memory_is_above_a_given_baseline():
    level = memory.anonymous_rss()
    use = peak_memory(lambda: None, baseline=level - 100 * 2**20)
    assert use.peak >= 100 * 2**20 - 10 * 2**20


def test_pages_of_a_memory_mapped_file_are_not_counted(tmp_path):
    n_bytes = 300 * 2**20

    def fill():
        out = np.lib.format.open_memmap(
            tmp_path / "big.npy", mode="w+", dtype="uint8", shape=(n_bytes,)
        )
        out[:] = 1  # every page touched: resident, but file-backed
        out.flush()
        return int(out[:: 2**20].sum())

    use = peak_memory(fill)
    assert use.result == 300
    assert use.peak < 100 * 2**20


def test_batch_jacobian_memory_grows_faster_than_linearly():
    """Measured in a fresh process: 4x the samples costs far more than 4x."""
    small, large = memory_sweeps.measure_in_fresh_process("batch", [100, 400])
    assert small > 0
    assert large / small > 6  # linear would give 4, quadratic 16


def test_a_jacobian_on_disk_larger_than_its_budget_measured_in_a_fresh_process(
    tmp_path,
):
    """04-chunked: the file's pages count in the kernel's high-water mark but
    not in the working memory, which the budget bounds; the file is right."""
    budget = 8 * 2**20
    x = ju.regression_data(600, seed=1)[0]
    path = tmp_path / "J.npy"
    run = memory_sweeps.chunked_to_disk_in_fresh_process(
        path, x, memory_budget=budget, seed=1
    )
    assert run["file_bytes"] == np.load(path, mmap_mode="r").nbytes
    assert run["file_bytes"] > budget
    assert 0 < run["working"] <= budget
    assert run["peak"] >= run["file_pages"]
    assert not list(tmp_path.glob("*.x.npy"))  # the inputs file is removed
    expected = ju.per_sample_jacobian(ju.question_mlp(seed=1), x)
    np.testing.assert_allclose(np.load(path), expected, rtol=1e-5, atol=1e-6)
