# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Vectorized: one tape for the batch, or one Jacobian per sample
#
# **Questions**
# - How do I drop the loop and let TensorFlow vectorize the Jacobian?
# - Why does the usual answer, `tape.jacobian` over the whole batch, grow
#   like n² in time and memory?
# - What is vectorized over samples instead, and why is it linear?
#
# **Objectives**
# - Run `vectorized_jacobian` and `per_sample_jacobian` and prove both equal
#   to the loop of `01-nested-loop`.
# - Measure time and peak memory against n, and read the slopes of a
#   log-log plot.
# - Predict the memory of a size before running it, and refuse a size that
#   would not fit.
#
# *Teaching: 20 min · Exercises: 15 min*

# %% [markdown]
# ## Setup

# %%
import numpy as np

import jacutil as ju
from jacutil import tf

# %%
# NBVAL_IGNORE_OUTPUT
print(ju.notebook.device_summary())

# %% tags=["parameters"]
n_check = 4  # samples in the correctness checks
batch_sizes = [100, 200, 400, 700, 1000]  # n for vectorized_jacobian
per_sample_sizes = [100, 1000, 10000]  # n for per_sample_jacobian
fit_up_to = 400  # fit the memory model on sizes up to this, predict the rest
map_sizes = [32, 256]  # n for pfor against a while_loop
repeats = 2  # timed runs after the first, per size
safety = 0.5  # run a size only if it needs under this share of free memory
seed = 0

# %%
model = ju.question_mlp(seed=seed)
x_all = ju.regression_data(max(per_sample_sizes + batch_sizes), seed=seed)[0]
x_check = x_all[:n_check]
n_outputs, n_params = 2, ju.flat_params(model).size
print("n_outputs =", n_outputs, " n_params =", n_params)

# %% [markdown]
# ## One tape for the whole batch
#
# The usual answer to the loop of `01`: record **one** forward pass of the
# whole batch and ask the tape for the Jacobian of every output with respect
# to every variable. `tape.jacobian` vectorizes the backward passes with
# *pfor* (parallel for): it rewrites "one backward pass per output row" into
# batched operations, so Python runs once.

# %%
ju.notebook.show_source(ju.vectorized.batch_tape_jacobian)

# %% [markdown]
# `vectorized_jacobian(model, x)` checks its input and calls that function.
# It must return exactly what the loop returned:

# %%
J_loop = ju.loop_jacobian(model, x_check)
J_batch = ju.vectorized_jacobian(model, x_check)
np.testing.assert_allclose(J_batch, J_loop, rtol=1e-5, atol=1e-6)
print("vectorized_jacobian:", J_batch.shape, "== loop_jacobian: True")

# %% [markdown]
# ## One Jacobian per sample, vectorized over samples
#
# The other way round: write the Jacobian of **one** sample (`l` rows), and
# let `tf.vectorized_map` run it for every sample at once. This is
# TensorFlow's counterpart of JAX's `vmap(jacrev(f))`.

# %%
ju.notebook.show_source(ju.vectorized.per_sample_tape_jacobian)

# %%
J_per_sample = ju.per_sample_jacobian(model, x_check)
np.testing.assert_allclose(J_per_sample, J_loop, rtol=1e-5, atol=1e-6)
print("per_sample_jacobian:", J_per_sample.shape, "== loop_jacobian: True")

# %% [markdown]
# ## Why the batch tape is quadratic
#
# `tape.jacobian(y, v)` back-propagates each of the `n·l` output rows through
# the recorded computation - and the recorded computation is the **whole
# batch**. Row `(i, k)` carries a gradient for every sample `j`, although only
# sample `i` can move it. Ask the tape for the Jacobian with respect to the
# inputs (an input is not a variable, so the tape must `watch` it: see
# "TensorFlow words" in 00-welcome) and you see that wasted work: an
# `(n, l, n, d)` array that is zero except where `j == i`.

# %%
x_small = tf.constant(x_all[:6])
with tf.GradientTape() as tape:
    tape.watch(x_small)
    y_small = model(x_small, training=False)
dy_dx = tape.jacobian(y_small, x_small).numpy()  # (n, l, n, d)
blocks = np.abs(dy_dx).sum(axis=(1, 3))  # (n, n): sample i's rows, sample j
print("tape.jacobian(y, x):", dy_dx.shape)
print("non-zero (i, j) blocks:\n", (blocks > 0).astype(int))

# %% [markdown]
# Only the diagonal is non-zero, yet every block was computed. With respect to
# the variables the same happens inside the backward pass: each row's
# gradient flows through all `n` samples' activations, so the work and the
# memory are about `n · l · n · (activations per sample)`: quadratic in n.
# `per_sample_jacobian` differentiates each sample through itself only:
# `n · l · (activations per sample)`, linear.

# %% [markdown]
# ## Predict the memory, then run
#
# `tape.jacobian` of a large batch can ask for more memory than the machine
# has. So before a size runs we **predict** its peak from a measured model,
# `a·n² + b·n + c`, whose constants are stored in `jacutil.memory` (they were
# measured on this network), and run only sizes that need less than `safety`
# of the memory that is free now.

# %%
ju.notebook.show_source(ju.memory.predicted_bytes)

# %%
# NBVAL_IGNORE_OUTPUT
free = ju.memory.available_bytes(safety)
print(f"may use {free / 2**30:.1f} GiB ({safety:.0%} of the free memory)")
batch_run = []
for n in sorted(batch_sizes + [10_000]):
    need = ju.memory.predicted_bytes(n, "batch")
    fits = need < free
    print(f"n = {n:>6,}: predicted {need / 2**20:>10,.0f} MiB   run: {fits}")
    if fits and n in batch_sizes:
        batch_run.append(n)
big = ju.memory.predicted_bytes(10_000, "batch") / 2**30
print(f"Finding: tape.jacobian over n = 10,000 samples would need about "
      f"{big:.0f} GiB; not run")

# %% [markdown]
# ### Measuring memory
#
# TensorFlow's tensors live outside Python's allocator, so `tracemalloc` sees
# none of them. `peak_memory` samples the process's real resident memory
# (RSS) while a call runs. One more trap: on x86 CPUs TensorFlow (with oneDNN)
# keeps the memory it grew in a **pool** and reuses it, so a second call at
# the same size measures almost nothing. `measure_in_fresh_process` therefore
# runs each sweep in a new Python process, sizes increasing, and reports how
# far the process had to grow.

# %%
ju.notebook.show_source(ju.memory.measure_in_fresh_process)

# %%
# NBVAL_IGNORE_OUTPUT
def measure(method, sizes):  # bytes; at least 1, for the log-log plots
    peaks = ju.memory.measure_in_fresh_process(method, sizes)
    return {n: max(peak, 1) for n, peak in zip(sizes, peaks, strict=True)}


batch_peaks = measure("batch", batch_run)
per_sample_peaks = measure("per_sample", per_sample_sizes)
fit_sizes = [n for n in batch_run if n <= fit_up_to]
batch_model = ju.memory.MemoryModel.fit(
    fit_sizes, [batch_peaks[n] for n in fit_sizes], quadratic=True)
per_sample_model = ju.memory.MemoryModel.fit(
    per_sample_sizes, list(per_sample_peaks.values()), quadratic=False)
print("fitted here:", f"batch {batch_model.quadratic:,.0f} bytes x n^2;",
      f"per sample {per_sample_model.linear:,.0f} bytes x n")
print("stored:     ", f"batch {ju.memory.BATCH_JACOBIAN.quadratic:,.0f}"
      " bytes x n^2;",
      f"per sample {ju.memory.PER_SAMPLE_JACOBIAN.linear:,.0f} bytes x n")
for n in batch_run:
    off = batch_model.predict(n) / batch_peaks[n] - 1
    print(f"n = {n:>5}: measured {batch_peaks[n] / 2**20:7.1f} MiB, "
          f"fit on n <= {fit_up_to} predicts "
          f"{batch_model.predict(n) / 2**20:7.1f} MiB ({off:+.0%})")

# %% [markdown]
# Read the last column: how far the fit on the small sizes is from each
# measured peak. Memory grows with n², and a fit on small runs predicts the
# large ones to within that margin - close enough to choose a chunk size
# before running out of memory (notebook 04 adds a safety margin for it).

# %% [markdown]
# ## Time against n
#
# Every size is timed after its first call (the trace that builds the graph,
# and pfor's conversion: "TensorFlow words" in 00-welcome), which is
# reported apart.

# %%
# NBVAL_IGNORE_OUTPUT
batch_times, per_sample_times, firsts = {}, {}, {}
for n in batch_run:
    timing = ju.time_call(ju.vectorized_jacobian, model, x_all[:n],
                          repeats=repeats)
    batch_times[n], firsts["batch", n] = timing.median, timing.first
for n in per_sample_sizes:
    timing = ju.time_call(ju.per_sample_jacobian, model, x_all[:n],
                          repeats=repeats)
    per_sample_times[n], firsts["per_sample", n] = timing.median, timing.first
print(f"{'n':>6} | {'method':<20} | {'first s':>8} | {'median s':>8} "
      f"| {'peak MiB':>9}")
for name, times, peaks in [("vectorized_jacobian", batch_times, batch_peaks),
                           ("per_sample_jacobian", per_sample_times,
                            per_sample_peaks)]:
    key = "batch" if name.startswith("vec") else "per_sample"
    for n in times:
        print(f"{n:>6} | {name:<20} | {firsts[key, n]:8.3f} | "
              f"{times[n]:8.3f} | {peaks[n] / 2**20:9.1f}")

# %%
# NBVAL_IGNORE_OUTPUT
import matplotlib.pyplot as plt

sizes = sorted(set(batch_run) | set(per_sample_sizes))


def on(sizes, values):
    return [values.get(n, np.nan) for n in sizes]


# The time above the fixed cost of eager pfor (the smallest size's time):
fixed = batch_times[batch_run[0]]
extra = {n: t - fixed for n, t in batch_times.items() if t > fixed}
series = {"vectorized_jacobian": on(sizes, batch_times),
          "per_sample_jacobian": on(sizes, per_sample_times)}
if len(extra) >= 2:
    series["vectorized, above its fixed cost"] = on(sizes, extra)
fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
ju.plots.loglog_scaling(sizes, series, ax=ax_t)
ax_t.set_title("time (steady state)")
ju.plots.loglog_scaling(sizes, {
    "vectorized_jacobian": on(sizes, {n: p / 2**20
                                      for n, p in batch_peaks.items()}),
    "per_sample_jacobian": on(sizes, {n: p / 2**20
                                      for n, p in per_sample_peaks.items()}),
}, ylabel="peak MiB", ax=ax_m)
ax_m.set_title("peak memory (fresh process)")
fig.tight_layout()
large = batch_run[-4:]  # the largest sizes: past the fixed cost
large_extra = [n for n in large if n in extra]
slope_t = (ju.plots.fitted_slope(large_extra, [extra[n] for n in large_extra])
           if len(large_extra) >= 2 else np.nan)
slope_m = ju.plots.fitted_slope(large, [batch_peaks[n] for n in large])
slope_p = ju.plots.fitted_slope(per_sample_sizes,
                                [per_sample_peaks[n]
                                 for n in per_sample_sizes])
print(f"Finding: vectorized_jacobian (n >= {large[0]}): time above its "
      f"fixed {fixed:.2f} s ~ n^{slope_t:.2f}, "
      f"memory ~ n^{slope_m:.2f}; per_sample_jacobian memory ~ "
      f"n^{slope_p:.2f}")
n_top = max(batch_run)
print(f"Finding: at n = {n_top:,}: vectorized_jacobian "
      f"{batch_times[n_top]:.2f} s and {batch_peaks[n_top] / 2**20:,.0f} MiB"
      + (f"; per_sample_jacobian {per_sample_times[n_top]:.2f} s and "
         f"{per_sample_peaks[n_top] / 2**20:,.0f} MiB"
         if n_top in per_sample_times else ""))

# %% [markdown]
# Read the slopes, not the first points. Both functions pay a large fixed
# cost on every call: eager TensorFlow converts the function with pfor
# again each time (a few tenths of a second here; `03-compiled` removes it).
# Up to n = 1,000 that fixed cost hides much of the batch tape's time, so
# look at the time *above* it (the third line): it grows
# like n², and so does the memory. The per-sample Jacobian's memory grows
# like n: a few copies of the result, `n · l · m · 4` bytes.

# %% [markdown]
# ## pfor against a `while_loop`
#
# `tf.vectorized_map` turns the per-sample function into batched operations
# (pfor). `tf.map_fn` runs the same function in a `while_loop`, one sample
# per iteration. Both inside `tf.function`, so only the strategy differs:

# %%
target = ju.target.resolve_target(model)


@tf.function
def with_pfor(x):
    return ju.vectorized.per_sample_tape_jacobian(target, x)


@tf.function
def with_while_loop(x):
    def one_sample(xi):
        with tf.GradientTape() as tape:
            y = target.forward(xi[None])
        jacobians = tape.jacobian(y, target.variables)
        return ju.target.stack_columns(jacobians, target.variables, 1)[0]

    return tf.map_fn(one_sample, x)


x_map = tf.constant(x_all[: min(map_sizes)])
np.testing.assert_allclose(with_while_loop(x_map).numpy(),
                           with_pfor(x_map).numpy(), rtol=1e-5, atol=1e-6)
print("tf.map_fn == tf.vectorized_map: True")

# %%
# NBVAL_IGNORE_OUTPUT
for n in map_sizes:
    x_n = tf.constant(x_all[:n])
    pfor = ju.time_call(with_pfor, x_n, repeats=repeats).median
    loop = ju.time_call(with_while_loop, x_n, repeats=repeats).median
    print(f"n = {n:>4}: vectorized_map {1e3 * pfor:7.1f} ms   "
          f"map_fn {1e3 * loop:7.1f} ms   ratio {loop / pfor:5.1f}")
print(f"Finding: at n = {n}, tf.map_fn (while_loop) is {loop / pfor:.0f}x "
      "slower than tf.vectorized_map (pfor)")

# %% [markdown]
# The `while_loop` pays one small step per sample, like the Python loop of
# `01` but without Python. pfor does one batched operation per step of the
# function for all samples. pfor wins whenever the function can be
# vectorized; `tf.vectorized_map(..., fallback_to_while_loop=True)` (the
# default) falls back to a loop for operations it cannot convert.

# %% [markdown]
# ## Exercises
#
# **1.** With the model fitted in this notebook (`batch_model`), find the
# largest batch for which `vectorized_jacobian` fits in 8 GiB, and how much
# doubling it would need.

# %% tags=["solution"] jupyter={"source_hidden": true}
# NBVAL_IGNORE_OUTPUT
# Solution: solve a*n^2 + b*n + c = 8 GiB; doubling n multiplies the n^2
# term by four.
n_max = batch_model.largest_n(8 * 2**30)
print(f"largest n in 8 GiB: {n_max:,}; 2n needs "
      f"{batch_model.predict(2 * n_max) / 2**30:.1f} GiB")

# %% [markdown]
# **2.** Take the Jacobian with respect to the last layer's variables only
# (`variables=model.layers[-1].trainable_variables`), with both functions.
# Check that they agree, and that they equal the last columns of the full
# `J_per_sample`.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: the columns come in flat_params order, so the last layer's kernel
# and bias are the last 32 * 2 + 2 = 66 columns.
last = model.layers[-1].trainable_variables
J_last_batch = ju.vectorized_jacobian(model, x_check, variables=last)
J_last = ju.per_sample_jacobian(model, x_check, variables=last)
n_last = sum(int(np.prod(v.shape)) for v in last)
np.testing.assert_allclose(J_last_batch, J_last, rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(J_last, J_per_sample[:, :, -n_last:], rtol=1e-6)
print(J_last.shape, "agree: True")

# %% [markdown]
# ## Keypoints
#
# - `tape.jacobian` over the batch (`vectorized_jacobian`) is far faster than
#   the loop at small n, and equal to it.
# - It back-propagates every output row through the whole batch: time and
#   memory grow like n² (n = 10,000 on this small network: over 100 GiB).
# - `tf.vectorized_map` of a one-sample Jacobian (`per_sample_jacobian`, the
#   counterpart of `vmap(jacrev)`) differentiates each sample through itself:
#   linear in n. pfor beats a `while_loop` (`tf.map_fn`).
# - Measure memory as resident memory, in a fresh process; predict a size
#   before running it.
# - Next, `03-compiled`: remove the fixed cost of eager mode with
#   `tf.function`.
