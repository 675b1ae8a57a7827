"""The (l*m) x n layout and the flat parameter vector."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jacutil as ju


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 7))
def test_lm_by_n_round_trip_and_index(n_samples, n_outputs, n_params):
    J = np.random.default_rng(0).standard_normal((n_samples, n_outputs, n_params))
    M = ju.to_lm_by_n(J)
    assert M.shape == (n_outputs * n_params, n_samples)
    for i, k, p in np.ndindex(J.shape):
        assert M[k * n_params + p, i] == J[i, k, p]
    np.testing.assert_array_equal(ju.from_lm_by_n(M, n_outputs), J)


def test_from_lm_by_n_checks_rows():
    with pytest.raises(ValueError, match="not n_outputs=3 times"):
        ju.from_lm_by_n(np.zeros((10, 4)), 3)


def test_to_lm_by_n_checks_rank():
    with pytest.raises(ValueError, match="n_samples, n_outputs, n_params"):
        ju.to_lm_by_n(np.zeros((3, 4)))


def test_flat_params_round_trip():
    model = ju.question_mlp()
    theta = ju.flat_params(model)
    assert theta.shape == (2850,)
    np.testing.assert_array_equal(theta[:640], model.layers[0].kernel.numpy().ravel())
    ju.set_flat_params(model, theta + 1)
    np.testing.assert_allclose(ju.flat_params(model), theta + 1)


def test_set_flat_params_checks_length():
    model = ju.question_mlp()
    with pytest.raises(ValueError, match="flat vector of 2,850 parameters"):
        ju.set_flat_params(model, np.zeros(2849))
