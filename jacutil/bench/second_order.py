"""Second order against Adam: time to the same training loss (issue 38).

``python -m jacutil.bench.second_order`` fits two problems from one start,
in one process, one after the other:

* notebook 09's wide network (10 -> 512 -> 512 -> 512 -> 2, about 530,000
  parameters) on 2,000 samples;
* the question's network (10 -> 64 -> 32 -> 2, 2,850 parameters) on
  10,000 samples.

The fits: ``levenberg_marquardt`` on the matrix-free problem with CG
preconditioned by KFAC, by G's diagonal, and plain (the problem's trial
steps and CG iterations, below); then Adam, full batch at two learning
rates and in mini-batches of 256, each for twice the longest
Levenberg-Marquardt fit. Every clock starts after the fit's first,
compiling call. The "same MSE" is the lowest that both the KFAC fit and
the best of the Adam fits reached; each fit's time is its first point at
or below it ("never" if it did not get there). The table prints each
time and the ratio of the KFAC fit's to the fastest Adam's (below 1:
second order wins). Introduced in ``09-matrix-free``.
"""

import argparse

import numpy as np

from ..fitting.scipy_bridge import least_squares_problem
from ..teaching.models import question_mlp, regression_data
from ..teaching.wide_fit import fit_adam, fit_levenberg_marquardt
from .machine import machine_summary

PROBLEMS = {  # name: (hidden layers, samples, LM's trial steps, CG iterations)
    "notebook 09's wide network": ((512, 512, 512), 2000, 12, 3),
    "the question's MLP": ((64, 32), 10000, 20, 10),
}
DAMPING = 0.1  # Levenberg-Marquardt's first damping
ADAM = (("Adam, full batch, lr 1e-3", 1e-3, None),
        ("Adam, full batch, lr 1e-2", 1e-2, None),
        ("Adam, batches of 256, lr 1e-3", 1e-3, 256))  # fmt: skip
PRECONDITIONERS = (("LM, CG + KFAC", "kfac"), ("LM, CG + diagonal", "diagonal"),
                   ("LM, plain CG", None))  # fmt: skip


def first_time_at_or_below(history, level):
    """The seconds of the first ``(seconds, mse)`` pair at or below ``level``
    (``inf`` if none)."""
    return next((t for t, mse in history if mse <= level), np.inf)


def race(hidden, n_samples, steps, iterations, seed=0):
    """Every fit of one problem from one start: ``{fit's name: history}``
    (``steps`` and ``iterations``: Levenberg-Marquardt's trial steps and CG
    iterations a step)."""
    model = question_mlp(hidden=hidden, seed=seed)
    x, y = regression_data(n_samples, seed=seed)
    start = model.get_weights()
    problem = least_squares_problem(model, x, y, jacobian="operator")
    fits = {
        name: fit_levenberg_marquardt(problem, steps, iterations, how, DAMPING)
        for name, how in PRECONDITIONERS
    }
    seconds = 2 * max(history[-1][0] for history in fits.values())
    for name, rate, batch_size in ADAM:
        model.set_weights(start)
        fits[name] = fit_adam(model, x, y, seconds, rate, batch_size, seed=seed)
    return fits


def best(history):
    return min(mse for _, mse in history)


def table(results):
    """Markdown rows: per problem and fit, the seconds to the same MSE."""
    lines = [
        "| problem | fit | best MSE | seconds to the same MSE | KFAC / fastest Adam |",
        "|---|---|---:|---:|---:|",
    ]
    for problem, fits in results.items():
        adam = {name: h for name, h in fits.items() if name.startswith("Adam")}
        level = max(best(fits["LM, CG + KFAC"]), min(map(best, adam.values())))
        times = {name: first_time_at_or_below(h, level) for name, h in fits.items()}
        ratio = times["LM, CG + KFAC"] / min(times[name] for name in adam)
        for name, history in fits.items():
            seconds = f"{times[name]:.2f} s" if np.isfinite(times[name]) else "never"
            mine = f"{ratio:.2f}" if name == "LM, CG + KFAC" else ""
            lines.append(
                f"| {problem} | {name} | {best(history):.2e} | {seconds} | {mine} |"
            )
        lines.append(f"| {problem} | the same MSE | {level:.2e} | | |")
    return "\n".join(lines)


def main(argv=None):
    """``python -m jacutil.bench.second_order``: run the races, print the table."""
    argparse.ArgumentParser(
        prog="python -m jacutil.bench.second_order",
        description="Levenberg-Marquardt with preconditioned CG against Adam.",
    ).parse_args(argv)
    results = {name: race(*settings) for name, settings in PROBLEMS.items()}
    m = machine_summary()
    print(f"\n{m['date']}, {m['cpu_count']} CPUs, load average {m['load_average']}. "
          f"Levenberg-Marquardt: first damping {DAMPING:g}; trial steps and CG "
          "iterations a step: " + "; ".join(
              f"{name} {s}, {k}" for name, (_, _, s, k) in PROBLEMS.items())
          + ". Adam for twice the longest of them. The same MSE: the lowest "
          "that the KFAC fit and the best Adam both reached.\n")  # fmt: skip
    print(table(results))


if __name__ == "__main__":
    main()
