"""10-beyond-one-machine's exercise checks: typical wrong answers get their hint.

The checks start no Dask worker; neither do these tests (a killed run's file
is imitated by zeroing the rows of its unfinished chunks).
"""

import pytest

import jacutil as ju
from jacutil.teaching import check
from tests.check_hints import hint


@pytest.fixture(scope="module")
def small():
    model = ju.question_mlp(hidden=(4,), seed=0)
    x = ju.regression_data(1500, seed=0)[0]  # more than one block of rows
    return model, x, ju.chunked_jacobian(model, x, chunk_size=100,
                                         method="per_sample", progress=False)


@pytest.mark.parametrize("key", ["10-1", "10-2"])
def test_the_rows_of_every_sample(small, key, tmp_path):
    model, x, J = small
    context = {"model": model, "x": x}
    assert check.verdict(key, J, **context).correct
    stored = ju.chunked_jacobian(model, x, chunk_size=300, out=tmp_path / "J.npy",
                                 method="per_sample", progress=False)
    assert check.verdict(key, stored, **context).correct
    assert not check.verdict(key, None, **context).answered
    unfinished = J.copy()
    unfinished[1200:] = 0  # a killed run: its last chunks never written
    message = hint(key, unfinished, **context)
    assert "300 of 1,500 samples" in message and "from sample 1,200" in message
    assert "shape" in hint(key, J[:1000], **context)
    assert "differs" in hint(key, 1.001 * J, **context)
    assert "path" in hint(key, str(tmp_path / "J.npy"), **context)


def test_a_changed_model_is_named(small):
    model, x, J = small
    weights = model.get_weights()
    try:
        model.layers[0].kernel.assign(model.layers[0].kernel * 1.001)
        assert "weights put back" in hint("10-1", J, model=model, x=x)
    finally:
        model.set_weights(weights)
