"""09-matrix-free's exercise checks: typical wrong answers get their hint."""

import numpy as np
import pytest

import jacutil as ju
from jacutil.teaching import check
from tests.check_hints import hint

# A fit as wide_fit.run records it: (seconds, MSE) per evaluation or step.
# Least squares' last evaluation is a rejected trial step (its MSE rose).
FIT = {
    "lsmr": [[0.1, 0.5], [0.4, 0.05], [0.7, 0.02], [1.0, 0.03]],
    "adam": [[0.01, 0.4], [0.2, 0.1], [0.5, 0.029], [0.6, 0.02], [0.9, 0.01]],
}


def test_09_1_seconds_for_adam_to_catch_up():
    assert check.verdict("09-1", 0.6, fit=FIT).correct
    assert check.verdict("09-1", np.float64(0.6), fit=FIT).correct
    message = hint("09-1", 0.5, fit=FIT)
    assert "last evaluation" in message and "0.6" not in message
    assert "how long least squares ran" in hint("09-1", 1.0, fit=FIT)
    assert "counts Adam's steps" in hint("09-1", 3, fit=FIT)
    assert "already that low earlier" in hint("09-1", 0.9, fit=FIT)
    assert "did get that low" in hint("09-1", np.inf, fit=FIT)
    assert "too large" in hint("09-1", 6.0, fit=FIT)
    assert "one number" in hint("09-1", "soon", fit=FIT)
    never = {"lsmr": FIT["lsmr"], "adam": FIT["adam"][:2]}
    assert check.verdict("09-1", np.inf, fit=never).correct
    assert "never got as low" in hint("09-1", 0.2, fit=never)
    assert not check.verdict("09-1", None, fit=FIT).answered


@pytest.fixture(scope="module")
def small():
    model = ju.question_mlp(hidden=(4,), seed=0, dtype="float64")
    x = ju.regression_data(3, seed=0)[0]
    v = np.random.default_rng(0).standard_normal(ju.flat_params(model).size)
    return model, x, v


def test_09_2_jvp_by_double_backward(small):
    model, x, v = small
    context = {"model": model, "x": x, "v": v}
    right = ju.products(model, mode="double_backward").jvp(x, v)
    assert check.verdict("09-2", right, **context).correct
    assert check.verdict("09-2", ju.jvp(model, x, v), **context).correct
    assert "J.T @ u" in hint("09-2", ju.vjp(model, x, right), **context)
    assert "flat" in hint("09-2", right.ravel(), **context)
    rounded = right.astype("float32")
    assert "float32" in hint("09-2", rounded, **context)
    assert "all zeros" in hint("09-2", np.zeros_like(right), **context)
    assert "differs" in hint("09-2", ju.jvp(model, x, 2 * v + 1), **context)
