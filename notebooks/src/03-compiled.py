# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Compiled: `tf.function` and XLA
#
# **Questions**
# - How much of the vectorized Jacobian's time is eager TensorFlow's fixed
#   cost, and how does `tf.function` remove it?
# - Why does a `tf.function` retrace when the number of samples changes, and
#   how does an input signature stop it?
# - What does XLA (`jit_compile=True`) add, and why must the batch be padded
#   (going further)?
#
# **Objectives**
# - Prove `compiled_jacobian` equal to `per_sample_jacobian` of `02`.
# - Count traces while n changes, with and without an input signature.
# - Report the first call (trace, compile) apart from the steady state.
# - Compare eager, graph and XLA for both vectorizations, as a table and a
#   plot.
#
# *Teaching: 17 min · Exercises: 10 min · Going further: 16 min*

# %% [markdown]
# ## Setup

# %%
import matplotlib.pyplot as plt
import numpy as np

import jacutil as ju
from jacutil import tf
from jacutil.teaching import check

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_check = 4  # samples in the correctness checks
trace_sizes = [3, 5, 8, 13, 21]  # n while counting traces
xla_sizes = [5, 6, 7, 9, 12, 20]  # n while counting XLA compiles
sizes = [100, 1000, 10000]  # n for the eager / graph / XLA comparison
batch_sizes = [100, 300, 1000, 10000]  # n for the batch tape in it
repeats = 3  # timed runs after the first, per size
safety = 0.5  # run the batch tape only if it needs under this share of free
seed = 0

# %%
model = ju.question_mlp(seed=seed)
x_all = ju.regression_data(
    max(sizes + batch_sizes + trace_sizes + xla_sizes), seed=seed)[0]
x_check = x_all[:n_check]
target = ju.core.target.resolve_target(model)  # its forward pass and variables

# %% [markdown]
# ## The compiled Jacobian
#
# `compiled_jacobian(model)` returns a reusable `jac`. Inside, the Jacobian
# of `02` is wrapped in a `tf.function` (a Python function turned into a
# graph: [TensorFlow words](00-welcome.ipynb#TensorFlow-words)) whose input
# signature - the shapes and dtypes it accepts - has the batch dimension
# `None`: one graph serves every n. The idea in plain TensorFlow, for a
# model with one input of `d` features, is the per-sample Jacobian of `02`
# inside such a `tf.function`:

# %% tags=["plain-version"]
def plain_compiled_jacobian(model, d):
    """One graph for every batch size: the signature's batch dimension is None."""
    @tf.function(input_signature=[tf.TensorSpec([None, d], tf.float32)])
    def jac(x):
        def rows(x_i):  # one sample's (l, m) rows
            with tf.GradientTape() as tape:
                y = model(x_i[None])[0]
            blocks = tape.jacobian(y, model.trainable_variables)
            return tf.concat([tf.reshape(b, [y.shape[0], -1]) for b in blocks], 1)
        return tf.vectorized_map(rows, x)
    return jac


# %% [markdown]
# `CompiledJacobian.build` makes `jacutil`'s `tf.function`. Its extras:
# `signature(x)` writes the signature for any inputs (several, dicts, any
# shape and dtype), `trace_count` and `note_trace` count the traces (the
# next section uses them), `quiet_function` is `tf.function` without
# TensorFlow's retracing warning, which `jacutil` replaces with its own
# count, and `jit_compile` hands the graph to XLA (later in this notebook).
# The graph itself, `self._jacobian`, is the fastest method that applies:
# the layer rules (notebook 07) where every layer has one, else the
# vectorized tape above.

# %%
ju.teaching.notebook.show_source(ju.stages.compiled.CompiledJacobian.build)

# %%
jac = ju.compiled_jacobian(model)
J_compiled = jac(x_check)
J_per_sample = ju.per_sample_jacobian(model, x_check)
np.testing.assert_allclose(J_compiled, J_per_sample, rtol=1e-5, atol=1e-6)
plain = plain_compiled_jacobian(model, x_check.shape[1])
np.testing.assert_allclose(plain(x_check), J_compiled, rtol=1e-5, atol=1e-6)
print("plain_compiled_jacobian == compiled_jacobian (float32 rounding): True")
for method in ["per_sample", "batch"]:
    for jit_compile in [False, True]:
        other = ju.compiled_jacobian(model, method=method,
                                     jit_compile=jit_compile)
        np.testing.assert_allclose(other(x_check), J_per_sample,
                                   rtol=1e-5, atol=1e-6)
print("compiled_jacobian:", J_compiled.shape,
      "== per_sample_jacobian, for both methods, graph and XLA: True")

# %% [markdown]
# ## Tracing, and retracing
#
# The first call of a `tf.function` *traces* it: Python runs once and
# records a graph. A plain `tf.function` records the shapes it saw, so a
# batch of another size traces again - slow, and a memory leak when n
# changes all the time. Count the traces with a Python side effect (it runs
# only while tracing). TensorFlow itself warns when a function retraces this
# often (the WARNING below):

# %%
traces = []


def jacobian_of_batch(x):
    traces.append(x.shape[0])  # runs once per trace
    return ju.stages.vectorized.per_sample_tape_jacobian(target, x)


no_signature = tf.function(jacobian_of_batch)
for n in trace_sizes:
    no_signature(tf.constant(x_all[:n]))
print("without a signature:", len(traces), "traces for", len(trace_sizes),
      "batch sizes; traced shapes", traces)

jac = ju.compiled_jacobian(model)
for n in trace_sizes:
    jac(x_all[:n])
print("compiled_jacobian:  ", jac.trace_count, "trace for", len(trace_sizes),
      "batch sizes")

# %% [markdown]
# ## First call and steady state
#
# The first call pays for the trace; every later call runs the graph.

# %% tags=["nbval-ignore-output"]
x_1000 = x_all[:1000]
fresh = ju.compiled_jacobian(model)
graph = ju.time_call(fresh, x_1000, repeats=repeats)
eager = ju.time_call(ju.per_sample_jacobian, model, x_1000, repeats=repeats)
print(f"n = 1,000  graph: first {graph.first:.3f} s, then "
      f"{1e3 * graph.median:.1f} ms;  eager: {1e3 * eager.median:.0f} ms")
print(f"Finding: tf.function makes the per-sample Jacobian at n = 1,000 "
      f"{eager.median / graph.median:.0f}x faster than eager "
      f"({1e3 * graph.median:.1f} ms, first call {graph.first:.2f} s)")

# %% [markdown]
# Eager `tf.vectorized_map` converts the function with pfor on every call;
# the graph did it once, while tracing.

# %% [markdown]
# ## Eager, graph and XLA, for both vectorizations
#
# `method="per_sample"` (`tf.vectorized_map`, linear) and `method="batch"`
# (`tape.jacobian` over the batch, quadratic). The batch tape runs only where
# its predicted memory fits (see `02-vectorized`).

# %% tags=["nbval-ignore-output"]
eager_of = {"per_sample": ju.per_sample_jacobian,
            "batch": ju.vectorized_jacobian}
rows = []
free = ju.core.memory.available_bytes(safety)
for method in ["per_sample", "batch"]:
    modes = {"eager": lambda x, m=method: eager_of[m](model, x),
             "graph": ju.compiled_jacobian(model, method=method),
             "XLA": ju.compiled_jacobian(model, method=method,
                                         jit_compile=True)}
    for n in sizes if method == "per_sample" else batch_sizes:
        if method == "batch" and ju.core.memory.predicted_bytes(n) > free:
            print(f"batch at n = {n:,}: predicted "
                  f"{ju.core.memory.predicted_bytes(n) / 2**30:.0f} GiB; not run")
            continue
        for mode, fn in modes.items():
            timing = ju.time_call(fn, x_all[:n], repeats=repeats)
            rows.append((method, mode, n, timing.first, timing.median))
print(f"{'method':<10} | {'mode':<5} | {'n':>6} | {'first s':>8} | "
      f"{'median ms':>10}")
for method, mode, n, first, median in rows:
    print(f"{method:<10} | {mode:<5} | {n:>6} | {first:8.3f} | "
          f"{1e3 * median:10.2f}")

# %% tags=["nbval-ignore-output"]
all_sizes = sorted(set(sizes) | set(batch_sizes))
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, method in zip(axes, ["per_sample", "batch"], strict=True):
    series = {}
    for mode in ["eager", "graph", "XLA"]:
        times = {n: med for m, mo, n, _, med in rows
                 if m == method and mo == mode}
        series[mode] = [times.get(n, np.nan) for n in all_sizes]
    ju.teaching.plots.loglog_scaling(all_sizes, series, ax=ax)
    ax.set_title(f'method="{method}" (steady state)')
fig.tight_layout()
best = {(m, mo, n): med for m, mo, n, _, med in rows}


def growth(slope):
    """A fitted log-log slope in words."""
    if slope < 0.75:
        return "flatter than n"
    return "about n" if slope < 1.5 else "about n^2 or steeper"


for method in ["per_sample", "batch"]:
    ran = sorted({n for m, _, n, _, _ in rows if m == method})
    fastest = {n: min(["eager", "graph", "XLA"],
                      key=lambda mode, n=n: best[method, mode, n])
               for n in ran}
    print(f"Finding: {method}, fastest mode: " + "; ".join(
        f"n = {n:,} {fastest[n]} ({1e3 * best[method, fastest[n], n]:.1f} ms)"
        for n in ran))
    if len(ran) >= 3:
        fitted = {mode: ju.teaching.plots.fitted_slope(
            ran, [best[method, mode, n] for n in ran])
            for mode in ["eager", "graph", "XLA"]}
        print(f"Finding: {method}, slopes over n = {ran[0]:,} to "
              f"{ran[-1]:,}: " + "; ".join(
                  f"{mode} {slope:.2f} ({growth(slope)})"
                  for mode, slope in fitted.items()))

# %% [markdown]
# Read the Findings. The first of each pair names the fastest mode at each
# n; the second gives each line's fitted slope in words. `02` predicts the
# work: linear in n for the per-sample Jacobian, quadratic for the batch
# tape, whatever runs it - no compiler removes work that is computed and
# thrown away. A fixed cost per call pulls a slope below that prediction
# where the work is still small: eager mode's fixed cost most of all (its
# line stays flat until the work outgrows it, as in `02`), a compiled
# call's much less. Which of graph and XLA wins, and at which n, depends on
# the machine and its load: on a small CPU XLA can lose to the plain graph,
# and even to eager at some sizes. XLA's first call (the compile, in the
# table's first column) costs far more, once per shape: the going-further
# part below shows why, and how padding keeps the shapes few.

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** `tf.function(..., reduce_retracing=True)` is another way to stop
# retracing without a signature. Wrap `jacobian_of_batch` with it, call it
# on each size of `trace_sizes`, and count its traces (`traces` records
# the batch dimension each one saw). Put two things in `answer`: the number
# of traces, and the batch dimension the last trace recorded (a number, or
# None) - `answer = (count, batch)`. The second one explains the first.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: the second new shape makes TensorFlow trace a general graph with
# a None batch dimension, which then serves every later size: 2 traces.
# (TensorFlow's WARNING counts the traces of jacobian_of_batch by every
# tf.function that wraps it: no_signature's five come first.)
traces.clear()
relaxed = tf.function(jacobian_of_batch, reduce_retracing=True)
for n in trace_sizes:
    relaxed(tf.constant(x_all[:n]))
answer = (len(traces), traces[-1])
print(answer[0], "traces; traced batch sizes:", traces)

# %%
check.exercise("03-1", answer, sizes=trace_sizes)

# %% [markdown]
# ## Going further: XLA compiles once per shape
#
# Why XLA's first call at each n is slow, and how `compiled_jacobian` pads
# the batch so that XLA sees only a few shapes.
#
# `jit_compile=True` hands the graph to XLA (a compiler:
# [TensorFlow words](00-welcome.ipynb#TensorFlow-words)), which fuses
# operations and compiles machine code **for one concrete shape**. The
# signature with `None` stops retracing (one trace below), but not
# compiling: every new n compiles again, and its first call is slow.

# %% tags=["nbval-ignore-output"]
spec = tf.TensorSpec([None, *x_all.shape[1:]], tf.float32)
traces.clear()
raw_xla = tf.function(lambda x: jacobian_of_batch(x),
                      input_signature=[spec], jit_compile=True)
for n in xla_sizes:
    timing = ju.time_call(raw_xla, tf.constant(x_all[:n]), repeats=1)
    print(f"n = {n:>3}: first call {timing.first:.2f} s (compile), "
          f"then {1e3 * timing.median:.2f} ms")
print("traces:", len(traces))

# %% [markdown]
# The cure is to show XLA few shapes: pad the batch with copies of its last
# sample to the next power of two (at least two: `tf.vectorized_map` fails
# on some models when it is given a single sample), up to `block_size` samples
# (`compiled_jacobian(..., block_size=1024)` by default; a larger batch runs
# in blocks of `block_size`, the last one padded to its own power of two),
# and cut the padded rows off the result. Each sample's rows depend on that
# sample only, so the padding changes nothing (copies, not zeros: a model
# that takes a log is not finite at zero). In plain NumPy, for a batch of at
# most `block_size` samples:

# %% tags=["plain-version"]
def plain_padded(jac, x):
    """jac on x padded with copies of its last sample to a power of two (>= 2)."""
    n = len(x)
    size = max(2, 2 ** int(np.ceil(np.log2(n))))
    padded = np.concatenate([x, np.repeat(x[-1:], size - n, axis=0)])
    return np.asarray(jac(padded))[:n]  # the padded rows cut off


# %% [markdown]
# `CompiledJacobian.tensor` does this for inputs of any structure
# (`pad_with_last`), keeps one compiled function per input signature
# (`checked_plan` first checks the model against it), records each shape
# XLA compiles in `compiled_shapes`, and pads even a batch of one sample to
# two. The blocks of `block_size` are cut one level up, in `__call__`.

# %%
ju.teaching.notebook.show_source(ju.stages.compiled.CompiledJacobian.tensor)

# %%
jac_xla = ju.compiled_jacobian(model, jit_compile=True)
for n in xla_sizes:
    J_xla = jac_xla(x_all[:n])
np.testing.assert_allclose(J_xla, ju.per_sample_jacobian(model, x_all[:n]),
                           rtol=1e-5, atol=1e-6)
print(len(xla_sizes), "sizes ->", len(jac_xla.compiled_shapes),
      "XLA shapes:", sorted(jac_xla.compiled_shapes),
      "; traces:", jac_xla.trace_count)
for n in xla_sizes:
    np.testing.assert_array_equal(plain_padded(jac_xla, x_all[:n]),
                                  jac_xla(x_all[:n]))
print("plain_padded == compiled_jacobian with XLA, at every size: True")

# %% [markdown]
# **2.** With `block_size=64`, which batch shapes does XLA compile when `jac`
# is called once with every batch size from 1 to 200? Predict them from the
# padding rule above, then check with `compiled_shapes` (use a small
# network, `ju.question_mlp(hidden=(8,))`, to keep it quick). Put the sorted
# list of shapes in `answer`.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: powers of two from 2 up to 64 (one sample runs as two); a
# larger batch runs in blocks of 64, and its last, partial block is padded
# to its own power of two.
small = ju.question_mlp(hidden=(8,), seed=seed)
jac_64 = ju.compiled_jacobian(small, jit_compile=True, block_size=64)
x_200 = ju.regression_data(200, seed=seed)[0]
for n in range(1, 201):  # every size: 2 and 4 too
    jac_64(x_200[:n])
answer = sorted(jac_64.compiled_shapes)
print(answer)

# %%
check.exercise("03-2", answer, sizes=range(1, 201), block_size=64)

# %% [markdown]
# ## Keypoints
#
# - `tf.function` traces once and removes eager mode's per-call cost; prove
#   the compiled Jacobian equal to the eager one.
# - Give it an input signature with a `None` batch dimension, or every new n
#   retraces (with one, `jac.trace_count` stays 1).
# - Report the first call (trace, compile) apart from the steady state.
# - XLA compiles once per concrete shape: pad the batch to a few sizes
#   (`jac.compiled_shapes`).
# - Compilation cannot fix the batch tape's n²: vectorize over samples.
# - Next, `04-chunked`: bounded memory for any n.
