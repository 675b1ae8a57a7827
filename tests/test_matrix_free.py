"""Products with J without forming it (jacutil.matrix_free.products): proved on the zoo
against the formed Jacobian, and the operator's transpose and matmat."""

import numpy as np
import pytest

import jacutil as ju
from jacutil.matrix_free import products as matrix_free
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


def test_matrix_free_fits_match_the_formed_ones():
    """The operator problem: SciPy's trf with lsmr, and LM with CG, lower the
    loss like the formed Jacobian does; the operator equals the formed jac."""
    from scipy.optimize import least_squares

    model = ju.question_mlp(hidden=(8,), seed=2, dtype="float64")
    x, y = ju.regression_data(40, seed=2)
    formed = ju.least_squares_problem(model, x, y)
    free = ju.least_squares_problem(model, x, y, jacobian="operator", chunk_size=16)
    theta = formed.theta0
    J = formed.jac(theta)
    A = free.jac(theta)
    v = np.random.default_rng(0).standard_normal(J.shape[1])
    np.testing.assert_allclose(A @ v, J @ v, rtol=1e-9, atol=1e-11)
    start = np.mean(formed.fun(theta) ** 2)
    result = least_squares(
        free.fun, free.theta0, jac=free.jac, tr_solver="lsmr", max_nfev=15
    )
    assert np.mean(result.fun**2) < 0.5 * start
    lm = ju.levenberg_marquardt(free, max_steps=8, solver="cg")
    assert lm["history"][-1, 1] < 0.5 * start and lm["n_accepted"] > 0
    with pytest.raises(ValueError, match="normal_equations forms an m x m"):
        free.normal_equations(theta)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_forward_jacobian_equals_the_reverse_mode_stage(name):
    case = build(name)
    x = case.batch(3)
    model, variables = case.model64, case.variables64
    expected = ju.per_sample_jacobian(model, x, variables=variables)
    jac = ju.forward_jacobian(model, variables=variables, columns_per_pass=16)
    np.testing.assert_allclose(jac(x), expected, rtol=1e-9, atol=1e-11)
    assert jac.trace_count == 1


def test_repeated_calls_reuse_one_compiled_product_and_shape_changes_are_caught():
    model = ju.question_mlp(hidden=(8,))
    x, _ = ju.regression_data(6)
    m = ju.flat_params(model).size
    for _ in range(3):
        matrix_free.jvp(model, x, np.ones(m))
    assert matrix_free.products_for(model, {}).trace_count == 1
    prods = matrix_free.products(model)
    prods.vjp(x, np.ones((6, 2)))
    prods.shapes[0] = (1, 1)  # as if the variables had changed shape
    with pytest.raises(ValueError, match="changed shape"):
        prods.vjp(x, np.ones((6, 2)))
