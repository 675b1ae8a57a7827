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
# - What does the loop of the source question compute, and is it right?
# - How does its time grow with the number of samples, and where does it go?
#
# **Objectives**
# - Read `loop_jacobian` and prove it against finite differences in float64.
# - Count its forward and backward passes: n · l of each.
# - Measure its time at growing n and explain it by a fixed cost per pass.
#
# *Teaching: 15 min · Exercises: 15 min*

# %% [markdown]
# ## Setup

# %%
import numpy as np

import jacutil as ju
from jacutil import tf
from jacutil.teaching import check

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
sizes = [10, 30, 100, 300, 1000]  # numbers of samples to time the loop at
repeats = 1  # timed runs after the first, per size
n_check = 3  # samples in the correctness check
seed = 0

# %% [markdown]
# ## The loop
#
# This is the code of the source question (*How to compute the Jacobian
# matrix efficiently in TensorFlow, and speed up my slow code?*, named in
# `00-welcome`), written with `tf.GradientTape` (a recorder of operations:
# [TensorFlow words](00-welcome.ipynb#TensorFlow-words)): for every sample
# `i` and every output `k`, record the forward pass of that one sample on a
# fresh tape and ask for the gradient of `f(x_i)[k]` with respect to every
# variable. The gradients, flattened and joined, are row `J[i, k, :]`.

# %%
ju.teaching.notebook.show_source(ju.loop_jacobian)

# %% [markdown]
# ## Is it right?
#
# A Jacobian is only useful if it is correct, so we prove it against an
# independent reference: central finite differences, which share no code with
# the tape. A finite difference divides a tiny change of the outputs by a
# tiny step, so it loses most of float32's 7 significant digits: the check
# runs on a float64 copy of the network instead. The Finding below prints
# how closely the two agree there.

# %%
model = ju.question_mlp(seed=seed)
model64 = ju.question_mlp(seed=seed, dtype="float64")
model64.set_weights(model.get_weights())
x_check = ju.regression_data(n_check, seed=seed, dtype="float64")[0]

J_loop = ju.loop_jacobian(model64, x_check)
J_fd = ju.finite_difference_jacobian(model64, x_check)
np.testing.assert_allclose(J_loop, J_fd, rtol=1e-6, atol=1e-9)
print("loop:", J_loop.shape, J_loop.dtype, "== finite differences: True")

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
print("forward passes:", len(calls) - checks, " n * l =", 20 * n_outputs)
print("samples per pass:", set(calls[checks:]))

# %% [markdown]
# (Two extra calls first, on one sample and on two, check that every output
# keeps the samples first and count the outputs.) Every pass carries **one**
# sample, so the computer does 40 tiny jobs instead of one job of 20 samples.

# %% [markdown]
# ## Timing at growing n
#
# Each size runs once as a warm-up (the first call) and `repeats` more times.
# A progress bar shows the largest run.

# %% tags=["nbval-ignore-output"]
times = {}
for n in sizes:
    x_n = ju.regression_data(n, seed=seed)[0]
    timing = ju.time_call(ju.loop_jacobian, model, x_n, repeats=repeats,
                          progress=n == max(sizes))
    times[n] = timing.median
    print(f"n = {n:>5}: {timing.median:7.3f} s   "
          f"({1e3 * timing.median / (n * n_outputs):.2f} ms per pass)")

# %% tags=["nbval-ignore-output"]
slope = ju.teaching.plots.fitted_slope(sizes, [times[n] for n in sizes])
per_pass = times[max(sizes)] / (max(sizes) * n_outputs)
ax = ju.teaching.plots.loglog_scaling(sizes,
                             {"loop_jacobian": [times[n] for n in sizes]})
ax.set_title("The nested loop: time grows linearly with n")
print(f"Finding: the loop grows like n^{slope:.2f}; "
      f"{1e3 * per_pass:.1f} ms per forward+backward pass")
print(f"Finding: at n = 100,000 the loop would take about "
      f"{per_pass * 100_000 * n_outputs / 60:.0f} minutes")

# %% [markdown]
# The slope in the Finding is close to 1: time is proportional to n. That
# sounds fine until you look at the constant, also in the Finding:
# milliseconds for each pass over a *single* sample.

# %% [markdown]
# ## Where the time goes
#
# Time one forward and backward pass at batch sizes 1 and 1,000. If the work
# were what costs, 1,000 samples would take 1,000 times longer.

# %% tags=["nbval-ignore-output"]
def forward_backward(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=False))
    return tape.gradient(loss, model.trainable_variables)


x_1000 = ju.regression_data(1000, seed=seed)[0]
one = ju.time_call(forward_backward, x_1000[:1], repeats=20).median
thousand = ju.time_call(forward_backward, x_1000, repeats=20).median
print(f"1 sample: {1e3 * one:.2f} ms   "
      f"1,000 samples: {1e3 * thousand:.2f} ms   ratio {thousand / one:.1f}")
print(f"Finding: one pass over 1,000 samples costs {thousand / one:.1f}x one "
      "sample's pass, not 1,000x")

# %% [markdown]
# Read the Finding: a pass over 1,000 samples costs nowhere near 1,000 passes
# over one. The loop's time is **overhead**: Python, the dispatch of every
# operation one at a time (*eager execution*:
# [TensorFlow words](00-welcome.ipynb#TensorFlow-words)), a new tape per
# row. The arithmetic itself is almost free. The next stages keep the work
# and drop the overhead: they hand TensorFlow the whole batch at once.

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** A colleague has n = 10,000 samples and a network with l = 10 outputs.
# Using the cost per pass you measured (`per_pass`, in seconds), predict how
# long the loop takes: put the number of **minutes** in `answer`.

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: n * l passes at the measured cost per pass (about the same for
# 10 outputs, since each pass is one sample and overhead-bound).
answer = 10_000 * 10 * per_pass / 60
print(f"about {answer:.0f} minutes")

# %%
check.exercise("01-1", answer, per_pass=per_pass)

# %% [markdown]
# **2.** Halve the work: open one *persistent* tape per sample
# (`tf.GradientTape(persistent=True)`, which answers more than one `gradient`
# call: [TensorFlow words](00-welcome.ipynb#TensorFlow-words)), run the
# forward pass once, and take the gradient of each output from it. Put the
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
# - It runs n · l forward and n · l backward passes, each on a single sample.
# - Its time is linear in n, but the constant is large: milliseconds of
#   overhead per pass, while the arithmetic of a whole batch costs little more
#   than one sample's.
# - Next, `02-vectorized`: one tape for the whole batch.
