"""Checks of 09-matrix-free's exercises."""

import numpy as np

from ...stages.loop import loop_jacobian
from . import Hint, answered, as_array, as_number, checks, close_array, close_number


def _first_time_at_or_below(history, level):
    """The seconds of the first (seconds, MSE) entry at or below ``level``."""
    return next((t for t, mse in history if mse <= level), np.inf)


@checks("09-1")
def seconds_for_adam_to_catch_up(answer, fit):
    """When Adam's MSE first reached the best MSE of least squares (lsmr)."""
    what = "the seconds Adam took to reach least squares' lowest MSE"
    answered(answer, f"{what} (np.inf if it never did)")
    seconds = as_number(answer, what, finite=False)
    lsmr, adam = fit["lsmr"], fit["adam"]
    best = min(mse for _, mse in lsmr)
    expected = _first_time_at_or_below(adam, best)
    if seconds == expected:
        return
    if np.isnan(seconds):
        raise Hint(f"{what} is NaN.")
    if np.isinf(expected):
        raise Hint(
            "in this run Adam never got as low as least squares' best MSE: "
            "look through all of fit['adam']; then the answer is np.inf."
        )
    if np.isinf(seconds):
        raise Hint(
            "Adam did get that low in this run: look for the first entry of "
            "fit['adam'] whose MSE is at or below least squares' lowest."
        )
    last = _first_time_at_or_below(adam, lsmr[-1][1])
    if lsmr[-1][1] != best and np.isclose(seconds, last, rtol=1e-9):
        raise Hint(
            "that compares with least squares' last evaluation. A "
            "trust-region method also evaluates trial steps it rejects, "
            "so take the lowest MSE of fit['lsmr'], not the last."
        )
    if np.isclose(seconds, lsmr[-1][0], rtol=1e-9):
        raise Hint(
            "that is how long least squares ran. The question is when "
            "Adam's MSE first fell to least squares' lowest."
        )
    steps = [i for i, (t, _) in enumerate(adam) if t == expected]
    if seconds in steps or seconds in [i + 1 for i in steps]:
        raise Hint(
            "that counts Adam's steps; the answer is in seconds, the first "
            "number of each (seconds, MSE) pair."
        )
    for t, mse in adam:
        if np.isclose(seconds, t, rtol=1e-9):
            if mse > best:
                raise Hint(
                    "at that time Adam's MSE was still above least squares' lowest."
                )
            raise Hint(
                "Adam was already that low earlier: take the first "
                "entry at or below least squares' lowest MSE."
            )
    close_number(seconds, expected, 1e-9, "your time")


@checks("09-2")
def jvp_by_double_backward(answer, model, x, v):
    """J @ v, shape (n, l), against J formed by the loop of 01 (float64)."""
    words = "(n samples, l outputs)"
    what = "J @ v"
    answered(answer, f"{what}, an array of shape {words}")
    J = loop_jacobian(model, x)
    n, rows, m = J.shape
    expected = J @ np.asarray(v, dtype="float64")
    try:
        size = np.size(answer)
    except ValueError:
        size = None
    if size == m:
        raise Hint(
            f"that has m = {m:,} numbers, one per parameter: the shape of a "
            "vector-Jacobian product J.T @ u. J @ v has one number per "
            "sample and output."
        )
    if size == n * rows and np.ndim(answer) == 1:
        raise Hint(
            f"that is J @ v flat, as the LinearOperator returns it; jvp "
            f"gives it per sample, shape {words}."
        )
    array = as_array(answer, what, (n, rows), words)
    if np.allclose(array, expected, rtol=1e-5, atol=1e-8):
        wrong = (
            "it agrees to about float32's precision only: the model and v are "
            "float64, so keep them float64 (jvp casts v to the model's dtype)."
        )
    else:
        wrong = (
            "it differs from J @ v with J formed by the loop of 01. Was it "
            "computed on `small` and `x_small` with the notebook's `v`?"
        )
    close_array(array, expected, what, rtol=1e-10, atol=1e-12, wrong=wrong)
