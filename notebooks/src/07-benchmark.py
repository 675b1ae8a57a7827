# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · The benchmark: every path side by side, and the fastest one
#
# **Questions**
# - How do all the stages compare on the same work, measured in one run?
# - How fast can a per-sample Jacobian get, and what is the limit?
# - Which path should I use, and when?
#
# **Objectives**
# - Derive the per-sample Jacobian of a Dense network by hand and prove it
#   equal to autodiff and to finite differences.
# - Run the benchmark of `make bench` on a small scale and read its table:
#   ratios to the loop, to the fastest path, to the *write floor* and, when
#   they are installed, to JAX and PyTorch.
# - Extend the hand derivation to every layer: a rule per layer type
#   (`jacutil.rules`), proved equal to finite differences on a CNN.
# - Compare the same paths on a CNN and an LSTM, where the hand-derived
#   Dense path does not apply but the layer rules do.
# - Explain where the fastest path's time goes, and choose a path for a job.
#
# *Teaching: 20 min · Exercises: 15 min*

# %% [markdown]
# ## Setup

# %%
import numpy as np
from IPython.display import Markdown, display

import jacutil as ju
from jacutil import bench, keras
from jacutil.bench.skipping import format_seconds
from jacutil.teaching import check

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
sizes = [100, 1000, 3000]  # numbers of samples the benchmark runs (the MLP)
repeats = 3  # timed runs after the first, per path and size
max_seconds = 10  # skip a path at a size if all its runs would take longer
paths = None  # None: every path; or a list of names from bench.PATHS
other_sizes = [100]  # numbers of samples for the CNN and the LSTM
other_paths = ["compiled_batch", "compiled", "rules", "jacobian", "jax",
               "torch"]
peer_row_sizes = [1000]  # numbers of samples of the per-sample gradient rows
jacobian_row_sizes = None  # the same for the Jacobian rows (None: 100 for
                           # the MLP, 2,000 for the residual and two-head)
n_check = 4  # samples in the correctness checks
seed = 0

# %% [markdown]
# ## The fastest path: derive it by hand
#
# Autodiff is general: it records the forward pass and replays it backwards,
# once per output and sample. For a chain of Dense layers we can write the
# answer down instead. A layer computes $z = aW + b$ and $a' = \sigma(z)$. Let
# $\delta_{ikq} = \partial y_{ik} / \partial z_{iq}$ be how output $k$ of
# sample $i$ moves with unit $q$. Then
#
# $$\frac{\partial y_{ik}}{\partial W_{pq}} = a_{ip}\,\delta_{ikq}, \qquad
# \frac{\partial y_{ik}}{\partial b_q} = \delta_{ikq}, \qquad
# \delta^{\text{below}} = (\delta W^\top) \odot \sigma'(z^{\text{below}}).$$
#
# Each weight's derivative is an **outer product** of the layer's input and the
# back-propagated signal: the per-example-gradient trick (Goodfellow 2015,
# BackPACK). Append a column of ones to the input and one outer product gives
# the kernel's columns followed by the bias's, in `flat_params` order.
#
# This derivation is written once in `jacutil`: the **Dense rule**. Its
# forward step computes the layer and keeps what the backward step needs,
# the input $a$ and the slope $\sigma'(z)$:

# %%
ju.teaching.notebook.show_source(ju.rules.dense.DenseRule._forward)

# %% [markdown]
# Its backward step multiplies the signal by the slope, writes the layer's
# block of columns (`kernel_and_bias` appends the column of ones), and
# passes $\delta W^\top$ to the layer below:

# %%
ju.teaching.notebook.show_source(ju.rules.dense.DenseRule._backward)

# %% [markdown]
# The outer product itself, for every sample and output at once: a batch of
# $(p, 1) \times (1, q)$ matrix products, which write the block faster on a
# CPU than a broadcast multiply.

# %%
ju.teaching.notebook.show_source(ju.rules.blocks.outer_blocks)

# %% [markdown]
# `compiled_dense_jacobian(model)` is the layer rules of `jacutil.rules`
# (more below) restricted to Dense: it runs when every layer of a chain
# gets the Dense rule and the input is one flat (n_samples, n_features)
# array, in a `tf.function` with a `None` batch dimension. One copy of the
# formulas serves both. On the first batch of each input shape it checks the
# rule against autodiff on up to 8 samples spread over the batch. Any other
# model, or one that fails the check, gets the autodiff per-sample stage,
# and `jac.fallback` says why.

# %% [markdown]
# ## Is it right?
#
# In float64 against finite differences, on a smaller network of the same
# kind with three outputs (finite differences need two forward passes per
# parameter); then on the question's network in float32 against the autodiff
# per-sample stage of notebook 02.

# %%
small64 = ju.question_mlp(n_inputs=4, n_outputs=3, hidden=(8, 6),
                          seed=seed, dtype="float64")
x_small = np.random.default_rng(seed).standard_normal((n_check, 4))
J_hand = ju.dense_jacobian(small64, x_small)
J_fd = ju.finite_difference_jacobian(small64, x_small)
np.testing.assert_allclose(J_hand, J_fd, rtol=1e-6, atol=1e-9)
print("hand-derived:", J_hand.shape, J_hand.dtype,
      "== finite differences: True")

model = ju.question_mlp(seed=seed)
jac = ju.compiled_dense_jacobian(model)
x32 = ju.regression_data(n_check, seed=seed)[0]
np.testing.assert_allclose(jac(x32), ju.per_sample_jacobian(model, x32),
                           rtol=1e-5, atol=1e-6)
print("compiled, float32 == per_sample_jacobian: True")
print("fallback:", jac.fallback)

# %% [markdown]
# A convolution is not a Dense layer, so the same call falls back:

# %%
conv = keras.Sequential([
    keras.Input((6, 6, 1)),
    keras.layers.Conv2D(2, 3, activation="tanh"),
    keras.layers.Flatten(),
    keras.layers.Dense(2),
])
x_conv = np.random.default_rng(seed).standard_normal((3, 6, 6, 1))
jac_conv = ju.compiled_dense_jacobian(conv)
np.testing.assert_allclose(jac_conv(x_conv.astype("float32")),
                           ju.per_sample_jacobian(conv, x_conv),
                           rtol=1e-5, atol=1e-6)
print("fallback:", jac_conv.fallback)

# %% [markdown]
# ## Beyond Dense: a rule per layer
#
# The Dense derivation generalizes. Every layer that has weights computes, at
# some positions, a product of its input with its kernel: one position for
# Dense, every output pixel for a convolution (its input there is the
# **patch** under the kernel), every time step for a recurrent layer. So
# each layer's block is the same outer product of its input and the signal at
# its output, summed over positions; and the signal below it is the signal
# times the transposed kernel. `jacutil.rules` holds one **rule** per layer
# type (Dense, Conv1D/Conv2D, Embedding, LayerNormalization, BatchNorm and
# Dropout in inference mode, reshapes, activation layers, LSTM/GRU/SimpleRNN
# by back-propagation through time); a layer without one passes the signal
# through by autodiff. Here is the convolution's backward step:

# %%
ju.teaching.notebook.show_source(ju.rules.conv.ConvRule._backward)

# %% [markdown]
# `compiled_jacobian(model, method="rules")` runs them, and says which rule
# each layer got; the convolution above, in float64, against finite
# differences:

# %%
conv64 = keras.Sequential([
    keras.Input((6, 6, 1), dtype="float64"),
    keras.layers.Conv2D(2, 3, activation="tanh", dtype="float64"),
    keras.layers.Flatten(dtype="float64"),
    keras.layers.Dense(2, dtype="float64"),
])
conv64.set_weights([w.astype("float64") for w in conv.get_weights()])
jac_rules = ju.compiled_jacobian(conv64, method="rules")
np.testing.assert_allclose(jac_rules(x_conv),
                           ju.finite_difference_jacobian(conv64, x_conv),
                           rtol=1e-6, atol=1e-9)
print("rules == finite differences: True")
for name, rule in jac_rules.plan.layers():
    print(f"  {name}: {rule}")

# %% [markdown]
# `ju.jacobian(model, x)` (notebook 00) takes the rules whenever they apply,
# and the compiled autodiff stage otherwise. Both are rows of the benchmark.

# %% [markdown]
# ## The benchmark
#
# `make bench` runs every path at n = 100, 1,000 and 10,000 in one process;
# here a smaller run of the same code, at the sizes of the parameters cell.
# Each path's first call (trace, compile) is timed apart, then `repeats`
# more give the median; each result is checked against the compiled
# per-sample stage before it is timed. A path is skipped where its predicted
# time is too long (`max_seconds`), or (the quadratic `tape.jacobian`) where
# its predicted memory does not fit. JAX (`jit(vmap(jacrev))`) and PyTorch
# (`torch.func.vmap(jacrev)`) join when installed (`make bench-peers`):
# `jacutil.peers` rebuilds the Keras model from its weights in each library,
# and the run checks their Jacobians against ours like any other path.
#
# The **write floor** (the *floor*, `x floor`) is the time to fill a
# preallocated array of the Jacobian's shape, `out.fill(1.0)`: whatever
# computes J writes its n · l · m numbers at least once. Beside it, the time
# to allocate and write a new one, `np.full((n, l, m), 1.0)`, which any
# function that returns a new Jacobian also pays. Each table gives every
# path's time over the floor (`x floor`) and over the faster of JAX and
# PyTorch (`x peer`) when they ran.

# %% tags=["nbval-ignore-output"]
results = bench.run_bench(sizes, repeats=repeats, max_seconds=max_seconds,
                          memory_mode="inline", paths=paths, seed=seed)

# %% [markdown]
# Peak memory here is measured in this process (`memory_mode="inline"`), so
# memory that an earlier path left in TensorFlow's pool is not counted again;
# `make bench` measures each path in a fresh process.

# %% tags=["nbval-ignore-output"]
for n in sizes:
    display(Markdown(bench.table_at(results, n)))

# %% [markdown]
# The plot has one line per path, the two floors in black; paths that were
# skipped at a size have no point there. Where lines overlap, tell them apart
# by their markers. Below it, the findings of this run.

# %% tags=["nbval-ignore-output"]
ax = bench.plot(results)
largest = max(sizes)


def peer_finding(results):
    """One line per n: jacutil's best path against the floor and the peer."""
    for row in bench.summary(results):
        best = results["labels"][row["best"]]
        line = (f"Finding: n = {row['n']:,}, jacutil's fastest is {best}, "
                f"{row['per_floor']:.1f}x the floor")
        if row["per_peer"]:
            line += f", {row['per_peer']:.2f}x the faster peer"
        print(line)


peer_finding(results)
share = bench.ratios(results, largest)
fastest = min(share, key=lambda p: share[p].fastest)
print(f"Finding: at n = {largest:,} the fastest of all paths is "
      f"{results['labels'][fastest]}, {share[fastest].floor:.1f}x the floor")
if "compiled" in share and "dense" in share:
    gain = share["compiled"].fastest / share["dense"].fastest
    print(f"Finding: at n = {largest:,} hand-derived is {gain:.1f}x faster "
          "than vectorized_map (tf.function)")
for plain, xla in [("compiled", "compiled_xla"), ("dense", "dense_xla")]:
    for n in sizes:
        at = bench.ratios(results, n)
        if plain in at and xla in at:
            print(f"Finding: n = {n:,}, {results['labels'][xla]} takes "
                  f"{at[xla].fastest / at[plain].fastest:.2f}x the time "
                  "of the same path without XLA")

# %% [markdown]
# How much of a difference between two rows is real? `jacutil.jacobian`
# picks its path for this model; when that is the layer rules, its row and
# the `layer rules` row time the same computation, and their difference is
# the noise of this run:

# %% tags=["nbval-ignore-output"]
_, choice = ju.jacobian(model, ju.regression_data(largest, seed=seed)[0],
                        explain=True)
print(f"jacutil.jacobian takes: {choice.path} ({choice.chunks} chunk(s))")
for n in sizes:
    at = bench.ratios(results, n)
    if choice.path == "layer rules" and "rules" in at and "jacobian" in at:
        apart = max(at["rules"].fastest, at["jacobian"].fastest) / min(
            at["rules"].fastest, at["jacobian"].fastest)
        print(f"Finding: n = {n:,}, the same computation timed twice: "
              f"{apart:.2f}x apart")

# %% [markdown]
# Read the ratios with that in mind: rows closer than the noise (the
# hand-derived path, the layer rules and `jacutil.jacobian` all do the same
# outer products here) are a tie, whatever their order in this run.

# %% [markdown]
# ## A CNN and an LSTM
#
# The same run on the two models of notebook 08: the small CNN
# (`small_cnn`: two convolutions with 3-by-3 kernels, then Dense) and the
# LSTM (`sequence_lstm`: LSTM(16), then Dense). The hand-derived Dense path
# does not apply to them; the layer rules do (patches for the convolutions,
# back-propagation through time for the LSTM), beside the autodiff paths and
# the peers when installed. The LSTM is unrolled for `vectorized_map`
# (notebook 08 says why), and so it is in the peers. `chunked_jacobian` is
# left out here: at these sizes it is one chunk of `vectorized_map`, the
# same row twice.

# %% tags=["nbval-ignore-output"]
others = {}
for name in ["cnn", "lstm"]:
    others[name] = bench.run_bench(
        other_sizes, repeats=repeats, max_seconds=max_seconds,
        memory_mode="inline", paths=other_paths, seed=seed, model=name,
        log=lambda *a: None)
    print(others[name]["model_label"])
    for n in other_sizes:
        display(Markdown(bench.table_at(others[name], n)))
    peer_finding(others[name])

# %% [markdown]
# Each finding prints how far the best path is above the floor; each
# table's first line prints the size of its Jacobian, of the same order as
# the MLP's. Where the best path sits much further above the floor than on
# the MLP, the arithmetic (convolutions, the recurrence step by step), not
# writing the result, is the limit. Compare the `layer rules` row with the
# autodiff rows: the rules do that arithmetic once per sample and output,
# with no tape over the model.

# %% [markdown]
# ## Beyond the Jacobian: per-sample gradients, norms, branched models
#
# What users do with J is often smaller: the gradient of each sample's own
# loss (DP-SGD clips it, notebook 09), or only its norm. A training loop
# calls these once per step, so each row times the call a user repeats:
# one warm-up call (its time is the `first call` column: the trace), then
# the median of the calls after it. Then the Jacobian of two functional
# models with branches, a residual MLP (`Add` skips) and a two-head model,
# which the layer rules now walk as graphs. The peers join when installed
# (`make bench-peers` runs these rows at n = 1,000 and 10,000 too).

# %% tags=["nbval-ignore-output"]
gradient_rows = [name for name in bench.peer_rows.TASKS
                 if not name.startswith("jacobian")]
jacobian_rows = ["jacobian-mlp", "jacobian-residual", "jacobian-two_head"]
for names, at in [(gradient_rows, peer_row_sizes),
                  (jacobian_rows, jacobian_row_sizes)]:
    rows = bench.run_peer_rows(names, sizes=at, repeats=repeats, seed=seed,
                               log=lambda *a: None)
    display(Markdown(bench.peer_rows_table(rows)))
    proofs = [bench.peer_rows.proof_line(row, rows["kinds"])
              for row in rows["rows"] if row["peers"]]
    print("\n".join(proofs) or "JAX and PyTorch are not installed here: "
          "make bench-peers times them beside these rows, each checked "
          "against jacutil first.")

# %% [markdown]
# Compare `jacutil` with `first call` in each row: the first call traces
# the graph for this model and loss; every later call with the same loss
# function reuses it. Pass the same function each step (not a new
# `lambda`): a new function is a new graph. The `x fastest peer` column is
# the ratio to the faster of JAX and PyTorch where they ran (below 1:
# jacutil is faster).

# %% [markdown]
# ## Scaling slopes
#
# The slope of log(time) against log(n): 1 is linear, 2 quadratic. It is
# fitted over every size a path ran at, and printed only where that is
# three sizes or more: two points always lie on a line, so a slope from two
# says nothing about its shape. At small n the fast paths still pay fixed
# costs (dispatch, small kernels) on every call; where those count, a slope
# comes out below 1. The time per sample shows it: it falls steeply while
# the fixed costs count, and stops falling once the work dominates.

# %% tags=["nbval-ignore-output"]
fitted = bench.slopes(results)  # only where a path ran at 3+ sizes
too_few = [label for label in bench.series(results) if label not in fitted]
for label, slope in fitted.items():
    print(f"{label:<45} slope {slope:4.2f}")
if too_few:
    print("no slope (ran at fewer than three sizes):", "; ".join(too_few))
for path in ["dense", "compiled"]:
    if path in results["labels"]:
        row = bench.series(results)[results["labels"][path]]
        each = ", ".join(f"{format_seconds(t / n)} at n = {n:,}"
                         for n, t in zip(results["sizes"], row, strict=True)
                         if t)
        print(f"Finding: {results['labels'][path]}, time per sample: {each}")

# %% [markdown]
# ## Where the time goes
#
# Time the hand-derived path piece by piece at the largest n, in this
# process after the benchmark. Each piece includes the ones above it; the
# two floors are timed again beside it. Noise on a shared machine only ever
# adds time, so each piece keeps the fastest of three profiles (each the
# median of `repeats` calls), and `x floor` is each piece over this
# profile's own floor.

# %% tags=["nbval-ignore-output"]
x_big = ju.regression_data(largest, seed=seed)[0]
rounds = [bench.profile_dense(model, x_big, repeats=repeats)
          for _ in range(3)]
profile = {piece: min(r[piece] for r in rounds) for piece in rounds[0]}
floor = profile["floor: fill a preallocated array"]
rows = [f"**Where the hand-derived path's time goes, n = {largest:,}**", "",
        "| piece | fastest of 3 | x floor |", "|---|---:|---:|"]
for piece, seconds in profile.items():
    rows.append(f"| {piece} | {format_seconds(seconds)} | "
                f"{seconds / floor:.1f} |")
display(Markdown("\n".join(rows)))

# %%
size = largest * 2 * ju.flat_params(model).size * 4
print(f"the result at n = {largest:,}: {size / 1e6:,.0f} MB of float32")

# %% [markdown]
# The pieces: the forward pass and the back-propagated signals (tiny
# matrices); the **outer products**, which write the column blocks, n · l · m
# numbers (the size printed above) in all (timed here one layer at a time,
# each from its own plan, so nothing joins them); `tf.concat`, which joins the
# blocks into one tensor, writing every number a second time; and the NumPy
# view that `jac(x)` returns. `.numpy()` or `jac(x, copy=True)` would copy it
# a third time: `jac(x)` hands back a read-only view of TensorFlow's buffer
# instead; ask for the copy only when you must write into the array. What
# the profile says, in this run:

# %% tags=["nbval-ignore-output"]
forward, blocks, joined, view, copy = list(profile.values())[:5]
print(f"Finding: the forward pass is {forward / view:.0%} of jac(x)'s "
      f"{format_seconds(view)}; the rest goes into J itself")
print(f"Finding: in floors (one write of J, {format_seconds(floor)}): "
      f"the column blocks {blocks / floor:.1f}, joined {joined / floor:.1f},"
      f" jac(x) {view / floor:.1f}, jac(x, copy=True) {copy / floor:.1f}")


def added(seconds):
    """A piece's extra time in floors, or noise where it is not positive."""
    return f"{seconds / floor:.1f} floors" if seconds > 0 else "within noise"


print(f"Finding: the blocks alone take "
      f"{'more' if blocks > floor else 'less'} time than one write of J; "
      f"the join adds {added(joined - blocks)}, the copy "
      f"{added(copy - view)}")

# %% [markdown]
# So the time goes into producing J, not into the network: the outer
# products that write it once, the join that writes it again, and a copy
# if you ask for one, each compared with one write of J by the findings.
# Fewer passes over J is what makes a path fast here; past that, the floor
# is the limit no path can pass.
#
# The floor in the profile and the floor in the benchmark's table at the
# same n are the same operation, timed differently and at different moments
# of this run:

# %% tags=["nbval-ignore-output"]
at = {r["path"]: r["median"] for r in results["results"] if r["n"] == largest}
print(f"Finding: at n = {largest:,}, filling a preallocated array took "
      f"{format_seconds(at['floor'])} in the table (the median of "
      f"{repeats} right after it was allocated) and {format_seconds(floor)} "
      "in the profile (the fastest of 3 profiles); a new array (np.full) "
      f"{format_seconds(at['floor_new'])} and "
      f"{format_seconds(profile['floor, new array: np.full'])}")
out = bench.preallocated((largest, 2, ju.flat_params(model).size))
fills = ju.time_call(bench.fill_floor, out, repeats=10)
print(f"Finding: the same fill on a new array, once and then 10 times more: "
      f"{format_seconds(fills.first)}, then "
      f"{format_seconds(min(fills.times))} to "
      f"{format_seconds(max(fills.times))}")

# %% [markdown]
# On a shared machine the same fill varies from call to call, and so does
# every row of every table: compare each path with the floor of its own
# table (the `x floor` column does), and trust a difference only where it is
# larger than the noise. The new array (`np.full`) does the fill's work and
# must also find its memory: where the allocator has to ask the system for
# fresh pages, that costs more than the fill.

# %% [markdown]
# ## Which path, when
#
# | job | use | why |
# |---|---|---|
# | any model | `jacutil.jacobian` | picks the rules, the compiled stage or chunks, and says which |
# | a chain of Dense layers, any n | `compiled_dense_jacobian` | the Dense rule, no tape; among the fastest paths |
# | a chain of known layers | `compiled_jacobian(method="rules")` | a rule per layer, no tape over the model |
# | any other model, fits in memory | `compiled_jacobian` | autodiff `vectorized_map`, linear in n |
# | any model, larger than memory | `chunked_jacobian(..., out=memmap)` | bounded memory, the compiled stage chunk by chunk |
# | one small batch, once | `per_sample_jacobian` | no compile to wait for |
# | never | `loop_jacobian`, `vectorized_jacobian` for large n | overhead per pass; n² memory |
#
# XLA (`jit_compile=True`) pays a compile per padded batch size (a power of
# two, up to `block_size`), and on this small
# network on a CPU it is no reliable gain over the plain `tf.function`: the
# XLA findings above say, size by size, where it won and where it lost in
# this run. Measure before you switch it on.

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** The last layer is linear, so its signal is the identity: its block
# of columns is just the layer's input, with a one appended, on the
# diagonal. Compute the last 66 columns of the Jacobian of `x32` (the last
# layer's kernel, 32 inputs by 2 outputs, then its 2 biases, in
# `flat_params` order) with NumPy from the activations of the second hidden
# layer. To get those activations, run the first two layers as a model of
# their own: `keras.Sequential(model.layers[:2])(x32)` (a `Sequential` of
# existing layers shares their weights). Put the array, of shape
# (n samples, 2 outputs, 66 columns), in `answer`; the check compares it
# with `loop_jacobian`'s.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: dy_k/dW[p, q] = a[p] if q == k else 0; dy_k/db[q] = 1 if q == k.
hidden = keras.Sequential(model.layers[:2])(x32).numpy()  # (n, 32)
a_aug = np.concatenate([hidden, np.ones((len(x32), 1), "float32")], axis=1)
eye = np.eye(2, dtype="float32")
answer = np.einsum("ip,kq->ikpq", a_aug, eye).reshape(len(x32), 2, -1)
print(answer.shape)

# %%
check.exercise("07-1", answer, model=model, x=x32)

# %% [markdown]
# **2.** How much does a writable result cost? `jac(x)` returns a read-only
# view of TensorFlow's buffer; `jac(x, copy=True)` copies it into a new
# NumPy array: it reads every number of J once and writes it once. How many
# bytes does that copy move, read and written together, for the question's
# network at n = 1,000? Put the number of bytes in `answer`. The cell after
# the check times both calls and the floor at that size.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: J holds n * l * m float32 numbers (4 bytes each); the copy reads
# and writes every one.
answer = 2 * 1000 * 2 * ju.flat_params(model).size * 4
print(f"{answer:,} bytes")

# %%
check.exercise("07-2", answer, model=model, n=1000)

# %% tags=["nbval-ignore-output"]
x_1000 = ju.regression_data(1000, seed=seed)[0]
view = ju.time_call(jac, x_1000, repeats=10).median
copy = ju.time_call(jac, x_1000, copy=True, repeats=10).median
fill = ju.time_call(bench.fill_floor, bench.preallocated(jac(x_1000).shape),
                    repeats=10).median
print(f"n = 1,000: jac(x) {format_seconds(view)}, jac(x, copy=True) "
      f"{format_seconds(copy)}: the copy adds {format_seconds(copy - view)}; "
      f"filling J's shape once (the floor) takes {format_seconds(fill)}")

# %% [markdown]
# ## Keypoints
#
# - Measure every path in one run, after a warm-up, with the first call
#   apart, and compare ratios, not absolute times on a shared machine; a
#   difference smaller than the noise (the same path timed twice) is a tie.
# - For Dense networks the per-sample Jacobian can be written down: outer
#   products of each layer's input and its back-propagated signal. It equals
#   autodiff and is among the fastest paths. The same outer products, summed
#   over positions, give a rule per layer type (`jacutil.rules`):
#   convolutions, embeddings, normalization, recurrent layers.
# - Near the limit the cost is writing n · l · m numbers: avoid extra copies
#   (joins, `.numpy()`) and compare with the write floor.
# - Fit a slope over three sizes or more; two points always lie on a line.
# - The nested loop and the batch-wide `tape.jacobian` are never the answer
#   at scale: one is overhead-bound, the other quadratic in memory.
# - JAX and PyTorch compute the same Jacobian from the same weights; the
#   `x peer` column says how far each path is from the faster of them, on
#   this machine, at each n.
