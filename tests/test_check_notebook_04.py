"""04-chunked's exercise checks: typical wrong answers get their hint."""

import numpy as np
import pytest

import jacutil as ju
from jacutil.teaching import check
from tests.check_hints import hint

MIB16 = 16 * 2**20


@pytest.fixture(scope="module")
def tiny():
    model = ju.question_mlp(hidden=(4,))
    return model, ju.regression_data(6)[0]


@pytest.fixture(scope="module")
def float64_answer(tiny):
    model, x = tiny
    model64 = ju.question_mlp(hidden=(4,), dtype="float64")
    model64.set_weights(model.get_weights())
    m = ju.flat_params(model).size
    chunk = ju.chunk_size_for(MIB16, 2, m, 8)
    return chunk, ju.per_sample_jacobian(model64, x.astype("float64")), m


def test_04_1_float64_chunks(tiny, float64_answer):
    model, x = tiny
    chunk, J64, m = float64_answer
    assert check.verdict("04-1", (chunk, J64), model=model, x=x).correct
    assert "(chunk, J)" in hint("04-1", J64, model=model, x=x)
    float32_chunk = ju.chunk_size_for(MIB16, 2, m, 4)
    message = hint("04-1", (float32_chunk, J64), model=model, x=x)
    assert "float32" in message and str(chunk) not in message
    message = hint("04-1", (ju.chunk_size_for(16e6, 2, m, 8), J64), model=model, x=x)
    assert "16 million bytes" in message and "2**20" not in message  # issue 57
    J32 = ju.per_sample_jacobian(model, x)
    message = hint("04-1", (chunk, J32), model=model, x=x)
    assert "dtype of the model" in message and "float64" not in message
    cast = J32.astype("float64")
    assert "float32 precision" in hint("04-1", (chunk, cast), model=model, x=x)
    assert "shape" in hint("04-1", (chunk, J64[:3]), model=model, x=x)
    message = hint("04-1", (chunk, J64 * 1.1), model=model, x=x)
    assert "weights" in message and "set_weights" not in message
    message = hint("04-1", (chunk + 1, J64), model=model, x=x)  # issue 39
    assert "one sample too many" in message and "factor" not in message
    message = hint("04-1", (chunk - 3, J64), model=model, x=x)
    assert "close but too small: by 3" in message and "factor" not in message


def test_04_2_two_halves(tiny):
    model, x = tiny
    J = ju.per_sample_jacobian(model, x)
    assert check.verdict("04-2", J, model=model, x=x).correct
    assert "one half" in hint("04-2", J[:3], model=model, x=x)
    first_lost = J.copy()
    first_lost[:3] = 0
    message = hint("04-2", first_lost, model=model, x=x)
    # the cause (the file opened again lost the rows), never the fix (issue 57)
    assert "opened again" in message and "mode" in message
    assert "r+" not in message and "w+" not in message
    second_lost = J.copy()
    second_lost[3:] = 0
    message = hint("04-2", second_lost, model=model, x=x)
    assert "second half is zeros" in message and "mm[half:]" not in message
    message = hint("04-2", np.zeros_like(J), model=model, x=x)
    assert "only zeros" in message and "mm[:half]" not in message
    swapped = np.concatenate([J[3:], J[:3]])
    message = hint("04-2", swapped, model=model, x=x)
    assert "swapped" in message and "mm[" not in message
