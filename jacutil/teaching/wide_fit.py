"""The fit of notebook 09: a wide network by matrix-free least squares.

``run(...)`` builds the question's network made wide (10 -> 512 -> 512 ->
512 -> 2 by default, about 530,000 parameters), fits it to seeded data with
``scipy.optimize.least_squares(..., tr_solver="lsmr")`` on the Jacobian as a
``LinearOperator`` (``least_squares_problem(..., jacobian="operator")``),
and then, from the same start, with Adam for the same wall-clock time. It
records both loss curves, the fit's peak memory above the level before it,
and how long one ``matvec`` + ``rmatvec`` pair takes against one forward
pass. ``run_in_fresh_process`` runs it in a new Python process, so that the
memory counted is the fit's alone (``python -m jacutil.teaching.wide_fit``).
Introduced in ``09-matrix-free``.
"""

import json
import resource
import sys
import time

import numpy as np

from ..core import memory
from ..core._tf import keras, tf
from ..fitting.scipy_bridge import least_squares_problem
from .memory_sweeps import fresh_python
from .models import question_mlp, regression_data
from .timing import time_call


def fit_lsmr(problem, max_nfev, lsmr_iterations):
    """``least_squares`` with lsmr (``lsmr_iterations`` a step) on the operator
    of ``problem`` (``jacobian="operator"``), for at most ``max_nfev``
    evaluations: a list of ``(seconds, mse)`` pairs, one per evaluation."""
    from scipy.optimize import least_squares

    history, start = [], time.perf_counter()

    def fun(theta):
        residuals = problem.fun(theta)
        history.append((time.perf_counter() - start, float(np.mean(residuals**2))))
        return residuals

    result = least_squares(
        fun,
        problem.theta0,
        jac=problem.jac,
        tr_solver="lsmr",
        tr_options={"maxiter": lsmr_iterations},
        max_nfev=max_nfev,
    )
    problem.set_params(result.x)
    return history


def fit_adam(model, x, y, seconds, learning_rate=1e-3):
    """Full-batch Adam on the MSE for ``seconds`` after its first (tracing) step,
    fitting ``model`` (its weights change) to ``x`` (n, ...) and ``y`` (n, l):
    a list of ``(seconds, mse)`` pairs, one per step."""
    optimizer = keras.optimizers.Adam(learning_rate)
    x, y = tf.constant(x), tf.constant(y, model.dtype)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    step()  # the trace (and a first step): the clock starts after it
    history, start = [], time.perf_counter()
    while not history or history[-1][0] < seconds:
        loss = float(step())
        history.append((time.perf_counter() - start, loss))
    return history


def run(n_samples=2000, width=512, depth=3, max_nfev=8, lsmr_iterations=10, seed=0):
    """Both fits from one start, on ``depth`` hidden layers of ``width``
    (``max_nfev`` and ``lsmr_iterations`` as in :func:`fit_lsmr`).

    Returns:
        A dict of plain numbers (JSON-ready): ``n_samples``, ``n_params`` (m),
        ``n_outputs`` (l),
        ``jacobian_bytes_float64`` (n * l * m * 8), ``fit_peak_bytes``,
        ``process_peak_bytes``, ``forward_seconds``, ``pair_seconds`` (a
        ``matvec`` and an ``rmatvec``), and the ``(seconds, mse)`` histories
        ``lsmr`` and ``adam``.
    """
    model = question_mlp(hidden=(width,) * depth, seed=seed)
    x, y = regression_data(n_samples, seed=seed)
    start_weights = model.get_weights()
    problem = least_squares_problem(model, x, y, jacobian="operator")
    n_params, n_rows = problem.n_params, n_samples * problem.n_outputs
    operator = problem.jac(problem.theta0)
    v, u = np.ones(n_params), np.ones(n_rows)
    forward = time_call(model, x, repeats=3).median
    pair = time_call(lambda: (operator.matvec(v), operator.rmatvec(u)), repeats=3)
    pair = pair.median
    use = memory.peak_memory(fit_lsmr, problem, max_nfev, lsmr_iterations)
    lsmr = use.result
    model.set_weights(start_weights)
    adam = fit_adam(model, x, y, seconds=lsmr[-1][0])
    return {
        "n_samples": n_samples,
        "n_params": n_params,
        "n_outputs": problem.n_outputs,
        "jacobian_bytes_float64": n_rows * n_params * 8,
        "fit_peak_bytes": use.peak,
        "process_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "forward_seconds": forward,
        "pair_seconds": pair,
        "lsmr": lsmr,
        "adam": adam,
    }


def run_in_fresh_process(**parameters):
    """:func:`run` in a new Python process (:func:`fresh_python`); its dict,
    pairs as lists."""
    arguments = ["-m", "jacutil.teaching.wide_fit", json.dumps(parameters)]
    return fresh_python(arguments, "the fit's process failed")


if __name__ == "__main__":
    print(json.dumps(run(**json.loads(sys.argv[1]))))
