"""The fit of notebook 09: a wide network by matrix-free least squares.

``run(...)`` builds the question's network made wide (10 -> 512 -> 512 ->
512 -> 2 by default, about 530,000 parameters), fits it to seeded data with
``scipy.optimize.least_squares(..., tr_solver="lsmr")`` on the Jacobian as a
``LinearOperator`` (``least_squares_problem(..., jacobian="operator")``),
then with Levenberg-Marquardt whose conjugate-gradient steps are
preconditioned by KFAC (``levenberg_marquardt(..., solver="cg",
preconditioner="kfac")``), and then, from the same start, with Adam for as
long as the longer of the two. It records the loss curves, the lsmr fit's
peak memory above the level before it, and how long one ``matvec`` +
``rmatvec`` pair takes against one forward pass. ``run_in_fresh_process``
runs it in a new Python process, so that the memory counted is the fit's
alone (``python -m jacutil.teaching.wide_fit``).
Introduced in ``09-matrix-free``.
"""

import json
import sys
import time

import numpy as np

from ..core import memory
from ..core._tf import keras, tf
from ..fitting.gauss_newton import levenberg_marquardt
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


def fit_levenberg_marquardt(
    problem, max_steps, cg_iterations, preconditioner="kfac", damping=0.1
):
    """``levenberg_marquardt`` on ``problem`` from its ``theta0`` with
    ``cg_iterations`` of CG a step, preconditioned by ``preconditioner``
    (``"kfac"``, ``"diagonal"`` or None), for ``max_steps`` trial steps: a
    list of ``(seconds, mse)`` pairs, one per accepted point (the start
    first). A first, untimed one-step call compiles what the fit uses, as
    Adam's first step does for Adam."""
    options = {"solver": "cg", "preconditioner": preconditioner}
    levenberg_marquardt(problem, max_steps=1, cg_iterations=1, **options)
    result = levenberg_marquardt(
        problem, max_steps=max_steps, damping=damping, cg_iterations=cg_iterations,
        **options,
    )  # fmt: skip
    return [tuple(map(float, row)) for row in result["history"]]


def fit_adam(model, x, y, seconds, learning_rate=1e-3, batch_size=None, seed=0):
    """Adam on the MSE for ``seconds`` after its first (tracing) step,
    fitting ``model`` (its weights change) to ``x`` (n, ...) and ``y`` (n, l):
    a list of ``(seconds, mse)`` pairs. Full-batch (``batch_size`` None): one
    pair per step. Otherwise mini-batches of ``batch_size`` rows, reshuffled
    each epoch (``seed``): one pair per epoch, the MSE on all of ``x``,
    whose evaluation is left out of the seconds."""
    optimizer = keras.optimizers.Adam(learning_rate)
    x, y = tf.constant(x), tf.constant(y, model.dtype)
    n = int(x.shape[0])
    size = n if batch_size is None else min(int(batch_size), n)

    @tf.function
    def step(rows):
        xb, yb = tf.gather(x, rows), tf.gather(y, rows)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def mse():
        return tf.reduce_mean((model(x) - y) ** 2)

    rng = np.random.default_rng(seed)
    every = tf.range(n)
    step(every[:size])  # the trace (and a first step): the clock starts after it
    mse()
    history, spent = [], 0.0
    while not history or history[-1][0] < seconds:
        started = time.perf_counter()
        if batch_size is None:
            loss = float(step(every))
            spent += time.perf_counter() - started
        else:  # one epoch of whole batches (one shape: one trace)
            order = tf.constant(rng.permutation(n)[: n - n % size].reshape(-1, size))
            for rows in order:
                step(rows)
            spent += time.perf_counter() - started
            loss = float(mse())
        history.append((spent, loss))
    return history


def run(
    n_samples=2000, width=512, depth=3, max_nfev=8, lsmr_iterations=10,
    lm_steps=12, cg_iterations=3, seed=0,
):  # fmt: skip
    """The three fits from one start, on ``depth`` hidden layers of ``width``
    (``max_nfev`` and ``lsmr_iterations`` as in :func:`fit_lsmr`,
    ``lm_steps`` and ``cg_iterations`` as in
    :func:`fit_levenberg_marquardt`; ``lm_steps=0`` leaves that fit out, and
    Adam then runs as long as the least-squares fit).

    Returns:
        A dict of plain numbers (JSON-ready): ``n_samples``, ``n_params`` (m),
        ``n_outputs`` (l),
        ``jacobian_bytes_float64`` (n * l * m * 8), ``fit_peak_bytes``,
        ``process_peak_bytes`` (this process's own peak, ``peak_rss``: not a
        parent's, which ``ru_maxrss`` would report after a fork),
        ``forward_seconds``, ``pair_seconds`` (a ``matvec`` and an
        ``rmatvec``), and the ``(seconds, mse)`` histories ``lsmr``,
        ``lm_kfac`` and ``adam``.
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
    lm_kfac = []  # lm_steps 0: no Levenberg-Marquardt fit
    if lm_steps:
        lm_kfac = fit_levenberg_marquardt(problem, lm_steps, cg_iterations)
    model.set_weights(start_weights)
    longest = max(lsmr[-1][0], lm_kfac[-1][0] if lm_kfac else 0.0)
    adam = fit_adam(model, x, y, seconds=longest)
    return {
        "n_samples": n_samples,
        "n_params": n_params,
        "n_outputs": problem.n_outputs,
        "jacobian_bytes_float64": n_rows * n_params * 8,
        "fit_peak_bytes": use.peak,
        "process_peak_bytes": memory.peak_rss(),
        "forward_seconds": forward,
        "pair_seconds": pair,
        "lsmr": lsmr,
        "lm_kfac": lm_kfac,
        "adam": adam,
    }


# The process's NumPy runs on one OpenBLAS thread: with two, the threads spin
# at a barrier while other processes hold the cores, and on a loaded
# 2-core machine one 513 x 513 ``eigh`` (a KFAC factor, every step) took
# 3 s against 0.1 s on one thread. TensorFlow's own threads are unaffected.
_ONE_BLAS_THREAD = (
    "import os, runpy, sys; os.environ['OPENBLAS_NUM_THREADS'] = '1'; "
    "sys.argv[0] = 'wide_fit'; "
    "runpy.run_module('jacutil.teaching.wide_fit', run_name='__main__')"
)


def run_in_fresh_process(**parameters):
    """:func:`run` in a new Python process (:func:`fresh_python`), its NumPy
    on one BLAS thread (above); its dict, pairs as lists."""
    arguments = ["-c", _ONE_BLAS_THREAD, json.dumps(parameters)]
    return fresh_python(arguments, "the fit's process failed")


if __name__ == "__main__":
    print(json.dumps(run(**json.loads(sys.argv[1]))))
