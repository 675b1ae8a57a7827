"""The SciPy bridge: its jac is the derivative of its fun, and SciPy can fit with it."""

import numpy as np
import pytest
from scipy.optimize import least_squares

import jacutil as ju


def small_problem(dtype="float64", n_samples=12, **kwargs):
    model = ju.question_mlp(n_inputs=4, hidden=(6, 5), n_outputs=3, dtype=dtype)
    x, y = ju.regression_data(n_samples, n_inputs=4, n_outputs=3, dtype=dtype)
    return model, x, y, ju.least_squares_problem(model, x, y, **kwargs)


def finite_differences(fun, theta, step=1e-6):
    """Central differences of fun, one parameter (column) at a time."""
    columns = []
    for p in range(theta.size):
        bump = np.zeros_like(theta)
        bump[p] = step
        columns.append((fun(theta + bump) - fun(theta - bump)) / (2 * step))
    return np.stack(columns, axis=1)


def test_jac_equals_finite_differences_of_fun():
    _, _, _, problem = small_problem()
    theta = problem.theta0 + 0.1 * np.random.default_rng(3).standard_normal(
        problem.n_params
    )
    J = problem.jac(theta)
    reference = finite_differences(problem.fun, theta)
    assert J.shape == (12 * 3, problem.n_params) == reference.shape
    assert J.dtype == np.float64
    assert np.abs(reference).max() > 0.1  # not trivially zero
    np.testing.assert_allclose(J, reference, rtol=1e-6, atol=1e-8)


def test_residual_rows_are_sample_major():
    """Row i*l + k is sample i, output k: J.reshape(n*l, m) of (n, l, m)."""
    model, x, y, problem = small_problem()
    J = ju.per_sample_jacobian(model, x)
    np.testing.assert_allclose(
        problem.jac(problem.theta0), J.reshape(-1, J.shape[2]), rtol=1e-12
    )
    np.testing.assert_allclose(
        problem.fun(problem.theta0), (model(x).numpy() - y).ravel(), rtol=1e-12
    )


def test_float32_model_gives_float64_arrays():
    _, _, _, problem = small_problem("float32")
    assert problem.fun(problem.theta0).dtype == np.float64
    assert problem.jac(problem.theta0).dtype == np.float64
    assert problem.theta0.dtype == np.float64


def test_least_squares_lowers_the_loss():
    model, x, y, problem = small_problem(n_samples=100)
    start = np.mean(problem.fun(problem.theta0) ** 2)
    result = least_squares(problem.fun, problem.theta0, jac=problem.jac, method="lm")
    final = np.mean(result.fun**2)
    assert start > 0.5
    assert final < 0.01  # from about 0.51; the noise alone is 0.0025
    assert problem.compiled.trace_count == 1
    # J is formed on the layer rules, proved on x (not per-sample autodiff)
    assert problem.compiled.plan is not None
    assert problem.compiled.formulation.startswith("layer rules")


def test_fit_writes_the_solution_into_the_model():
    model, x, y, _ = small_problem(n_samples=40)
    result = ju.fit_least_squares(model, x, y, method="trf", max_nfev=20)
    np.testing.assert_array_equal(ju.flat_params(model), result.x)
    np.testing.assert_allclose(
        (model(x).numpy() - y).ravel(), result.fun, rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("chunk_size", [1, 7, 40])
def test_chunked_normal_equations_equal_the_full_ones(chunk_size):
    _, _, _, problem = small_problem(n_samples=20, chunk_size=chunk_size)
    theta = problem.theta0 + 0.05
    J, r = problem.jac(theta), problem.fun(theta)
    JtJ, Jtr = problem.normal_equations(theta)
    assert JtJ.shape == (problem.n_params, problem.n_params)
    np.testing.assert_allclose(JtJ, J.T @ J, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(Jtr, J.T @ r, rtol=1e-10, atol=1e-12)
    assert problem.compiled.trace_count == 1


def test_chunk_size_from_memory_budget():
    model, x, _, _ = small_problem()
    activations = ju.core.memory.activation_elements(model, x[:1])
    assert activations > 0
    budget = 5 * ju.core.planner.bytes_per_sample(3, 83, 8, activations)
    _, _, _, problem = small_problem(n_samples=20, memory_budget=budget)
    assert problem.n_params == 83
    assert problem.chunk_size == 5


def test_no_retrace_across_calls():
    _, _, _, problem = small_problem()
    for scale in (0.0, 0.1, 0.2):
        theta = problem.theta0 + scale
        problem.fun(theta)
        problem.jac(theta)
        problem.normal_equations(theta)
    assert problem.compiled.trace_count == 1


@pytest.mark.parametrize("method", ["fun", "jac", "normal_equations", "set_params"])
def test_bad_theta_length_is_a_clear_error(method):
    _, _, _, problem = small_problem()
    with pytest.raises(ValueError, match="83 trainable parameters"):
        getattr(problem, method)(problem.theta0[:-1])


def test_bad_y_shape_is_a_clear_error():
    model = ju.question_mlp(n_inputs=4, hidden=(5,), n_outputs=3)
    x, y = ju.regression_data(10, n_inputs=4, n_outputs=2)
    with pytest.raises(ValueError, match=r"should have shape \(10, 3\)"):
        ju.least_squares_problem(model, x, y)


@pytest.mark.parametrize("scaling", ["diag", "identity"])
def test_levenberg_marquardt_lowers_the_loss(scaling):
    model, x, y, problem = small_problem(n_samples=100, chunk_size=30)
    result = ju.levenberg_marquardt(problem, max_steps=60, scaling=scaling)
    history = result["history"]
    assert history[0, 1] > 0.5  # the MSE at theta0
    assert history[-1, 1] < 0.01  # about 0.005; the noise alone is 0.0025
    assert np.isclose(history[-1, 1], np.mean(problem.fun(result["theta"]) ** 2))
    assert result["n_accepted"] <= result["n_jev"] <= result["n_accepted"] + 1
    assert result["n_fev"] == 61
    assert problem.compiled.trace_count == 1


def test_levenberg_marquardt_history_is_monotone():
    _, _, _, problem = small_problem(n_samples=50, chunk_size=16)
    result = ju.levenberg_marquardt(problem, max_steps=15, scaling="identity")
    losses = result["history"][:, 1]
    assert result["n_accepted"] == len(losses) - 1 >= 5
    assert result["n_accepted"] < 15  # damping 1e-3 forces some rejections
    assert np.all(np.diff(losses) < 0)
    assert np.all(np.diff(result["history"][:, 0]) > 0)  # wall-clock seconds


@pytest.mark.parametrize("scaling", ["diag", "identity"])
def test_levenberg_marquardt_first_step_equals_the_full_j_step(scaling):
    _, _, _, problem = small_problem(n_samples=100, chunk_size=7)
    theta, damping = problem.theta0, 100.0
    result = ju.levenberg_marquardt(
        problem, theta, max_steps=1, damping=damping, scaling=scaling
    )
    assert result["n_accepted"] == 1  # so theta moved by the first step
    J, r = problem.jac(theta), problem.fun(theta)
    # Columns of dead ReLU units are zero in J: they get no step. Solve for
    # the others, where diag(JtJ) > 0 and the system is not singular.
    live = np.abs(J).max(axis=0) > 0
    J = J[:, live]
    D = np.diag(np.diag(J.T @ J)) if scaling == "diag" else np.eye(J.shape[1])
    step = np.zeros_like(theta)
    step[live] = np.linalg.solve(J.T @ J + damping * D, -J.T @ r)
    assert np.linalg.norm(step) > 0.1  # not trivially zero
    np.testing.assert_allclose(result["theta"] - theta, step, rtol=1e-7, atol=1e-10)


def test_levenberg_marquardt_writes_the_solution_into_the_model():
    model, x, y, problem = small_problem(n_samples=30)
    result = ju.levenberg_marquardt(problem, max_steps=6)
    # Steps 1-4 and 6 are rejected: the last point evaluated is a rejected
    # trial, so the model holds theta only because it is written back.
    assert result["n_accepted"] == 1
    np.testing.assert_array_equal(ju.flat_params(model), result["theta"])
    np.testing.assert_allclose(
        np.mean((model(x).numpy() - y) ** 2), result["history"][-1, 1], rtol=1e-10
    )


def test_levenberg_marquardt_bad_scaling_is_a_clear_error():
    _, _, _, problem = small_problem()
    with pytest.raises(ValueError, match='use "diag" or "identity"'):
        ju.levenberg_marquardt(problem, scaling="marquardt")


@pytest.mark.parametrize("name", ["two_inputs_two_heads", "lstm", "embedding"])
def test_the_bridge_takes_the_models_users_bring(name):
    """Several inputs (a dict), two heads (y as a list), recurrent, integer ids."""
    from tests.architectures import build

    case = build(name)
    x = case.batch(6)
    outputs = ju.tf.nest.map_structure(lambda t: t.numpy(), case.model64(x))
    rng = np.random.default_rng(0)
    y = ju.tf.nest.map_structure(lambda t: t + rng.standard_normal(t.shape), outputs)
    problem = ju.least_squares_problem(case.model64, x, y, chunk_size=4)
    theta = problem.theta0 + 0.05 * rng.standard_normal(problem.n_params)
    J = problem.jac(theta)
    assert J.shape == (6 * case.n_outputs, problem.n_params)
    np.testing.assert_allclose(
        J, finite_differences(problem.fun, theta), rtol=1e-6, atol=1e-8
    )
    JtJ, Jtr = problem.normal_equations(theta)
    np.testing.assert_allclose(JtJ, J.T @ J, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(Jtr, J.T @ problem.fun(theta), rtol=1e-9, atol=1e-10)


# --- issue 21, items 4 and 12: the operator is J at its theta, cg on any J ----


def fit_problem(seed, **kwargs):
    """60 samples, 106 parameters, float64: rejected trials in a few steps."""
    model = ju.question_mlp(seed=seed, hidden=(8,), dtype="float64")
    x, y = ju.regression_data(60, seed=5, dtype="float64")
    return ju.least_squares_problem(model, x, y, **kwargs)


def test_the_operator_stays_j_at_its_theta_after_fun_moves_the_model():
    """``jac(theta)``, then ``fun(trial)`` (a trial SciPy or LM rejects): the
    operator's products are still those of J at theta, and of no other point."""
    problem, formed = fit_problem(0, jacobian="operator"), fit_problem(0)
    theta = problem.theta0
    J, J_theta = problem.jac(theta), formed.jac(theta)
    trial = theta + 0.5
    assert np.abs(formed.jac(trial) - J_theta).max() > 0.1  # another J there
    rng = np.random.default_rng(0)
    v, u = rng.standard_normal(problem.n_params), rng.standard_normal(J.shape[0])
    V, U = rng.standard_normal((len(v), 3)), rng.standard_normal((len(u), 2))
    for product, expected in [
        (lambda: J.matvec(v), J_theta @ v),
        (lambda: J.rmatvec(u), J_theta.T @ u),
        (lambda: J.matmat(V), J_theta @ V),
        (lambda: J.rmatmat(U), J_theta.T @ U),
    ]:
        problem.fun(trial)  # the model now holds the trial's parameters
        np.testing.assert_allclose(product(), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(ju.flat_params(problem.model), theta)


class FunOnACopy:
    """``problem``, but ``fun`` runs on a copy of the model: J never moves."""

    def __init__(self, problem, copy):
        self.theta0, self.jac = problem.theta0, problem.jac
        self.set_params, self.fun = problem.set_params, copy.fun


def test_levenberg_marquardt_cg_after_rejected_steps_uses_j_at_theta():
    """A whole LM-cg fit with rejected trials takes the steps it takes when
    nothing moves the model under the operator (before the fix: final MSE
    0.057 instead of 0.0125)."""
    options = {"solver": "cg", "max_steps": 15, "cg_iterations": 20}
    fit = ju.levenberg_marquardt(fit_problem(3, jacobian="operator"), **options)
    reference = ju.levenberg_marquardt(
        FunOnACopy(fit_problem(3, jacobian="operator"), fit_problem(3)), **options
    )
    assert 5 <= reference["n_accepted"] <= 12  # rejected trials, steps after them
    assert reference["history"][-1, 1] < 0.05 * reference["history"][0, 1]
    np.testing.assert_allclose(
        fit["history"][:, 1], reference["history"][:, 1], rtol=1e-9
    )
    np.testing.assert_allclose(fit["theta"], reference["theta"], rtol=1e-9, atol=1e-12)


def test_scipy_lsmr_on_the_operator_reaches_the_cost_of_the_formed_j():
    """SciPy's trf applies J again after a rejected trial (for the predicted
    reduction of the next): the operator must still be J at the accepted point."""
    problems = fit_problem(4, jacobian="operator"), fit_problem(4)
    start = 0.5 * np.sum(problems[1].fun(problems[1].theta0) ** 2)
    results = [
        least_squares(p.fun, p.theta0, jac=p.jac, tr_solver="lsmr", max_nfev=8)
        for p in problems
    ]
    assert results[1].njev < results[1].nfev - 1  # trials were rejected
    assert results[1].cost < 0.5 * start
    # the same algorithm on the same J: the same cost, to lsmr's roundoff
    # (4e-6 apart; before the fix 13% lower, on another path)
    np.testing.assert_allclose(results[0].cost, results[1].cost, rtol=1e-3)


def test_levenberg_marquardt_cg_on_a_formed_problem():
    """cg takes products with a formed J too; its first step is the LM step."""
    problem = fit_problem(0)  # jacobian="formed"
    theta, damping = problem.theta0, 100.0
    fit = ju.levenberg_marquardt(
        problem, max_steps=1, damping=damping, solver="cg", cg_iterations=500
    )
    assert fit["n_accepted"] == 1
    J, r = problem.jac(theta), problem.fun(theta)
    step = np.linalg.solve(J.T @ J + damping * np.eye(problem.n_params), -J.T @ r)
    assert np.linalg.norm(step) > 0.01  # not trivially zero
    np.testing.assert_allclose(fit["theta"] - theta, step, rtol=1e-4, atol=1e-6)


def test_the_preconditioners_curvature_is_that_of_the_formed_j():
    """diag(JtJ) from ``ggn_diagonal`` is the formed J's column norms; KFAC of
    the residuals is JtJ itself where it is exact (one sample, one layer)."""
    problem, formed = fit_problem(1, jacobian="operator"), fit_problem(1)
    theta = problem.theta0 + 0.05  # not the model's weights: written first
    J = formed.jac(theta)
    np.testing.assert_allclose(
        problem.gauss_newton_diagonal(theta), np.sum(J**2, axis=0), rtol=1e-10
    )
    keras = ju.keras
    model = keras.Sequential(
        [keras.Input((4,), dtype="float64"), keras.layers.Dense(3, dtype="float64")]
    )
    x, y = ju.regression_data(1, n_inputs=4, n_outputs=3, dtype="float64")
    one = ju.least_squares_problem(model, x, y, jacobian="operator")
    theta = one.theta0 + 0.1
    J = ju.least_squares_problem(model, x, y).jac(theta)
    kfac = one.gauss_newton_kfac(theta).to_dense()
    np.testing.assert_allclose(kfac, J.T @ J, atol=1e-12)


def exact_step(problem, theta, damping, scale):
    J, r = problem.jac(theta), problem.fun(theta)
    return np.linalg.solve(J.T @ J + damping * np.diag(scale), -J.T @ r)


def damped_residual(J, r, damping, scale, step):
    """``|(JtJ + damping D) step + Jtr| / |Jtr|``: what CG's rtol bounds."""
    b = J.T @ r
    residual = J.T @ (J @ step) + damping * scale * step + b
    return np.linalg.norm(residual) / np.linalg.norm(b)


@pytest.mark.parametrize(
    "preconditioner, scaling",
    [("diagonal", "diag"), ("diagonal", "identity"), ("kfac", "diag")],
)
def test_preconditioned_cg_solves_the_damped_system(preconditioner, scaling):
    """With enough iterations the preconditioned CG step solves the LM system
    of its damping to CG's tolerance (relative residual 1e-5): D = diag(JtJ)
    under Marquardt scaling with the diagonal preconditioner, D = I otherwise
    (KFAC's damping); the other D leaves a residual 1,000 times larger."""
    problem, formed = fit_problem(2, jacobian="operator"), fit_problem(2)
    theta, damping = problem.theta0, 0.5
    fit = ju.levenberg_marquardt(
        problem, max_steps=1, damping=damping, solver="cg", cg_iterations=500,
        preconditioner=preconditioner, scaling=scaling,
    )  # fmt: skip
    assert fit["n_accepted"] == 1
    J, r = formed.jac(theta), formed.fun(theta)
    diagonal, ones = np.sum(J**2, axis=0), np.ones(len(theta))
    scale, other = ones, diagonal
    if preconditioner == "diagonal" and scaling == "diag":
        scale, other = diagonal, ones
    step = fit["theta"] - theta
    assert damped_residual(J, r, damping, scale, step) <= 1.01e-5
    assert damped_residual(J, r, damping, other, step) > 1e-2


@pytest.mark.parametrize("preconditioner", ["diagonal", "kfac"])
def test_an_exact_preconditioner_solves_the_step_in_one_iteration(preconditioner):
    """Where the preconditioner is the damped system's exact inverse, one CG
    iteration gives the exact step; plain CG's one iteration does not.
    JtJ is diagonal (not a multiple of I) for one Dense layer without bias
    on orthogonal inputs; KFAC is JtJ for one Dense layer (its A is the
    inputs' covariance, its B n I)."""
    keras = ju.keras
    kfac = preconditioner == "kfac"
    if kfac:
        x, y = ju.regression_data(6, n_inputs=4, n_outputs=3, dtype="float64")
    else:
        x, y = np.diag([1.0, 2.0, 3.0]), np.array([[1.0], [-1.0], [0.5]])
    dense = keras.layers.Dense(y.shape[1], use_bias=kfac, dtype="float64")
    model = keras.Sequential([keras.Input((x.shape[1],), dtype="float64"), dense])
    theta, damping = ju.flat_params(model).astype(np.float64), 0.3
    formed = ju.least_squares_problem(model, x, y)
    step = exact_step(formed, theta, damping, np.ones(len(theta)))
    steps = {}
    for name in (preconditioner, None):
        fit = ju.levenberg_marquardt(
            ju.least_squares_problem(model, x, y, jacobian="operator"), theta,
            max_steps=1, damping=damping, solver="cg", cg_iterations=1,
            preconditioner=name, scaling="identity",
        )  # fmt: skip
        steps[name] = fit["theta"] - theta
    assert np.linalg.norm(steps[None] - step) > 1e-2 * np.linalg.norm(step)
    np.testing.assert_allclose(steps[preconditioner], step, rtol=1e-9, atol=1e-12)


def test_the_preconditioner_is_checked():
    problem = fit_problem(0, jacobian="operator")
    with pytest.raises(ValueError, match='use None, "diagonal" or "kfac"'):
        ju.levenberg_marquardt(problem, solver="cg", preconditioner="jacobi")
    with pytest.raises(ValueError, match='is for solver="cg"'):
        ju.levenberg_marquardt(problem, preconditioner="kfac")
    model = ju.question_mlp(seed=0, hidden=(8,), dtype="float64")
    x, y = ju.regression_data(6, dtype="float64")
    training = ju.least_squares_problem(model, x, y, training=True, jacobian="operator")
    with pytest.raises(ValueError, match="built with training=True"):
        ju.levenberg_marquardt(training, solver="cg", preconditioner="diagonal")
