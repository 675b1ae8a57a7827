"""Products with J without forming it (jacutil.matrix_free): proved on the zoo
against the formed Jacobian, and the operator's transpose and matmat."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import matrix_free
from tests.architectures import ARCHITECTURES, build


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_jvp_and_vjp_equal_products_with_the_formed_jacobian(name):
    case = build(name)
    x = case.batch(5)
    model, variables = case.model64, case.variables64
    J = ju.per_sample_jacobian(model, x, variables=variables)
    n, n_out, m = J.shape
    rng = np.random.default_rng(0)
    v, u = rng.standard_normal(m), rng.standard_normal((n, n_out))
    prods = matrix_free.products(model, variables=variables, chunk_size=2)
    np.testing.assert_allclose(prods.jvp(x, v), J @ v, rtol=1e-9, atol=1e-11)
    twice = matrix_free.products(model, variables=variables, mode="double_backward")
    np.testing.assert_allclose(twice.jvp(x, v), J @ v, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(
        prods.vjp(x, u), np.einsum("ik,ikp->p", u, J), rtol=1e-9, atol=1e-11
    )


def test_operator_matvec_rmatvec_matmat_and_transpose():
    case = build("convolution")
    x = case.batch(4)
    model = case.model32
    J = ju.per_sample_jacobian(model, x).astype(np.float64)
    n, n_out, m = J.shape
    rows = J.reshape(n * n_out, m)
    A = matrix_free.jacobian_operator(model, x)
    assert A.shape == (n * n_out, m) and A.dtype == np.float64
    rng = np.random.default_rng(1)
    v, u, V = (
        rng.standard_normal(m),
        rng.standard_normal(n * n_out),
        rng.standard_normal((m, 3)),
    )
    np.testing.assert_allclose(A @ v, rows @ v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(A.T @ u, rows.T @ u, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(A @ V, rows @ V, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(A.rmatvec(u), rows.T @ u, rtol=1e-4, atol=1e-5)


def test_products_are_compiled_once_per_shape():
    model = ju.question_mlp(hidden=(8,))
    x, _ = ju.regression_data(10)
    prods = matrix_free.products(model)
    m = prods.n_params
    for _ in range(3):
        prods.jvp(x, np.ones(m))
        prods.vjp(x, np.ones((10, 2)))
    assert prods.trace_count == 2


def test_bad_input_errors_teach():
    model = ju.question_mlp(hidden=(8,))
    x, _ = ju.regression_data(6)
    prods = matrix_free.products(model)
    with pytest.raises(ValueError, match="flat vector of length"):
        prods.jvp(x, np.ones(3))
    with pytest.raises(ValueError, match="one weight per sample and output"):
        prods.vjp(x, np.ones((6, 3)))
    with pytest.raises(TypeError, match="floating-point"):
        prods.jvp(x, np.ones(prods.n_params, dtype=int))
    model.layers[0].trainable = False
    prods_frozen = matrix_free.products(model)
    assert prods_frozen.n_params < prods.n_params
