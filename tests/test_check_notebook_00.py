"""00-welcome's exercise checks: typical wrong answers get their hint."""

import numpy as np
import pytest

import jacutil as ju
from jacutil.teaching import check
from tests.check_hints import hint


def test_00_1_parameters():
    assert check.verdict("00-1", 1795).correct
    assert "weights only" in hint("00-1", 10 * 128 + 128 * 3)
    assert "biases only" in hint("00-1", 131)
    assert "too small, by a factor of about 10" in hint("00-1", 180)
    assert "one number" in hint("00-1", "many")


@pytest.fixture(scope="module")
def J():
    model = ju.question_mlp(hidden=(4,), n_outputs=3)
    return ju.jacobian(model, ju.regression_data(5)[0])


def test_00_2_derivative_by_a_bias(J):
    assert check.verdict("00-2", np.eye(3), J=J).correct
    assert "shape" in hint("00-2", np.eye(2), J=J)
    assert "all zeros" in hint("00-2", np.zeros((3, 3)), J=J)
    message = hint("00-2", np.ones((3, 3)), J=J)
    assert "Which terms" in message and "eye" not in message


def test_00_3_frozen_columns():
    assert check.verdict("00-3", 3 * 3 * 8 + 8).correct
    assert "kernel alone" in hint("00-3", 72)
    assert "biases alone" in hint("00-3", 8)
