"""02-vectorized's exercise checks: typical wrong answers get their hint."""

import numpy as np
import pytest

import jacutil as ju
from jacutil.teaching import check
from tests.check_hints import hint


def test_02_1_doubling_the_batch():
    model = ju.core.memory.MemoryModel(quadratic=2000.0, linear=3000.0, constant=4.5e6)
    n = model.largest_n(8 * 2**30)
    gib = model.predict(2 * n) / 2**30  # about 4 x 8 GiB
    assert check.verdict("02-1", (n, gib), batch_model=model).correct
    assert check.verdict("02-1", [n - 10, round(gib)], batch_model=model).correct
    message = hint("02-1", (n, 16.0), batch_model=model)
    assert "linear in n" in message and f"{gib:.0f}" not in message
    message = hint("02-1", (2 * n, gib), batch_model=model)
    assert "too large" in message and "n^2" in message and f"{n}" not in message
    assert "too small" in hint("02-1", (n // 3, gib), batch_model=model)
    assert "MiB" in hint("02-1", (n, gib * 1024), batch_model=model)
    assert "at n itself" in hint("02-1", (n, 8.0), batch_model=model)
    assert "two numbers" in hint("02-1", n, batch_model=model)
    assert not check.verdict("02-1", None, batch_model=model).answered


@pytest.fixture(scope="module")
def setup():
    model = ju.question_mlp(hidden=(4,), n_outputs=2)
    x = ju.regression_data(3)[0]
    count = 4 * 2 + 2  # the last layer: kernel 4 x 2, bias 2
    return model, x, ju.per_sample_jacobian(model, x), count


def test_02_2_columns_of_the_last_layer(setup):
    model, x, J, count = setup
    right = J[:, :, -count:]
    assert check.verdict("02-2", right, model=model, x=x).correct
    last = model.layers[-1].trainable_variables
    answer = ju.vectorized_jacobian(model, x, variables=last)
    assert check.verdict("02-2", answer, model=model, x=x).correct
    assert "every parameter" in hint("02-2", J, model=model, x=x)
    assert "FIRST columns" in hint("02-2", J[:, :, :count], model=model, x=x)
    swapped = np.concatenate([right[:, :, -2:], right[:, :, :-2]], axis=2)
    assert "bias comes before the kernel" in hint("02-2", swapped, model=model, x=x)
    assert "all zeros" in hint("02-2", np.zeros_like(right), model=model, x=x)
    assert "shape" in hint("02-2", right[:, :, :-2], model=model, x=x)
    assert "not the last columns" in hint("02-2", right + 0.1, model=model, x=x)
