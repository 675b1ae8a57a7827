"""The race of notebook 09 and ``make bench``: Levenberg-Marquardt with
preconditioned CG against Adam, measured at the same training MSE."""

import sys

import numpy as np
import pytest

import jacutil as ju
from jacutil.bench import second_order
from jacutil.core import memory
from jacutil.teaching import wide_fit


def test_the_table_times_each_fit_to_the_lowest_mse_kfac_and_adam_both_reached():
    fits = {
        "LM, CG + KFAC": [(0.0, 1.0), (1.0, 0.1), (2.0, 0.01)],
        "LM, plain CG": [(0.0, 1.0), (3.0, 0.5)],
        "Adam, full batch, lr 1e-3": [(0.0, 1.0), (4.0, 0.05), (8.0, 0.02)],
        "Adam, batches of 256, lr 1e-3": [(0.0, 1.0), (6.0, 0.02)],
    }
    text = second_order.table({"toy": fits})
    rows = {line.split(" | ")[1]: line for line in text.splitlines()[2:]}
    assert "| 2.00e-02 |" in rows["the same MSE"]  # Adam's best, above KFAC's
    assert "| 2.00 s | 0.33 |" in rows["LM, CG + KFAC"]  # 2 s against Adam's 6 s
    assert "| 6.00 s |" in rows["Adam, batches of 256, lr 1e-3"]
    assert "| never |" in rows["LM, plain CG"]
    assert second_order.first_time_at_or_below(fits["LM, plain CG"], 0.4) == np.inf


def small_fit(n=64):
    model = ju.question_mlp(hidden=(8,), seed=0)
    x, y = ju.regression_data(n, seed=0)
    return model, x, y


@pytest.mark.parametrize("batch_size", [None, 16])
def test_adam_records_the_mse_of_all_samples_at_its_weights(batch_size):
    """Full batch: the loss of each step, at the weights it started from;
    mini-batches: after each epoch, the MSE on all of x at the weights then."""
    model, x, y = small_fit()
    start = float(np.mean((model(x).numpy() - y) ** 2))
    history = wide_fit.fit_adam(model, x, y, 0.2, 1e-2, batch_size)
    seconds = [t for t, _ in history]
    assert seconds == sorted(seconds) and seconds[-1] >= 0.2
    last = float(np.mean((model(x).numpy() - y) ** 2))
    if batch_size is not None:  # full batch: the loss before the last step
        np.testing.assert_allclose(history[-1][1], last, rtol=1e-6)
    assert history[-1][1] < 0.8 * start  # it learned


def test_the_timed_levenberg_marquardt_is_the_plain_one():
    """The untimed warm-up call leaves the fit as ``levenberg_marquardt``
    alone takes it: the same MSE at each accepted point."""
    model, x, y = small_fit()
    problem = ju.least_squares_problem(model, x, y, jacobian="operator")
    history = wide_fit.fit_levenberg_marquardt(problem, 4, 3, "kfac", 0.1)
    reference = ju.levenberg_marquardt(
        ju.least_squares_problem(model, x, y, jacobian="operator"), problem.theta0,
        max_steps=4, damping=0.1, solver="cg", cg_iterations=3, preconditioner="kfac",
    )  # fmt: skip
    np.testing.assert_allclose(
        [mse for _, mse in history], reference["history"][:, 1], rtol=1e-6
    )
    assert history[-1][1] < history[0][1]


def test_a_race_runs_every_fit_from_one_start():
    fits = second_order.race((4,), 40, 2, 2)
    assert set(fits) == {name for name, _ in second_order.PRECONDITIONERS} | {
        name for name, _, _ in second_order.ADAM
    }
    starts = {name: history[0][1] for name, history in fits.items()}
    lm = [starts[name] for name, _ in second_order.PRECONDITIONERS]
    assert lm == [lm[0]] * len(lm)  # the same start (Adam records after a step)


def test_the_wide_fit_without_levenberg_marquardt_runs_adam_as_long_as_least_squares():
    """``lm_steps=0`` (notebook 09's exercise 1): no KFAC fit, and Adam's
    clock runs to the least-squares fit's last second."""
    fit = wide_fit.run(n_samples=64, width=8, depth=1, max_nfev=2, lsmr_iterations=2,
                       lm_steps=0)  # fmt: skip
    assert fit["lm_kfac"] == []
    assert fit["adam"][-1][0] >= fit["lsmr"][-1][0] > fit["adam"][-2][0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_the_wide_fits_fresh_process_reports_its_own_peak_not_its_parents():
    """A child started by fork and exec keeps its parent's ``ru_maxrss``; the
    fit's process reports its own peak (``peak_rss``), so a parent that once
    held 2 GiB does not show through (notebook 09's memory line)."""
    ballast = np.ones(2**31 // 8)  # 2 GiB, touched: this process's peak
    parent = memory.peak_rss()
    del ballast
    fit = wide_fit.run_in_fresh_process(
        n_samples=32, width=4, depth=1, max_nfev=2, lsmr_iterations=2, lm_steps=0
    )
    assert parent >= 2**31
    assert 0 < fit["process_peak_bytes"] < parent - 2**30
