# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 00 · Welcome: the per-sample Jacobian
#
# **Questions**
# - What is the Jacobian of a network's outputs with respect to its parameters, sample by sample?
# - What shape does it have, and which layouts do the layout question and
#   SciPy's `least_squares` want?
# - How is this collection organised, and how do I run it?
#
# **Objectives**
# - Name the two questions this collection answers: the loop question and
#   the layout question.
# - Compute a per-sample Jacobian with `ju.jacobian` and read its shape `(n, l, m)`.
# - Ask `ju.jacobian` which path it took, and why.
# - Convert it to the `(l·m) × n` layout of the layout question and back.
# - Find the notebook for each stage, and run them all with `make run`.
#
# *Teaching: 16 min · Exercises: 5 min · Going further: 29 min*

# %% [markdown]
# ## Setup
#
# `jacutil` imports TensorFlow for us (quietly: no start-up log) and holds every
# function these notebooks teach.

# %%
import matplotlib.pyplot as plt
import numpy as np

import jacutil as ju
from jacutil import tf
from jacutil.teaching import check
from jacutil.teaching.claims import claim

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_samples = 4  # samples in the batch
seed = 0  # seeds the weights and the data

# %% [markdown]
# ## The two questions
#
# This collection grew from two questions asked on Stack Exchange (and
# reposted, with answers, in Chinese). Every notebook calls them by these
# two names:
#
# - **The loop question**: *How to compute the Jacobian matrix efficiently
#   in TensorFlow, and speed up my slow code?* Its code loops over samples
#   and outputs, one gradient at a time, and is slow. Its network is our
#   running example, its loop is `01-nested-loop`, and the mistakes in its
#   popular answers are `06-pitfalls`.
# - **The layout question**: *An efficient per-sample Jacobian of a
#   network's outputs with respect to its trainable variables, for an
#   external SciPy optimizer.* It wants the Jacobian as an $(l·m) \times n$
#   matrix, one column per sample (`to_lm_by_n` below). SciPy's
#   `least_squares` itself wants another layout, $(n·l) \times m$;
#   `05-scipy-least-squares` fits with it.

# %% [markdown]
# ## The object we compute
#
# A network $f$ maps one sample $x_i$ to $l$ outputs. Its trainable variables,
# flattened and joined, form one vector $\theta$ of $m$ parameters. The
# **per-sample Jacobian** holds every derivative of every output of every sample:
#
# $$J[i, k, p] = \frac{\partial f(x_i)_k}{\partial \theta_p}, \qquad
# J \in \mathbb{R}^{n \times l \times m}.$$
#
# Our running example is the network of
# [the loop question](#The-two-questions):
# 10 inputs → Dense 64 (ReLU) → Dense 32 (ReLU) → Dense 2.

# %%
model = ju.question_mlp(seed=seed)
x, y = ju.regression_data(n_samples, seed=seed)
for v in model.trainable_variables:
    print(f"{v.path:<18} shape {str(tuple(v.shape)):<9} size {np.prod(v.shape):>5}")
theta = ju.flat_params(model)
print("m = n_params =", theta.size)

# %% [markdown]
# `flat_params` flattens each variable in row-major order and joins them in
# `model.trainable_variables` order. The Jacobian's last axis follows exactly
# that order, and `set_flat_params(model, theta)` writes such a vector back.

# %% [markdown]
# ## One call: `ju.jacobian`
#
# `ju.jacobian(model, x)` is the one call to use. It does not time the
# paths: it takes the first that applies, by a fixed rule read from the
# model and the size: (1) **forward mode** where the outputs outnumber the
# parameters many times over (the ratio is printed below); (2) else the
# **layer rules** where every layer has one; (3) else the compiled
# per-sample stage of `03-compiled`; each in chunks (`04-chunked`) where
# the predicted working memory would pass a budget, by default half the
# memory free now. Every path is correct; the rule does not promise the
# quickest one (`09-matrix-free` times them side by side). With
# `explain=True` it says which path it took and why. The later notebooks
# build each path: they are the lessons, this is the tool.

# %%
J, choice = ju.jacobian(model, x, explain=True)
print("x:", x.shape, " f(x):", model(x).shape, " J:", J.shape, J.dtype)
print(f"forward mode only where l >= "
      f"{ju.auto.FORWARD_WHEN_OUTPUTS_PER_PARAMETER} * m: here l = "
      f"{J.shape[1]}, m = {J.shape[2]}")
print("path:", choice.path, "-", choice.why, "- chunks:", choice.chunks)
for name, rule in choice.layers:
    print(f"  layer {name}: {rule}")
claim("rules-path", choice.path == "layer rules" and not J.flags.writeable,
      f"the path taken is '{choice.path}' ({len(choice.layers)} layers, each "
      "with a rule), and J comes back read-only")

# %% [markdown]
# Here every layer has a **rule**: a formula for its own block of columns,
# derived by hand (`07-benchmark` derives the Dense one). A model the rules
# cannot read - a subclassed model, branches - takes the compiled per-sample
# stage instead, and `choice.why` says why. J comes back read-only (a view
# of TensorFlow's result, no copy); `copy=True` gives an array you may
# write to. Every path returns the same numbers: the per-sample stage of
# `02-vectorized` agrees.

# %%
np.testing.assert_allclose(J, ju.per_sample_jacobian(model, x), rtol=1e-5, atol=1e-6)
print("jacobian == per_sample_jacobian:", True)

# %% [markdown]
# Each entry is a real derivative. Nudge one parameter by a small step and the
# outputs move by that step times one column of `J` (up to float32's
# rounding: a ReLU network is linear in any one parameter between kinks):

# %%
p = 5  # any parameter
step = 1e-2
bumped = theta.copy()
bumped[p] += step
ju.set_flat_params(model, bumped)
moved = model(x).numpy()
ju.set_flat_params(model, theta)
before = model(x).numpy()
move = np.abs(moved - before).max()
error = np.abs(moved - (before + step * J[:, :, p])).max()
relative = error / move if move > 0 else np.inf
claim("j-predicts-move", relative < 0.01,
      f"the outputs moved by up to {move:.2e}; step * J[:, :, p] predicted "
      f"that move to within {error:.1e}, a share {relative:.1e} of it")

# %% [markdown]
# ## The layouts, as code
#
# `to_lm_by_n` and `from_lm_by_n` convert between `J` and the layout
# question's matrix; the index rule is checked below for every entry.
# SciPy's `least_squares` takes yet another
# layout: one row per residual (sample `i`, output `k`), one column per
# parameter, an $(n·l) \times m$ matrix - a plain `reshape`.

# %%
M = ju.to_lm_by_n(J)
n, l, m = J.shape
rule_holds = all(M[k * m + p, i] == J[i, k, p] for i, k, p in np.ndindex(J.shape))
print("(l*m) x n:", M.shape, " rule M[k*m + p, i] == J[i, k, p]:", rule_holds)
print("round trip exact:", np.array_equal(ju.from_lm_by_n(M, n_outputs=l), J))
print("SciPy (n*l) x m:", J.reshape(n * l, m).shape)

# %% [markdown]
# ## How this collection works
#
# | path | notebook | stage | `jacutil` function |
# |---|---|---|---|
# | core | `00-welcome` | what we compute; the one call | `jacobian`, `to_lm_by_n` |
# | core | `01-nested-loop` | the loop of the loop question | `loop_jacobian` |
# | core | `02-vectorized` | one tape, `tape.jacobian`; `vectorized_map` | `vectorized_jacobian`, `per_sample_jacobian` |
# | core | `03-compiled` | `tf.function` and XLA | `compiled_jacobian` |
# | core | `04-chunked` | bounded memory | `chunked_jacobian` |
# | core | `05-scipy-least-squares` | fit with SciPy | `least_squares_problem` |
# | further | `06-pitfalls` | the popular answers' traps | `guards` |
# | further | `07-benchmark` | every path side by side; layer rules | `compiled_dense_jacobian`, `rules` |
# | further | `08-your-own-model` | CNNs, LSTMs, several inputs and heads | `split_outputs` |
# | further | `09-matrix-free` | when J does not fit: products with J | `jvp`, `vjp`, `jacobian_operator` |
# | further | `10-beyond-one-machine` | resumable runs; chunks on worker processes | `distributed_jacobian`, `LocalWorkers` |
# | further | `11-curvature-and-uncertainty` | curvature, the NTK and Laplace uncertainty from J | `ggn_operator`, `laplace` |
# | further | `12-private-fine-tuning` | a transformer fine-tuned privately with LoRA | `make_private` |
#
# The **core path**, 00 to 05, answers the question, from the loop to a
# Keras model fitted by SciPy, in under 3 hours with one exercise a notebook.
# Each core notebook ends with a "Going further" part, and 06 to 11 go
# further still: read them in any order after the core. The README's plan
# gives the minutes of each, measured.
#
# The later notebooks use a few TensorFlow words (tape, pfor, tracing, XLA);
# each links to its one-line meaning in [TensorFlow words](#TensorFlow-words),
# at the end of this notebook. Each stage is proved equal to the previous
# one inside its notebook, then timed. From the repository's root, `make run` executes every notebook and
# prints what each found; `make test` runs the test suite; `make lab` opens
# JupyterLab here.

# %%
print("Finding: J has shape (n, l, m) =", J.shape, "for the question's network")

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** How many parameters does a network 10 → 128 (ReLU) → 3 have? Count
# them by hand (`answer = ...`); the check builds the network
# (`ju.question_mlp(hidden=(128,), n_outputs=3)`) and compares.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: a Dense layer from a to b has a*b weights and b biases.
answer = 10 * 128 + 128 + 128 * 3 + 3

# %%
check.exercise("00-1", answer)

# %% [markdown]
# ## Going further: words, shapes, and the Jacobian's columns
#
# For those with time left: a glossary of the TensorFlow words the later
# notebooks use (they link to it), a picture of the layouts, models with
# several inputs and outputs, and two more exercises.

# %% [markdown]
# ## TensorFlow words
#
# The later notebooks use these words; each is one sentence and one line here.
#
# - **Eager execution**: TensorFlow runs each operation as Python reaches it,
#   like NumPy. `tf.constant([1.0]) * 2` is computed at once.
# - **`tf.GradientTape`**: records the operations run inside its `with` block,
#   so that `tape.gradient(y, variables)` can go back through them.
#   `with tf.GradientTape() as tape: y = model(x)`
# - **`watch`**: a tape records trainable `tf.Variable`s by itself; anything
#   else (an input tensor) must be watched first, inside the block.
#   `tape.watch(x)`
# - **`persistent=True`**: a tape can answer one `gradient` call and is then
#   released; a persistent tape answers many (and is deleted by you).
#   `with tf.GradientTape(persistent=True) as tape: ...`
# - **`tape.jacobian`**: every output's gradient, stacked; with
#   `experimental_use_pfor=True` (TensorFlow's default setting) one
#   vectorized backward pass in place of a loop. `tape.jacobian(y, model.trainable_variables)`
# - **pfor / `tf.vectorized_map`**: rewrites a per-item function into one
#   batched computation over all items. `tf.vectorized_map(f, x)`
# - **`tf.function` and tracing**: runs a Python function once with symbolic
#   inputs (a *trace*) to build a graph, then runs the graph on each call; a
#   new input shape or dtype can cause a new trace. `fast = tf.function(f)`
# - **XLA**: a compiler that fuses a graph's operations into fewer kernels,
#   once per concrete input shape. `tf.function(f, jit_compile=True)`

# %%
x_words = tf.constant(x)
with tf.GradientTape(persistent=True) as tape:
    tape.watch(x_words)  # an input: watched by hand
    y_words = model(x_words)
J_input = tape.batch_jacobian(y_words, x_words)  # d outputs / d inputs, per sample
J_params = tape.jacobian(y_words, model.trainable_variables)  # one block per variable
del tape  # a persistent tape is released by hand
print("d y / d x per sample:", tuple(J_input.shape),
      "| d y / d kernel of the first layer:", tuple(J_params[0].shape))

# %% [markdown]
# ## A picture of the shapes
#
# A tiny network (2 inputs → 3 hidden → 2 outputs, so $m = 17$) makes every
# entry visible. Left: `J` as $n$ blocks of $l \times m$, one per sample. Right:
# the same numbers in the $(l·m) \times n$ layout of
# [the layout question](#The-two-questions): one **column per sample**, row
# `k*m + p` for output `k` and parameter `p`.

# %% tags=["nbval-ignore-output"]
tiny = ju.question_mlp(n_inputs=2, hidden=(3,), n_outputs=2, seed=seed)
x_tiny = ju.regression_data(3, n_inputs=2, seed=seed)[0]
J_tiny = ju.jacobian(tiny, x_tiny)
M_tiny = ju.to_lm_by_n(J_tiny)

scale = {"cmap": "RdBu", "vmin": -np.abs(J_tiny).max(), "vmax": np.abs(J_tiny).max()}
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2),
                         gridspec_kw={"width_ratios": [3, 1]})
axes[0].imshow(np.concatenate(list(J_tiny), axis=0), aspect="auto", **scale)
for i in range(1, len(J_tiny)):  # a line between samples
    axes[0].axhline(i * J_tiny.shape[1] - 0.5, color="black", lw=1)
axes[0].set_title("J: n blocks of (l x m), one per sample")
axes[0].set_xlabel("parameter p")
axes[0].set_ylabel("sample i, output k")
image = axes[1].imshow(M_tiny, aspect="auto", **scale)
fig.colorbar(image, ax=axes[1], label="derivative")
axes[1].set_title("(l*m) x n")
axes[1].set_xlabel("sample i")
axes[1].set_ylabel("row k*m + p")
fig.tight_layout()
print(f"Finding: left, {len(J_tiny)} blocks of {J_tiny.shape[1]} x "
      f"{J_tiny.shape[2]}, one per sample; right, the same {J_tiny.size} "
      f"numbers as a {M_tiny.shape[0]} x {M_tiny.shape[1]} matrix, one column "
      f"per sample; derivatives from {J_tiny.min():.2f} to {J_tiny.max():.2f}")

# %%
print("J_tiny:", J_tiny.shape, " -> to_lm_by_n:", M_tiny.shape)

# %% [markdown]
# ## Several inputs, several outputs
#
# A model with several inputs takes them as a list (or a dict by input
# name) of arrays that share their first dimension: the samples. A model
# with several outputs - a list or dict of heads, or an output of shape
# `(n, 4, 2)` - contributes **every output leaf, flattened per sample, in
# `tf.nest.flatten` order** (a list in its order, a dict by sorted keys), so
# `l` counts them all. `split_outputs` gives the model's structure back:

# %%
inputs = [ju.keras.Input((3,)), ju.keras.Input((2,))]
joined = ju.keras.layers.Concatenate()(inputs)
heads = [ju.keras.layers.Dense(2)(joined), ju.keras.layers.Dense(1)(joined)]
two_heads = ju.keras.Model(inputs, heads)
x_two = [np.ones((4, 3), "float32"), np.ones((4, 2), "float32")]
J_two, choice_two = ju.jacobian(two_heads, x_two, explain=True)
print("J:", J_two.shape, "- l = 2 + 1 rows per sample")
print("path:", choice_two.path, "-", choice_two.why)
print("split:", [part.shape for part in ju.split_outputs(J_two, two_heads, x_two)])

# %% [markdown]
# ## The Jacobian's columns
#
# Where a layer's columns lie in `J`, and what freezing a layer takes out.
#
# **2.** The last layer computes $f_k = \sum_j h_j W_{jk} + b_k$. What is
# $\partial f_k / \partial b_{k'}$ for every pair $(k, k')$? Write it as an
# `l × l` matrix `answer`, then find the last layer's bias in `J` (its last
# `l` columns) and compare, for every sample.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: 1 when k == k', else 0 - for every sample: the last l columns of
# J are an identity matrix.
answer = np.eye(l)
print(np.array_equal(J[:, :, -l:], np.broadcast_to(answer, (n, l, l))))

# %%
check.exercise("00-2", answer, J=J)

# %% [markdown]
# **3.** Ask `ju.jacobian` about the small CNN of `08-your-own-model`
# (`ju.small_cnn()` on `ju.image_data(4)`): which path does it take, and
# which rule does each layer get? Then freeze its first layer
# (`layers[0].trainable = False`): how many columns does J lose
# (`answer`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: the layer rules (Conv2D: patches and one product per layer);
# freezing the first convolution drops its 3*3*1*8 weights and 8 biases.
cnn = ju.small_cnn(seed=seed)
x_cnn = ju.image_data(4, seed=seed)
J_cnn, choice_cnn = ju.jacobian(cnn, x_cnn, explain=True)
print(choice_cnn.path, [rule for _, rule in choice_cnn.layers])
cnn.layers[0].trainable = False
answer = J_cnn.shape[2] - ju.jacobian(cnn, x_cnn).shape[2]
print(answer, "columns fewer")

# %%
check.exercise("00-3", answer)

# %% [markdown]
# ## Keypoints
#
# - The per-sample Jacobian has shape `(n, l, m)`: samples, outputs, parameters.
# - `ju.jacobian(model, x)` takes the first path that applies, by a fixed
#   rule, not by timing them: forward mode, the layer rules, or the compiled
#   per-sample stage, in chunks where memory is short; `explain=True` says
#   which and why.
# - The parameter axis follows `flat_params(model)`: each variable flattened,
#   in `trainable_variables` order.
# - `to_lm_by_n` gives the `(l·m) × n` matrix of the layout question (one
#   column per sample); SciPy's `least_squares` wants `J.reshape(n*l, m)`,
#   an `(n·l) × m` matrix.
# - Next, `01-nested-loop`: the slow way, and why it is slow.
