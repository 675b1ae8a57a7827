"""01-nested-loop's exercise checks: typical wrong answers get their hint."""

import numpy as np
import pytest

import jacutil as ju
from jacutil.teaching import check
from tests.check_hints import hint


def test_01_1_minutes_for_a_colleague():
    per_row = 0.009  # seconds per row of the loop
    right = 10_000 * 10 * per_row / 60  # 15 minutes
    assert check.verdict("01-1", right, per_row=per_row).correct
    assert check.verdict("01-1", 1.2 * right, per_row=per_row).correct
    assert "per output" in hint("01-1", right / 10, per_row=per_row)
    assert "l = 10" in hint("01-1", right / 5, per_row=per_row)
    assert "seconds" in hint("01-1", right * 60, per_row=per_row)
    assert "hours" in hint("01-1", right / 60, per_row=per_row)
    assert "twice" in hint("01-1", 2 * right, per_row=per_row)
    message = hint("01-1", right * 7, per_row=per_row)
    assert "too large" in message and "15" not in message
    assert "one number" in hint("01-1", "a while", per_row=per_row)
    assert not check.verdict("01-1", None, per_row=per_row).answered


@pytest.fixture(scope="module")
def setup():
    model = ju.question_mlp(hidden=(4,), n_outputs=2)
    x = ju.regression_data(3, dtype="float64")[0]
    return model, x, ju.loop_jacobian(model, x)


def test_01_2_one_forward_pass_per_sample(setup):
    model, x, J = setup
    assert check.verdict("01-2", J, model=model, x=x).correct
    assert check.verdict("01-2", J.astype("float64"), model=model, x=x).correct
    assert "shape" in hint("01-2", J[:, :, :-1], model=model, x=x)
    assert "sum over the outputs" in hint("01-2", J.sum(axis=1), model=model, x=x)
    summed = np.repeat(J.sum(axis=1, keepdims=True), 2, axis=1)
    assert "SUM" in hint("01-2", summed, model=model, x=x)
    assert "all zeros" in hint("01-2", np.zeros_like(J), model=model, x=x)
    assert "None" in hint("01-2", [None, J], model=model, x=x)
    assert "rows of each sample" in hint("01-2", J[:, ::-1], model=model, x=x)
    assert "samples are in the wrong order" in hint("01-2", J[::-1], model=model, x=x)
    same = np.repeat(J[:, :1], 2, axis=1)
    assert "same output" in hint("01-2", same, model=model, x=x)
    assert "differs from" in hint("01-2", J + 0.1, model=model, x=x)
