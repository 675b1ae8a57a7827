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
# - Why does the usual answer, `tape.jacobian` over the whole batch, do
#   work that grows like n²?
# - What is vectorized over samples instead, and why is it linear?
#
# **Objectives**
# - Run `vectorized_jacobian` and `per_sample_jacobian` and prove both equal
#   to the loop of `01-nested-loop`.
# - Measure peak memory against n in a fresh process, and read its slope.
# - Predict the memory of a size before running it, and refuse a size that
#   would not fit.
#
# *Teaching: 21 min · Exercises: 7 min · Going further: 33 min*

# %% [markdown]
# ## Setup

# %%
import numpy as np

import jacutil as ju
from jacutil import tf
from jacutil.teaching import check
from jacutil.teaching.claims import claim

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_check = 4  # samples in the correctness checks
batch_sizes = [100, 200, 400, 700, 1000]  # n for vectorized_jacobian
per_sample_sizes = [100, 1000, 10000, 20000, 30000]  # n, per_sample_jacobian
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
# *pfor* (parallel for:
# [TensorFlow words](00-welcome.ipynb#TensorFlow-words)): it rewrites "one
# backward pass per output row" into batched operations, so Python runs
# once. In plain TensorFlow:

# %% tags=["plain-version"]
def plain_batch_jacobian(model, x):
    """tape.jacobian of the whole batch's outputs: (n, l, m)."""
    with tf.GradientTape() as tape:
        y = model(x)  # (n, l): one forward pass of the batch
    blocks = tape.jacobian(y, model.trainable_variables)  # (n, l, *shape) each
    n, n_out = y.shape
    return tf.concat([tf.reshape(b, [n, n_out, -1]) for b in blocks], 2).numpy()


# %% [markdown]
# `jacutil`'s `batch_tape_jacobian` is the same tape. Its `target` is the
# model's forward pass and variables as every stage sees them (any inputs,
# training mode or not, chosen variables: notebook 01), and `stack_columns`
# joins the blocks, with zeros for a variable the outputs do not use:

# %%
ju.teaching.notebook.show_source(ju.stages.vectorized.batch_tape_jacobian,
                                plain=plain_batch_jacobian)

# %% [markdown]
# `vectorized_jacobian(model, x)` checks its input and calls that function.
# It must return exactly what the loop returned, and what the plain version
# does:

# %%
J_loop = ju.loop_jacobian(model, x_check)
J_batch = ju.vectorized_jacobian(model, x_check)
np.testing.assert_allclose(J_batch, J_loop, rtol=1e-5, atol=1e-6)
np.testing.assert_array_equal(plain_batch_jacobian(model, x_check), J_batch)
print("vectorized_jacobian:", J_batch.shape, "== loop_jacobian: True;",
      "== plain_batch_jacobian, bit for bit: True")

# %% [markdown]
# ## One Jacobian per sample, vectorized over samples
#
# The other way round: write the Jacobian of **one** sample (`l` rows), and
# let `tf.vectorized_map` run it for every sample at once. This is
# TensorFlow's counterpart of JAX's `vmap(jacrev(f))`. In plain TensorFlow:

# %% tags=["plain-version"]
def plain_per_sample_jacobian(model, x):
    """One sample's (l, m) Jacobian, vectorized over the n samples."""
    def one_sample(x_i):
        with tf.GradientTape() as tape:
            y = model(x_i[None])[0]  # (l,): a batch of one sample
        blocks = tape.jacobian(y, model.trainable_variables)
        return tf.concat([tf.reshape(b, [y.shape[0], -1]) for b in blocks], 1)
    return tf.vectorized_map(one_sample, tf.constant(x)).numpy()


# %% [markdown]
# `jacutil`'s version is the batch tape above, run on a batch of one sample
# (`tf.nest.map_structure` makes one from a sample that is a list or dict of
# arrays) and mapped over the samples:

# %%
ju.teaching.notebook.show_source(ju.stages.vectorized.per_sample_tape_jacobian,
                                plain=plain_per_sample_jacobian)

# %%
J_per_sample = ju.per_sample_jacobian(model, x_check)
np.testing.assert_allclose(J_per_sample, J_loop, rtol=1e-5, atol=1e-6)
np.testing.assert_array_equal(plain_per_sample_jacobian(model, x_check),
                              J_per_sample)
print("per_sample_jacobian:", J_per_sample.shape, "== loop_jacobian: True;",
      "== plain_per_sample_jacobian, bit for bit: True")

# %% [markdown]
# ## Why the batch tape is quadratic
#
# `tape.jacobian(y, v)` back-propagates each of the `n·l` output rows through
# the recorded computation - and the recorded computation is the **whole
# batch**. Row `(i, k)` carries a gradient for every sample `j`, although only
# sample `i` can move it. Ask the tape for the Jacobian with respect to the
# inputs (an input is not a variable, so the tape must `watch` it: see
# [TensorFlow words](00-welcome.ipynb#TensorFlow-words)) and you see that
# wasted work: an `(n, l, n, d)` array that is zero except where `j == i`.

# %%
x_small = tf.constant(x_all[:6])
with tf.GradientTape() as tape:
    tape.watch(x_small)
    y_small = model(x_small, training=False)
dy_dx = tape.jacobian(y_small, x_small).numpy()  # (n, l, n, d)
blocks = np.abs(dy_dx).sum(axis=(1, 3))  # (n, n): sample i's rows, sample j
print("non-zero (i, j) blocks:\n", (blocks > 0).astype(int))
claim("diagonal-only", np.array_equal(blocks > 0, np.eye(len(blocks), dtype=bool)),
      f"of the {blocks.size} (i, j) blocks computed, only the {len(blocks)} "
      "with j == i are non-zero")

# %% [markdown]
# Every block was computed, the zeros too. With respect to
# the variables the same happens inside the backward pass: each row's
# gradient flows through all `n` samples' activations, so the work and the
# memory are about `n · l · n · (activations per sample)`: quadratic in n.
# `per_sample_jacobian` differentiates each sample through itself only:
# `n · l · (activations per sample)`, linear.

# %% [markdown]
# ## Predict the memory, then run
#
# `tape.jacobian` of a large batch can ask for more memory than the machine
# has. So before a size runs we **predict** its peak, `a·n² + b·n + c`,
# with constants measured on this network and stored in
# `jacutil.core.memory`, and run only sizes that need less than `safety` of
# the memory free now. In plain Python:

# %% tags=["plain-version"]
def plain_predicted_bytes(n):
    """a n^2 + b n + c bytes, with the constants measured for the batch tape."""
    measured = ju.core.memory.BATCH_JACOBIAN
    a, b, c = measured.quadratic, measured.linear, measured.constant
    return a * n**2 + b * n + c


for n in batch_sizes:
    assert plain_predicted_bytes(n) == ju.core.memory.predicted_bytes(n, "batch")
print("plain_predicted_bytes == predicted_bytes: True")

# %% [markdown]
# `ju.core.memory.predicted_bytes(n, method)` is that polynomial for
# `method="batch"`, and the per-sample Jacobian's own model, linear in n,
# for `method="per_sample"`:

# %% tags=["nbval-ignore-output"]
free = ju.core.memory.available_bytes(safety)
print(f"may use {free / 2**30:.1f} GiB ({safety:.0%} of the free memory)")
for n in sorted(batch_sizes + [10_000]):
    need = ju.core.memory.predicted_bytes(n, "batch")
    print(f"n = {n:>6,}: predicted {need / 2**20:>10,.0f} MiB   run: {need < free}")
batch_run = [n for n in batch_sizes
             if ju.core.memory.predicted_bytes(n, "batch") < free]
per_sample_run = [n for n in per_sample_sizes
                  if ju.core.memory.predicted_bytes(n, "per_sample") < free]
print("per_sample_jacobian runs at n =", per_sample_run)
big = ju.core.memory.predicted_bytes(10_000, "batch") / 2**30
print(f"Finding: tape.jacobian over n = 10,000 samples would need about "
      f"{big:.0f} GiB; not run")

# %% [markdown]
# ### Measuring memory
#
# TensorFlow's tensors live outside Python's allocator, so `tracemalloc` sees
# none of them: `peak_memory` samples the process's resident memory (RSS)
# while a call runs. And on x86 CPUs TensorFlow keeps the memory it grew in
# a **pool** and reuses it, so a second call at the same size measures
# almost nothing. `measure_in_fresh_process` therefore runs each sweep, sizes
# increasing, in a new Python process, and reads back how far that process
# had to grow at each size.

# %% tags=["nbval-ignore-output"]
def measure(method, sizes):  # bytes; at least 1, for the log-log plots
    peaks = ju.teaching.memory_sweeps.measure_in_fresh_process(method, sizes)
    return {n: max(peak, 1) for n, peak in zip(sizes, peaks, strict=True)}


batch_peaks = measure("batch", batch_run)
per_sample_peaks = measure("per_sample", per_sample_run)
fit_sizes = [n for n in batch_run if n <= fit_up_to]
batch_model = ju.core.memory.MemoryModel.fit(
    fit_sizes, [batch_peaks[n] for n in fit_sizes], quadratic=True)
for n in batch_run:
    print(f"n = {n:>5}: measured {batch_peaks[n] / 2**20:7.1f} MiB, "
          f"fit on n <= {fit_up_to} predicts "
          f"{batch_model.predict(n) / 2**20:7.1f} MiB "
          f"({batch_model.predict(n) / batch_peaks[n] - 1:+.0%})")
slope_batch = ju.teaching.plots.fitted_slope(batch_run, list(batch_peaks.values()))
slope_per_sample = ju.teaching.plots.fitted_slope(
    per_sample_run, list(per_sample_peaks.values()))
claim("batch-memory-quadratic", slope_batch > 1.5,
      f"the batch tape's peak memory grows like n^{slope_batch:.2f} over "
      f"n = {batch_run}: like n^2 (a slope above 1.5)")
claim("per-sample-memory-linear", 0.7 < slope_per_sample < 1.3,
      f"per_sample_jacobian's peak memory grows like n^{slope_per_sample:.2f} "
      f"over n = {per_sample_run}: linear in n (a slope from 0.7 to 1.3)")

# %% [markdown]
# The last column is how far the fit on the small sizes is from each
# measured peak: the margin to keep when choosing a size (notebook 04 adds
# one). The two claims measure the slopes the analysis above predicts.

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** The memory model fitted in this notebook, `batch_model`, predicts
# `a·n² + b·n + c` bytes (`batch_model.quadratic`, `.linear`, `.constant`;
# `batch_model.predict(n)`). Find the largest batch n for which
# `vectorized_jacobian` fits in 8 GiB, and how many GiB a batch of 2n would
# need. Put both in `answer = (n, gib)`.

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: solve a*n^2 + b*n + c = 8 GiB; doubling n multiplies the n^2
# term by four.
n_max = batch_model.largest_n(8 * 2**30)
answer = (n_max, batch_model.predict(2 * n_max) / 2**30)

# %%
check.exercise("02-1", answer, batch_model=batch_model)

# %% [markdown]
# ## Going further: time against n
#
# Every size is timed `repeats` times after a first call, which is reported
# apart: it also pays one-time costs (the memory the process grows into,
# TensorFlow's first use of an operation at a new shape). The table keeps
# the fastest of the repeated calls, the one least disturbed by other
# programs. Both functions pay a **fixed cost on every call** as well: run
# eagerly, `tape.jacobian` and `tf.vectorized_map` trace the function and
# convert it with pfor again each time (a *trace*:
# [TensorFlow words](00-welcome.ipynb#TensorFlow-words); `03-compiled`
# removes it). The smallest size, where the work is least, stands for
# that fixed cost.

# %% tags=["nbval-ignore-output"]
functions = {"vectorized_jacobian": (ju.vectorized_jacobian, batch_run),
             "per_sample_jacobian": (ju.per_sample_jacobian, per_sample_run)}
fixed, times, firsts = {}, {}, {}
for name, (function, run) in functions.items():
    times[name] = {}
    for n in run:  # more repeats at the smallest size: the fixed cost
        count = max(repeats, 4) if n == run[0] else repeats
        timing = ju.time_call(function, model, x_all[:n], repeats=count)
        times[name][n], firsts[name, n] = min(timing.times), timing.first
    fixed[name] = times[name][run[0]]
batch_times = times["vectorized_jacobian"]
per_sample_times = times["per_sample_jacobian"]
peaks = {"vectorized_jacobian": batch_peaks,
         "per_sample_jacobian": per_sample_peaks}
print(f"{'n':>6} | {'method':<20} | {'first s':>8} | {'best s':>8} "
      f"| {'peak MiB':>9}")
for name in functions:
    for n in times[name]:
        print(f"{n:>6} | {name:<20} | {firsts[name, n]:8.3f} | "
              f"{times[name][n]:8.3f} | {peaks[name][n] / 2**20:9.1f}")
print("fixed cost per call (the best call at the smallest size): "
      + ", ".join(f"{name} {t:.3f} s" for name, t in fixed.items()))

# %% tags=["nbval-ignore-output"]
import matplotlib.pyplot as plt

sizes = sorted(set(batch_run) | set(per_sample_run))


def on(values):
    return [values.get(n, np.nan) for n in sizes]


def nearer(slope, pairs):
    """Which growth a fitted slope is nearer, n (1) or n^2 (2) - if the
    slopes between every pair of sizes lie within 0.5 of it."""
    if np.isnan(slope):
        return "no slope"
    low, high = min(pairs), max(pairs)
    spread = f"between pairs of sizes {low:.2f} to {high:.2f}"
    if 0.5 < low and high < 1.5:
        return f"{spread}: nearer n than n^2"
    if 1.5 < low and high < 2.5:
        return f"{spread}: nearer n^2 than n"
    return f"{spread}: too noisy to say at these sizes"


def fit(values):
    """Log-log slope of values (a dict by n), the range of n it spans, and
    the slope between each pair of those sizes."""
    ns = [n for n in sorted(values) if values[n] > 0]
    if len(ns) < 3:  # two points always lie on a line
        return np.nan, "fewer than 3 sizes", []
    slope = ju.teaching.plots.fitted_slope(ns, [values[n] for n in ns])
    pairs = [np.log(values[b] / values[a]) / np.log(b / a)
             for i, a in enumerate(ns) for b in ns[i + 1:]]
    return slope, f"n = {ns[0]:,} to {ns[-1]:,}", pairs


fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 5.5))
time_series, memory_series, findings = {}, {}, []
for name in functions:
    work = {n: t - fixed[name] for n, t in times[name].items()}
    largest = {n: work[n] for n in sorted(work)[-3:] if work[n] > 0}
    slope_t, range_t, pairs_t = fit(largest)
    slope_m, range_m, pairs_m = fit(peaks[name])
    time_series[name] = on(times[name])
    if len(largest) >= 3:
        time_series[f"{name}, above its fixed cost (slope {slope_t:.2f})"] = (
            on(largest))
    memory_series[f"{name} (slope {slope_m:.2f})"] = on(
        {n: p / 2**20 for n, p in peaks[name].items()})
    findings.append(
        f"Finding: {name}: time above its fixed {fixed[name]:.2f} s ~ "
        f"n^{slope_t:.2f} ({range_t}; {nearer(slope_t, pairs_t)}); memory ~ "
        f"n^{slope_m:.2f} ({range_m}; {nearer(slope_m, pairs_m)})")
ju.teaching.plots.loglog_scaling(sizes, time_series, ax=ax_t, slopes=False)
for line, label in zip(ax_t.get_lines(), time_series, strict=True):
    line.set_color("C0" if label.startswith("vec") else "C1")
    line.set_linestyle("--" if "above" in label else "-")
ax_t.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15))
ax_t.set_title("time (best call); dashed: the work alone,\n"
               "slopes over each method's 3 largest sizes")
ju.teaching.plots.loglog_scaling(sizes, memory_series, ylabel="peak MiB", ax=ax_m,
                        slopes=False)
ax_m.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15))
ax_m.set_title("peak memory (fresh process), slopes over all sizes")
fig.tight_layout()
print("\n".join(findings))
per_sample_model = ju.core.memory.MemoryModel.fit(
    per_sample_run, list(per_sample_peaks.values()), quadratic=False)
copies = per_sample_model.linear / (n_outputs * n_params * 4)
print(f"Finding: per_sample_jacobian's memory is {copies:.1f} copies of its "
      "result (n * l * m * 4 bytes)")
n_top = max(batch_run)
print(f"Finding: at n = {n_top:,}: vectorized_jacobian "
      f"{batch_times[n_top]:.2f} s and {batch_peaks[n_top] / 2**20:,.0f} MiB"
      + (f"; per_sample_jacobian {per_sample_times[n_top]:.2f} s and "
         f"{per_sample_peaks[n_top] / 2**20:,.0f} MiB"
         if n_top in per_sample_times else ""))

# %% [markdown]
# Read the left panel from the right. A solid line is a function's whole
# time; where it is flat, you see only the fixed cost of each call (printed
# under the table). The dashed lines subtract the fixed cost and leave the
# work, at each method's three largest sizes: the Findings fit their slopes
# there and say whether each is nearer 1 (time proportional to n) or 2
# (proportional to n²) - only when the slope between every pair of those
# sizes lies within 0.5 of it; otherwise they say the run is too noisy to
# tell. A slope
# taken from a work not much larger than the fixed cost scatters from run
# to run (rerun the timing cell to see by how much). Memory has no fixed
# cost to subtract, so its slopes are fitted over all sizes (right panel).

# %% [markdown]
# ## Going further: pfor against a `while_loop`
#
# Optional: how much pfor gains over running the same per-sample function
# in a loop. This section writes that loop by hand with two documented
# helpers of `jacutil.core.target`: `resolve_target` (the model's forward
# pass and variables) and `stack_columns` (one block per variable, joined
# into `(n, l, m)`).
#
# `tf.vectorized_map` turns the per-sample function into batched operations
# (pfor). `tf.map_fn` runs the same function in a `while_loop`, one sample
# per iteration. Both run inside a `tf.function` (traced once into a graph:
# [TensorFlow words](00-welcome.ipynb#TensorFlow-words)), so that eager
# mode's fixed cost is gone and only the strategy differs:

# %%
target = ju.core.target.resolve_target(model)


@tf.function
def with_pfor(x):
    return ju.stages.vectorized.per_sample_tape_jacobian(target, x)


@tf.function
def with_while_loop(x):
    def one_sample(xi):
        with tf.GradientTape() as tape:
            y = target.forward(xi[None])
        jacobians = tape.jacobian(y, target.variables)
        return ju.core.target.stack_columns(jacobians, target.variables, 1)[0]

    return tf.map_fn(one_sample, x)


x_map = tf.constant(x_all[: min(map_sizes)])
np.testing.assert_allclose(with_while_loop(x_map).numpy(),
                           with_pfor(x_map).numpy(), rtol=1e-5, atol=1e-6)
print("tf.map_fn == tf.vectorized_map: True")

# %% tags=["nbval-ignore-output"]
for n in map_sizes:
    x_n = tf.constant(x_all[:n])
    pfor = ju.time_call(with_pfor, x_n, repeats=repeats).median
    loop = ju.time_call(with_while_loop, x_n, repeats=repeats).median
    print(f"n = {n:>4}: vectorized_map {1e3 * pfor:7.1f} ms   "
          f"map_fn {1e3 * loop:7.1f} ms   ratio {loop / pfor:5.1f}")
print(f"Finding: at n = {n}, tf.map_fn (while_loop) takes {loop / pfor:.1f}x "
      "the time of tf.vectorized_map (pfor)")

# %% [markdown]
# The `while_loop` pays one small step per sample, like the Python loop of
# `01` but without Python. pfor does one batched operation per step of the
# function for all samples. Read the ratio in the Finding: above 1, pfor is
# the faster (the table gives the ratio at each size).
# `tf.vectorized_map(..., fallback_to_while_loop=True)` (the default) falls
# back to a loop for operations it cannot convert.

# %% [markdown]
# ## Going further: the last layer's columns
#
# **2.** Take the Jacobian with respect to the last layer's variables only
# (`variables=model.layers[-1].trainable_variables`) on `x_check`, with both
# functions, and check that they agree. Which columns of the full
# `J_per_sample` are they? Put the last layer's Jacobian in `answer`: an
# array of shape (n, l, the last layer's number of parameters).

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: the columns come in flat_params order, so the last layer's
# kernel and bias are the last 32 * 2 + 2 = 66 columns.
last = model.layers[-1].trainable_variables
J_last_batch = ju.vectorized_jacobian(model, x_check, variables=last)
answer = ju.per_sample_jacobian(model, x_check, variables=last)
n_last = sum(int(np.prod(v.shape)) for v in last)
np.testing.assert_allclose(J_last_batch, answer, rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(answer, J_per_sample[:, :, -n_last:],
                           rtol=1e-5, atol=1e-6)
print(answer.shape, "agree: True")

# %%
check.exercise("02-2", answer, model=model, x=x_check)

# %% [markdown]
# ## Keypoints
#
# - `tape.jacobian` over the batch (`vectorized_jacobian`) gives the loop's
#   Jacobian with one tape and no Python loop.
# - It back-propagates every output row through the whole batch: n² work,
#   and its measured memory grows like n². <!-- claim: diagonal-only, batch-memory-quadratic -->
# - `tf.vectorized_map` of a one-sample Jacobian (`per_sample_jacobian`, the
#   counterpart of `vmap(jacrev)`) differentiates each sample through
#   itself: its memory is linear in n. <!-- claim: per-sample-memory-linear -->
# - Measure memory as resident memory, in a fresh process; predict a size
#   before running it.
# - Going further: eager TensorFlow pays a cost on every call (tracing and
#   pfor's conversion): subtract it before reading a time slope; pfor against
#   a `while_loop` (`tf.map_fn`) running the same per-sample function.
# - Next, `03-compiled`: compile the call once with `tf.function`.
