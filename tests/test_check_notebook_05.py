"""05-scipy-least-squares's exercise checks: typical wrong answers get their hint."""

import numpy as np
import pytest
from scipy.optimize import least_squares

import jacutil as ju
from jacutil.teaching import check
from tests.check_hints import hint


def test_05_1_method_for_few_residuals():
    tiny = ju.question_mlp(hidden=(4,))
    x, y = ju.regression_data(3)  # 6 residuals, 54 parameters
    few = ju.least_squares_problem(tiny, x, y)
    with pytest.raises(ValueError, match="number of residuals"):
        least_squares(few.fun, few.theta0, jac=few.jac, method="lm")
    for method in ("trf", "dogbox"):  # both accept it, as the check does
        least_squares(few.fun, few.theta0, jac=few.jac, method=method, max_nfev=2)
        assert check.verdict("05-1", method).correct
    for spelling in ("TRF", " trf", "'trf'", "Dogbox"):  # SciPy refuses them
        with pytest.raises(ValueError):
            least_squares(few.fun, few.theta0, jac=few.jac, method=spelling)
        assert not check.verdict("05-1", spelling).correct
        assert "exactly" in hint("05-1", spelling)
    message = hint("05-1", "lm")
    assert "MINPACK" in message and "at least as many residuals" in message
    assert "string" in hint("05-1", 2)
    assert "not a method" in hint("05-1", "adam")


@pytest.fixture(scope="module")
def mse_problem():
    model = ju.question_mlp(hidden=(4,), dtype="float64")
    x, y = ju.regression_data(7)
    problem = ju.least_squares_problem(model, x.astype("float64"), y,
                                       chunk_size=3)
    _, Jtr = problem.normal_equations(problem.theta0)
    return model, x, y, Jtr


def test_05_2_gradient_of_the_mse(mse_problem):
    model, x, y, Jtr = mse_problem
    nl = y.size
    context = {"model": model, "x": x, "y": y}
    assert check.verdict("05-2", 2 * Jtr / nl, **context).correct
    assert "2 r" in hint("05-2", Jtr / nl, **context)
    message = hint("05-2", -2 * Jtr / nl, **context)
    assert "sign" in message and "not -J^T r" not in message  # issue 57
    message = hint("05-2", 2 * Jtr, **context)
    assert "mean over all n*l" in message and "divide" not in message
    assert "divided by n only" in hint("05-2", 2 * Jtr / len(y), **context)
    assert "shape" in hint("05-2", Jtr[:5], **context)
    message = hint("05-2", np.ones_like(Jtr), **context)
    assert "multiple of J^T r" in message


def test_05_3_step_lengths():
    rng = np.random.default_rng(0)
    J = rng.standard_normal((30, 8))
    r = rng.standard_normal(30)
    JtJ, Jtr = J.T @ J, J.T @ r
    lengths = [np.linalg.norm(np.linalg.solve(JtJ + lam * np.eye(8), -Jtr))
               for lam in (1e-4, 1e-2, 100.0)]
    context = {"JtJ": JtJ, "Jtr": Jtr}
    assert check.verdict("05-3", lengths, **context).correct
    assert "reversed" in hint("05-3", lengths[::-1], **context)
    message = hint("05-3", np.square(lengths), **context)
    assert "squared" in message and "norm" not in message  # issue 57
    marquardt = [np.linalg.norm(np.linalg.solve(JtJ + lam * np.diag(np.diag(JtJ)),
                                                -Jtr))
                 for lam in (1e-4, 1e-2, 100.0)]
    assert "Marquardt" in hint("05-3", marquardt, **context)
    inverted = [np.linalg.norm(np.linalg.solve(JtJ + np.eye(8) / lam, -Jtr))
                for lam in (1e-4, 1e-2, 100.0)]
    message = hint("05-3", inverted, **context)
    assert "grow with lambda" in message
    assert f"{lengths[0]:.2f}" not in message
    assert "delta = -J^T r" not in message  # the cause, not the fix (issue 57)
    message = hint("05-3", np.ones(3), **context)
    assert "term by term" in message and "norm" not in message
    assert "shape" in hint("05-3", lengths[:2], **context)
