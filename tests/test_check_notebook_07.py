"""07-benchmark's exercise checks: typical wrong answers get their hint."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras
from jacutil.teaching import check
from tests.check_hints import hint


@pytest.fixture(scope="module")
def tiny():
    """A 3 -> 5 -> 4 (ReLU) -> 2 network, three samples: the last layer 4 x 2."""
    model = ju.question_mlp(n_inputs=3, hidden=(5, 4), seed=2)
    x = ju.regression_data(3, n_inputs=3, seed=2)[0]
    return model, x


def last_columns(model, x, order="pq", bias_first=False, before=False):
    """The last layer's columns, built as the solution does (or wrongly)."""
    hidden = keras.Sequential(model.layers[:2])(x).numpy()
    if before:  # the pre-activations of the second hidden layer
        first = keras.Sequential(model.layers[:1])(x).numpy()
        layer = model.layers[1]
        hidden = first @ layer.kernel.numpy() + layer.bias.numpy()
    kernel = np.einsum(f"ip,kq->ik{order}", hidden, np.eye(2)).reshape(len(x), 2, -1)
    bias = np.broadcast_to(np.eye(2), (len(x), 2, 2))
    parts = [bias, kernel] if bias_first else [kernel, bias]
    return np.concatenate(parts, axis=2)


def test_07_1_last_columns(tiny):
    model, x = tiny
    right = last_columns(model, x)
    assert right.shape == (3, 2, 10)
    assert check.verdict("07-1", right, model=model, x=x).correct
    assert "kernel's alone" in hint("07-1", right[:, :, :8], model=model, x=x)
    said = hint("07-1", last_columns(model, x, order="qp"), model=model, x=x)
    assert "wrong columns" in said and "row by row" in said
    said = hint("07-1", last_columns(model, x, bias_first=True), model=model, x=x)
    assert "bias columns come last" in said
    assert "shape" in hint("07-1", right[:, 0], model=model, x=x)
    assert "all zeros" in hint("07-1", np.zeros_like(right), model=model, x=x)
    said = hint("07-1", right + 0.5, model=model, x=x)
    assert "Which terms" in said and "0." not in said  # no values given away


def test_07_1_before_the_activation():
    """A network whose second hidden layer has negative pre-activations."""
    model = ju.question_mlp(n_inputs=3, hidden=(5, 6), seed=0)
    x = ju.regression_data(8, n_inputs=3, seed=0)[0]
    z = last_columns(model, x, before=True)
    assert not np.allclose(z, last_columns(model, x))  # some ReLU cut them
    assert "before its activation" in hint("07-1", z, model=model, x=x)


def test_07_2_bytes_the_copy_moves(tiny):
    model, _ = tiny
    n, numbers = 1000, 1000 * 2 * ju.flat_params(model).size
    assert check.verdict("07-2", 2 * numbers * 4, model=model, n=n).correct
    said = hint("07-2", numbers * 4, model=model, n=n)
    assert "size once" in said and str(numbers) not in said
    assert "not bytes" in hint("07-2", 2 * numbers, model=model, n=n)
    assert "not 8" in hint("07-2", 16 * numbers, model=model, n=n)
    assert "MB" in hint("07-2", 2 * numbers * 4 / 1e6, model=model, n=n)
    assert "too large" in hint("07-2", 3 * numbers * 4, model=model, n=n)
    assert "one number" in hint("07-2", "lots", model=model, n=n)


def test_07_2_the_question_network():
    """45.6 MB at n = 1,000: J is 1,000 x 2 x 2,850 float32, read and written."""
    model = ju.question_mlp()
    assert check.verdict("07-2", 45_600_000, model=model, n=1000).correct
