# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Matrix-free: when J does not fit
#
# **Questions**
# - When should I not form the Jacobian at all?
# - How does SciPy fit a model with only products `J @ v` and `J.T @ u`?
# - When is forward mode the faster way to get J, and how do I get
#   per-sample gradients of a loss cheaply?
# - How do per-sample gradient norms train a model with differential
#   privacy, and what does the privacy cost in accuracy and time?
#
# **Objectives**
# - Compute `J @ v` (forward mode) and `J.T @ u` (reverse mode) without J,
#   and prove them equal to products with the formed J.
# - Fit a network of about half a million parameters with
#   `least_squares(..., tr_solver="lsmr")` through a `LinearOperator`, and
#   measure its memory against what J would need.
# - Compare forward and reverse mode for the whole J as m and l vary.
# - Compute per-sample gradients of a loss and their norms.
# - Train a classifier by DP-SGD with ghost clipping, prove its step equal to
#   clipping each sample's gradient, then train it privately with plain
#   `model.fit` after `make_private` for three target ε, and plot accuracy
#   against the privacy spent.
# - Audit a private run in the same run: measure a lower bound on its ε with
#   canaries, and see it catch a run whose noise is off.
#
# *Teaching: 88 min · Exercises: 35 min*

# %% [markdown]
# ## Setup

# %%
import inspect
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np

import jacutil as ju
from jacutil import keras, tf
from jacutil.teaching import check, wide_fit
from jacutil.teaching.claims import claim

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_samples = 1000  # samples in the wide fit
width = 512  # units of each hidden layer of the wide network
depth = 3  # hidden layers of the wide network
max_nfev = 6  # least_squares evaluations (trust-region steps)
lsmr_iterations = 10  # lsmr iterations per step, each a matvec + rmatvec
lm_steps = 6  # Levenberg-Marquardt trial steps of the KFAC-preconditioned fit
cg_iterations = 3  # its conjugate-gradient iterations per step
n_check = 5  # samples in the correctness checks
crossover_outputs = [4, 1024]  # l for the forward / reverse comparison
crossover_hidden = [2, 32]  # hidden units (5 parameters each)
n_cross = 300  # samples in that comparison
dp_samples = 1000  # training samples of the DP-SGD classifier
dp_epochs = 2  # its epochs, plain and private
dp_budgets = [0.5, 2.0, 8.0]  # target epsilons, one private fit each
audit_canaries = 1000  # canaries of the one-run privacy audit
audit_width = 256  # hidden units of the audited network
audit_epochs = 2  # its epochs
seed = 0

# %% [markdown]
# ## The size of J
#
# The question's network made wide, 10 → 512 → 512 → 512 → 2, has about half
# a million parameters. Its Jacobian on `n_samples` samples, in the float64
# that SciPy works in, is n·l × m numbers:

# %%
wide = ju.question_mlp(hidden=(width,) * depth, seed=seed)
m_wide = ju.flat_params(wide).size
rows = n_samples * 2
print(f"m = {m_wide:,} parameters; J: {rows:,} x {m_wide:,} float64 = "
      f"{rows * m_wide * 8 / 2**30:,.1f} GiB")

# %% [markdown]
# A trust-region or Gauss-Newton step never needs J itself, only products
# with it: the Jacobian-vector product (JVP) `J @ v`, how the outputs move
# along a parameter direction v, and the vector-Jacobian product (VJP)
# `J.T @ u`, the gradient of `u · f`. Each costs a pass or two over the
# batch, forward and backward (the fit below measures a pair).

# %% [markdown]
# ## Products without J
#
# Forward mode pushes a *tangent* - the direction v, carried beside every
# value - through the network (`tf.autodiff.ForwardAccumulator`); reverse
# mode is one `tape.gradient` with `output_gradients=u`. In plain
# TensorFlow:

# %% tags=["plain-version"]
def plain_jvp(model, x, v):
    """J @ v, (n, l): one forward pass carrying the tangent v, split per variable."""
    variables = [w.value for w in model.trainable_variables]  # TensorFlow's own
    pieces = np.split(v, np.cumsum([int(np.prod(w.shape)) for w in variables])[:-1])
    tangents = [tf.constant(t.reshape(w.shape), w.dtype)
                for t, w in zip(pieces, variables, strict=True)]
    with tf.autodiff.ForwardAccumulator(variables, tangents) as forward:
        y = model(x)
    return forward.jvp(y).numpy()


def plain_vjp(model, x, u):
    """J.T @ u, (m,): one backward pass started from u."""
    with tf.GradientTape() as tape:
        y = model(x)
    grads = tape.gradient(y, model.trainable_variables, output_gradients=u)
    return np.concatenate([g.numpy().ravel() for g in grads])


# %% [markdown]
# `jacutil`'s products are these, for one chunk of samples, compiled once
# per chunk shape (`_traced`), with any inputs and outputs, zeros for an
# output that does not move (`or_zeros`), and a refusal where forward mode
# would miss a layer's read of its weights (`refuse_hidden_reads`); `jvp`
# and `vjp` run them chunk by chunk:

# %%
ju.teaching.notebook.show_source(ju.matrix_free.products.Products.forward_chunk,
                                 plain=plain_jvp)
ju.teaching.notebook.show_source(ju.matrix_free.products.Products.reverse_chunk,
                                 plain=plain_vjp)

# %% [markdown]
# Proved on a small network against the formed J, in float64; then the same
# products wrapped as a SciPy `LinearOperator` (rows sample-major, as the
# SciPy bridge of notebook 05), its transpose and `matmat` included:

# %%
small = ju.question_mlp(hidden=(8, 6), seed=seed, dtype="float64")
x_small, y_small = ju.regression_data(n_check, seed=seed)
J = ju.per_sample_jacobian(small, x_small)
n, l, m = J.shape
rng = np.random.default_rng(seed)
v, u = rng.standard_normal(m), rng.standard_normal((n, l))
np.testing.assert_allclose(ju.jvp(small, x_small, v), J @ v, rtol=1e-10)
np.testing.assert_allclose(ju.vjp(small, x_small, u),
                           np.einsum("ik,ikp->p", u, J), rtol=1e-10)
np.testing.assert_allclose(plain_jvp(small, x_small, v), J @ v, rtol=1e-10)
np.testing.assert_allclose(plain_vjp(small, x_small, u),
                           np.einsum("ik,ikp->p", u, J), rtol=1e-10)
print("plain_jvp and plain_vjp == jvp and vjp == the formed J: True")
A = ju.jacobian_operator(small, x_small)
rows_J = J.reshape(n * l, m)
V = rng.standard_normal((m, 3))
np.testing.assert_allclose(A @ v, rows_J @ v, rtol=1e-10)
np.testing.assert_allclose(A.T @ u.ravel(), rows_J.T @ u.ravel(), rtol=1e-10)
np.testing.assert_allclose(A @ V, rows_J @ V, rtol=1e-10)
print("operator", A.shape, "== formed J: matvec, rmatvec, matmat: True")

# %% [markdown]
# ## Fitting half a million parameters
#
# `least_squares_problem(model, x, y, jacobian="operator")` returns the
# operator from `jac`; SciPy's trust-region method solves each step with
# `lsmr` - an iterative least-squares solver that touches J only through
# products (notebook 05) - using at most `lsmr_iterations` pairs of
# products per step.
#
# A second fit sharpens each step. `levenberg_marquardt` (notebook 05) with
# `solver="cg"` solves its damped system `(JᵀJ + λI) step = -Jᵀr` by
# *conjugate gradients* (CG): each iteration is one `J.T @ (J @ v)`, two
# products. Few iterations get close only when the system is well
# conditioned, so CG is *preconditioned*: each iteration also applies a
# cheap approximate inverse of the system. `preconditioner="kfac"` takes
# it from KFAC (Kronecker-factored curvature, notebook 11 in full): each
# Dense layer's block of JᵀJ approximated by the Kronecker product of two
# small matrices, the covariance of the layer's inputs and that of the
# signals flowing back into it, whose damped inverse costs a few small
# matrix products. It is computed once per step; `cg_iterations` of CG then
# refine the step.
#
# The fits run in a fresh process (so that the memory measured is their
# own), and then Adam runs from the same start for as long as the longer of
# the two. Every clock starts after the fit's first, compiling call. The
# cell's last line says how long it ran on this machine.

# %% tags=["nbval-ignore-output"]
fit_started = time.perf_counter()
fit = wide_fit.run_in_fresh_process(
    n_samples=n_samples, width=width, depth=depth, max_nfev=max_nfev,
    lsmr_iterations=lsmr_iterations, lm_steps=lm_steps,
    cg_iterations=cg_iterations, seed=seed)
lsmr, adam = np.array(fit["lsmr"]), np.array(fit["adam"])
lm = np.array(fit["lm_kfac"])
print(f"m = {fit['n_params']:,}: J would need "
      f"{fit['jacobian_bytes_float64'] / 2**30:,.1f} GiB in float64")
fit_mib = fit["fit_peak_bytes"] / 2**20
j_mib = fit["jacobian_bytes_float64"] / 2**20
print(f"the fit's peak memory: {fit_mib:,.0f} MiB above the level before it "
      f"(the whole process {fit['process_peak_bytes'] / 2**20:,.0f} MiB): "
      + (f"{j_mib / max(fit_mib, 1):,.0f}x less than J alone would take"
         if fit_mib < j_mib else "at this small size no less than J's "
         f"{j_mib:,.1f} MiB: the passes' own buffers outweigh J"))
print(f"one matvec + rmatvec: {1e3 * fit['pair_seconds']:.0f} ms = "
      f"{fit['pair_seconds'] / fit['forward_seconds']:.1f} forward passes "
      f"({1e3 * fit['forward_seconds']:.0f} ms)")
print(f"least_squares (lsmr): MSE {lsmr[:, 1].min():.2e} after "
      f"{lsmr[-1, 0]:.1f} s; levenberg_marquardt, CG + KFAC: MSE "
      f"{lm[-1, 1]:.2e} after {lm[-1, 0]:.1f} s; Adam: MSE {adam[-1, 1]:.2e} "
      f"after {adam[-1, 0]:.1f} s ({len(adam)} steps)")
print(f"this cell ran {time.perf_counter() - fit_started:.0f} s: starting "
      "the process, the two fits, then Adam for as long as the longer")

# %% tags=["nbval-ignore-output"]
curves = {"least_squares, tr_solver='lsmr'": lsmr,
          "levenberg_marquardt, CG + KFAC": lm, "Adam, full batch": adam}
fig, ax = plt.subplots(figsize=(7, 3.5))
for label, curve in curves.items():
    ax.semilogy(curve[:, 0], np.minimum.accumulate(curve[:, 1]),
                "-" if label.startswith("Adam") else "o-", label=label)
ax.set_xlabel("seconds")
ax.set_ylabel("training MSE (best so far)")
ax.set_title(f"{fit['n_params']:,} parameters, {fit['n_samples']:,} samples")
ax.legend()
fig.tight_layout()
same = max(lm[:, 1].min(), adam[:, 1].min())  # a level both reached
seconds_to = {label: curve[np.argmax(curve[:, 1] <= same), 0]
              for label, curve in curves.items() if curve[:, 1].min() <= same}
first = min(seconds_to, key=seconds_to.get)
print(f"Finding: to the MSE both reached, {same:.2e}: " + ", ".join(
    f"{label} {t:.1f} s" for label, t in seconds_to.items())
    + f"; {first} first")

# %% [markdown]
# Read the memory line above: the fit holds a few forward and backward
# passes, never J. The Finding line compares the fits at equal loss: the
# seconds each took to reach the lowest MSE that both the KFAC fit and Adam
# reached, and which got there first on this machine. Least squares' steps
# each come from a few unpreconditioned products; KFAC's preconditioner is
# meant to let a few CG iterations a step do more. Who wins depends on the
# problem: `make bench` races the same fits, plain CG and G's diagonal as
# preconditioner included, on this network and on the question's network
# at 10,000 samples, and prints who wins where.
# A training MSE below the noise in `y` (standard deviation 0.05, so
# 0.0025) means the network has fitted the noise: the race measures the
# optimizers, not how well the network generalizes. Exercise 1 compares
# least squares and Adam at equal loss and tries another budget.

# %% [markdown]
# ## Forward mode for the whole J
#
# Reverse mode builds J a row at a time (one backward pass per output and
# sample); forward mode a column at a time (one JVP per parameter, every
# sample's column at once): `forward_jacobian`. Counting passes, forward
# mode should pay off when there are fewer parameters than outputs; the
# timings below test that. A tanh layer of h
# units (its m = 5h parameters are the columns) feeds a frozen Dense layer of
# l outputs. In plain TensorFlow, one JVP per unit vector:

# %% tags=["plain-version"]
def plain_forward_jacobian(model, x):
    """J, (n, l, m), a column at a time: the JVP along each unit vector."""
    m = sum(int(np.prod(w.shape)) for w in model.trainable_variables)
    return np.stack([plain_jvp(model, x, e) for e in np.eye(m)], axis=-1)


# %% [markdown]
# `jacutil`'s `forward_jacobian` compiles `jvp_columns`, which takes many
# unit vectors in one pass (`tf.vectorized_map` over the tangents), with
# recurrent layers unrolled as in 08:

# %%
ju.teaching.notebook.show_source(ju.matrix_free.forward.ForwardJacobian.jvp_columns,
                                 plain=plain_forward_jacobian)

# %%
tiny = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                         keras.layers.Dense(3, trainable=False)])
x_tiny = np.random.default_rng(seed).standard_normal((n_check, 4)).astype("float32")
np.testing.assert_allclose(plain_forward_jacobian(tiny, x_tiny),
                           ju.forward_jacobian(tiny)(x_tiny), rtol=1e-5, atol=1e-6)
print("plain_forward_jacobian == forward_jacobian: True")

# %% tags=["nbval-ignore-output"]
x_cross = np.random.default_rng(seed).standard_normal((n_cross, 4))
x_cross = x_cross.astype("float32")
timings = {}
for l_out in crossover_outputs:
    for hidden in crossover_hidden:
        net = keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(hidden, activation="tanh"),
            keras.layers.Dense(l_out, trainable=False)])
        fwd = ju.forward_jacobian(net)
        np.testing.assert_allclose(fwd(x_cross[:n_check]),
                                   ju.jacobian(net, x_cross[:n_check]),
                                   rtol=1e-4, atol=1e-5)
        rules = ju.compiled_jacobian(net, method="rules")
        paths = {"forward_jacobian": fwd,
                 "layer rules": lambda x, rules=rules: rules(x, copy=False),
                 "compiled_jacobian": ju.compiled_jacobian(net)}
        timings[l_out, 5 * hidden] = {
            name: ju.time_call(jac, x_cross, repeats=3).median
            for name, jac in paths.items()}
for (l_out, m_cols), row in timings.items():
    best = min(row, key=row.get)
    print(f"l = {l_out:4d}, m = {m_cols:4d}: " + ", ".join(
        f"{name} {1e3 * s:6.1f} ms" for name, s in row.items())
        + f"  -> {best}")

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(7, 3.5))
for l_out in crossover_outputs:
    ms = [m_cols for (ll, m_cols) in timings if ll == l_out]
    ratio = [timings[l_out, m_cols]["forward_jacobian"]
             / min(t for k, t in timings[l_out, m_cols].items()
                   if k != "forward_jacobian")
             for m_cols in ms]
    ax.plot(ms, ratio, "o-", label=f"l = {l_out}")
ax.axhline(1, color="black", lw=0.8)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("m (parameters)")
ax.set_ylabel("forward time / best reverse time")
ax.set_title("below 1: forward mode wins")
ax.legend()
fig.tight_layout()
wins = [(l_out, m_cols) for (l_out, m_cols), row in timings.items()
        if min(row, key=row.get) == "forward_jacobian"]
beats_rules = [f"l = {l_out}, m = {m_cols}"
               for (l_out, m_cols), row in timings.items()
               if row["forward_jacobian"] < row["layer rules"]]
print("Finding: forward time over the best reverse-mode time against m, "
      "one line per l; " + (
          "forward mode was fastest at " + "; ".join(
              f"l = {a}, m = {b} (l = {a / b:.0f} m)" for a, b in wins)
          if wins else "forward mode was fastest at none of these sizes, "
          "not even where the outputs outnumber the parameters")
      + f"; it beat the layer rules at {'; '.join(beats_rules) or 'none'}")
m_most = 5 * max(crossover_hidden)
ratios = {l_out: timings[l_out, m_most]["forward_jacobian"]
          / timings[l_out, m_most]["layer rules"] for l_out in crossover_outputs}
claim("forward-slower-at-large-m", min(ratios.values()) > 1,
      f"with m = {m_most} parameters forward mode took " + ", ".join(
          f"{r:.1f}x the layer rules' time at l = {a}"
          for a, r in ratios.items()))

# %% [markdown]
# Each line is one l; points below 1 are where forward mode won. Forward
# mode's time grows with m, one JVP per column, and the claim above shows
# it losing wherever m is large, even with more outputs than parameters:
# the reverse-mode paths vectorize over samples and outputs, and the layer
# rules start each row from the output's identity without a pass. The
# Finding line says where, if anywhere, forward mode won on this machine
# (timings this close change from run to run). So `ju.jacobian` takes
# forward mode only when l is many times m (the threshold,
# `FORWARD_WHEN_OUTPUTS_PER_PARAMETER` in `jacutil.auto`, is printed
# below), and says so. It is the tool for a model with a handful of
# parameters and long outputs, such as a physical model fitted to a signal.
#
# What the choice weighs: `ju.jacobian` times nothing. It compares l with
# m against that fixed threshold, and below it takes the layer rules for
# any Keras chain they can read; the per-sample stage (`compiled_jacobian`'s
# default method, printed below) only for models the rules cannot read. So
# its choice is a cost rule, not a race, and need not be the fastest path.
# The cells below check the rule and put the time of the path it takes
# beside the others, from the table above:

# %%
threshold = ju.auto.FORWARD_WHEN_OUTPUTS_PER_PARAMETER
print(f"ju.jacobian takes forward mode when l >= {threshold} m; "
      "compiled_jacobian's default method: "
      + repr(inspect.signature(ju.compiled_jacobian).parameters["method"].default))
taken_at = {}
for l_out in crossover_outputs:
    net = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(min(crossover_hidden), activation="tanh"),
        keras.layers.Dense(l_out, trainable=False)])
    _, choice = ju.jacobian(net, x_cross[:n_check], explain=True)
    taken_at[l_out, 5 * min(crossover_hidden)] = choice.path
for (l_out, m_cols), path in taken_at.items():
    print(f"l = {l_out}, m = {m_cols}: ju.jacobian takes {path}")
claim("jacobian-cost-rule", all(
    (path == "forward mode") == (l_out >= threshold * m_cols)
    for (l_out, m_cols), path in taken_at.items()),
    f"ju.jacobian took forward mode exactly where l >= {threshold} m")

# %% tags=["nbval-ignore-output"]
for (l_out, m_cols), path in taken_at.items():
    row = timings[l_out, m_cols]
    taken = {"forward mode": "forward_jacobian",
             "layer rules": "layer rules"}.get(path, "compiled_jacobian")
    fastest = min(row, key=row.get)
    print(f"l = {l_out}, m = {m_cols}: ju.jacobian's path ({taken}) took "
          f"{row[taken] / row[fastest]:.2f}x the time of the fastest in this "
          f"run ({fastest}): " + ("it was the fastest" if taken == fastest
                                   else "a cost rule, not the fastest here"))

# %% [markdown]
# ## Per-sample gradients of a loss
#
# Differential-privacy clipping and influence estimates need each sample's
# own gradient, `d loss_i / d theta`: the rows of J weighted by
# `d loss_i / d f`. On the layer-rules path the backward pass simply starts
# from that weight instead of the identity, and for a chain of Dense layers
# the norms do not even need the gradients (`|a|² |δ|²` per layer):

# %%
loss = keras.losses.mean_squared_error  # one loss per sample
G = ju.per_sample_gradients(small, loss, x_small, y_small)
norms = ju.per_sample_gradient_norms(small, loss, x_small, y_small)
np.testing.assert_allclose(norms, np.linalg.norm(G, axis=1), rtol=1e-10)
mean_gradient = G.mean(axis=0)
with ju.tf.GradientTape() as tape:
    batch_loss = ju.tf.reduce_mean(
        loss(y_small.astype("float64"), small(x_small)))
full = np.concatenate([np.ravel(g) for g in tape.gradient(
    batch_loss, small.trainable_variables)])
np.testing.assert_allclose(mean_gradient, full, rtol=1e-10)
print("per-sample gradients", G.shape,
      "- their mean is the batch gradient: True")
print("norms without the gradients == norms of the gradients: True")

# %% [markdown]
# ## Private training: DP-SGD from the norms
#
# Differentially private SGD (DP-SGD) trains a model that reveals little
# about any one of its training samples. Its terms, one at a time:
#
# - **Clipping and noise.** Each step clips every sample's gradient to norm
#   at most C, sums them, adds Gaussian noise of standard deviation σC to
#   every coordinate, and divides by the batch size. σ is the *noise
#   multiplier*. Why: clipping bounds how far one sample can move the model,
#   and the noise hides whether that sample was there at all.
# - **(ε, δ)**, the privacy spent. Training with or without any one sample
#   changes the probability of any outcome by at most a factor e^ε, except
#   with a small probability δ (kept far below 1/n). Smaller ε is more
#   private. Why: it is the promise made to the people in the data, so it
#   is what you choose, and σ follows from it.
# - **An accountant** adds up the ε that all the steps spend, from σ, the
#   sampling rate and the number of steps. Why: ε grows with every step,
#   and only the accountant knows by how much.
# - **Ghost clipping.** Clipping needs each gradient's *norm*, not the
#   gradient. With the weights wᵢ = min(1, C / ‖gᵢ‖), the gradient of
#   Σᵢ wᵢ Lᵢ is Σᵢ wᵢ gᵢ, the clipped sum: one ordinary backward pass, after
#   `per_sample_gradient_norms`. Why: n per-sample gradients take n times
#   the memory of one; their norms take n numbers.
#
# One DP-SGD step in plain TensorFlow, the slow way - a gradient per
# sample, each clipped:

# %% tags=["plain-version"]
def plain_dp_sgd_step(model, loss, optimizer, x, y, clip, sigma, rng):
    """Each sample's gradient clipped to norm clip, summed, noised, averaged."""
    clipped = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss_i = tf.reduce_sum(loss(y[i : i + 1], model(x[i : i + 1])))
        g = tape.gradient(loss_i, model.trainable_variables)
        norm = float(tf.sqrt(sum(tf.reduce_sum(t**2) for t in g)))
        clipped.append([t * min(1.0, clip / norm) for t in g])
    noisy = [sum(parts) + sigma * clip * rng.standard_normal(parts[0].shape)
             for parts in zip(*clipped, strict=True)]
    optimizer.apply_gradients(
        zip([t / len(x) for t in noisy], model.trainable_variables, strict=True))
    return model  # its variables took the step


# %% [markdown]
# `ju.DPSGD` gets the same step from the norms alone (ghost clipping, above)
# and one backward pass of the weighted loss, compiled; it adds the noise
# from its own seeded generator, divides by the batch size it was told (the
# accountant's, under Poisson sampling: below), and adds the gradient of
# any weight penalty unclipped, since no sample is in it. This is its
# compiled part, then its two halves: the clipped sum by one backward pass
# of the weighted loss, and the noise and the update:

# %%
ju.teaching.notebook.show_source(ju.DPSGD.clipped_noisy_update,
                                 plain=plain_dp_sgd_step)
ju.teaching.notebook.show_source(ju.DPSGD.clipped_sum, plain=plain_dp_sgd_step)
ju.teaching.notebook.show_source(ju.DPSGD.noisy_update, plain=plain_dp_sgd_step)

# %% [markdown]
# Proved on a copy of `small`: with no noise and `SGD(1.0)`, one DP-SGD
# step moves the parameters by exactly the mean of the per-sample gradients
# `G` from above, each clipped to C (here the median norm):

# %%
copy = keras.models.clone_model(small)
copy.set_weights(small.get_weights())
clip = float(np.median(norms))
noiseless = ju.DPSGD(copy, loss, keras.optimizers.SGD(1.0),
                     l2_norm_clip=clip, noise_multiplier=0.0)
before = ju.flat_params(copy)
noiseless.step(x_small, y_small)
clipped = np.minimum(1.0, clip / norms)[:, None] * G
np.testing.assert_allclose(before - ju.flat_params(copy),
                           clipped.mean(axis=0), rtol=1e-10, atol=1e-14)
print(f"{(norms > clip).sum()} of {len(norms)} gradients clipped; "
      "the step == the mean of the clipped gradients: True")
plain_copy = keras.models.clone_model(small)
plain_copy.set_weights(small.get_weights())
stepped = plain_dp_sgd_step(plain_copy, loss, keras.optimizers.SGD(1.0),
                            x_small, y_small.astype("float64"), clip, 0.0, rng)
np.testing.assert_allclose(ju.flat_params(stepped), ju.flat_params(copy),
                           rtol=1e-10, atol=1e-14)
print("plain_dp_sgd_step == DPSGD.step, without noise: True")

# %% [markdown]
# Now a classifier, trained the Keras way: three classes of points in ten
# dimensions (generated, seeded), first with plain `model.fit`, then
# privately. `ju.make_private(model, epsilon=..., delta=..., ...)` takes a
# compiled model and a *target* ε: it asks Google's `dp-accounting` for the
# smallest noise multiplier σ that keeps ε under the target after all the
# planned steps, prints it, and gives the model back. Then plain
# `model.fit` (with its callbacks, `validation_data`, metrics and progress
# bar) takes DP-SGD steps, each clipping every sample's gradient of the
# loss Keras itself would train on: what `compile` set (every output, its
# `loss_weights`) plus the losses layers add. `model.privacy` holds the
# run: σ, the steps, and `epsilon()`.
#
# **The seed.** By default the noise and the sampling come fresh from the
# operating system. Here `seed=seed` makes the course's run repeatable, and
# `make_private` prints what that costs: anyone who knows the seed can
# replay the noise, so such a run is not private. Leave it out for real
# data.
#
# **Poisson sampling.** Each step draws its batch by letting every sample
# join, independently, with probability batch size / n, so batches vary in
# size. Why: the accountant's ε assumes exactly this sampling (it is what
# makes a step's privacy depend on the sampling rate), so `fit` does it
# instead of shuffling. The validation data is not private and spends no
# ε: only training touches the training samples.

# %%
n_features, n_classes, batch, delta = 10, 3, 25, 1e-5
rng = np.random.default_rng(seed)
centers = 0.8 * rng.standard_normal((n_classes, n_features))
labels = rng.integers(0, n_classes, 2 * dp_samples)
points = (centers[labels]
          + rng.standard_normal((2 * dp_samples, n_features)))
points = points.astype("float32")
x_train, x_test = points[:dp_samples], points[dp_samples:]
y_train, y_test = labels[:dp_samples], labels[dp_samples:]


def cross_entropy(y, logits):  # one loss per sample
    return keras.losses.sparse_categorical_crossentropy(
        y, logits, from_logits=True)


def compiled_net():
    """A new classifier, the same start each time (the seed), compiled."""
    keras.utils.set_random_seed(seed)
    net = keras.Sequential([
        keras.Input((n_features,)), keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(n_classes)])
    net.compile(keras.optimizers.SGD(0.5), cross_entropy,
                metrics=["accuracy"])
    return net

# %% tags=["nbval-ignore-output"]
try:
    import dp_accounting  # noqa: F401
    has_accountant = True
except ImportError:  # make_private needs it: the private fits are skipped
    has_accountant = False
    print(ju.privacy.accounting.INSTALL_HINT)
plain = compiled_net().fit(x_train, y_train, epochs=dp_epochs, batch_size=batch,
                           validation_data=(x_test, y_test), verbose=0)
plain_accuracy = plain.history["val_accuracy"][-1]
print(f"plain model.fit: test accuracy {plain_accuracy:.3f}")
private = {}
for target in dp_budgets if has_accountant else []:
    model = ju.make_private(
        compiled_net(), epsilon=target, delta=delta, l2_norm_clip=1.0,
        batch_size=batch, epochs=dp_epochs, train_size=dp_samples, seed=seed)
    history = model.fit(x_train, y_train, epochs=dp_epochs,
                        validation_data=(x_test, y_test), verbose=0)
    private[target] = (model.privacy.noise_multiplier, history.history)
    print(f"  then {model.privacy.steps} steps: epsilon "
          f"{model.privacy.epsilon():.3f} <= {target:g}, test accuracy "
          f"{history.history['val_accuracy'][-1]:.3f}")
if private:
    sigmas = [private[t][0] for t in sorted(private)]
    claim("smaller-epsilon-more-noise", sigmas == sorted(sigmas, reverse=True)
          and len(set(sigmas)) == len(sigmas),
          "the smaller the target epsilon, the larger sigma: " + ", ".join(
              f"epsilon {t:g}: sigma {private[t][0]:.2f}" for t in sorted(private)))

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(6, 3.5))
spent = [private[t][1]["epsilon"][-1] for t in private]
accuracy = [private[t][1]["val_accuracy"][-1] for t in private]
ax.plot(spent, accuracy, "o-", label="make_private, then model.fit")
for t, x_at, y_at in zip(private, spent, accuracy, strict=True):
    ax.annotate(f"σ = {private[t][0]:.2f}", (x_at, y_at), ha="center",
                va="top", textcoords="offset points", xytext=(0, -8))
ax.axhline(plain_accuracy, color="black", ls="--",
           label="plain model.fit (no privacy)")
ax.set_xscale("log")
ax.set_xticks(spent, [f"{e:.2g}" for e in spent])
ax.minorticks_off()
ax.margins(x=0.15, y=0.2)
ax.set_xlabel(f"ε spent at δ = {delta:g} (smaller: more private)")
ax.set_ylabel("test accuracy")
ax.legend(loc="lower right")
fig.tight_layout()
print("Finding: test accuracy against the privacy spent; plain fit "
      f"{plain_accuracy:.3f}; private " + "; ".join(
          f"epsilon {private[t][1]['epsilon'][-1]:.2f} (sigma "
          f"{private[t][0]:.2f}): accuracy {private[t][1]['val_accuracy'][-1]:.3f}"
          for t in private))

# %% [markdown]
# `model.fit`'s History holds ε after each epoch, beside the loss and the
# metrics: the privacy spent grows with every step, and `fit` refuses to go
# past the epochs that σ was calibrated for (the guarantee would not hold).
# The steps are counted in a *ledger* kept with the model
# (`model.privacy.ledger`): a second `make_private` on the same model
# composes them with its own, and `model.save` keeps them
# (`ju.privacy.load_model` reads them back). The training loss and accuracy
# in the History are computed without noise, so they are not covered by ε
# (`report_training=False` leaves them out):

# %% tags=["nbval-ignore-output"]
for t in private:
    print(f"target {t:g}: epsilon after each epoch",
          [round(e, 3) for e in private[t][1]["epsilon"]])
if private:
    refused = False
    try:
        model.fit(x_train, y_train, epochs=1, verbose=0)
    except ValueError as error:
        refused = True
        print("one more epoch:", error)
    spent_at = {t: private[t][1]["epsilon"][-1] for t in private}
    claim("private-fit-within-target",
          refused and all(e <= t * (1 + 1e-6) for t, e in spent_at.items()),
          "every private fit spent at most its target (" + ", ".join(
              f"{e:.3f} <= {t:g}" for t, e in spent_at.items())
          + "), and one more epoch was refused")

# %% [markdown]
# Some layers cannot be trained privately at all. `BatchNormalization` in
# training normalizes each sample by its batch's statistics, so one
# sample's gradient depends on the others and clipping no longer bounds any
# sample's influence. `make_private` checks the model first and says what
# to use instead:

# %%
with_batch_norm = keras.Sequential([
    keras.Input((n_features,)), keras.layers.Dense(32),
    keras.layers.BatchNormalization(), keras.layers.Dense(n_classes)])
with_batch_norm.compile(keras.optimizers.SGD(0.5), cross_entropy)
try:
    ju.make_private(with_batch_norm, epsilon=2.0, delta=delta,
                    l2_norm_clip=1.0, batch_size=batch, epochs=dp_epochs,
                    train_size=dp_samples)
except ValueError as error:
    print(error)

# %% [markdown]
# Three more options of `make_private`, as Opacus has them:
#
# - **Per-layer clipping**: `l2_norm_clip={layer name: C_g}` clips each
#   sample's gradient *on each layer* to its own norm C_g, so that a layer
#   with large gradients does not crowd out the others. A sample's clipped
#   gradient then has norm at most √(Σ C_g²), and the noise is scaled by
#   that total.
# - **Gradient accumulation**: `max_physical_batch_size=k` computes each
#   step's clipped sum in passes of at most k rows and adds them before the
#   noise, for batches that do not fit in memory. It is the same step, not
#   an approximation: below, the weights after a fit with passes of 8 rows
#   against one pass per step, from the same seed.
# - **`secure_mode=True`** draws the sampling and the noise from
#   `os.urandom` itself, in float64 (as Opacus's secure mode), for a model
#   you release; it refuses a seed.
#
# And one that Opacus and TF Privacy also have: **adaptive clipping**,
# `target_quantile=0.5`, lets C follow the median of the per-sample norms
# (Andrew et al., 2021) by a noisy count each step; the gradient's noise
# grows a little to pay for the count, and ε stays the target.

# %% tags=["nbval-ignore-output"]
after = []
for rows in (None, 8) if has_accountant else []:
    model = compiled_net()
    per_layer = {layer.name: 0.7 for layer in model.layers}
    model = ju.make_private(
        model, epsilon=2.0, delta=delta, l2_norm_clip=per_layer,
        batch_size=batch, epochs=dp_epochs, train_size=dp_samples, seed=seed,
        max_physical_batch_size=rows)
    history = model.fit(x_train, y_train, epochs=dp_epochs,
                        validation_data=(x_test, y_test), verbose=0)
    after.append(ju.flat_params(model))
    print(f"passes of {rows or 'the whole batch'}: epsilon "
          f"{model.privacy.epsilon():.3f}, test accuracy "
          f"{history.history['val_accuracy'][-1]:.3f}")
if after:
    largest = np.abs(after[0] - after[1]).max()
    claim("accumulation-same-step", largest < 1e-5,
          "largest difference of a parameter, with and without "
          f"accumulation: {largest:.1e} (float32 rounding: the passes add "
          "the same terms in another order)")

# %% [markdown]
# A smaller target ε takes more noise (the claim under the fits); what it
# costs in accuracy on this data, the Finding under the plot says. What
# one DP step costs in time: the step `model.fit` takes after
# `make_private` (`DPSGD.sampled_step`: a Poisson-sampled batch, its
# norms, the clipping and the update in one compiled call), against a
# plain step on a batch of the same size and against the slow way,
# `plain_dp_sgd_step` (a tape per sample), all timed after a first call,
# each the fastest of its calls:

# %% tags=["nbval-ignore-output"]
x_batch, y_batch = x_train[:batch], y_train[:batch]
plain_opt = keras.optimizers.SGD(0.5)
net = compiled_net()


@ju.tf.function
def plain_step(x, y):
    with ju.tf.GradientTape() as tape:
        mean_loss = ju.tf.reduce_mean(cross_entropy(y, net(x)))
    grads = tape.gradient(mean_loss, net.trainable_variables)
    plain_opt.apply_gradients(zip(grads, net.trainable_variables, strict=True))


timer = ju.DPSGD(net, cross_entropy, keras.optimizers.SGD(0.5),
                 l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed)
# the fastest of 20 calls each: a busy machine only adds to a call's time
plain_s = min(ju.time_call(plain_step, x_batch, y_batch, repeats=20).times)
dp_s = min(ju.time_call(timer.sampled_step, x_train, y_train, batch,
                        repeats=20).times)
slow_net = compiled_net()
slow_s = ju.time_call(plain_dp_sgd_step, slow_net, cross_entropy,
                      keras.optimizers.SGD(0.5), x_batch, y_batch, 1.0, 1.0,
                      np.random.default_rng(seed), repeats=3).times
slow_s = min(slow_s)
print(f"plain step {1e3 * plain_s:.1f} ms; DP step {1e3 * dp_s:.1f} ms; "
      f"plain_dp_sgd_step {1e3 * slow_s:.1f} ms")
print(f"Finding: a DP-SGD step costs {dp_s / plain_s:.1f}x a plain step "
      f"on batches of {batch} samples (in expectation); the compiled step "
      f"traced {timer.trace_count} time(s)")
claim("ghost-step-beats-loop", dp_s < slow_s,
      f"the compiled DP step ({1e3 * dp_s:.1f} ms, norms, clipping, noise "
      f"and update) is {slow_s / dp_s:.0f}x faster than a tape per sample "
      f"({1e3 * slow_s:.1f} ms)")

# %% [markdown]
# ### Proof that the noise is real: a one-run audit
#
# ε is computed from σ, the sampling rate and the steps, so a bug that
# skipped the noise would print the same ε. An audit measures instead
# (Steinke, Nasr and Jagielski, 2023, "Privacy auditing with one (1)
# training run"):
#
# - `ju.privacy.CanaryAudit` adds 1,000 *canaries*, each kept in or out by
#   a coin flip. A canary is a per-sample gradient in a random direction,
#   longer than C. It joins each Poisson batch like a sample and goes
#   through the step's own clipping and noise.
# - After each step the audit scores every canary: how much of its
#   direction the step's update holds, less what the training data, which
#   the auditor may know, adds on average.
# - It guesses "in" for the highest scores and "out" for the lowest, and
#   counts the right guesses. Too many right guesses are impossible under
#   the claimed ε: the largest ε they rule out, at 95% confidence, is a
#   *lower bound* on the true ε.
#
# Below, a correct run of a wider network (the audit needs many
# parameters), and the same run with its noise switched off - the bug an
# audit exists to catch - while the accountant still claims the same ε.
# Read the verdicts:

# %% tags=["nbval-ignore-output"]
def audited_fit(noise=True):
    """A private fit of a wider network with a canary audit."""
    keras.utils.set_random_seed(seed)
    audited = keras.Sequential([
        keras.Input((n_features,)),
        keras.layers.Dense(audit_width, activation="tanh"),
        keras.layers.Dense(n_classes)])
    audited.compile(keras.optimizers.SGD(0.5), cross_entropy)
    with warnings.catch_warnings():  # seeded: not private, as said above
        warnings.simplefilter("ignore")
        audited = ju.make_private(
            audited, epsilon=1.0, delta=delta, l2_norm_clip=1.0,
            batch_size=batch, epochs=audit_epochs, train_size=dp_samples,
            seed=seed, verbose=False)
    if not noise:  # the bug: no noise added, the same sigma accounted
        audited.privacy.dpsgd.switch_noise_off_unaccounted()
    audit = ju.privacy.CanaryAudit(audited, x_train, y_train,
                                   canaries=audit_canaries, seed=seed)
    audited.fit(x_train, y_train, epochs=audit_epochs, verbose=0,
                callbacks=[audit])
    return audit.result()


audits = {}
if has_accountant:
    audits = {"correct run": audited_fit(),
              "noise switched off": audited_fit(noise=False)}
for name, result in audits.items():
    print(f"{name}: {result}")

# %% tags=["nbval-ignore-output"]
if audits:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3), sharey=True)
    for ax, (name, result) in zip(axes, audits.items(), strict=True):
        bins = np.linspace(result.scores.min(), result.scores.max(), 40)
        ax.hist(result.scores[result.included], bins, alpha=0.6,
                label="canaries in")
        ax.hist(result.scores[~result.included], bins, alpha=0.6,
                label="canaries out")
        ax.set_title(f"{name}: ε ≥ {result.epsilon_lower_bound:.2f} "
                     f"(claimed {result.claimed_epsilon:.2f})", fontsize=10)
        ax.set_xlabel("canary score")
    axes[0].set_ylabel("canaries")
    axes[0].legend()
    fig.tight_layout()
    # the theorem: a correct run's bound is below its claim (95% of runs;
    # this seeded run is one of them)
    claim("audit-catches-no-noise", audits["correct run"].holds
          and not audits["noise switched off"].holds,
          "the correct run's measured bound is within its claimed epsilon, "
          "the run without noise's is above it")
    print("Finding: " + "; ".join(
        f"{name}: measured epsilon >= {r.epsilon_lower_bound:.2f}, "
        f"{'within' if r.holds else 'ABOVE'} the claimed "
        f"{r.claimed_epsilon:.2f}" for name, r in audits.items()))

# %% [markdown]
# **TensorFlow Privacy.** Google's own DP-SGD library (last release 0.9.0,
# 2024) does not install next to this course's packages: it pins
# `absl-py` 1, `numpy` 1, `dp-accounting` 0.4.3 and TensorFlow Probability
# 0.22 (made for TF 2.14). Installed without its pins on TF 2.21 and
# Keras 3, `import tensorflow_privacy` fails (it imports
# `tensorflow_estimator`, gone since TF 2.16). Imported module by module,
# its privacy analysis (`compute_dp_sgd_privacy_statement`, which calls
# `dp-accounting`) runs and its `DPQuery` classes load. Its Keras side
# fails: `DPKerasSGDOptimizer` and the vectorized one subclass Keras 2's
# legacy optimizers (an `ImportError` in Keras 3), `DPSequential` reads
# Keras 2's compiled-loss internals, and its fast gradient clipping reads
# Keras 2's functional-model internals. So here the accountant is
# `dp-accounting`, the one TF Privacy uses, and the clipping is jacutil's
# norms. No release of `dp-accounting` installs with this course's lock
# file either (each pins an older `attrs` or `absl-py`), but its code runs
# with ours; `make setup` installs it into `.venv` with the command below
# (printed here; run it yourself in another environment).

# %%
print(ju.privacy.accounting.INSTALL_COMMAND)

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** Compare least squares and Adam at equal loss instead of equal time: how many
# seconds did Adam take to reach the lowest MSE that least squares reached?
# `fit["lsmr"]` (one entry per evaluation) and `fit["adam"]` (one per step)
# are lists of `(seconds, MSE)` pairs. Put the seconds in `answer`
# (`np.inf` if Adam never got that low). Then give each trust-region step
# more products - `lsmr_iterations=40, max_nfev=4` - on a smaller problem
# to keep it quick (`width=128` and `n_samples=500`), and compare the same
# way: does least squares now get there first?

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: the lowest MSE, not the last (a trust-region method also
# evaluates the trial steps it rejects); then the first Adam step at or
# below it. More products per step bring each step closer to the exact
# Gauss-Newton step; whether that pays depends on the problem.
def adam_seconds_to_catch_up(run):
    best = min(mse for _, mse in run["lsmr"])
    return next((t for t, mse in run["adam"] if mse <= best), np.inf)


answer = adam_seconds_to_catch_up(fit)
more = wide_fit.run_in_fresh_process(
    n_samples=min(n_samples, 500), width=min(width, 128), depth=depth,
    max_nfev=4, lsmr_iterations=40, lm_steps=0, seed=seed)
print(f"Adam caught up after {answer:.2f} s of the fit's {lsmr[-1, 0]:.1f} s; "
      f"with 40 products a step after {adam_seconds_to_catch_up(more):.2f} s "
      f"of {more['lsmr'][-1][0]:.1f} s")

# %%
check.exercise("09-1", answer, fit=fit)

# %% [markdown]
# **2.** `jvp` has a second mode, `products(model, mode="double_backward")`:
# the JVP as the gradient of a VJP with respect to its weights (reverse mode
# twice). Compute `J @ v` that way on `small`, `x_small` and the `v` of the
# proof above (`answer`, shape `(n, l)`), check that forward mode gives the
# same, and time both on the wide network's first 500 samples.

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: the same numbers; forward mode is usually cheaper (one pass
# carrying tangents against a forward and two backward passes).
answer = ju.products(small, mode="double_backward").jvp(x_small, v)
np.testing.assert_allclose(answer, ju.jvp(small, x_small, v), rtol=1e-10)
x_wide = ju.regression_data(500, seed=seed)[0]
v_wide = np.ones(m_wide)
for mode in ("forward", "double_backward"):
    prods = ju.products(wide, mode=mode)
    seconds = ju.time_call(prods.jvp, x_wide, v_wide, repeats=3).median
    print(f"{mode:<16} {1e3 * seconds:.1f} ms")

# %%
check.exercise("09-2", answer, model=small, x=x_small, v=v)

# %% [markdown]
# ## Keypoints
#
# - A trust-region or Gauss-Newton step needs products with J, not J:
#   `jvp` (forward mode) and `vjp` (reverse mode) cost a pass or two each.
# - `jacobian_operator` wraps them as a SciPy `LinearOperator`;
#   `least_squares_problem(..., jacobian="operator")` with
#   `tr_solver="lsmr"` trains a model from products alone, J never formed.
# - `levenberg_marquardt(..., solver="cg", preconditioner="kfac")` takes
#   damped Gauss-Newton steps from a few CG iterations preconditioned by
#   KFAC; read the Finding line for how it compared with Adam here.
# - `forward_jacobian` builds J a column at a time, so its time grows with
#   m: with many parameters it is slower than the layer rules even where
#   outputs outnumber parameters. `ju.jacobian` takes it only when l is
#   many times m, by a cost rule, not a race.
#   <!-- claim: forward-slower-at-large-m, jacobian-cost-rule -->
# - Per-sample gradients of a loss are J's rows weighted by `dloss/df`:
#   `per_sample_gradients`, and `per_sample_gradient_norms` for clipping.
# - DP-SGD needs only the norms: the gradient of Σᵢ wᵢ Lᵢ with
#   wᵢ = min(1, C / ‖gᵢ‖) is the clipped sum (`ju.DPSGD`).
# - `model = ju.make_private(model, epsilon=..., ...)`, then plain
#   `model.fit`: each sample's gradient of Keras's own loss clipped, σ from
#   the target ε by `dp-accounting`, ε in the History, the steps in a
#   ledger kept with the model, and a refusal for what would break the
#   guarantee (BatchNorm, a loss that couples samples, more epochs than
#   budgeted). Read the Finding line for what ε cost in accuracy here.
#   <!-- claim: private-fit-within-target, smaller-epsilon-more-noise -->
# - The noise is fresh from the operating system unless you seed it; a
#   seeded run is repeatable, and not private.
# - A one-run canary audit (`ju.privacy.CanaryAudit`) measures a lower
#   bound on ε: a correct run stays within its claim, and a run without
#   noise does not (read the audit's Finding).
#   <!-- claim: audit-catches-no-noise -->
