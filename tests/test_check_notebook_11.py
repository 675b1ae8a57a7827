"""11-curvature-and-uncertainty's exercise checks: typical wrong answers get
their hint."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras
from jacutil.curvature import diagonal
from jacutil.teaching import check
from tests.check_hints import hint


@pytest.fixture(scope="module")
def classifier():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(5, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    return model, np.random.default_rng(0).standard_normal((12, 4))


def test_11_1_trace_of_g(classifier):
    model, x = classifier
    context = {"model": model, "x": x}
    d = diagonal.ggn_diagonal(model, x, "softmax_cross_entropy")
    assert check.verdict("11-1", d.sum(), **context).correct
    assert not check.verdict("11-1", None, **context).answered
    assert "the diagonal itself" in hint("11-1", d, **context)
    squared = diagonal.ggn_diagonal(model, x).sum()
    assert "squared error" in hint("11-1", squared, **context)
    assert "one number" in hint("11-1", "big", **context)
    message = hint("11-1", 0.99 * d.sum(), **context)  # Hutchinson's, say
    assert "estimate" in message and "exact trace" in message
    assert "factor of about" in hint("11-1", 3 * d.sum(), **context)


def test_11_2_ntk_block():
    model = ju.question_mlp(hidden=(8, 6), seed=0)  # two layers: a block that
    # is not symmetric (with one hidden layer it is, and its transpose is right)
    x = ju.regression_data(3, seed=0)[0]
    context = {"model": model, "x": x}
    J = ju.jacobian(model, x[:2])
    assert check.verdict("11-2", J[0] @ J[1].T, **context).correct
    assert not check.verdict("11-2", None, **context).answered
    assert "J.T J" in hint("11-2", J[0].T @ J[1], **context)
    assert "with itself" in hint("11-2", J[0] @ J[0].T, **context)
    assert "transpose" in hint("11-2", J[1] @ J[0].T, **context)
    assert "differs" in hint("11-2", 2 * J[0] @ J[1].T + 1, **context)
