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
# - Derive the per-sample Jacobian of a Dense network by hand, and a rule
#   per layer type (`jacutil.rules`); prove both equal to finite differences.
# - Run `make bench` on a small scale and read its table: ratios to the
#   loop, the fastest path and the *write floor*.
# - Explain where the fastest path's time goes, and choose a path for a job.
#
# *Teaching: 46 min · Exercises: 19 min*

# %% [markdown]
# ## Setup

# %%
import numpy as np
from IPython.display import Markdown, display

import jacutil as ju
from jacutil import bench, keras, tf
from jacutil.bench import format_seconds
from jacutil.teaching import check
from jacutil.teaching.claims import claim

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
sizes = [100, 300, 3000]  # numbers of samples (the MLP)
repeats = 3  # timed runs after the first, per path and size
max_seconds = 10  # skip a path at a size if all its runs would take longer
paths = ["loop", "vectorized", "compiled_batch", "compiled", "compiled_xla",
         "dense", "rules", "jacobian", "jax", "torch"]  # None: all of PATHS
other_sizes = [100]  # numbers of samples for the CNN and the LSTM
other_paths = ["compiled", "rules", "jacobian", "jax", "torch"]
peer_row_sizes = [1000]  # samples of the per-sample gradient rows
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
# forward step computes the layer and keeps the input $a$ and the slope
# $\sigma'(z)$; its backward step multiplies the signal by the slope,
# writes the layer's block of columns, and passes $\delta W^\top$ to the
# layer below. In plain TensorFlow, for a chain of Dense layers (the rule's
# whole idea; it is proved equal to `jacutil`'s below):

# %% tags=["plain-version"]
def plain_dense_jacobian(model, x):
    """J of a chain of Dense layers by the rule: an outer product per layer."""
    a, inputs, slopes = tf.constant(x), [], []
    for layer in model.layers:  # forward: keep each layer's input and slope
        with tf.GradientTape() as tape:
            z = a @ layer.kernel + layer.bias
            tape.watch(z)
            out = layer.activation(z)
        inputs.append(a), slopes.append(tape.gradient(out, z))
        a = out
    n, l = a.shape
    delta = tf.eye(l, dtype=a.dtype)[None] * slopes[-1][:, None, :]  # (n, l, q)
    blocks = []
    for k in reversed(range(len(model.layers))):  # backward: write, pass down
        a1 = tf.concat([inputs[k], tf.ones_like(inputs[k][:, :1])], 1)  # [a, 1]
        blocks.insert(0, tf.reshape(a1[:, None, :, None] * delta[:, :, None], [n, l, -1]))
        delta = delta @ tf.transpose(model.layers[k].kernel) * slopes[k - 1][:, None] if k else None
    return tf.concat(blocks, 2).numpy()


# %% [markdown]
# In `jacutil` the block is written by `kernel_and_bias`, which appends the
# column of ones and takes the outer products for every sample and output.
# What it adds: inputs with positions (a convolution's patches, a
# sequence's steps, `by_position`), a kernel or a bias that is not wanted
# (frozen, or not asked for), and one joint block for a kernel and its bias:

# %%
ju.teaching.notebook.show_source(ju.rules.blocks.kernel_and_bias,
                                 plain=plain_dense_jacobian)

# %% [markdown]
# `compiled_dense_jacobian(model)` runs this rule for a chain of Dense
# layers on flat inputs, in a `tf.function` with a `None` batch dimension,
# and checks it against autodiff on a few samples of the first batch of each
# shape. Any other model, or one that fails the check, gets the autodiff
# per-sample stage, and `jac.fallback` says why.

# %% [markdown]
# ## Is it right?
#
# In float64 against finite differences on a smaller network of the same
# kind; then on the question's network in float32 against the autodiff
# per-sample stage of notebook 02.

# %%
small64 = ju.question_mlp(n_inputs=4, n_outputs=3, hidden=(8, 6),
                          seed=seed, dtype="float64")
x_small = np.random.default_rng(seed).standard_normal((n_check, 4))
J_hand = ju.dense_jacobian(small64, x_small)
np.testing.assert_array_equal(plain_dense_jacobian(small64, x_small), J_hand)
print("plain_dense_jacobian == dense_jacobian, bit for bit: True")
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
# ## Beyond Dense: a rule per layer
#
# Every layer with weights multiplies its input by its kernel at some
# positions: once for Dense, at every output pixel for a convolution (its
# input there is the **patch** under the kernel), at every time step for a
# recurrent layer. So each layer's block is the same outer product of input
# and signal, summed over positions. `jacutil.rules` holds one **rule** per
# layer type (Dense, convolutions, Embedding, normalization, reshapes,
# activations, recurrent layers by back-propagation through time); a layer
# without one passes the signal through by autodiff. The convolution's rule
# calls the same `kernel_and_bias`, with the patches as the input `a`.
#
# `compiled_jacobian(model, method="rules")` runs them, and says which rule
# each layer got; a small convolution in float64, against finite
# differences:

# %%
keras.utils.set_random_seed(seed)
conv64 = keras.Sequential([
    keras.Input((6, 6, 1), dtype="float64"),
    keras.layers.Conv2D(2, 3, activation="tanh", dtype="float64"),
    keras.layers.Flatten(dtype="float64"),
    keras.layers.Dense(2, dtype="float64"),
])
x_conv = np.random.default_rng(seed).standard_normal((3, 6, 6, 1))
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
# `make bench` times every path in one process, at n = 100, 1,000 and
# 10,000, and measures each path's peak memory apart, in a fresh process per
# path. Here the same code at the sizes of the parameters cell, with memory
# measured in this process (`memory_mode="inline"`, see below), and the
# table of the largest size. Each path's first call (trace, compile) is
# timed apart, then `repeats` more give the median, after a check against
# the compiled per-sample stage. The **write floor** (`x floor`) is filling
# a preallocated array of J's shape: whatever computes J writes its
# n · l · m numbers at least once. `x peer` compares with JAX and PyTorch
# when installed (`make bench-peers`).
#
# A path is skipped at a size where its first call and `repeats` more, at
# its predicted time per call (from the sizes it ran at), would exceed
# `max_seconds`; or, for the quadratic `tape.jacobian` paths, where its
# predicted peak memory is above half the memory free.

# %% tags=["nbval-ignore-output"]
results = bench.run_bench(sizes, repeats=repeats, max_seconds=max_seconds,
                          memory_mode="inline", paths=paths, seed=seed,
                          log=lambda *a: None)
largest = max(sizes)
display(Markdown(bench.table_at(results, largest)))

# %% [markdown]
# The `peak memory` column is what each first call added, in this process,
# above the level just before it. TensorFlow keeps the memory it grew in a
# pool and reuses it, so a path run after another one grew the pool reads
# too little, down to nothing. A fresh process has no such pool: here are
# the quadratic paths measured both ways, then the memory rule with this
# run's values:

# %% tags=["nbval-ignore-output"]
quadratic = [r for r in results["results"] if r["predicted_peak"]]
for name in sorted({r["path"] for r in quadratic}):
    ran = [r for r in quadratic if r["path"] == name and r["median"]]
    fresh = bench.measure_in_fresh_process(name, [r["n"] for r in ran], seed)
    for r, peak in zip(ran, fresh, strict=True):
        print(f"Finding: {results['labels'][name]}, n = {r['n']:,}: peak "
              f"{peak / 2**20:,.0f} MiB in a fresh process, "
              f"{r['peak'] / 2**20:,.0f} MiB in this one")
# the three guesses of a quadratic path's peak at n, from these inputs
mlp = bench.MODELS["mlp"]
x_one = mlp.inputs(1, seed)
network = mlp.build(seed)
l = bench.paths.count_outputs(network, x_one)
activations = ju.core.memory.activation_elements(network, x_one, unroll=False)
per_n2 = l * activations * x_one.dtype.itemsize  # bytes per n**2
fit02 = ju.core.memory.BATCH_JACOBIAN
print(f"guesses of the peak at n: (a) notebook 02's fit "
      f"{fit02.quadratic:,.0f} n² + {fit02.constant:,.0f} bytes; (b) l x "
      f"activations x bytes each = {l} x {activations:,} x "
      f"{x_one.dtype.itemsize} = {per_n2:,} bytes x n²; (c) the largest "
      "peak / n² measured at a smaller n, x n²")
for n in sizes:
    r = min((r for r in quadratic if r["n"] == n), key=lambda r: r["free"],
            default=None)
    if r:
        smaller = [q["peak"] / q["n"] ** 2 for q in results["results"]
                   if q["path"] == r["path"] and q["n"] < n and q["peak"]]
        guesses = {"a": fit02.predict(n), "b": per_n2 * n**2,
                   "c": max(smaller) * n**2 if smaller else 0.0}
        largest_guess = max(guesses, key=guesses.get)
        assert abs(guesses[largest_guess] - r["predicted_peak"]) <= 1, (
            "the bench predicted otherwise")
        skipped = r["predicted_peak"] > r["free"] / 2
        assert skipped == str(r["skipped"]).startswith("out of memory")
        print(f"n = {n:,}, {results['labels'][r['path']]}: guesses "
              + ", ".join(f"({k}) {v / 2**30:.2f}" for k, v in guesses.items())
              + f" GiB; predicted peak ({largest_guess}) "
              f"{r['predicted_peak'] / 2**30:.2f} GiB, half the free memory "
              f"{r['free'] / 2**31:.1f} GiB: "
              + ("above: skipped" if skipped else "below: allowed"))

# %% [markdown]
# A size runs only where its predicted peak, the largest of the three
# guesses printed above, is below half the free memory. The plot has one line per path, the floors in black.

# %% tags=["nbval-ignore-output"]
ax = bench.plot(results)


for row in bench.summary(results):  # jacutil's fastest path at each n
    peer = f", {row['per_peer']:.2f}x the peer" if row["per_peer"] else ""
    print(f"Finding: MLP, n = {row['n']:,}, the fastest jacutil path is "
          f"{results['labels'][row['best']]}, {row['per_floor']:.1f}x the "
          f"floor{peer}")
for n in sizes:
    at = bench.ratios(results, n)
    if "compiled" in at and "compiled_xla" in at:
        print(f"Finding: MLP, n = {n:,}, vectorized_map with XLA takes "
              f"{at['compiled_xla'].fastest / at['compiled'].fastest:.2f}x "
              "the time without XLA")

# %% [markdown]
# When `jacutil.jacobian` picks the layer rules, its row and the `layer
# rules` row time the same computation: their gap is this run's noise, and
# rows closer than it are a tie.

# %% tags=["nbval-ignore-output"]
_, choice = ju.jacobian(model, ju.regression_data(largest, seed=seed)[0],
                        explain=True)
print(f"jacutil.jacobian takes: {choice.path} ({choice.chunks} chunk(s))")
for n in sizes:
    at = bench.ratios(results, n)
    if choice.path == "layer rules" and "rules" in at and "jacobian" in at:
        apart = max(at["rules"].fastest, at["jacobian"].fastest) / min(
            at["rules"].fastest, at["jacobian"].fastest)
        print(f"Finding: MLP, n = {n:,}, the same computation timed twice: "
              f"{apart:.2f}x apart")

# %% [markdown]
# ## A CNN and an LSTM
#
# The same run on a CNN and an LSTM: the CNN is notebook 08's (`small_cnn`);
# the LSTM has notebook 08's layers (`sequence_lstm`) but longer sequences
# than 08's default (its label gives the steps). The hand-derived Dense
# path does not apply; the layer rules do.

# %% tags=["nbval-ignore-output"]
others = {}
for name in ["cnn", "lstm"]:
    others[name] = bench.run_bench(
        other_sizes, repeats=repeats, max_seconds=max_seconds,
        memory_mode="inline", paths=other_paths, seed=seed, model=name,
        log=lambda *a: None)
    print(others[name]["model_label"])
    spec = bench.MODELS[name]
    _, picked = ju.jacobian(spec.build(seed), spec.inputs(other_sizes[0], seed),
                            explain=True)
    print(f"jacutil.jacobian takes: {picked.path} ({picked.chunks} chunk(s))")
    claim(f"picks-rules-{name}", picked.path == "layer rules",
          f"on the {name.upper()}, jacutil.jacobian picks the layer rules")
    for n in other_sizes:
        at = bench.ratios(others[name], n)
        print(f"Finding: {name.upper()}, n = {n:,}: " + ", ".join(
            f"{others[name]['labels'][p]} {r.floor:.0f}x the floor"
            for p, r in sorted(at.items(), key=lambda item: item[1].floor)))
        if picked.path == "layer rules" and {"rules", "jacobian"} <= set(at):
            ms = {p: bench.report.results_at(others[name], n)[p]["median"] * 1e3
                  for p in ("rules", "jacobian")}
            print(f"Finding: {name.upper()}, n = {n:,}, the same computation "
                  f"timed twice (layer rules {ms['rules']:.2f} ms, "
                  f"jacutil.jacobian {ms['jacobian']:.2f} ms): "
                  f"{max(ms.values()) / min(ms.values()):.2f}x apart")

# %% [markdown]
# Where the best path sits much further above the floor than on the MLP,
# the arithmetic (convolutions, the recurrence step by step), not writing
# J, is the limit. On both models `jacutil.jacobian` picks the layer rules,
# as on the MLP, so its row and the layer-rules row time the same
# computation: the gap between them is this run's noise (the last Finding
# of each model gives it, in milliseconds). A call of a few milliseconds
# is moved by any pause of the machine, so such a gap is large in
# multiples of the floor and says nothing about the two paths.

# %% [markdown]
# ## Beyond the Jacobian: per-sample gradients
#
# Often a user needs less than J: each sample's own gradient (DP-SGD clips
# it, notebook 09), once per training step. Each row times the call a user
# repeats: one warm-up call (`first call`, the trace), then the median.
# (`make bench-peers` adds their norms, and the Jacobian of models with
# branches.)

# %% tags=["nbval-ignore-output"]
gradient_rows = [name for name in bench.TASKS if name.startswith("grad")]
rows = bench.run_peer_rows(gradient_rows, sizes=peer_row_sizes,
                           repeats=repeats, seed=seed, log=lambda *a: None)
display(Markdown(bench.peer_rows_table(rows)))
proofs = [bench.proof_line(row, rows["kinds"])
          for row in rows["rows"] if row["peers"]]
print("\n".join(proofs) or "JAX and PyTorch are not installed here.")

# %% [markdown]
# The first call traces a graph for this model and loss; later calls with
# the same loss function reuse it, so pass the same function each step, not
# a new `lambda`.

# %% [markdown]
# ## Scaling slopes
#
# The slope of log(time) against log(n): 1 is linear, 2 quadratic, fitted
# only where a path ran at three sizes or more (two points always lie on a
# line). At small n the fast paths still pay fixed costs per call, which
# pull a slope below 1.

# %% tags=["nbval-ignore-output"]
fitted = bench.slopes(results)  # only where a path ran at 3+ sizes
print("; ".join(f"{label}: {slope:.2f}" for label, slope in fitted.items()))
floors = {r["n"]: r["median"] for r in results["results"]
          if r["path"] == "floor"}
mb = 2 * ju.flat_params(model).size * 4 / 1e6  # MB of J per sample
print(f"Finding: the write floor's slope is "
      f"{fitted[results['labels']['floor']]:.2f}; its time per MB of J: "
      + ", ".join(f"{format_seconds(t / (n * mb))} at n = {n:,} "
                  f"({n * mb:,.1f} MB)" for n, t in floors.items()))

# %% [markdown]
# The write floor does the same work per number at every n: its slope
# would be 1 if every megabyte cost the same. A small array can stay in the
# CPU's caches, a large one goes to main memory and costs more per byte (a
# slope above 1): its time per MB shows which happened.

# %% [markdown]
# ## Where the time goes
#
# The hand-derived path piece by piece at the largest n. Each piece runs
# the code of the one above it and more: the forward pass; the column blocks
# (outer products writing J's n · l · m numbers once); the blocks joined by
# `tf.concat` (writing them again); the read-only view `jac(x)` returns;
# and `jac(x, copy=True)`, a writable copy. Each piece is timed apart: the
# fastest of three profiles (each the median of `repeats` calls), and the
# slowest, which shows the noise.

# %% tags=["nbval-ignore-output"]
x_big = ju.regression_data(largest, seed=seed)[0]
rounds = [bench.profile_dense(model, x_big, repeats=repeats)
          for _ in range(3)]
profile = {piece: min(r[piece] for r in rounds) for piece in rounds[0]}
slowest = {piece: max(r[piece] for r in rounds) for piece in rounds[0]}
floor = profile["floor: fill a preallocated array"]
rows = [f"**Where the hand-derived path's time goes, n = {largest:,}**", "",
        "| piece | fastest of 3 | slowest of 3 | x floor |",
        "|---|---:|---:|---:|"]
for piece, seconds in profile.items():
    rows.append(f"| {piece} | {format_seconds(seconds)} | "
                f"{format_seconds(slowest[piece])} | {seconds / floor:.1f} |")
display(Markdown("\n".join(rows)))

# %% tags=["nbval-ignore-output"]
pieces = list(profile)[:5]  # each piece runs the one above it and more
names = ["forward", "blocks", "joined", "jac(x)", "jac(x, copy=True)"]
forward, view = profile[pieces[0]], profile[pieces[3]]
print(f"Finding: the forward pass is {forward / view:.0%} of jac(x)'s "
      f"{format_seconds(view)}")
steps = []
for k in range(1, 5):
    added = profile[pieces[k]] - profile[pieces[k - 1]]
    noise = max(slowest[p] - profile[p] for p in pieces[k - 1:k + 1])
    steps.append(f"{names[k]} {1e3 * added:+.1f} ms ("
                 f"{'beyond' if abs(added) > noise else 'within'} the "
                 f"noise, {1e3 * noise:.1f} ms)")
print("Finding: each piece minus the one above:", "; ".join(steps))

# %% [markdown]
# A piece that reads faster than the one above it, or adds less than the
# noise (the spread of its profiles), is a tie in this run. The blocks, the
# join and the copy are each a pass over J: fewer passes make a path fast,
# and the floor is the limit.

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
# XLA (`jit_compile=True`) pays a compile per padded batch size, and on this
# small network on a CPU it is no reliable gain: the XLA findings above say
# how it did in this run. Measure before you use it.

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
# - Time every path in one run, the first call apart, and compare ratios; a
#   difference smaller than the noise is a tie. Measure memory in a fresh
#   process: a pooled allocator hides what an earlier call grew.
# - A Dense layer's block of J is an outer product of its input and the
#   back-propagated signal; summed over positions, a rule per layer type.
# - Near the limit the cost is writing n · l · m numbers: avoid extra
#   passes over J and compare with the write floor.
# - The nested loop and the batch-wide `tape.jacobian` are never the answer
#   at scale: one is overhead-bound, the other quadratic in memory.
