# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Fitting a Keras model with SciPy's `least_squares`
#
# **Questions**
# - What exactly does `scipy.optimize.least_squares` need from a network,
#   and in which layout?
# - How do I fit the network with it?
#
# **Objectives**
# - Turn `(model, x, y)` into `fun`, `jac` and `theta0` with
#   `least_squares_problem`, and prove `jac` against the earlier stages.
# - Fit the network with `least_squares` and write the solution back.
#
# *Going further* (optional, after the exercise): Levenberg–Marquardt on
# chunked normal equations, `"trf"` and Adam raced from the same weights,
# and where Levenberg–Marquardt's time goes; SciPy's `"lm"` on a narrow
# network; the layout question's `(l·m) × n` matrix against SciPy's
# `(n·l) × m`; the chain rule with a derivative computed outside
# TensorFlow; one Gauss–Newton step without holding J; two more exercises.
#
# *Teaching: 16 min · Exercises: 15 min · Going further: 81 min*

# %% [markdown]
# ## Setup

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from scipy.optimize import least_squares

import jacutil as ju
from jacutil import keras, tf
from jacutil.teaching import check
from jacutil.teaching.claims import claim

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_samples = 2000  # samples to fit: n*l = 4000 residuals
noise = 0.05  # standard deviation of the noise on y
small_hidden = [16, 8]  # hidden widths of the narrow network of the race
narrow_race = ["lm", "trf"]  # its methods; add "adam" for the whole race
trf_max_nfev = 20  # residual evaluations allowed to method="trf"
lm_max_nfev = 15  # residual evaluations allowed to method="lm"
lm_steps = 8  # trial steps of levenberg_marquardt (loop question's network)
lm_damping = 10.0  # its starting damping lambda
lsmr_maxiter = 10  # inner iterations of TRF's lsmr solver, per step
adam_epochs = 20  # passes over the data for Adam
batch_size = 64  # Adam's mini-batch
n_chain = 20  # samples in the chain-rule check (float64)
n_gn = 500  # samples in the Gauss-Newton step check
gn_chunk = 100  # samples per chunk of J in that check
seed = 0

# %%
x, y = ju.regression_data(n_samples, seed=seed, noise=noise)
model = ju.question_mlp(seed=seed)
n, l = y.shape
m = ju.flat_params(model).size
print(f"n = {n} samples, l = {l} outputs, m = {m} parameters")
print(f"residuals n*l = {n * l}, parameters m = {m}")
print(f"one QR factorisation of the (n*l) x m matrix: 2*n*l*m**2 = "
      f"{2 * n * l * m**2:.1e} operations")

# %% [markdown]
# ## What SciPy needs
#
# `least_squares(fun, theta0, jac=jac)` minimises
# $\tfrac12 \lVert r(\theta) \rVert^2$. It knows nothing of networks: it
# wants three things.
#
# - `theta0`: one flat float64 vector of all $m$ parameters;
# - `fun(theta)`: the residuals $r = f(x;\theta) - y$, one per sample and
#   output, $n·l$ of them;
# - `jac(theta)`: their $(n·l) \times m$ Jacobian.
#
# Row `i*l + k` is sample `i`, output `k` - exactly `J.reshape(n*l, m)` of
# the `(n, l, m)` Jacobian of the earlier notebooks, with no transpose.
# (That is SciPy's layout, not the layout question's $(l·m) \times n$ of
# [`00-welcome`](00-welcome.ipynb#The-two-questions): the going-further
# part relates the two.) In plain TensorFlow and NumPy, `fun` and `jac`
# write `theta` into the model's variables, in order, and run it:

# %% tags=["plain-version"]
def plain_fun_and_jac(model, x, y):
    """SciPy's fun(theta) and jac(theta) for a Keras model and its data."""
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]

    def set_params(theta):  # theta's pieces into the variables, in order
        pieces = np.split(theta, np.cumsum(sizes)[:-1])
        for v, piece in zip(model.trainable_variables, pieces, strict=True):
            v.assign(piece.reshape(v.shape).astype(v.dtype))

    def fun(theta):
        set_params(theta)
        return (np.asarray(model(x)) - y).ravel().astype("float64")

    def jac(theta):
        set_params(theta)
        return ju.chunked_jacobian(model, x, progress=False).reshape(len(fun(theta)), -1)

    return fun, jac


# %% [markdown]
# `least_squares_problem` builds the three from a model and data. Its `fun`
# and `jac` are these, with the parameters written once per `theta` (and
# only the variables that changed), the residuals and J computed in chunks
# of a memory budget (`_residuals`, `_jacobian`), any inputs and outputs,
# and `jacobian="operator"`, a J that is never formed (notebook 09):

# %%
ju.teaching.notebook.show_source(ju.LeastSquaresProblem.fun,
                                 plain=plain_fun_and_jac)
ju.teaching.notebook.show_source(ju.LeastSquaresProblem.jac,
                                 plain=plain_fun_and_jac)

# %% [markdown]
# `jac` runs `chunked_jacobian` of `04`, whose one compiled function is
# reused by every call, so nothing is retraced. Check `jac` against the
# per-sample Jacobian of `02`, and `fun` against the model's own outputs.
# `fun` and `jac` run the model itself, so each call first writes its
# `theta` into the model's variables: after a call at another `theta` the
# model holds that one, and `set_params(theta0)` puts the start back. A
# solver's last call need not be at its solution, which is why the fits
# below end with `set_params(result.x)`.

# %%
problem = ju.least_squares_problem(model, x, y)
theta0 = problem.theta0
r0 = problem.fun(theta0)
J0 = problem.jac(theta0)
print("theta0:", theta0.shape, theta0.dtype, " r:", r0.shape,
      " jac:", J0.shape)
x_few = x[:5]
J_few = ju.per_sample_jacobian(model, x_few).reshape(5 * l, m)
np.testing.assert_allclose(J0[: 5 * l], J_few, rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(r0, (model(x).numpy() - y).ravel(), atol=1e-6)
plain_fun, plain_jac = plain_fun_and_jac(model, x, y)
np.testing.assert_allclose(plain_fun(theta0), r0, rtol=1e-6, atol=1e-7)
np.testing.assert_allclose(plain_jac(theta0), J0, rtol=1e-5, atol=1e-6)
print("plain_fun_and_jac == problem.fun and problem.jac: True")
problem.jac(theta0 + 0.01)  # note: writes theta0 + 0.01 into the model
problem.set_params(theta0)  # ... so put the start back
print("jac == per_sample_jacobian, reshaped: True")
claim("jac-never-retraces", problem.compiled.trace_count == 1,
      f"after calls at two theta, the compiled Jacobian was traced "
      f"{problem.compiled.trace_count} time(s)")

# %% [markdown]
# ## One fit
#
# One call fits the model: `"trf"` (trust region reflective) with
# `tr_solver="lsmr"`, an iterative solver that needs only products of J
# with vectors, never a factorisation of J, for at most `trf_max_nfev`
# evaluations of `fun`; then `result.x` goes back into the model:

# %% tags=["nbval-ignore-output"]
start = time.perf_counter()
result = least_squares(problem.fun, theta0, jac=problem.jac, method="trf",
                       tr_solver="lsmr", tr_options={"maxiter": lsmr_maxiter},
                       max_nfev=trf_max_nfev)
trf_seconds = time.perf_counter() - start
problem.set_params(result.x)  # the solution, into the model
mse_start = np.mean(r0**2)
mse_trf = np.mean((model(x).numpy() - y) ** 2)
print(f"trf: {result.nfev} calls of fun, {result.njev} of jac, "
      f"{trf_seconds:.1f} s; {result.message}")
claim("trf-lowers-the-mse", mse_trf < mse_start,
      f"the model's MSE fell from {mse_start:.4f} at theta0 to {mse_trf:.4f}")
problem.set_params(theta0)  # the start, for what follows

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** Fit a narrow network, `ju.question_mlp(hidden=(16, 8),
# seed=seed)`, to only ten samples, `x[:10]` and `y[:10]`, so that there are fewer residuals than parameters
# ($n·l < m$), with `method="lm"`. What does SciPy say? Which method of
# `least_squares` still works? Put its name in `answer` (a string, exactly
# as you would pass it to `method=`).

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: MINPACK's LM refuses an underdetermined problem; "trf" (and
# "dogbox") accept it - with more parameters than residuals they can fit
# the data exactly.
tiny = ju.question_mlp(hidden=(16, 8), seed=seed)  # 330 parameters
few = ju.least_squares_problem(tiny, x[:10], y[:10])  # 20 residuals
try:
    least_squares(few.fun, few.theta0, jac=few.jac, method="lm")
except ValueError as error:
    print("lm:", error)
answer = "trf"

# %%
check.exercise("05-1", answer)

# %% [markdown]
# ## Going further: three optimizers, one start
#
# The harness below fits the data with `"trf"` (as above),
# Levenberg–Marquardt and Adam, each from the same weights, and logs the
# mean squared error $\mathrm{MSE} = \lVert r \rVert^2 / (n·l)$ against
# wall-clock time: at every call of `fun` (we plot the best so far, since a
# rejected trial step raises it), or after every epoch for Adam. Each method
# runs to its own cap (the parameters cell): the end of a line is what it
# did within its budget, not the best it can do. `TimedProblem` adds up the
# seconds a fit spends in `fun` and `normal_equations`, for later.

# %%
SCIPY_OPTIONS = {
    "trf": {"max_nfev": trf_max_nfev, "tr_solver": "lsmr",
            "tr_options": {"maxiter": lsmr_maxiter}},
    "lm": {"max_nfev": lm_max_nfev},
}


class TimedProblem:
    """problem, adding up the seconds of fun and normal_equations."""

    def __init__(self, problem):
        self.problem, self.theta0 = problem, problem.theta0
        self.set_params = problem.set_params
        self.seconds = {"fun": 0.0, "normal_equations": 0.0}

    def timed(self, name, theta):
        start = time.perf_counter()
        result = getattr(self.problem, name)(theta)
        self.seconds[name] += time.perf_counter() - start
        return result

    def fun(self, theta):
        return self.timed("fun", theta)

    def normal_equations(self, theta):
        return self.timed("normal_equations", theta)


def fit_scipy(problem, method, log, start):
    """least_squares from problem.theta0; log (seconds, MSE) at every fun."""
    def fun(theta):
        r = problem.fun(theta)
        log.append((time.perf_counter() - start, np.mean(r**2)))
        return r

    result = least_squares(fun, problem.theta0, jac=problem.jac,
                           method=method, **SCIPY_OPTIONS[method])
    problem.set_params(result.x)  # the solution, into the model
    return result.nfev, result.njev, np.mean(result.fun**2)


def fit_adam(model, log, start):
    """Keras' model.fit with Adam; log (seconds, MSE) after every epoch."""
    def after_epoch(epoch, logs):
        mse = np.mean((model(x).numpy() - y) ** 2)
        log.append((time.perf_counter() - start, mse))

    keras.utils.set_random_seed(seed)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=adam_epochs, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(
                  on_epoch_end=after_epoch)])
    steps = adam_epochs * int(np.ceil(n / batch_size))
    return steps, None, log[-1][1]


lm_jtj_parts = {}  # where levenberg_marquardt's time went


def fit_lm_jtj(problem, log):
    """jacutil's levenberg_marquardt from problem.theta0, its parts timed."""
    timed = TimedProblem(problem)
    result = ju.levenberg_marquardt(timed, max_steps=lm_steps,
                                    damping=lm_damping)
    log.extend(map(tuple, result["history"][1:]))
    lm_jtj_parts.update(timed.seconds)
    return result["n_fev"], result["n_jev"], result["history"][-1, 1]


def race(model, methods):
    """Fit model from the same weights with each method; MSE against time."""
    problem = ju.least_squares_problem(model, x, y)
    mse0 = np.mean(problem.fun(problem.theta0) ** 2)
    rows, curves = [], {}
    for method in methods:
        problem.set_params(problem.theta0)
        log = [(0.0, mse0)]
        start = time.perf_counter()
        if method == "adam":
            nfev, njev, mse = fit_adam(model, log, start)
        elif method == "lm-jtj":
            nfev, njev, mse = fit_lm_jtj(problem, log)
        else:
            nfev, njev, mse = fit_scipy(problem, method, log, start)
        seconds = time.perf_counter() - start
        rows.append((method, nfev, njev, mse, seconds))
        curves[method] = np.array(log)
    problem.set_params(problem.theta0)
    return rows, curves, problem


# %% [markdown]
# SciPy's own `method="lm"` is Levenberg–Marquardt from MINPACK, the
# Fortran library SciPy wraps: every step factorises the whole
# $(n·l) \times m$ matrix, the $2 n l m^2$ operations printed at the start,
# as plain loops on one core. On this network it stays out of the race: a
# section below times it on a narrow network and, from its speed there,
# estimates what one of its steps would cost here.
#
# Levenberg–Marquardt does not need that factorisation.
# `levenberg_marquardt` (`"lm-jtj"`) solves the same damped system from the
# normal equations: `normal_equations` sums the $m \times m$ matrix
# $J^\top J$ and $J^\top r$ chunk by chunk, and each step is one Cholesky
# solve of size $m$, whatever $n$. A step that lowers the MSE is kept and
# the damping $\lambda$ shrinks; one that does not is undone and $\lambda$
# grows, re-using $J^\top J$. The damping is Marquardt's,
# $\lambda\,\mathrm{diag}(J^\top J)$: each parameter damped in proportion
# to its own curvature, so the step does not depend on the parameters'
# scales.

# %% tags=["nbval-ignore-output"]
rows_big, curves_big, problem_big = race(model, ["lm-jtj", "trf", "adam"])
print("traces of the compiled Jacobian:", problem_big.compiled.trace_count)

# %% [markdown]
# The dashed line is the noise in `y`: its variance, `noise**2`, is the
# MSE of the true function itself. A fit that ends below it on the data it
# was fitted to has begun to fit the noise too - with thousands of
# parameters and a few thousand residuals, it can. The Finding names the
# methods that did so in this run.

# %% tags=["nbval-ignore-output"]
def show_race(network, rows, curves):
    """Best MSE so far against time, the noise line, a Finding, a table."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, log in curves.items():
        best = np.minimum.accumulate(log[:, 1])
        ax.semilogy(log[:, 0], best, "o-", ms=3, label=method)
    ax.axhline(noise**2, ls="--", color="gray", label="noise in y")
    ax.set(title=network, xlabel="wall-clock seconds", ylabel="MSE")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    plt.show()
    below = [row[0] for row in rows if row[3] < noise**2]
    print(f"Finding: {network}: " + "; ".join(
        f"{method} ends at MSE {mse:.4f} after {seconds:.1f} s"
        for method, _, _, mse, seconds in rows)
        + f"; below the noise line ({noise**2:.4f}): "
        + (", ".join(below) or "none"))
    print(f"{'method':<6} {'nfev':>6} {'njev':>5} {'final MSE':>10} "
          f"{'seconds':>8}")
    for method, nfev, njev, mse, seconds in rows:
        njev = "-" if njev is None else njev
        print(f"{method:<6} {nfev:>6} {njev:>5} {mse:>10.5f} {seconds:>8.2f}")


show_race(f"loop question's network, m = {m}", rows_big, curves_big)

# %% [markdown]
# For SciPy's methods, `nfev` and `njev` count the calls of `fun` and `jac`.
# For Adam, `nfev` counts mini-batch gradient steps; for `lm-jtj`, `nfev` is
# its trial steps plus the start, and `njev` the systems it summed. The
# least-squares methods use the Jacobian of all residuals at every step;
# each of Adam's steps uses one mini-batch's gradient. Which
# line is lowest at a given time is the answer for this run. Each step of
# `lm-jtj` sums the Jacobian of all residuals and solves an $m \times m$
# system: where does its time go?

# %% [markdown]
# ## Where Levenberg–Marquardt's time goes
#
# `TimedProblem` measured the seconds `lm-jtj` spent in `fun` and in
# `normal_equations`; what is left of its total is the steps' Cholesky
# solves of the damped $m \times m$ system and the bookkeeping. Inside
# `normal_equations`, each system needs one Jacobian of all $n$ samples and
# the products $J^\top J$ and $J^\top r$. We time one Jacobian (`jac`, the
# same compiled function and chunks) and one $J^\top J$ alone, and split
# `normal_equations` with them:

# %% tags=["nbval-ignore-output"]
jac_time = ju.time_call(problem_big.jac, theta0, repeats=3).median
J_big = problem_big.jac(theta0)
gram_time = ju.time_call(np.matmul, J_big.T, J_big, repeats=1).median
del J_big
print(f"one jac: {jac_time:.3f} s;  one J.T @ J ({n * l} x {m}): "
      f"{gram_time:.3f} s")
_, jtj_nfev, jtj_njev, _, lm_jtj_seconds = rows_big[0]  # the lm-jtj row
jacobians = jtj_njev * jac_time
algebra = lm_jtj_seconds - jacobians - lm_jtj_parts["fun"]
parts = [
    (f"{jtj_njev} Jacobians ({jtj_njev} x one jac)", jacobians),
    (f"J.T @ J, J.T @ r of {jtj_njev} systems (the rest of them)",
     lm_jtj_parts["normal_equations"] - jacobians),
    (f"{jtj_nfev} evaluations of fun", lm_jtj_parts["fun"]),
    (f"{lm_steps} Cholesky solves and the rest",
     lm_jtj_seconds - lm_jtj_parts["normal_equations"] - lm_jtj_parts["fun"]),
]
for what, seconds in parts:
    print(f"{what:<48} {seconds:7.2f} s {100 * seconds / lm_jtj_seconds:4.0f} %")
print(f"{'total (the table above)':<48} {lm_jtj_seconds:7.2f} s")
share = {what.split(" (")[0]: 100 * seconds / lm_jtj_seconds
         for what, seconds in parts}
print(f"Finding: lm-jtj's {lm_jtj_seconds:.1f} s: " + "; ".join(
    f"{what} {percent:.0f} %" for what, percent in share.items()))
claim("algebra-not-jacobian", algebra > jacobians,
      f"the dense algebra (J.T @ J, J.T @ r and the solves, {algebra:.2f} s) "
      f"took longer than the {jtj_njev} Jacobians ({jacobians:.2f} s)")

# %% [markdown]
# Compare the Jacobians' share with the rest in the Finding. The dense
# algebra on them - $J^\top J$ (about $n l m^2$ operations per system) and a
# Cholesky factorisation ($m^3/3$) per trial step - grows as $m^2$ and $m^3$,
# while the Jacobian grows as $m$: at thousands of parameters the algebra,
# not the Jacobian, sets the pace. Our `levenberg_marquardt` runs that algebra as one matrix product per
# chunk, which BLAS runs blocked and on every core; MINPACK's QR of the
# whole $(n·l) \times m$ matrix runs as plain column-by-column loops on one
# core, which is why SciPy's `"lm"` sat out on this network. The price of
# the normal equations is precision: they square J's condition number,
# which float64 and the damping absorb here.

# %% [markdown]
# ## SciPy's `"lm"` on a narrow network
#
# With hidden widths `small_hidden` the network has far fewer parameters,
# and MINPACK's dense algebra is small enough for SciPy's `"lm"` to join
# the race (`narrow_race`, a parameter: add `"adam"` for all three). The
# Finding says where each method ended, and when.

# %% tags=["nbval-ignore-output"]
narrow = ju.question_mlp(hidden=tuple(small_hidden), seed=seed)
rows_small, curves_small, problem_small = race(narrow, narrow_race)
show_race(f"narrow network, m = {problem_small.n_params}", rows_small,
          curves_small)

# %% [markdown]
# From `"lm"`'s own time here we can estimate what it would cost on the
# loop question's network, without waiting for it: each of its Jacobians is
# followed by one QR factorisation, $2 n l m^2$ operations, so this run gives
# its speed in operations a second (its residuals and Jacobians counted in,
# so the estimate errs on the fast side).

# %% tags=["nbval-ignore-output"]
lm_row = next(row for row in rows_small if row[0] == "lm")
_, _, lm_njev, _, scipy_lm_seconds = lm_row
m_small = problem_small.n_params
rate = 2 * n * l * m_small**2 * lm_njev / scipy_lm_seconds  # operations a second
lm_step_seconds = 2 * n * l * m**2 / rate  # one factorisation at m, at that speed
print(f"SciPy's lm here: {lm_njev} factorisations of the {n * l} x {m_small} "
      f"matrix in {scipy_lm_seconds:.1f} s, {rate / 1e9:.1f}e9 operations a second")
print(f"Finding: at that speed one step of SciPy's lm on the loop question's "
      f"network (m = {m}) takes about {lm_step_seconds:.0f} s, and {lm_njev} steps "
      f"about {lm_njev * lm_step_seconds / 60:.1f} min (an estimate from this run, not "
      f"a run); lm-jtj's whole fit there took {lm_jtj_seconds:.1f} s.")

# %% [markdown]
# ## The layout question
#
# The layout question of [`00-welcome`](00-welcome.ipynb#The-two-questions)
# wants an $(l·m) \times n$ matrix for a SciPy optimizer: one **column** per
# sample, row `k*m + p`. SciPy's `least_squares` wants $(n·l) \times m$: one
# **row** per residual. Same numbers, different order. `to_lm_by_n` makes
# the layout question's matrix from the `(n, l, m)` array, which is SciPy's
# matrix reshaped:

# %%
J3 = J0.reshape(n, l, m)  # SciPy's matrix as (n, l, m): a view, no copy
M = ju.to_lm_by_n(J3)
print("SciPy:", J0.shape, "  (n, l, m):", J3.shape,
      "  layout question:", M.shape)
rng = np.random.default_rng(seed)
i, k, p = rng.integers(n), rng.integers(l), rng.integers(m)
print("M[k*m + p, i] == jac[i*l + k, p]:",
      M[k * m + p, i] == J0[i * l + k, p])

# %% [markdown]
# The gradient of SciPy's cost $\tfrac12\lVert r\rVert^2$ is $J^\top r$ in
# SciPy's layout. In the layout question's $(l·m) \times n$ the same sum
# runs over columns, one block of $m$ rows per output:

# %%
grad_scipy = J0.T @ r0
R = r0.reshape(n, l)  # residual of sample i, output k
grad_question = sum(M[k * m : (k + 1) * m] @ R[:, k] for k in range(l))
np.testing.assert_allclose(grad_question, grad_scipy, rtol=1e-6, atol=1e-8)
print("J.T @ r, both layouts, equal: True")
del M

# %% [markdown]
# ## The chain rule, with a derivative from outside TensorFlow
#
# Often the objective is not $f$ itself but a function of it computed
# elsewhere - a simulator, a physics formula, NumPy code:
# $L(\theta) = \sum_i g(f(x_i;\theta))$. TensorFlow cannot see inside $g$,
# but it does not need to. With $G_{ik} = \partial g / \partial f_k$ at
# $f(x_i)$ (shape $(l,)$ per sample, from NumPy), the chain rule is one
# matrix product with the Jacobian:
#
# $$\frac{\partial L}{\partial \theta_p} = \sum_{i,k} G_{ik}\, J[i, k, p].$$
#
# Our $g$: the two outputs $(a, b)$ predict a signal $q = a\,e^{b}$,
# compared with an observation $z$ by $g = \tfrac12 (q - z)^2$. We check on
# a float64 copy of the network, where finite differences are accurate.

# %%
def outside(u, z):
    """g summed over samples, and dg/du per sample: NumPy only."""
    a, b = u[:, 0], u[:, 1]
    q = a * np.exp(b)
    error = q - z
    G = np.stack([error * np.exp(b), error * q], axis=1)  # (n, l)
    return 0.5 * np.sum(error**2), G


model64 = ju.question_mlp(seed=seed, dtype="float64")
model64.set_weights(model.get_weights())
x_c = x[:n_chain].astype("float64")
z = np.random.default_rng(seed + 1).standard_normal(n_chain)

L, G = outside(model64(x_c).numpy(), z)
J_c = ju.compiled_jacobian(model64)(x_c)  # (n, l, m)
grad = np.einsum("ik,ikp->p", G, J_c)
print("G:", G.shape, " J:", J_c.shape, " gradient:", grad.shape)

# %% [markdown]
# Finite differences of $L$ need two forward passes per direction. We check
# the gradient along five random directions and at one parameter of every
# variable:

# %%
theta64 = ju.flat_params(model64)


def loss_at(theta):
    ju.set_flat_params(model64, theta)
    return outside(model64(x_c).numpy(), z)[0]


directions = list(rng.standard_normal((5, m)))
starts = np.cumsum([0] + [int(np.prod(v.shape))
                          for v in model64.trainable_variables])[:-1]
directions += [np.eye(m)[p] for p in starts]
step = 1e-6
for v in directions:
    fd = (loss_at(theta64 + step * v)
          - loss_at(theta64 - step * v)) / (2 * step)
    np.testing.assert_allclose(grad @ v, fd, rtol=1e-6, atol=1e-8)
ju.set_flat_params(model64, theta64)
print(f"chain rule == finite differences along {len(directions)} directions")

# %% [markdown]
# ## One Gauss–Newton step without holding J
#
# A damped Gauss–Newton (Levenberg–Marquardt) step solves
#
# $$(J^\top J + \lambda I)\,\delta = -J^\top r.$$
#
# Both $J^\top J$ ($m \times m$) and $J^\top r$ ($m$) are sums over samples,
# so `normal_equations` adds them up one chunk of J at a time: memory is one
# chunk plus $m^2$ numbers, whatever $n$. The check computes the same step
# from the full J another way, through the $(n·l) \times (n·l)$ system
# $\delta = -J^\top (J J^\top + \lambda I)^{-1} r$ (with fewer residuals
# than parameters, that system is the smaller one).
#
# Note the damping: $\lambda I$ here, Levenberg's, where
# `levenberg_marquardt` above damps with Marquardt's
# $\lambda\,\mathrm{diag}(J^\top J)$. The second route holds for
# $\lambda I$ only - it rests on
# $(J^\top J + \lambda I)\,J^\top = J^\top (J J^\top + \lambda I)$ - and
# with $\lambda I$ a large $\lambda$ turns the step into
# $-J^\top r / \lambda$, a short gradient-descent step (exercise 3).
# Marquardt's scaling is what an optimizer wants, since it does not depend
# on the parameters' units; the algebra of the step is the same.
#
# Summing pays only when the residuals outnumber the parameters,
# $n·l > m$: below that, $J^\top J$ is larger than J itself. This check is
# small, so compare the sizes printed below, and then the last line, which
# gives J at $n$ = 100,000, where the sums save almost everything. In plain
# NumPy around the chunked Jacobian of 04:

# %% tags=["plain-version"]
def plain_normal_equations(model, x, y, chunk):
    """J.T J and J.T r summed chunk by chunk: one chunk of J at a time."""
    m = ju.flat_params(model).size
    JtJ, Jtr = np.zeros((m, m)), np.zeros(m)
    for start in range(0, len(x), chunk):
        x_c, y_c = x[start : start + chunk], y[start : start + chunk]
        J_c = ju.chunked_jacobian(model, x_c, progress=False).reshape(-1, m)
        r_c = (np.asarray(model(x_c)) - y_c).ravel()
        JtJ += J_c.T @ J_c
        Jtr += J_c.T @ r_c
    return JtJ, Jtr


# %% [markdown]
# `normal_equations` is that loop (`chunk_normal_equations` makes one
# chunk's pair), with the parameters written first and a `checkpoint` that
# lets an interrupted sum go on from its last chunk (notebook 10):

# %%
ju.teaching.notebook.show_source(ju.LeastSquaresProblem.normal_equations,
                                 plain=plain_normal_equations)

# %%
damping = 1.0
gn = ju.least_squares_problem(model64, x[:n_gn].astype("float64"),
                              y[:n_gn], chunk_size=gn_chunk)
JtJ, Jtr = gn.normal_equations(theta64)
plain_sums = plain_normal_equations(model64, x[:n_gn].astype("float64"),
                                    y[:n_gn], gn_chunk)
for ours, plain in zip((JtJ, Jtr), plain_sums, strict=True):
    np.testing.assert_allclose(plain, ours, rtol=1e-10, atol=1e-12)
print("plain_normal_equations == normal_equations: True")
step_chunked = np.linalg.solve(JtJ + damping * np.eye(m), -Jtr)

J_full, r_full = gn.jac(theta64), gn.fun(theta64)
n_res = J_full.shape[0]
step_full = -J_full.T @ np.linalg.solve(
    J_full @ J_full.T + damping * np.eye(n_res), r_full)
np.testing.assert_allclose(step_chunked, step_full, rtol=1e-6, atol=1e-9)
print(f"{int(np.ceil(n_gn / gn_chunk))} chunks of {gn_chunk} samples; "
      "step from chunks == step from full J: True")
before = np.mean(gn.fun(theta64) ** 2)
after = np.mean(gn.fun(theta64 + step_chunked) ** 2)
print(f"MSE before the step {before:.4f}, after {after:.4f}")
gn.set_params(theta64)
print(f"J held: one chunk, {gn_chunk * l * m * 8 / 2**20:.1f} MiB, instead "
      f"of {n_res * m * 8 / 2**20:.1f} MiB; JtJ: {m * m * 8 / 2**20:.1f} MiB")
print(f"at n = 100,000 the whole J would need "
      f"{100_000 * l * m * 8 / 2**30:.1f} GiB; JtJ stays the same size")

# %% [markdown]
# `levenberg_marquardt`, the `"lm-jtj"` of the race, takes this step with
# Marquardt's damping, again and again, and adapts $\lambda$. In plain
# NumPy:

# %% tags=["plain-version"]
def plain_levenberg_marquardt(problem, theta, steps, damping, factor=10.0):
    """Damped Gauss-Newton steps; one that does not lower the MSE is undone."""
    mse = np.mean(problem.fun(theta) ** 2)
    JtJ, Jtr = problem.normal_equations(theta)
    for _ in range(steps):
        curvature = np.diag(JtJ)  # Marquardt: each parameter by its own,
        D = np.diag(np.maximum(curvature, 1e-9 * curvature.max()))  # floored
        trial = theta + np.linalg.solve(JtJ + damping * D, -Jtr)
        trial_mse = np.mean(problem.fun(trial) ** 2)
        if trial_mse < mse:  # keep it, damp less, sum J at the new point
            theta, mse, damping = trial, trial_mse, damping / factor
            JtJ, Jtr = problem.normal_equations(theta)
        else:  # undo it, damp more, reuse J.T J
            damping *= factor
    return theta


theta_plain = plain_levenberg_marquardt(gn, theta64, 3, damping)
theta_ours = ju.levenberg_marquardt(gn, theta64, max_steps=3, damping=damping)
np.testing.assert_allclose(theta_plain, theta_ours["theta"], rtol=1e-8, atol=1e-10)
gn.set_params(theta64)
print("plain_levenberg_marquardt == levenberg_marquardt, 3 steps: True")

# %% [markdown]
# `levenberg_marquardt` adds a record of each step (`history`, the counts
# SciPy reports), `scaling="identity"` (Levenberg's $\lambda I$),
# `solver="cg"` (conjugate gradients on products with J, no $J^\top J$:
# notebook 09), Cholesky for the solve, and a step it cannot factor
# treated as a rejected one:

# %%
ju.teaching.notebook.show_source(ju.levenberg_marquardt,
                                 plain=plain_levenberg_marquardt)

# %% [markdown]
# Two more exercises, on the normal equations.
#
# **2.** Adam minimises the mean squared error,
# $\mathrm{MSE} = \lVert r \rVert^2/(n·l)$. Write its gradient in terms of
# $J$ and $r$, compute it from `normal_equations` of the float64 network
# `model64` on the first 50 samples (`x[:50]`, `y[:50]`), and check it
# against `tape.gradient` of the same loss. `answer`: the gradient, shape
# `(m,)`.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: d/dtheta |r|^2 = 2 J^T r, and the mean divides by n*l. Jtr from
# the chunks, scaled; the tape differentiates the mean itself.
x_ex, y_ex = x[:50].astype("float64"), y[:50]
n_ex = len(x_ex)
ex = ju.least_squares_problem(model64, x_ex, y_ex, chunk_size=16)
_, Jtr_ex = ex.normal_equations(theta64)
answer = 2 * Jtr_ex / (n_ex * l)
with tf.GradientTape() as tape:
    mse = tf.reduce_mean((model64(x_ex) - y_ex) ** 2)
grads = tape.gradient(mse, model64.trainable_variables)
grad_tape = np.concatenate([g.numpy().ravel() for g in grads])
np.testing.assert_allclose(answer, grad_tape, rtol=1e-8, atol=1e-12)
print("2 J.T r / (n l) == tape.gradient of the MSE: True")

# %%
check.exercise("05-2", answer, model=model64, x=x[:50], y=y[:50])

# %% [markdown]
# **3.** Repeat the Gauss–Newton step of above (its `JtJ` and `Jtr`) with
# damping $\lambda$ of $10^{-4}$, $10^{-2}$ and $100$. How do the length of
# the step and the MSE after it change, and why is a large $\lambda$ like a
# small gradient-descent step? `answer`: the three step lengths
# $\lVert\delta\rVert$, in that order.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: a large damping shrinks the step towards -Jtr / lambda, a short
# step downhill; a tiny damping trusts the linear model of r far away.
answer = []
for lam in (1e-4, 1e-2, 100.0):
    delta = np.linalg.solve(JtJ + lam * np.eye(m), -Jtr)
    answer.append(np.linalg.norm(delta))
    print(f"lambda {lam:g}: step length {answer[-1]:.2f}, "
          f"MSE after {np.mean(gn.fun(theta64 + delta) ** 2):.4f}")
gn.set_params(theta64)

# %%
check.exercise("05-3", answer, JtJ=JtJ, Jtr=Jtr)

# %% [markdown]
# ## Keypoints
#
# - `least_squares_problem(model, x, y)` gives SciPy `fun`, `jac` and
#   `theta0` in float64; its `jac` reuses one compiled Jacobian and never
#   retraces. <!-- claim: jac-never-retraces -->
# - `least_squares(problem.fun, theta0, jac=problem.jac, method="trf")`
#   lowers the model's MSE; write the solution back with
#   `set_params(result.x)`. <!-- claim: trf-lowers-the-mse -->
# - SciPy's Jacobian is `J.reshape(n*l, m)`: row `i*l + k`. The layout
#   question's `(l·m) × n` is `to_lm_by_n(J)`: the same numbers, in another
#   order.
# - An MSE below the noise floor of the data (`noise**2` here), on the data
#   the model learnt from, means it has learnt the noise too.
# - Going further: with thousands of parameters the optimizer's own dense
#   algebra, not the Jacobian, is the cost of Levenberg–Marquardt: SciPy's
#   `"lm"` factorises the whole `(n·l) × m` matrix on one core;
#   `levenberg_marquardt` solves the damped normal equations
#   ($m \times m$, summed from chunks) with BLAS; `"trf"` with
#   `tr_solver="lsmr"` needs only products with J. <!-- claim: algebra-not-jacobian -->
# - Going further: a derivative computed outside TensorFlow joins the
#   Jacobian by one product, `einsum("ik,ikp->p", G, J)`; `JᵀJ` and `Jᵀr`
#   add up over chunks, so a Gauss–Newton step never needs the whole J in
#   memory.
