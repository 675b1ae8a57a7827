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
# - Prove `compiled_jacobian` equal to `per_sample_jacobian` of `02`, and
#   read which formulation its graph runs.
# - Count traces while n changes, with and without an input signature.
# - Report the first call (trace, compile) apart from the steady state.
# - Going further: time XLA's compile at each new shape, and compare eager,
#   graph and XLA for both vectorizations, as a table and a plot.
#
# *Teaching: 15 min · Exercises: 12 min · Going further: 36 min*

# %% [markdown]
# ## Setup

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
# count, and `jit_compile` hands the graph to XLA (going further).
# What the graph computes, `self._jacobian`, is chosen by `method`: by
# default `"per_sample"`, the vectorized tape above (`tf.vectorized_map`
# over samples); `"batch"` is `02`'s tape over the whole batch; `"rules"`
# the layer rules of notebook `07`. `jac.formulation` says which one ran;
# `ju.jacobian` (notebook `00`) picks a path for you instead.

# %%
ju.teaching.notebook.show_source(ju.stages.compiled.CompiledJacobian.build,
                                 plain=plain_compiled_jacobian)

# %%
jac = ju.compiled_jacobian(model)
J_compiled = jac(x_check)
J_per_sample = ju.per_sample_jacobian(model, x_check)
np.testing.assert_allclose(J_compiled, J_per_sample, rtol=1e-5, atol=1e-6)
plain = plain_compiled_jacobian(model, x_check.shape[1])
np.testing.assert_allclose(plain(x_check), J_compiled, rtol=1e-5, atol=1e-6)
print("compiled_jacobian:", J_compiled.shape, "== per_sample_jacobian == "
      "plain_compiled_jacobian (float32 rounding): True")
claim("default-method", jac.method == "per_sample"
      and jac.formulation.startswith("tf.vectorized_map"),
      f"compiled_jacobian(model) runs method={jac.method!r} by default: "
      f"{jac.formulation}")

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
claim("one-trace", jac.trace_count == 1 and len(traces) == len(trace_sizes),
      f"without a signature {len(traces)} traces for {len(trace_sizes)} batch "
      f"sizes; compiled_jacobian: {jac.trace_count} trace")

# %% [markdown]
# ## First call and steady state
#
# The first call pays for the trace; every later call runs the graph.

# %% tags=["nbval-ignore-output"]
x_1000 = x_all[:1000]
fresh = ju.compiled_jacobian(model)
graph = ju.time_call(fresh, x_1000, repeats=repeats)
eager = ju.time_call(ju.per_sample_jacobian, model, x_1000, repeats=repeats)
n = len(x_1000)
print(f"n = {n:,}  graph: first {graph.first:.3f} s, then "
      f"{1e3 * graph.median:.1f} ms;  eager: {1e3 * eager.median:.0f} ms")
claim("graph-beats-eager", eager.median > 5 * graph.median,
      f"at n = {n:,} the graph runs {eager.median / graph.median:.0f}x "
      f"faster than eager ({1e3 * graph.median:.1f} ms against "
      f"{1e3 * eager.median:.0f} ms)")
claim("first-call-traces", fresh.trace_count == 1
      and graph.first > 3 * graph.median,
      f"the first call, which traced, took {graph.first:.2f} s, "
      f"{graph.first / graph.median:.0f}x a later one")

# %% [markdown]
# Eager `tf.vectorized_map` converts the function with pfor on every call;
# the graph did it once, while tracing.

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
answer = (len(traces), traces[-1])  # traces: the batch sizes traced

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
raw_xla = tf.function(lambda x: jacobian_of_batch(x),  # a new function:
                      input_signature=[spec], jit_compile=True)  # nothing kept
firsts, warms = [], []
for n in xla_sizes:
    timing = ju.time_call(raw_xla, tf.constant(x_all[:n]), repeats=3)
    firsts.append(timing.first)
    warms.append(timing.median)
    print(f"n = {n:>3}: first call {timing.first:.2f} s, "
          f"then {1e3 * timing.median:.2f} ms")
print("traces:", len(traces))
claim("xla-first-call", len(traces) == 1 and all(
    first > 5 * warm for first, warm in zip(firsts, warms, strict=True)),
    f"one trace, yet every new n compiles: first calls {min(firsts):.2f} to "
    f"{max(firsts):.2f} s, warm calls {1e3 * min(warms):.2f} to "
    f"{1e3 * max(warms):.2f} ms")

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
ju.teaching.notebook.show_source(ju.stages.compiled.CompiledJacobian.tensor,
                                 plain=plain_padded)

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
# Every method runs in a graph and under XLA, and all give the same J:

# %%
for method in ["per_sample", "batch", "rules"]:
    for jit_compile in [False, True]:
        other = ju.compiled_jacobian(model, method=method,
                                     jit_compile=jit_compile)
        np.testing.assert_allclose(other(x_check), J_per_sample,
                                   rtol=1e-5, atol=1e-6)
    print(f"method={method!r}, graph and XLA == per_sample_jacobian: "
          f"{other.formulation}")

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
# ## Going further: eager, graph and XLA, for both vectorizations
#
# `method="per_sample"` (`tf.vectorized_map`, linear) and `method="batch"`
# (`tape.jacobian` over the batch, quadratic). The batch tape runs only where
# its predicted memory fits (see `02-vectorized`). The column `new` says
# what a row's first call built: a trace, an XLA compile (its padded
# shape), or nothing (reused).

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
            traced = getattr(fn, "trace_count", 0)
            shapes = set(getattr(fn, "compiled_shapes", ()))
            timing = ju.time_call(fn, x_all[:n], repeats=repeats)
            new = (["trace"] if getattr(fn, "trace_count", 0) > traced else []) + [
                f"compile {s}" for s in sorted(
                    set(getattr(fn, "compiled_shapes", ())) - shapes)]
            rows.append((method, mode, n, timing.first, timing.median,
                         ", ".join(new) or ("-" if mode == "eager" else "reused")))
print(f"{'method':<10} | {'mode':<5} | {'n':>6} | {'first s':>8} | "
      f"{'median ms':>10} | new")
for method, mode, n, first, median, new in rows:
    print(f"{method:<10} | {mode:<5} | {n:>6} | {first:8.3f} | "
          f"{1e3 * median:10.2f} | {new}")
reused = [f"{m} at n = {n:,}" for m, mode, n, *_, new in rows
          if mode == "XLA" and new == "reused"]
if reused:
    print("Finding: XLA compiled nothing new for", "; ".join(reused),
          "- its padded shapes were compiled already, so the first call "
          "there is a warm one")

# %% tags=["nbval-ignore-output"]
all_sizes = sorted(set(sizes) | set(batch_sizes))
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, method in zip(axes, ["per_sample", "batch"], strict=True):
    series = {}
    for mode in ["eager", "graph", "XLA"]:
        times = {n: med for m, mo, n, _, med, _ in rows
                 if m == method and mo == mode}
        series[mode] = [times.get(n, np.nan) for n in all_sizes]
    ju.teaching.plots.loglog_scaling(all_sizes, series, ax=ax)
    ax.set_title(f'method="{method}" (steady state)')
fig.tight_layout()
best = {(m, mo, n): med for m, mo, n, _, med, _ in rows}


def growth(slope):
    """A fitted log-log slope in words."""
    if slope < 0.75:
        return "flatter than n"
    return "about n" if slope < 1.5 else "about n^2 or steeper"


slopes, ran_of = {}, {}
for method in ["per_sample", "batch"]:
    ran = ran_of[method] = sorted({n for m, _, n, *_ in rows if m == method})
    fastest = {n: min(["eager", "graph", "XLA"],
                      key=lambda mode, n=n: best[method, mode, n])
               for n in ran}
    print(f"Finding: {method}, fastest mode: " + "; ".join(
        f"n = {n:,} {fastest[n]} ({1e3 * best[method, fastest[n], n]:.1f} ms)"
        for n in ran))
    slopes[method] = {mode: ju.teaching.plots.fitted_slope(
        ran, [best[method, mode, n] for n in ran])
        for mode in ["eager", "graph", "XLA"]}
    print(f"Finding: {method}, slopes over n = {ran[0]:,} to "
          f"{ran[-1]:,}: " + "; ".join(
              f"{mode} {slope:.2f} ({growth(slope)})"
              for mode, slope in slopes[method].items()))
compiled_slopes = {m: [slopes[m][mode] for mode in ["graph", "XLA"]]
                   for m in slopes}
span = min(max(ns) / min(ns) for ns in ran_of.values())
if span >= 10:  # a slope needs sizes a decade apart
    claim("batch-tape-steeper", min(compiled_slopes["batch"])
          > max(compiled_slopes["per_sample"]) + 0.4,
          "compiled, the batch tape's time grows faster with n than the "
          "per-sample Jacobian's: slopes " + ", ".join(
              f"{s:.2f}" for s in compiled_slopes["batch"]) + " against "
          + ", ".join(f"{s:.2f}" for s in compiled_slopes["per_sample"]))
else:
    print(f"sizes only {span:.0f}x apart: too close to compare slopes")

# %% [markdown]
# Read the Findings. The first of each pair names the fastest mode at each
# n; the second gives each line's fitted slope in words. `02` predicts the
# work: linear in n for the per-sample Jacobian, quadratic for the batch
# tape, whatever runs it - no compiler removes work that is computed and
# thrown away. A fixed cost per call pulls a slope below that prediction
# where the work is still small, eager mode's most of all. Which of graph
# and XLA wins, and at which n, depends on the machine and its load: on a
# small CPU XLA can lose to the plain graph. Read the first column with
# `new`: a first call costs more only where it traced or compiled.

# %% [markdown]
# ## Keypoints
#
# - `tf.function` traces once and removes eager mode's per-call cost; prove
#   the compiled Jacobian equal to the eager one. <!-- claim: graph-beats-eager -->
# - `compiled_jacobian` runs `tf.vectorized_map` by default (`jac.formulation`). <!-- claim: default-method -->
# - Give it an input signature with a `None` batch dimension, or every new n
#   retraces (with one, `jac.trace_count` stays 1). <!-- claim: one-trace -->
# - Report the first call (trace, compile) apart from the steady state. <!-- claim: first-call-traces -->
# - XLA compiles once per concrete shape, and each compile costs more than
#   many warm calls: pad the batch to a few sizes (`jac.compiled_shapes`). <!-- claim: xla-first-call -->
# - Compilation cannot fix the batch tape's n²: vectorize over samples. <!-- claim: batch-tape-steeper -->
# - Next, `04-chunked`: bounded memory for any n.
