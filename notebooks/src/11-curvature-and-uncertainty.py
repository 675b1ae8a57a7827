# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · Curvature, the NTK and uncertainty from the same pieces
#
# **Questions**
# - What else are per-sample Jacobians for, once a model is fitted?
# - How do I multiply by the Gauss–Newton matrix, or take its diagonal,
#   without forming it - or J?
# - What is the empirical neural tangent kernel, and does training change it?
# - How do I put error bars on a Keras model's predictions?
#
# **Objectives**
# - Multiply by `G = Σᵢ Jᵢᵀ Hᵢ Jᵢ` with a JVP, the loss's `H` and a VJP,
#   and prove it equal to the formed `JᵀHJ`.
# - Compare G's exact diagonal and its KFAC approximation with the exact G
#   on a small network, in a heat map.
# - Compute the empirical NTK of the question's network before and after
#   training, and its spectrum.
# - Fit Laplace posteriors (last layer, diagonal, KFAC), choose their prior
#   by the marginal likelihood, and plot predictive bands for a regression
#   and a two-class problem.
#
# *Teaching: 51 min · Exercises: 18 min*

# %% [markdown]
# ## Setup

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import SymLogNorm

import jacutil as ju
from jacutil import keras, tf
from jacutil.curvature import diagonal, ggn, hessian, kfac, laplace, ntk, spectra
from jacutil.curvature.losses import output_loss
from jacutil.teaching import check
from jacutil.teaching.claims import claim

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_check = 6  # samples in the proofs against the formed J
n_heat = 200  # samples of the small classifier in the heat map
n_ntk = 100  # samples of the question's network in its NTK
train_epochs = 150  # Adam epochs of the question's network
n_regression = 60  # samples of the 1-D regression
n_classes = 200  # samples of the two-class problem
fit_epochs = 600  # Adam epochs of the two small models fitted for Laplace
n_probes = 100  # Hutchinson's random sign vectors
seed = 0

# %% [markdown]
# ## The pieces, and the loss between them
#
# Every tool of this notebook is built from three per-sample pieces: the
# outputs `fᵢ` (l numbers), the Jacobian `Jᵢ` (l × m), and `Hᵢ`, the
# Hessian of sample i's loss with respect to its outputs (l × l). For the
# squared error `½‖f − y‖²`, `H = I`; for softmax cross-entropy on logits,
# `H = diag(p) − p pᵀ` with `p = softmax(f)`. The Gauss–Newton matrix of
# the summed loss is
#
# `G = Σᵢ Jᵢᵀ Hᵢ Jᵢ`  (m × m),
#
# the curvature that Gauss–Newton steps (notebook 05), natural gradient
# and the Laplace approximation below use. For these losses G equals the
# *Fisher information*, the expected curvature of the log-likelihood under
# the model's own predictions: code written with "the Fisher" (natural
# gradient, many Laplace libraries) means this same matrix here. A cross-entropy's curvature is taken at the *logits*, so the
# model must end without a softmax: `output_loss` refuses one that does,
# with that advice.

# %%
keras.utils.set_random_seed(seed)
small = keras.Sequential([
    keras.Input((4,), dtype="float64"),
    keras.layers.Dense(6, activation="tanh", dtype="float64"),
    keras.layers.Dense(3, dtype="float64"),  # logits of 3 classes
])
rng = np.random.default_rng(seed)
x_check = rng.standard_normal((n_check, 4))
loss = output_loss("softmax_cross_entropy", small)
f = np.asarray(small(x_check))
H = loss.hessian(f)
print(f"m = {ju.flat_params(small).size} parameters, l = {f.shape[1]} logits")
print("H of sample 0 (diag(p) - p p.T), rows sum to zero:")
print(np.round(H[0], 3))

# %% [markdown]
# ## G without J
#
# `ggn_operator` multiplies by G with one forward pass that carries the
# tangent `J v` (forward mode, notebook 09), `H` applied to it at the
# outputs, and one backward pass started from `H J v`. In plain
# TensorFlow, for softmax cross-entropy:

# %% tags=["plain-version"]
def plain_ggn_product(model, x, v):
    """G v = sum_i J_i.T H_i J_i v: forward mode, H at the logits, reverse mode."""
    variables = [w.value for w in model.trainable_variables]  # TensorFlow's own
    pieces = np.split(v, np.cumsum([int(np.prod(w.shape)) for w in variables])[:-1])
    tangents = [tf.constant(t.reshape(w.shape))
                for t, w in zip(pieces, variables, strict=True)]
    with tf.GradientTape() as tape:
        with tf.autodiff.ForwardAccumulator(variables, tangents) as forward:
            f = model(x)
    jv = forward.jvp(f)  # J v, (n, l)
    p = tf.nn.softmax(f)
    hjv = p * jv - p * tf.reduce_sum(p * jv, -1, keepdims=True)  # (diag(p) - p pT) J v
    grads = tape.gradient(f, variables, output_gradients=hjv)  # J.T H J v
    return np.concatenate([g.numpy().ravel() for g in grads])


# %% [markdown]
# `jacutil`'s `ggn_chunk` does this for one chunk of samples, for every
# loss and head (`loss.hessian_product_tf`, with per-sample weights `w`),
# in a compiled function (`_traced`), and where forward mode cannot see a
# layer's reads (`refuse_hidden_reads`) it takes `J v` by a double
# backward pass instead:

# %%
ju.teaching.notebook.show_source(ju.curvature.compiled.CurvatureProducts.ggn_chunk)

# %% [markdown]
# Proved against `Σᵢ Jᵢᵀ Hᵢ Jᵢ` built from the formed float64 J, and
# against the plain version:

# %%
J = ju.jacobian(small, x_check)
G_formed = np.einsum("ikp,ikj,ijq->pq", J, H, J)
G = ggn.ggn_operator(small, x_check, "softmax_cross_entropy")
V = rng.standard_normal((G.shape[0], 3))
np.testing.assert_allclose(G @ V, G_formed @ V, rtol=1e-10, atol=1e-12)
print(f"G: a LinearOperator {G.shape}; G @ V == (J.T H J) @ V: True")
np.testing.assert_allclose(plain_ggn_product(small, x_check, V[:, 0]), G @ V[:, 0],
                           rtol=1e-10, atol=1e-12)
print("plain_ggn_product == G @ v: True")

# %% [markdown]
# ## Several heads, each with its own Keras loss
#
# A model with several outputs (heads) is trained with one loss per head,
# as `model.compile(loss=[...])` takes them, and the curvature takes the
# same list: Keras loss objects (or names), each with its `reduction`,
# `from_logits` and label smoothing. Each head's `H` comes from its own
# loss and its own class count, so `Hᵢ` is block-diagonal, one block per
# head. Keras' default reduction averages over the samples, so G is
# divided by n. Below, two softmax heads of different widths:

# %%
keras.utils.set_random_seed(seed)
inputs = keras.Input((4,), dtype="float64")
hidden = keras.layers.Dense(6, activation="tanh", dtype="float64")(inputs)
two_heads = keras.Model(inputs, [
    keras.layers.Dense(2, dtype="float64")(hidden),  # logits of 2 classes
    keras.layers.Dense(4, dtype="float64")(hidden),  # logits of 4 classes
])
head_losses = [keras.losses.SparseCategoricalCrossentropy(from_logits=True)] * 2
G_heads = ggn.ggn_operator(two_heads, x_check, head_losses)

f_heads = np.concatenate([np.asarray(t) for t in two_heads(x_check)], axis=1)
H_heads = np.zeros((n_check, 6, 6))
for block in (slice(0, 2), slice(2, 6)):  # one softmax per head
    z = f_heads[:, block] - f_heads[:, block].max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    H_heads[:, block, block] = np.einsum("ik,kj->ikj", p, np.eye(p.shape[1]))
    H_heads[:, block, block] -= np.einsum("ik,ij->ikj", p, p)
J_heads = ju.jacobian(two_heads, x_check)
G_heads_formed = np.einsum("ikp,ikj,ijq->pq", J_heads, H_heads, J_heads) / n_check
V_heads = rng.standard_normal((G_heads.shape[0], 2))
np.testing.assert_allclose(G_heads @ V_heads, G_heads_formed @ V_heads,
                           rtol=1e-10, atol=1e-12)
print("classes per head:", [head.classes for head in output_loss(head_losses, two_heads).heads])
print(f"G: {G_heads.shape}; G @ V == (J.T H J) @ V / n: True")

# %% [markdown]
# A head that ends in a softmax outputs probabilities, not logits. The
# model's graph is read, so it is refused wherever the softmax sits (a
# layer, `keras.ops.softmax`, a nested model):

# %%
probabilities = keras.Model(
    inputs, keras.ops.softmax(keras.layers.Dense(3, dtype="float64")(hidden)))
try:
    ggn.ggn_operator(probabilities, x_check, head_losses[0])
except ValueError as error:
    print("refused:", str(error).split(": ")[0])

# %% [markdown]
# ## The diagonal and KFAC against the exact G
#
# Two cheaper approximations of G are common. Its **diagonal** (m numbers)
# is exact here: the backward pass of the layer rules starts from the
# columns of a square root `S` of each `H` (`H = S Sᵀ`, one signal per
# class) instead of the identity, and the blocks are squared and summed
# over samples. **KFAC** keeps, for each Dense or Conv layer, the
# *Kronecker product* `A ⊗ B` of two small matrices - the matrix whose
# block (i, j) is `A[i, j] · B`: `A`, the covariance of the layer's inputs
# (with a 1 for the bias), and `B`, that of the signals at its outputs.
# Why: a layer with `a` inputs and `b` outputs has a block of G with
# `(a·b)²` entries; its two factors hold `a² + b²`, and each inverts on its
# own. Both are compared below with the exact G of a small
# classifier, entry by entry.

# %%
x_heat = rng.standard_normal((n_heat, 4))
J_heat = ju.jacobian(small, x_heat)
H_heat = loss.hessian(np.asarray(small(x_heat)))
G_exact = np.einsum("ikp,ikj,ijq->pq", J_heat, H_heat, J_heat)
d, how = diagonal.ggn_diagonal(small, x_heat, "softmax_cross_entropy", explain=True)
K = kfac.kfac(small, x_heat, "softmax_cross_entropy")
G_kfac = K.to_dense()
np.testing.assert_allclose(d, np.diag(G_exact), rtol=1e-10)
print(f"diagonal: {how}; equal to diag(G): True")
for factor in K.factors:
    print(f"KFAC of {factor.name}: A {factor.A.shape}, B {factor.B.shape}")


def relative_error(approx):
    return np.linalg.norm(approx - G_exact) / np.linalg.norm(G_exact)


print(f"relative error (Frobenius): diagonal {relative_error(np.diag(d)):.2f}, "
      f"KFAC {relative_error(G_kfac):.2f}")

# %% tags=["nbval-ignore-output"]
scale = np.abs(G_exact).max()
colours = SymLogNorm(linthresh=1e-3 * scale, vmin=-scale, vmax=scale)
# rows and columns: the parameters, variable by variable (kernel, then bias)
sizes = [int(np.prod(v.shape)) for v in small.trainable_variables]
bounds = np.cumsum([0, *sizes])
names = [f"{v.path.split('/')[-2]} {v.name} ({v.shape[0]}"
         + (f" x {v.shape[1]})" if len(v.shape) == 2 else ")")
         for v in small.trainable_variables]
centres = (bounds[:-1] + bounds[1:]) / 2 - 0.5
fig, axes = plt.subplots(1, 3, figsize=(11, 4.4))
for ax, (title, matrix) in zip(axes, [("exact G", G_exact), ("KFAC", G_kfac),
                                      ("diagonal", np.diag(d))], strict=True):
    image = ax.imshow(matrix, cmap="RdBu_r", norm=colours)
    ax.set_title(f"{title}: error {relative_error(matrix):.2f}" if title != "exact G"
                 else f"{title} ({matrix.shape[0]} x {matrix.shape[0]})")
    for edge in bounds[1:-1] - 0.5:  # where one variable's parameters end
        ax.axhline(edge, color="black", lw=0.8)
        ax.axvline(edge, color="black", lw=0.8)
    ax.set_xticks(centres, names, rotation=90, fontsize=7)
    ax.set_yticks(centres, names if ax is axes[0] else [], fontsize=7)
    ax.set_xlabel("parameter (column)")
axes[0].set_ylabel("parameter (row)")
ticks = [s * scale * 10.0**-k for s in (-1, 1) for k in (0, 1, 2)] + [0]
fig.colorbar(image, ax=axes, shrink=0.8, ticks=sorted(ticks), format="%.0e",
             label="entry (symmetric log scale)")
print(f"Finding: G of the 4-6-3 classifier on {n_heat} samples; KFAC keeps each "
      "layer's block (the two squares on the diagonal) and drops the blocks "
      "between layers; the diagonal keeps m numbers; relative errors "
      f"{relative_error(G_kfac):.2f} and {relative_error(np.diag(d)):.2f}")

# %% [markdown]
# Read the heat map: each layer's block of G (kernel, then bias) is a
# square on the diagonal. KFAC reproduces its pattern; the diagonal keeps
# only the middle line. The Laplace section below uses both.

# %% [markdown]
# ## The Hessian, and spectra from products
#
# The Hessian of the loss adds to G the outputs' own second derivatives,
# weighted by the residuals; it can have negative eigenvalues where G never
# has. `hessian_operator` multiplies by it with forward mode over the
# reverse-mode gradient. *Lanczos*'s method (SciPy's `eigsh`) finds the
# largest eigenvalues of a symmetric matrix from products with it alone;
# why: G and the Hessian are m × m, and their sharpest directions come from
# a few dozen products, never the matrix. It takes any of these operators
# as it is, and Hutchinson's estimator gives the trace from products with
# random ±1 vectors, `E[zᵀ A z] = tr(A)`:

# %%
y_check = rng.integers(0, 3, n_heat)
H_op = hessian.hessian_operator(small, x_heat, y_check, "softmax_cross_entropy")
G_op = ggn.ggn_operator(small, x_heat, "softmax_cross_entropy")
print("top eigenvalues of G:      ", np.round(spectra.top_eigenvalues(G_op, 4), 3))
print("top eigenvalues of Hessian:", np.round(spectra.top_eigenvalues(H_op, 4), 3))
print("numpy on the formed G:     ",
      np.round(np.linalg.eigvalsh(G_exact)[::-1][:4], 3))
estimate = spectra.hutchinson_trace(G_op, n_probes=n_probes, seed=seed)
print(f"trace of G: exact {np.trace(G_exact):.2f}; Hutchinson with {n_probes} "
      f"probes {estimate.value:.2f} ± {estimate.standard_error:.2f}")

# %% [markdown]
# ## The empirical NTK, before and after training
#
# The empirical neural tangent kernel `Θ(x, x') = J(x) J(x')ᵀ` says how a
# gradient step on one sample moves the outputs on another: it is G's
# twin, `J Jᵀ` (n·l × n·l) instead of `Jᵀ J` (m × m), with the same
# nonzero eigenvalues. `empirical_ntk` builds it in blocks of samples
# within a memory budget (into memory, or into a resumable `.npy`). A
# network in the *lazy regime* (very wide, small steps) keeps its NTK
# nearly fixed while it trains, and then behaves like a kernel method with
# that kernel; why: theory about wide networks rests on it, and the NTK
# before training predicts such a network's training only then. Below, the
# question's network before and after training with Adam, and how far it
# is from that regime:

# %% tags=["nbval-ignore-output"]
x_ntk, y_ntk = ju.regression_data(n_ntk, seed=seed)
net = ju.question_mlp(seed=seed)
before = ntk.empirical_ntk(net, x_ntk)


def fit_full_batch(model, x, y, loss, steps):
    """Adam on the whole batch for ``steps`` steps, as one Keras epoch."""
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    data = ju.tf.data.Dataset.from_tensors((x, y)).repeat(steps)
    return model.fit(data, epochs=1, shuffle=False, verbose=0)


mse_before = float(np.mean((np.asarray(net(x_ntk)) - y_ntk) ** 2))
fit_full_batch(net, x_ntk, y_ntk, "mse", train_epochs)
mse_after = float(np.mean((np.asarray(net(x_ntk)) - y_ntk) ** 2))
after = ntk.empirical_ntk(net, x_ntk)
change = np.linalg.norm(after - before) / np.linalg.norm(before)
print(f"NTK: {before.shape} for n = {n_ntk}, l = 2; training MSE "
      f"{mse_before:.3f} -> {mse_after:.4f}")
print(f"relative change of the NTK by training: {change:.2f}")
print(f"trace: {np.trace(before):.0f} before, {np.trace(after):.0f} after "
      f"(ntk_trace without the matrix: {ntk.ntk_trace(net, x_ntk):.0f})")

# %% tags=["nbval-ignore-output"]
eig_before = np.linalg.eigvalsh(before)[::-1]
eig_after = np.linalg.eigvalsh(after)[::-1]
fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.semilogy(np.clip(eig_before, 1e-8, None), label="at initialization")
ax.semilogy(np.clip(eig_after, 1e-8, None), label=f"after {train_epochs} epochs")
ax.set_xlabel("eigenvalue index")
ax.set_ylabel("eigenvalue of the NTK")
ax.set_title(f"the question's network, n = {n_ntk}")
ax.legend()
fig.tight_layout()
top = eig_after[0] / eig_before[0]
print(f"Finding: the NTK's eigenvalues, largest first, fall over "
      f"{np.log10(eig_before[0] / max(eig_before[-1], 1e-8)):.0f} orders of "
      f"magnitude at initialization; training changed the kernel by "
      f"{change:.0%} (Frobenius) and its largest eigenvalue by a factor "
      f"{top:.2f}")
claim("ntk-training-changes", change > 0.1,
      f"training changed this network's NTK by {change:.0%}: far from the "
      "lazy, fixed-kernel regime (where it would change by a few percent)")

# %% [markdown]
# The claim measures how far this network is from the lazy regime: the
# relative change of its kernel by training. <!-- claim: ntk-training-changes -->

# %% [markdown]
# ## Error bars for a regression: the Laplace approximation
#
# A fitted model's weights θ* are a single guess. The Laplace
# approximation puts a Gaussian around them whose precision is the loss's
# curvature plus a prior's, `P = G / σ² + δ I`, and propagates it to the
# outputs through the linearized model: the predictive variance at a
# point x* is `J* Σ J*ᵀ` with `Σ = P⁻¹`. Three structures of P, from the
# pieces above: the **last layer** with its full G, the **diagonal** of G
# over all weights, and **KFAC** over all weights. The noise σ is the
# fitted model's residual standard deviation; the prior precision δ is
# chosen by maximizing the *marginal likelihood*, the probability of the
# training data with the weights averaged over the Gaussian (prior
# included). Why: it rewards a fit and penalizes a prior that leaves the
# weights freer than the data need, so δ comes from the training data
# alone - no validation set. The
# data below have a gap in the middle; the bands of the model's own
# uncertainty (the noise left out) should widen there and outside.

# %% tags=["nbval-ignore-output"]
rng = np.random.default_rng(seed)
x_reg = np.concatenate([rng.uniform(-4, -1, n_regression // 2),
                        rng.uniform(1, 4, n_regression - n_regression // 2)])[:, None]
noise = 0.1  # the data's noise standard deviation
y_reg = np.sin(x_reg) + noise * rng.standard_normal(x_reg.shape)
keras.utils.set_random_seed(seed)
reg = keras.Sequential([
    keras.Input((1,), dtype="float64"),
    keras.layers.Dense(32, activation="tanh", dtype="float64"),
    keras.layers.Dense(32, activation="tanh", dtype="float64"),
    keras.layers.Dense(1, dtype="float64"),
])
fit_full_batch(reg, x_reg, y_reg, "mse", fit_epochs)
sigma = float(np.sqrt(np.mean((np.asarray(reg(x_reg)) - y_reg) ** 2)))
print(f"noise sigma from the residuals: {sigma:.3f} (the data's: {noise})")
x_grid = np.linspace(-8, 8, 161)[:, None]
bands = {}
for structure in laplace.STRUCTURES:
    post = laplace.laplace(reg, x_reg, y_reg, "squared_error", structure,
                           sigma_noise=sigma)
    delta, _ = post.optimize_prior_precision()
    mean, var = post.predict(x_grid, observation_noise=False)
    bands[structure] = (mean[:, 0], np.sqrt(var[:, 0, 0]))
    print(f"{structure:<10} m = {post.n_params:5,}: prior precision {delta:8.3g}, "
          f"log marginal likelihood {post.log_marginal_likelihood():8.2f}")

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(1, 3, figsize=(11, 3.3), sharey=True)
inside = (np.abs(x_grid[:, 0]) > 1) & (np.abs(x_grid[:, 0]) < 4)
for ax, (structure, (mean, std)) in zip(axes, bands.items(), strict=True):
    ax.fill_between(x_grid[:, 0], mean - 2 * std, mean + 2 * std, alpha=0.3,
                    label="± 2 std")
    ax.plot(x_grid[:, 0], mean, label="prediction")
    ax.plot(x_reg[:, 0], y_reg[:, 0], "k.", markersize=3, label="data")
    ax.set_title(structure.replace("_", " "))
    ax.set_ylim(-4, 4)
    ax.set_xlabel("x")
axes[0].set_ylabel("y")
axes[0].legend(loc="lower left", fontsize=8)
fig.tight_layout()
ratios = {s: std[~inside].mean() / std[inside].mean() for s, (_, std) in bands.items()}
print("Finding: predictive mean ± 2 standard deviations of the model's "
      "uncertainty; the average std away from the data over that on it: "
      + ", ".join(f"{s} {r:.1f}x" for s, r in ratios.items()))
claim("bands-widen", min(ratios["last_layer"], ratios["kfac"]) > 1.5
      and ratios["diagonal"] < min(ratios["last_layer"], ratios["kfac"]),
      f"away from the data the bands of the last layer and KFAC widen "
      f"{ratios['last_layer']:.1f}x and {ratios['kfac']:.1f}x, the "
      f"diagonal's only {ratios['diagonal']:.1f}x")

# %% [markdown]
# Read the bands and the Finding: how much each widens away from the data
# depends on the structure. The diagonal drops every correlation between
# weights, and its bands come out too even; the last layer sees only what
# the last layer can change; KFAC keeps each layer's correlations.
# <!-- claim: bands-widen -->

# %% [markdown]
# ## Two classes: confidence where there are no data
#
# For a classification, `predict` turns the Gaussian over the logits into
# probabilities by the *probit approximation*: the sigmoid averaged over a
# Gaussian has no formula, but the normal CDF (the probit) has one and
# nearly the same shape, which gives `sigmoid(f / √(1 + π/8 var))`. Why: one
# line turns a logit's mean and variance into a probability, without
# sampling; a large variance pulls the probability towards ½. A network fitted to
# two clusters is nearly as confident far from both as on them. The Laplace
# predictive lowers its confidence everywhere, and more where there are no
# data - the more of the network it treats as uncertain, the more: all
# layers (`"kfac"`) more than the last one alone. The Finding says by how
# much, on the data and far from it; neither comes down to ½ here, because
# tanh features stop growing far from the data, and with them the variance.
# <!-- claim: confidence-falls -->

# %% tags=["nbval-ignore-output"]
rng = np.random.default_rng(seed)
labels = rng.integers(0, 2, n_classes)
x_two = rng.standard_normal((n_classes, 2)) * 0.7 + np.where(labels[:, None], 1.5, -1.5)
keras.utils.set_random_seed(seed)
clf = keras.Sequential([
    keras.Input((2,), dtype="float64"),
    keras.layers.Dense(16, activation="tanh", dtype="float64"),
    keras.layers.Dense(16, activation="tanh", dtype="float64"),
    keras.layers.Dense(1, dtype="float64"),  # the logit
])
fit_full_batch(clf, x_two, labels[:, None].astype("float64"),
               keras.losses.BinaryCrossentropy(from_logits=True), fit_epochs // 2)
g = np.linspace(-6, 6, 61)
grid = np.stack(np.meshgrid(g, g), -1).reshape(-1, 2)
far = np.abs(grid).max(axis=1) > 5  # a frame around the plot, away from the data


def network_p(points):
    return 1 / (1 + np.exp(-np.asarray(clf(points))[:, 0]))


predictives = {"the fitted network": network_p}
for structure in ("last_layer", "kfac"):
    post = laplace.laplace(clf, x_two, labels[:, None], "sigmoid_cross_entropy",
                           structure)
    delta, _ = post.optimize_prior_precision()
    predictives[f"Laplace, {structure.replace('_', ' ')}"] = (
        lambda points, post=post: post.predict(points)[:, 0])
    print(f"{structure} Laplace: prior precision {delta:.3g} (marginal likelihood)")


def confidence(p):
    return np.maximum(p, 1 - p)


maps = {title: confidence(p(grid)) for title, p in predictives.items()}
on_data = {title: confidence(p(x_two)).mean() for title, p in predictives.items()}

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
for ax, (title, conf) in zip(axes, maps.items(), strict=True):
    image = ax.contourf(g, g, conf.reshape(len(g), len(g)),
                        levels=np.linspace(0.5, 1, 11), cmap="viridis")
    ax.scatter(*x_two.T, c=labels, cmap="coolwarm", s=6, edgecolors="none")
    ax.set_title(title)
    ax.set_xlabel("x₁")
axes[0].set_ylabel("x₂")
fig.colorbar(image, ax=axes, label="confidence max(p, 1 - p)")
print("Finding: mean confidence of the predicted class on the training data, "
      "then far from it (|x| > 5): " + "; ".join(
          f"{title} {on_data[title]:.2f}, then {conf[far].mean():.2f} "
          f"(down {on_data[title] - conf[far].mean():.2f})"
          for title, conf in maps.items()))
fall = {title: on_data[title] - conf[far].mean() for title, conf in maps.items()}
net_title, last, full = maps  # the fitted network, last layer, KFAC
claim("confidence-falls", fall[net_title] < fall[last] < fall[full]
      and all(on_data[t] < on_data[net_title] for t in (last, full))
      and min(maps[t][far].mean() for t in (last, full)) > 0.55,
      f"far from the data confidence falls by {fall[net_title]:.2f} for the "
      f"network, {fall[last]:.2f} for the last layer, {fall[full]:.2f} for "
      "KFAC; Laplace is less confident on the data too, and stays above ½ "
      f"far from it (at least {min(maps[t][far].mean() for t in (last, full)):.2f})")

# %% [markdown]
# ## What each costs
#
# Each tool keeps a different amount, and each costs passes over the data.
# Measured on the regression model above (m parameters, n samples), each
# call timed after a first one that compiles:

# %% tags=["nbval-ignore-output"]
m_reg = ju.flat_params(reg).size
v_reg = np.ones(m_reg)
G_reg = ggn.ggn_operator(reg, x_reg)
rows = [
    ("G @ v (JVP, H, VJP)", lambda: G_reg @ v_reg, m_reg),
    ("diagonal of G", lambda: diagonal.ggn_diagonal(reg, x_reg), m_reg),
    ("KFAC factors", lambda: kfac.kfac(reg, x_reg),
     sum(f.A.size + f.B.size for f in kfac.kfac(reg, x_reg).factors)),
    ("formed G = J.T J", lambda: np.einsum("ikp,ikq->pq", *[ju.jacobian(reg, x_reg)] * 2),
     m_reg**2),
    ("NTK J J.T", lambda: ntk.empirical_ntk(reg, x_reg), n_regression**2),
]
print(f"m = {m_reg:,}, n = {n_regression}")
print(f"{'what':<22}{'ms':>9}{'numbers kept':>15}")
for name, call, kept in rows:
    seconds = ju.time_call(call, repeats=3).median
    print(f"{name:<22}{1e3 * seconds:9.2f}{kept:15,}")

# %% [markdown]
# G itself grows as m²; its diagonal as m; KFAC as the squares of the
# layers' widths. The NTK grows as n², so it is the one to keep when there
# are fewer samples than parameters.

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** The trace of G is the sum of its diagonal. Compute the trace of G
# of `small` on `x_heat` for softmax cross-entropy with `ggn_diagonal`
# (one number), and compare it with Hutchinson's estimate above: how many
# standard errors apart are they?

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: the diagonal is exact, so its sum is the trace; Hutchinson's
# estimate is within a few standard errors of it.
answer = diagonal.ggn_diagonal(small, x_heat, "softmax_cross_entropy").sum()
print(f"trace {answer:.3f}; Hutchinson {estimate.value:.3f}: "
      f"{abs(answer - estimate.value) / estimate.standard_error:.1f} standard errors")

# %%
check.exercise("11-1", answer, model=small, x=x_heat)

# %% [markdown]
# **2.** One entry block of the NTK by hand: with `ju.jacobian`, compute
# `Θ(x_a, x_b) = J(x_a) J(x_b)ᵀ` (an l × l array) for the first two samples
# of `x_ntk` on the trained `net`, and compare it with the block of
# `after` at rows 0-1 and columns 2-3.

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: rows i*l + k of the NTK are sample i, output k, so sample 0
# is rows 0-1 and sample 1 columns 2-3.
J_ab = ju.jacobian(net, x_ntk[:2])
answer = J_ab[0] @ J_ab[1].T
print(answer)
print("block of the NTK:", np.allclose(answer, after[0:2, 2:4], rtol=1e-4))

# %%
check.exercise("11-2", answer, model=net, x=x_ntk)

# %% [markdown]
# ## Keypoints
#
# - G = Σᵢ Jᵢᵀ Hᵢ Jᵢ: `ggn_operator` multiplies by it with a JVP, the
#   loss's H and a VJP - no J; `hessian_operator` by the Hessian, forward
#   over reverse.
# - `ggn_diagonal` is G's exact diagonal: the layer rules' backward pass
#   started from a square root of H. `kfac` keeps two small factors per
#   Dense or Conv layer and inverts them exactly.
# - SciPy's `eigsh`, `svds` and Hutchinson's estimator take these operators
#   as they are: spectra and traces from products.
# - `empirical_ntk` builds `J Jᵀ` in blocks under a memory budget; training
#   changes it unless the network is in the lazy regime. <!-- claim: ntk-training-changes -->
# - `laplace` puts error bars on a Keras model: last layer, diagonal or
#   KFAC, the prior chosen by the marginal likelihood; the bands of the last
#   layer and KFAC widen where there are no data, and a classifier's
#   confidence falls there more than on the data (not to ½ with saturating
#   features). <!-- claim: bands-widen, confidence-falls -->
