# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · The nested loop, and why it is slow
#
# **Questions**
# - What does the loop of the loop question compute, and is it right?
# - How does its time grow with the number of samples, and where does it go?
#
# **Objectives**
# - Read `loop_jacobian` and prove it against finite differences in float64.
# - Count its forward and backward passes: n · l of each.
# - Measure its time at growing n, and compare one pass over a batch with
#   one pass over a single sample.
#
# *Teaching: 18 min · Exercises: 6 min · Going further: 36 min*

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
sizes = [10, 30, 100, 300]  # numbers of samples to time the loop at
repeats = 1  # timed runs per size (the fastest is kept)
n_check = 3  # samples in the correctness check
seed = 0

# %% [markdown]
# ## The loop
#
# This is the code of
# [the loop question](00-welcome.ipynb#The-two-questions) (*How to compute
# the Jacobian matrix efficiently in TensorFlow, and speed up my slow
# code?*), written with `tf.GradientTape` (a recorder of operations:
# [TensorFlow words](00-welcome.ipynb#TensorFlow-words)): for every sample
# `i` and every output `k`, record the forward pass of that one sample on a
# fresh tape and ask for the gradient of `f(x_i)[k]` with respect to every
# variable. The gradients, flattened and joined, are row `J[i, k, :]`. One
# row costs one forward and one backward pass on one sample. In plain
# TensorFlow, for a model with one input and one output:

# %% tags=["plain-version"]
def plain_loop_jacobian(model, x):
    """J[i, k, :] = d f(x_i)[k] / d theta: one tape per sample and output."""
    rows = []
    for i in range(len(x)):
        for k in range(model.output_shape[-1]):
            with tf.GradientTape() as tape:
                y = model(x[i : i + 1])[0, k]  # output k of sample i
            grads = tape.gradient(y, model.trainable_variables)
            rows.append(tf.concat([tf.reshape(g, [-1]) for g in grads], 0))
    return tf.reshape(tf.stack(rows), [len(x), model.output_shape[-1], -1]).numpy()


# %% [markdown]
# `jacutil`'s `loop_jacobian` is the same loop. What it adds lets every
# later stage share it: `resolve_target` takes a Keras model or any
# function with its variables; `as_batch`, `take` and `output_layout`
# accept several inputs and outputs; `shared` keeps one tape per sample in
# training mode (one Dropout mask for all of a sample's outputs);
# `stack_columns` gives an unused variable zeros instead of `None`; and a
# progress bar. The next section proves the two equal.

# %%
ju.teaching.notebook.show_source(ju.loop_jacobian, plain=plain_loop_jacobian)

# %% [markdown]
# ## Is it right?
#
# A Jacobian is only useful if it is correct, so we prove it against an
# independent reference: central finite differences, which share no code with
# the tape. A finite difference divides a tiny change of the outputs by a
# tiny step, so it loses most of float32's 7 significant digits: the check
# runs in float64 instead, on a narrower network of the same kind
# (10 → 16 → 8 → 2), so that finite differences' two forward passes per
# parameter take seconds, not a minute. The Finding below prints how
# closely the two agree.

# %%
model = ju.question_mlp(seed=seed)  # the question's network, for later
model64 = ju.question_mlp(hidden=(16, 8), seed=seed, dtype="float64")
x_check = ju.regression_data(n_check, seed=seed, dtype="float64")[0]

J_loop = ju.loop_jacobian(model64, x_check)
J_fd = ju.finite_difference_jacobian(model64, x_check)
np.testing.assert_allclose(J_loop, J_fd, rtol=1e-6, atol=1e-9)
print("loop:", J_loop.shape, J_loop.dtype, "== finite differences: True")
np.testing.assert_array_equal(plain_loop_jacobian(model64, x_check), J_loop)
print("plain_loop_jacobian == ju.loop_jacobian, bit for bit: True")

# %% tags=["nbval-ignore-output"]
print("Finding: in float64 the loop and finite differences differ by at "
      f"most {np.abs(J_loop - J_fd).max():.0e}")

# %% [markdown]
# ## Counting the passes
#
# Wrap the model in a function that counts its calls. Each call is one forward
# pass on the tape, and each `tape.gradient` one backward pass.

# %%
calls = []


def counted(x):
    calls.append(x.shape[0])
    return model(x, training=False)


x_small = ju.regression_data(20, seed=seed)[0]
ju.loop_jacobian(counted, x_small, variables=model.trainable_variables)
n_outputs = model.output_shape[-1]
checks = 2  # calls on 1 and 2 samples that check and count the outputs
passes = len(calls) - checks
claim("n-times-l-passes", passes == 20 * n_outputs and set(calls[checks:]) == {1},
      f"{passes} forward passes for n * l = 20 * {n_outputs}, each on "
      f"{set(calls[checks:])} sample")

# %% [markdown]
# (Two extra calls first, on one sample and on two, check that every output
# keeps the samples first and count the outputs.) Every pass carries **one**
# sample: many tiny jobs in place of one job of 20 samples.

# %% [markdown]
# ## Timing at growing n
#
# One call on the smallest size first pays TensorFlow's one-time costs
# (a warm-up). Then each size runs `repeats` times and keeps its fastest
# run; a progress bar follows the first run at the largest size.

# %% tags=["nbval-ignore-output"]
x_sizes = ju.regression_data(max(sizes), seed=seed)[0]
ju.loop_jacobian(model, x_sizes[: min(sizes)])  # warm-up, not timed
times = {}
for n in sizes:
    times[n] = min(
        ju.teaching.timing.first_call(
            ju.loop_jacobian, model, x_sizes[:n],
            progress=n == max(sizes) and run == 0)[1]
        for run in range(repeats))
    print(f"n = {n:>5}: {times[n]:7.3f} s   "
          f"({1e3 * times[n] / (n * n_outputs):.2f} ms per row of J)")

# %% tags=["nbval-ignore-output"]
slope = ju.teaching.plots.fitted_slope(sizes, [times[n] for n in sizes])
per_row = times[max(sizes)] / (max(sizes) * n_outputs)  # seconds
ax = ju.teaching.plots.loglog_scaling(sizes,
                             {"loop_jacobian": [times[n] for n in sizes]})
ax.set_title(f"The nested loop: time ~ n^{slope:.2f}")
claim("loop-linear", 0.7 < slope < 1.3,
      f"the loop's time grows like n^{slope:.2f}, linear in n (a slope "
      "between 0.7 and 1.3)")
print(f"Finding: at n = {max(sizes):,} each row of J (one sample's forward "
      f"and backward pass, with the loop around them) costs "
      f"{1e3 * per_row:.1f} ms; at n = 100,000 the loop would take about "
      f"{per_row * 100_000 * n_outputs / 60:.0f} minutes")

# %% [markdown]
# A slope near 1 means time proportional to n. That sounds fine until you
# look at the constant in the Finding: the time of each row, and each row
# is a pass over a *single* sample.

# %% [markdown]
# ## One sample or a thousand
#
# Time one bare forward and backward pass (a tape, the forward pass, one
# gradient) at batch sizes 1 and 1,000, keeping the fastest of 20 calls
# (the one least disturbed by other programs). If the arithmetic were what
# costs, 1,000 samples would take 1,000 times as long.

# %% tags=["nbval-ignore-output"]
def forward_backward(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=False))
    return tape.gradient(loss, model.trainable_variables)


def best_ms(fn, *args, repeats=20):  # the fastest call: the least disturbed
    return 1e3 * min(ju.time_call(fn, *args, repeats=repeats).times)


x_1000 = ju.regression_data(1000, seed=seed)[0]
one = best_ms(forward_backward, x_1000[:1])
thousand = best_ms(forward_backward, x_1000)
print(f"1 sample: {one:.2f} ms   1,000 samples: {thousand:.2f} ms")
claim("batch-pass-cheap", thousand / one < 100,
      f"one bare pass over 1,000 samples costs {thousand / one:.1f}x one "
      "sample's pass: under a tenth of 1,000 single passes")

# %% [markdown]
# So the time of a row is mostly **overhead**: Python, and the dispatch of
# every operation one at a time (*eager execution*:
# [TensorFlow words](00-welcome.ipynb#TensorFlow-words)), paid n · l times.
# The next stages keep the work and drop the overhead: they hand TensorFlow
# the whole batch at once.

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** A colleague has n = 10,000 samples and a network with l = 10 outputs.
# Using the cost of one row of the loop that you measured (`per_row`, in
# seconds), predict how long the loop takes: put the number of **minutes**
# in `answer`.

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: n * l rows at the measured cost per row (about the same for
# 10 outputs, since each row is one sample and overhead-bound).
answer = 10_000 * 10 * per_row / 60

# %%
check.exercise("01-1", answer, per_row=per_row)

# %% [markdown]
# ## Going further: where the time of a row goes
#
# How does a row of the loop compare with the bare pass above, and where
# does the difference go? Rebuild one row step by step and time each step
# on one sample (the fastest of 50 calls): a fresh tape with the forward
# pass, its outputs sliced on the tape (`tf.unstack`); then the backward
# pass of one output; then flattening the gradients and joining them into
# a row of NumPy. Whatever `loop_jacobian` spends beyond that, per row (the
# fastest of 3 runs on `n_row` samples), is the loop's own bookkeeping: its
# Python loop, and the eager operations a general function adds to every
# row (a wrapper around the model, two axes added to each gradient,
# `stack_columns`, and a copy into `J`).

# %% tags=["nbval-ignore-output"]
x_1 = x_1000[:1]
variables = model.trainable_variables


def record():  # a fresh tape; one sample's outputs, sliced on the tape
    with tf.GradientTape() as tape:
        y = tf.unstack(model(x_1, training=False)[0])
    return tape, y


def record_gradient():
    tape, y = record()
    return tape.gradient(y[0], variables)


def record_gradient_row():
    flat = [tf.reshape(g, [-1]) for g in record_gradient()]
    return tf.concat(flat, 0).numpy()


n_row = min(50, max(sizes))  # samples: the loop's time per row
totals = {
    "tape, forward pass, slice": best_ms(record, repeats=50),
    "+ backward pass of one output": best_ms(record_gradient, repeats=50),
    "+ flatten, join, to NumPy": best_ms(record_gradient_row, repeats=50),
    "+ the loop's bookkeeping": best_ms(ju.loop_jacobian, model,
                                        x_1000[:n_row], repeats=3)
    / (n_row * n_outputs),
}
parts, before = {}, 0.0
print(f"{'one row, step by step':<32} {'total ms':>9} {'step ms':>8}")
for name, total in totals.items():
    parts[name] = total - before
    print(f"{name:<32} {total:9.2f} {parts[name]:8.2f}")
    before = total
row_ms = totals["+ the loop's bookkeeping"]
passes = totals["+ backward pass of one output"]
claim("row-beyond-bare-pass", row_ms > one,
      f"a row of loop_jacobian costs {row_ms:.2f} ms, more than the "
      f"{one:.2f} ms of one bare pass; its tape, forward and backward pass "
      f"take {passes:.2f} ms, and flattening, joining and the loop's "
      f"bookkeeping the other {row_ms - passes:.2f} ms (the timing at "
      f"n = {max(sizes):,} above: {1e3 * per_row:.2f} ms a row)")

# %% [markdown]
# Read the table from the top: each line adds one step, and the last column
# is what that step costs (on a busy machine a small step can come out near
# zero, or below). The first two steps are the bare pass again; the last
# two are what the loop adds to every row, and the Finding sums them. Every
# step is a handful of eager operations on one sample, so each pays its
# dispatch, and the row pays all of them, n · l times.

# %% [markdown]
# ## Going further: one forward pass per sample
#
# The loop records a fresh forward pass for every row, although one sample's
# forward pass yields all its `l` outputs. A tape can serve them all if it
# is persistent, and if the outputs are **sliced on the tape**: a tape
# differentiates only what it recorded, so `y[k]` taken after the `with`
# block is a new tensor the tape never saw, and its gradient is `None`.
# Slice inside the block (`tf.unstack(y)` gives every output at once, as
# `loop_jacobian` does):

# %%
x_one = x_check[:1].astype("float32")
variables = model.trainable_variables
with tf.GradientTape(persistent=True) as tape:
    y = model(x_one, training=False)[0]
    outputs = tf.unstack(y)  # sliced on the tape
late = y[0]  # sliced after the block: the tape did not record it
print("sliced on the tape, gradient is None:",
      tape.gradient(outputs[0], variables)[0] is None)
print("sliced after the block, gradient is None:",
      tape.gradient(late, variables)[0] is None)
del tape

# %% [markdown]
# **2.** Save the repeated forward passes: open one *persistent* tape per sample
# (`tf.GradientTape(persistent=True)`, which answers more than one `gradient`
# call: [TensorFlow words](00-welcome.ipynb#TensorFlow-words)), run the
# forward pass once, slice its outputs on the tape, and take the gradient
# of each output from it (the l backward passes stay, so by the table
# above this saves the forward passes' share of the time, not half). Put the
# Jacobian your loop computes for `model` on `x_check` in `answer`: an array
# of shape (n, l, m), as `loop_jacobian` returns. The check compares it with
# `loop_jacobian`.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: one forward pass per sample instead of l; the l backward
# passes stay.
def loop_one_forward(model, x):
    rows = []
    for i in range(len(x)):
        with tf.GradientTape(persistent=True) as tape:
            y = model(x[i : i + 1], training=False)[0]
            outputs = tf.unstack(y)  # slice on the tape, or it is lost
        per_output = []
        for y_k in outputs:
            grads = tape.gradient(y_k, model.trainable_variables)
            flat = [tf.reshape(g, [-1]) for g in grads]
            per_output.append(tf.concat(flat, 0))
        rows.append(tf.stack(per_output))
        del tape
    return tf.stack(rows).numpy()


answer = loop_one_forward(model, x_check.astype("float32"))
print(answer.shape)

# %%
check.exercise("01-2", answer, model=model, x=x_check)

# %% [markdown]
# ## Keypoints
#
# - The loop is correct: it matches float64 finite differences.
# - It runs n · l forward and n · l backward passes, each on a single
#   sample. <!-- claim: n-times-l-passes -->
# - Its time is linear in n, but the constant is large: each row is
#   overhead, while one pass over 1,000 samples costs a small fraction of
#   1,000 single passes. <!-- claim: loop-linear, batch-pass-cheap -->
# - A tape differentiates only what it recorded: slice outputs inside the
#   `with` block.
# - Next, `02-vectorized`: one tape for the whole batch.
