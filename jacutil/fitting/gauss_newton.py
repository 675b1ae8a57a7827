"""Levenberg-Marquardt on a least-squares problem (notebooks 05 and 09).

Each step solves the damped Gauss-Newton system ``(JtJ + damping * D) step =
-Jtr``. Two ways to solve it, one loop:

* ``solver="cholesky"`` forms JtJ (m x m) chunk by chunk from J and factors
  it: exact, for m up to a few thousand (notebook 05);
* ``solver="cg"`` never forms JtJ: conjugate gradients on the products
  ``J.T @ (J @ v)``; of a matrix-free problem (``jacobian="operator"``,
  notebook 09) it never forms J either, for large m. On a formed problem it
  takes products with the formed J.
"""

import time

import numpy as np
import scipy.linalg
from scipy.sparse.linalg import LinearOperator, aslinearoperator, cg


class NormalEquations:
    """JtJ and Jtr of a :class:`jacutil.LeastSquaresProblem` (its
    ``normal_equations``) at ``theta`` (m,), factored with Cholesky for each
    damping; ``scaling`` is ``"diag"`` (D = diag(JtJ), floored) or
    ``"identity"``."""

    def __init__(self, problem, theta, scaling):
        self.JtJ, self.Jtr = problem.normal_equations(theta)
        diag = np.diag(self.JtJ).copy() if scaling == "diag" else np.ones(len(self.Jtr))
        self.diag = np.maximum(diag, 1e-9 * diag.max())

    def step(self, damping):
        """The step, shape (m,), solving ``(JtJ + damping * D) step = -Jtr``
        for the Levenberg-Marquardt ``damping`` (a float > 0)."""
        factors = scipy.linalg.cho_factor(self.JtJ + damping * np.diag(self.diag))
        return scipy.linalg.cho_solve(factors, -self.Jtr)


class GaussNewtonProducts:
    """The same system as products with J: conjugate gradients, no JtJ.

    ``problem.jac(theta)`` is J at theta: a formed array, or an operator
    that stays J at theta when ``problem.fun`` moves the model to a trial
    (``LeastSquaresProblem.jac``), so ``step`` may be called after a
    rejected trial. ``problem`` and ``theta`` as :class:`NormalEquations`
    takes them; ``iterations``: the most conjugate-gradient iterations per
    step. The preconditioner (notebook 09) is built once per system, from
    the curvature of notebook 11:

    * ``None``: plain CG, damping ``D = I``;
    * ``"diagonal"``: diag(JtJ) (``problem.gauss_newton_diagonal``); ``D``
      as ``scaling`` says, and CG preconditioned by the system's own
      diagonal ``diag(JtJ) + damping * D`` (Jacobi);
    * ``"kfac"``: the Kronecker factors of JtJ
      (``problem.gauss_newton_kfac``); ``D = I``, and CG preconditioned by
      ``(KFAC + damping I)^-1``, exact through the factors' eigenvectors.
    """

    def __init__(self, problem, theta, iterations, preconditioner=None, scaling="diag"):
        self.J = aslinearoperator(problem.jac(theta))  # an array as well
        self.Jtr = self.J.rmatvec(problem.fun(theta))
        self.iterations = iterations
        m = len(self.Jtr)
        self.scale, self.inverse = np.ones(m), None  # D, and the preconditioner
        if preconditioner == "diagonal":
            diag = problem.gauss_newton_diagonal(theta)
            diag = np.maximum(diag, 1e-9 * diag.max())  # dead units: not singular
            if scaling == "diag":
                self.scale = diag
            self.inverse = lambda damping: lambda v: v / (diag + damping * self.scale)
        elif preconditioner == "kfac":
            factors = problem.gauss_newton_kfac(theta)
            self.inverse = lambda damping: lambda v: factors.inverse_matvec(v, damping)

    def step(self, damping):
        """The step, shape (m,), from ``iterations`` of CG on
        ``(JtJ + damping D) step = -Jtr`` (``damping`` as in
        :meth:`NormalEquations.step`)."""
        m = len(self.Jtr)
        J, scale = self.J, self.scale
        system = LinearOperator(
            (m, m),
            matvec=lambda v: J.rmatvec(J.matvec(v)) + damping * scale * v,
            dtype=float,
        )
        inverse = None
        if self.inverse is not None:
            inverse = LinearOperator((m, m), matvec=self.inverse(damping), dtype=float)
        step, _ = cg(system, -self.Jtr, maxiter=self.iterations, M=inverse)
        return step


def levenberg_marquardt(
    problem,
    theta0=None,
    *,
    max_steps=20,
    damping=1e-3,
    factor=10.0,
    scaling="diag",
    solver="cholesky",
    cg_iterations=50,
    preconditioner=None,
):
    """Levenberg-Marquardt on ``problem`` (from ``least_squares_problem``).

    Each step solves ``(JtJ + damping * D) step = -Jtr`` with
    ``D = diag(JtJ)`` (Marquardt; ``scaling="diag"``, floored so dead units
    do not make it singular) or ``D = I`` (``scaling="identity"``).
    ``solver="cholesky"`` factors JtJ, summed one chunk of J at a time
    (memory m x m); ``solver="cg"`` runs ``cg_iterations`` of conjugate
    gradients on products with J (on a ``jacobian="operator"`` problem memory
    is a few vectors of length m, on a formed one J), with ``D = I`` and no
    preconditioner unless ``preconditioner`` names one
    (:class:`GaussNewtonProducts`: ``"diagonal"``, with ``D`` as ``scaling``
    says, or ``"kfac"``; notebook 09 races the KFAC one against Adam). A step
    that lowers the loss is accepted and ``damping /= factor``; otherwise it
    is rejected and ``damping *= factor``, re-using the system. The
    solution is written into the model. Introduced in
    ``05-scipy-least-squares``.

    Args:
        problem: a :class:`jacutil.LeastSquaresProblem`.
        theta0: the start, shape (m,) (default: ``problem.theta0``).
        max_steps: trial steps (accepted or not).
        damping: the first damping.
        factor: what the damping is divided or multiplied by.
        scaling: ``"diag"`` or ``"identity"``.
        solver: ``"cholesky"`` or ``"cg"``.
        cg_iterations: conjugate-gradient iterations per step.
        preconditioner: ``None``, ``"diagonal"`` or ``"kfac"`` (``solver="cg"``
            only).

    Returns:
        A dict: ``theta`` (m,), ``history`` (rows of seconds since the start
        and MSE, one per accepted point, the start first), ``damping``,
        ``n_steps``, ``n_accepted``, ``n_jev`` (systems built) and ``n_fev``.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, least_squares_problem, levenberg_marquardt
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> problem = least_squares_problem(model, x, np.zeros((4, 2)))
        >>> result = levenberg_marquardt(problem, max_steps=5)
        >>> result["theta"].shape, bool(result["history"][-1, 1] < 1e-12)
        ((8,), True)
    """
    if scaling not in ("diag", "identity"):
        raise ValueError(f'scaling is {scaling!r}; use "diag" or "identity".')
    if solver not in ("cholesky", "cg"):
        raise ValueError(f'solver is {solver!r}; use "cholesky" or "cg".')
    if preconditioner not in (None, "diagonal", "kfac"):
        raise ValueError(
            f'preconditioner is {preconditioner!r}; use None, "diagonal" or "kfac".'
        )
    if preconditioner is not None and solver != "cg":
        raise ValueError(
            f'preconditioner="{preconditioner}" is for solver="cg"; the Cholesky '
            "solver factors the system exactly and needs none."
        )
    start = time.perf_counter()
    theta = np.array(problem.theta0 if theta0 is None else theta0, np.float64)
    loss = np.mean(problem.fun(theta) ** 2)
    history = [(time.perf_counter() - start, loss)]
    n_jev, n_fev, n_accepted = 0, 1, 0
    fresh = True  # the system must be (re)built at theta
    for _ in range(max_steps):
        if fresh:
            if solver == "cg":
                system = GaussNewtonProducts(
                    problem, theta, cg_iterations, preconditioner, scaling
                )
            else:
                system = NormalEquations(problem, theta, scaling)
            n_jev += 1
        try:
            trial = theta + system.step(damping)
            trial_loss = np.mean(problem.fun(trial) ** 2)
            n_fev += 1
        except np.linalg.LinAlgError:  # not positive definite: damp more
            trial_loss = np.inf
        fresh = trial_loss < loss
        if fresh:
            theta, loss, damping = trial, trial_loss, damping / factor
            n_accepted += 1
            history.append((time.perf_counter() - start, loss))
        else:
            damping *= factor
    problem.set_params(theta)
    return {
        "theta": theta,
        "history": np.array(history),
        "n_steps": max_steps,
        "n_accepted": n_accepted,
        "n_jev": n_jev,
        "n_fev": n_fev,
        "damping": damping,
    }
