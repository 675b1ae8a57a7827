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
# - How do Levenberg–Marquardt (`"lm"`), trust-region (`"trf"`) and Adam
#   compare on the same start, and what does each iteration cost?
# - How do I combine the Jacobian with a derivative computed outside
#   TensorFlow, and take a Gauss–Newton step when J does not fit in memory?
#
# **Objectives**
# - Turn `(model, x, y)` into `fun`, `jac` and `theta0` with
#   `least_squares_problem`, and prove `jac` against the earlier stages.
# - Fit with `"lm"`, `"trf"` and Adam from the same weights; read loss
#   against time, `nfev` and `njev`.
# - Relate SciPy's `(n·l) × m` layout to the question's `(l·m) × n`.
# - Apply the chain rule by a matrix product, checked by finite differences.
# - Take one damped Gauss–Newton step from `JᵀJ` and `Jᵀr` summed chunk by
#   chunk, and check it against the step from the full J.
# - Fit the question's network with Levenberg–Marquardt built on those
#   chunked normal equations, where SciPy's `"lm"` is too slow.
#
# *Teaching: 25 min · Exercises: 15 min*

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

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_samples = 2000  # samples to fit: n*l = 4000 residuals
small_hidden = [16, 8]  # hidden widths of the narrow network of the race
trf_max_nfev = 20  # residual evaluations allowed to method="trf"
lm_max_nfev = 25  # residual evaluations allowed to method="lm"
lm_steps = 12  # trial steps of levenberg_marquardt (question's network)
lm_damping = 10.0  # its starting damping lambda
lsmr_maxiter = 10  # inner iterations of TRF's lsmr solver, per step
adam_epochs = 30  # passes over the data for Adam
batch_size = 64  # Adam's mini-batch
n_chain = 20  # samples in the chain-rule check (float64)
n_gn = 500  # samples in the Gauss-Newton step check
gn_chunk = 100  # samples per chunk of J in that check
seed = 0

# %%
x, y = ju.regression_data(n_samples, seed=seed)
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
# `least_squares_problem` builds the three from a model and data. `jac`
# runs `chunked_jacobian` of `04`, whose one compiled function is reused by
# every call, so nothing is retraced.

# %%
ju.teaching.notebook.show_source(ju.LeastSquaresProblem)

# %% [markdown]
# Check `jac` against the per-sample Jacobian of `02`, and `fun` against
# the model's own outputs. `fun` and `jac` run the model itself, so each
# call first writes its `theta` into the model's variables: after a call at
# another `theta` the model holds that one, and `set_params(theta0)` puts
# the start back. A solver's last call need not be at its solution, which is
# why the fits below end with `set_params(result.x)`.

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
problem.jac(theta0 + 0.01)  # note: writes theta0 + 0.01 into the model
problem.set_params(theta0)  # ... so put the start back
print("jac == per_sample_jacobian, reshaped: True")
print("traces after two calls at different theta:",
      problem.compiled.trace_count)

# %% [markdown]
# ## Three optimizers, one start
#
# We fit the data with `method="trf"`, `method="lm"` and Adam, each starting
# from the same weights. Each logs the mean squared error
# $\mathrm{MSE} = \lVert r \rVert^2 / (n·l)$ against wall-clock time: SciPy's
# at every call of `fun` (we plot the best so far: a trial step that SciPy
# rejects raises it), Adam's after every epoch. Times include each method's
# first call (tracing).
#
# `"trf"` (trust region reflective) runs with `tr_solver="lsmr"`: lsmr is an
# iterative least-squares solver that needs only products of J with vectors
# (`lsmr_maxiter` of them per step), never a factorisation of J. `"lm"` is
# Levenberg-Marquardt from MINPACK, the Fortran library SciPy wraps: it
# factorises the whole $(n·l) \times m$ matrix at every step, which costs
# about $2 n l m^2$ operations - more on that below.
#
# Each method runs to its own cap (`trf_max_nfev`, `lm_max_nfev`, Adam's
# epochs; the parameters cell): the end of each line is what it did within
# its budget, not the best it can do. Compare the lines at the same time on
# the x axis.

# %%
COLORS = {"lm": "tab:blue", "trf": "tab:orange", "adam": "tab:green",
          "lm-jtj": "tab:purple"}
SCIPY_OPTIONS = {
    "trf": {"max_nfev": trf_max_nfev, "tr_solver": "lsmr",
            "tr_options": {"maxiter": lsmr_maxiter}},
    "lm": {"max_nfev": lm_max_nfev},
}


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


def fit_lm_jtj(problem, log):
    """jacutil's levenberg_marquardt from problem.theta0."""
    result = ju.levenberg_marquardt(problem, max_steps=lm_steps,
                                    damping=lm_damping)
    log.extend(map(tuple, result["history"][1:]))
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
# ### The question's network: 10 → 64 → 32 → 2
#
# With the $m$ parameters of this network, one MINPACK step factorises the
# whole $(n·l) \times m$ matrix: the $2 n l m^2$ operations printed at the
# start, run as plain loops on one core - far more than the Jacobian itself
# (below, `J.T @ J`, work of the same order done by a fast BLAS, is timed
# against the Jacobian). So on this network SciPy's `"lm"` stays out of the
# race.
#
# Levenberg–Marquardt itself does not need that factorisation.
# `levenberg_marquardt` (`"lm-jtj"` below) solves the same damped system
# from the normal equations: `normal_equations` sums the $m \times m$
# matrix $J^\top J$ and $J^\top r$ chunk by chunk, and each step is one
# Cholesky solve of size $m$, whatever $n$. A step that lowers the MSE is
# kept and the damping $\lambda$ shrinks; a step that does not is undone
# and $\lambda$ grows, re-using $J^\top J$ without a new Jacobian. The
# damping is Marquardt's: $\lambda\,\mathrm{diag}(J^\top J)$.

# %%
ju.teaching.notebook.show_source(ju.levenberg_marquardt)

# %% tags=["nbval-ignore-output"]
rows_big, curves_big, problem_big = race(model, ["lm-jtj", "trf", "adam"])
print("traces of the compiled Jacobian:", problem_big.compiled.trace_count)

# %% [markdown]
# ### A narrow network of the same shape, where LM fits
#
# With hidden widths `small_hidden` the network has far fewer parameters,
# and Levenberg–Marquardt's dense algebra is cheap again:

# %% tags=["nbval-ignore-output"]
narrow = ju.question_mlp(hidden=tuple(small_hidden), seed=seed)
rows_small, curves_small, problem_small = race(narrow, ["lm", "trf", "adam"])
print("parameters of the narrow network:", problem_small.n_params)

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for ax, curves, title in [
        (axes[0], curves_big, f"question's network, m = {m}"),
        (axes[1], curves_small,
         f"narrow network, m = {problem_small.n_params}")]:
    for method, log in curves.items():
        best = np.minimum.accumulate(log[:, 1])
        ax.semilogy(log[:, 0], best, "o-", ms=3, label=method,
                    color=COLORS[method])
    ax.axhline(0.05**2, ls="--", color="gray", label="noise in y")
    ax.set_title(title)
    ax.set_xlabel("wall-clock seconds")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
axes[0].set_ylabel("MSE (best so far)")
fig.tight_layout()

# %% tags=["nbval-ignore-output"]
print(f"{'network':<9} {'method':<6} {'nfev':>6} {'njev':>5} "
      f"{'final MSE':>10} {'seconds':>8}")
for network, rows in [("question", rows_big), ("narrow", rows_small)]:
    for method, nfev, njev, mse, seconds in rows:
        njev = "-" if njev is None else njev
        print(f"{network:<9} {method:<6} {nfev:>6} {njev:>5} {mse:>10.5f} "
              f"{seconds:>8.2f}")
for network, rows in [("question", rows_big), ("narrow", rows_small)]:
    print(f"Finding: {network} network: " + "; ".join(
        f"{method} MSE {mse:.4f} in {seconds:.1f} s"
        for method, _, _, mse, seconds in rows))

# %% [markdown]
# For SciPy's methods, `nfev` and `njev` count the calls of `fun` and `jac`.
# For Adam, `nfev` counts mini-batch gradient steps; for `lm-jtj`, `nfev` is
# its trial steps plus the start, and `njev` the times it summed the normal
# equations. Read the plot as a race to a given loss. The least-squares
# methods use the Jacobian of all residuals at every step, so each step is
# costly but goes far; Adam's steps are cheap and many. Which line is lowest
# at a given time is the answer for this run; the table above gives where
# each ended. `lm-jtj` forms and solves an $m \times m$ system at every
# step: few steps, each expensive. The dashed line is the noise in `y`
# (standard deviation 0.05): a fit below it is learning the noise.

# %% [markdown]
# ## Why LM is costly for wide networks
#
# SciPy's layout stacks the residuals: $(n·l) \times m$. MINPACK reduces
# that matrix to a triangle at every Jacobian ($\approx 2 n l m^2$
# operations) and solves for the damping with more $O(m^3)$ work. The
# Jacobian costs about $n·l$ backward passes. Compare the two on the
# question's network (the normal equations below use the same algebra):

# %% tags=["nbval-ignore-output"]
jac_time = ju.time_call(problem_big.jac, theta0, repeats=3).median
J_big = problem_big.jac(theta0)
gram_time = ju.time_call(lambda: J_big.T @ J_big, repeats=3).median
print(f"jac: {jac_time:.3f} s   J.T @ J ({J_big.shape[0]} x {m}): "
      f"{gram_time:.3f} s")
print(f"Finding: at m = {m}, J.T @ J alone costs {gram_time / jac_time:.1f}x "
      "the Jacobian; LM's factorisation costs more")

# %% [markdown]
# Our `levenberg_marquardt` does work of the same order, about $n l m^2$
# for $J^\top J$, but as one matrix product per chunk, which BLAS runs
# blocked and on every core, plus one $m \times m$ Cholesky ($m^3/3$) per
# trial step. MINPACK's QR of the whole $(n·l) \times m$ matrix runs as
# plain column-by-column loops on one core. The price of the normal
# equations is precision: they square J's condition number, which float64
# and the damping absorb here.

# %% [markdown]
# ## The layout of the source question
#
# The source question wanted an $(l·m) \times n$ matrix: one **column** per
# sample, row `k*m + p`. SciPy wants $(n·l) \times m$: one **row** per
# residual. Same numbers, different order. `to_lm_by_n` makes the question's
# layout from the `(n, l, m)` array, which is SciPy's matrix reshaped:

# %%
J3 = J0.reshape(n, l, m)  # SciPy's matrix as (n, l, m): a view, no copy
M = ju.to_lm_by_n(J3)
print("SciPy:", J0.shape, "  (n, l, m):", J3.shape, "  question:", M.shape)
rng = np.random.default_rng(seed)
i, k, p = rng.integers(n), rng.integers(l), rng.integers(m)
print("M[k*m + p, i] == jac[i*l + k, p]:",
      M[k * m + p, i] == J0[i * l + k, p])

# %% [markdown]
# The gradient of SciPy's cost $\tfrac12\lVert r\rVert^2$ is $J^\top r$ in
# SciPy's layout. In the question's layout the same sum runs over columns,
# one block of $m$ rows per output:

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
# Summing pays only when the residuals outnumber the parameters,
# $n·l > m$: below that, $J^\top J$ is larger than J itself. This check is
# small, so compare the sizes printed below and then the last line, which
# gives J at $n$ = 100,000, where the sums save almost everything.

# %%
ju.teaching.notebook.show_source(ju.LeastSquaresProblem.normal_equations)

# %%
damping = 1.0
gn = ju.least_squares_problem(model64, x[:n_gn].astype("float64"),
                              y[:n_gn], chunk_size=gn_chunk)
JtJ, Jtr = gn.normal_equations(theta64)
step_chunked = np.linalg.solve(JtJ + damping * np.eye(m), -Jtr)

J_full, r_full = gn.jac(theta64), gn.fun(theta64)
n_res = J_full.shape[0]
step_full = -J_full.T @ np.linalg.solve(
    J_full @ J_full.T + damping * np.eye(n_res), r_full)
np.testing.assert_allclose(step_chunked, step_full, rtol=1e-6, atol=1e-9)
print(f"{int(np.ceil(n_gn / gn_chunk))} chunks of {gn_chunk} samples; "
      "step from chunks == step from full J: True")
print(f"J held: one chunk, {gn_chunk * l * m * 8 / 2**20:.1f} MiB, instead "
      f"of {n_res * m * 8 / 2**20:.1f} MiB; JtJ: {m * m * 8 / 2**20:.1f} MiB")
print(f"at n = 100,000 the whole J would need "
      f"{100_000 * l * m * 8 / 2**30:.1f} GiB; JtJ stays the same size")

before = np.mean(gn.fun(theta64) ** 2)
after = np.mean(gn.fun(theta64 + step_chunked) ** 2)
print(f"MSE before the step {before:.4f}, after {after:.4f}")
gn.set_params(theta64)

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** Fit the narrow network to only a few samples, so that there are
# fewer residuals than parameters ($n·l < m$), with `method="lm"`. What does
# SciPy say? Which method of `least_squares` still works? Put its name in
# `answer` (a string, as you would pass it to `method=`).

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: MINPACK's LM refuses an underdetermined problem; "trf" (and
# "dogbox") accept it - with more parameters than residuals they can fit
# the data exactly.
tiny = ju.question_mlp(hidden=tuple(small_hidden), seed=seed)
n_few = ju.flat_params(tiny).size // (2 * l)
few = ju.least_squares_problem(tiny, x[:n_few], y[:n_few])
print("residuals:", n_few * l, " parameters:", few.n_params)
try:
    least_squares(few.fun, few.theta0, jac=few.jac, method="lm")
except ValueError as error:
    print("lm:", error)
fit = least_squares(few.fun, few.theta0, jac=few.jac, method="trf",
                    max_nfev=5)
print("trf runs, status:", fit.status)
answer = "trf"

# %%
check.exercise("05-1", answer)

# %% [markdown]
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
#   retraces. Write the solution back with `set_params(result.x)`.
# - SciPy's Jacobian is `J.reshape(n*l, m)`: row `i*l + k`. The source
#   question's `(l·m) × n` is `to_lm_by_n(J)`: the same numbers, transposed.
# - A derivative computed outside TensorFlow joins the Jacobian by one
#   product: `einsum("ik,ikp->p", G, J)`.
# - `JᵀJ` and `Jᵀr` add up over chunks, so a Gauss–Newton step never needs
#   the whole J in memory.
# - With thousands of parameters the optimizer's own dense algebra, not the
#   Jacobian, is the cost of SciPy's `"lm"`: use `"trf"` with
#   `tr_solver="lsmr"`, or `levenberg_marquardt`, which solves the damped
#   normal equations ($m \times m$, from chunks) instead.
