# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · Pitfalls: the popular answers, failing and fixed
#
# **Questions**
# - Which mistakes in the well-known answers give a wrong Jacobian, `None`,
#   a page of zeros or a cryptic error?
# - Why are Dropout and BatchNormalization in training mode a trap?
# - Why is a Jacobian slow when it keeps being traced, and when does a
#   correct Jacobian "fail" a check against finite differences?
#
# **Objectives**
# - See each trap fail, say what went wrong, and fix it - with an assertion
#   that the fix is right.
# - Recognise the three traps that `jacutil` guards against, and read the
#   messages that tell you what to do.
# - Check a Jacobian against finite differences the way that settles it:
#   in float64.
#
# *Teaching: 67 min · Exercises: 40 min*

# %% [markdown]
# ## Setup
#
# Every trap below was run on the TensorFlow version printed here, with
# Keras 3. Other versions may fail differently.
#
# A failing call runs inside `fails_with(...)`: it prints the error the way
# Python would (shortened, without the traceback), and fails itself if
# nothing is raised - so the notebook still runs from top to bottom. Where
# TensorFlow's own warnings are the lesson, `tf_warnings()` catches them and
# prints them as text.

# %%
import contextlib
import logging
import re
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np

import jacutil as ju
from jacutil import keras, tf
from jacutil.teaching import check
from jacutil.teaching.claims import claim


@contextlib.contextmanager
def fails_with(error_type):
    """Run the block, which must raise error_type; print the error briefly."""
    try:
        yield
    except error_type as error:
        name = type(error).__name__
        message = " ".join(str(error).split())
        # Drop what tf.function puts in front ("in user code: File ..."),
        # and the values of a variable quoted in the message.
        message = message.rsplit(f" {name}: ", 1)[-1]
        message = re.sub(r"value=\[.*\]>", "value=...>", message)
        if len(message) > 700:
            message = message[:350] + " [...] " + message[-300:]
        print(f"{name}: {message}")
    else:
        raise AssertionError(f"{error_type.__name__} expected, none raised")


@contextlib.contextmanager
def tf_warnings():
    """Catch what TensorFlow logs in the block; print each line briefly."""
    caught = []
    handler = logging.Handler()
    handler.emit = lambda record: caught.append(record.getMessage())
    logger = tf.get_logger()
    saved, logger.handlers = logger.handlers, [handler]
    try:
        yield caught
    finally:
        logger.handlers = saved
    for message in caught:
        message = re.sub(r" at 0x[0-9a-f]+", "", message)  # no address
        print("TensorFlow warns:", message.split(" Tracing is")[0])


# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())
print("Keras", keras.__version__)
print(f"Finding: every pitfall below shown on TensorFlow {tf.__version__}, "
      f"Keras {keras.__version__}")

# %% tags=["parameters"]
n_samples = 32  # batch size for the retracing timings (at least 7)
repeats = 3  # timed calls after the first
n_batches = 12  # batches in the "compiled Jacobian built in a loop" trap
xla_sizes = 8  # batch sizes 1..xla_sizes through the XLA Jacobian
seed = 0

# %% [markdown]
# The pitfalls come from the popular answers to the loop question of
# [`00-welcome`](00-welcome.ipynb#The-two-questions); its network (10 → 64 →
# 32 → 2, 2,850 parameters) and a batch. `J_ref` is the answer every fix
# must reproduce: the per-sample Jacobian, proved against finite differences
# in `02-vectorized` and the tests.

# %%
keras.utils.set_random_seed(seed)
model = ju.question_mlp(seed=seed)
variables = model.trainable_variables
x, _ = ju.regression_data(4, seed=seed)
J_ref = ju.per_sample_jacobian(model, x)
n, l, m = J_ref.shape
print("x:", x.shape, " J_ref:", J_ref.shape)

# %% [markdown]
# ## 1 · `tf.gradients` on a batch: the sum, not one row per sample
#
# A TF1-style answer computes the per-sample outputs (or losses) of the whole
# batch and calls `tf.gradients` once, expecting one gradient per sample.
# Eager TensorFlow 2 refuses `tf.gradients` outright:

# %%
with fails_with(RuntimeError):
    tf.gradients(model(x), variables)


# %% [markdown]
# Inside `tf.function` it runs - and quietly returns something else:

# %%
@tf.function
def batch_gradients(x):
    y = model(x, training=False)  # (n, l): one row per sample
    return tf.gradients(y, variables)


grads = batch_gradients(tf.constant(x))
print("kernel of the first layer:", tuple(variables[0].shape))
print("its 'gradient':           ", tuple(grads[0].shape), "- no sample axis")

# %% [markdown]
# **What went wrong.** `tf.gradients(ys, xs)` returns the gradient of
# `sum(ys)`: it adds up every sample and every output before it
# differentiates. One vector of length `m`, not an `(n, l, m)` array.
#
# **The fix.** Differentiate each sample's outputs on their own:
# `ju.per_sample_jacobian` (a tape per sample, vectorized with
# `tf.vectorized_map`). And we can prove what `tf.gradients` returned: the
# per-sample Jacobian summed over samples and outputs.

# %%
flat_grads = np.concatenate([g.numpy().ravel() for g in grads])
np.testing.assert_allclose(flat_grads, J_ref.sum(axis=(0, 1)),
                           rtol=1e-5, atol=1e-5)
print("tf.gradients == J summed over samples and outputs: True")
print("the fix:", J_ref.shape, "- one (l, m) block per sample")

# %% [markdown]
# ## 2 · `tape.watch` on Keras 3 variables; a forward pass outside the tape
#
# Two lines of a popular answer, each wrong on TensorFlow 2 with Keras 3.
# First, watching the model's variables by hand:

# %%
with fails_with(ValueError):
    with tf.GradientTape() as tape:
        tape.watch(model.trainable_variables)

# %% [markdown]
# Keras 3 variables are `keras.Variable`s, not `tf.Variable`s, and
# `tape.watch` takes only tensors and `tf.Variable`s. It is also not needed:
# a tape watches every trainable variable that the forward pass reads.
#
# Second, the outputs computed *before* the tape opened:

# %%
y = model(x, training=False)  # forward pass first ...
with tf.GradientTape() as tape:  # ... tape second: it recorded nothing
    pass
print("Jacobian:", tape.jacobian(y, variables))

# %% [markdown]
# **What went wrong.** A tape records only what runs while it is open. `y`
# was computed before, so for the tape it is a constant: every Jacobian is
# `None`.
#
# **The fix.** Run the forward pass inside the tape, and watch nothing by
# hand. `tape.jacobian` over the batch then gives one block per variable;
# flattened and joined they are `J_ref`.

# %%
with tf.GradientTape() as tape:
    y = model(x, training=False)
blocks = tape.jacobian(y, variables)
J_tape = np.concatenate([b.numpy().reshape(n, l, -1) for b in blocks], 2)
np.testing.assert_allclose(J_tape, J_ref, rtol=1e-5, atol=1e-6)
print("forward pass inside the tape:", J_tape.shape, "== J_ref: True")

# %% [markdown]
# ## 3 · The Jacobian with respect to a flattened copy
#
# The layout question of [`00-welcome`](00-welcome.ipynb#The-two-questions)
# wants the columns in one flat parameter vector, so an answer flattens and
# joins the variables - *after* the forward pass - and differentiates with
# respect to that:

# %%
with tf.GradientTape(persistent=True) as tape:
    y = model(x, training=False)
    theta = tf.concat([tf.reshape(v, [-1]) for v in variables], axis=0)
print("d y / d theta:", tape.jacobian(y, theta))

# %% [markdown]
# `None`. Asking for zeros instead of `None` hides the mistake completely:

# %%
zeros = tape.jacobian(
    y, theta, unconnected_gradients=tf.UnconnectedGradients.ZERO)
print("shape", tuple(zeros.shape), " every entry zero:",
      bool(np.all(zeros.numpy() == 0)))

# %% [markdown]
# A page of zeros with the right shape: the optimizer now sees a flat
# landscape. Made into a variable - `theta` a `keras.Variable`, as one might
# try next - the same call on TensorFlow 2.21 fails with an error that says
# nothing about the cause:

# %%
theta_var = keras.Variable(theta)
with fails_with(AttributeError):
    with tf.GradientTape() as tape:
        y = model(x, training=False)
    tape.jacobian(y, theta_var,
                  unconnected_gradients=tf.UnconnectedGradients.ZERO)

# %% [markdown]
# **What went wrong.** `theta` is a *copy*: the model reads its own
# variables, never `theta`, so no path leads from `theta` to the outputs.
# The outputs do not depend on `theta` at all: zero is the true answer to
# the question asked, and the question is the mistake.
#
# `jacutil` refuses the mistake with a message that says what to do. The
# rule, in plain Python: one unused variable is fine (its columns are
# truly zero), but when *no* variable reaches the outputs, the question
# was asked of the wrong thing:

# %% tags=["plain-version"]
def plain_require_connected(gradients):
    """Refuse a Jacobian in which no variable reaches the outputs."""
    if all(g is None for g in gradients):
        raise ValueError("no variable reaches the outputs: differentiate "
                         "with respect to the variables the model reads")


def refuses(guard, gradients):
    try:
        guard(gradients)
    except ValueError:
        return True
    return False


def ours(gradients):
    return ju.core.guards.require_connected(gradients, gradients)


for gradients in ([None, None], [None, tf.zeros(3)]):  # refused, then not
    assert refuses(plain_require_connected, gradients) == refuses(ours, gradients)
print("plain_require_connected refuses what require_connected refuses: True")

# %% [markdown]
# `jacutil`'s guard, called at the end of every stage, is that rule; its
# message (`DISCONNECTED`) also names how many variables were asked for
# and what to pass instead:

# %%
ju.teaching.notebook.show_source(ju.core.guards.require_connected,
                                 plain=plain_require_connected)

# %%
with fails_with(ValueError):
    ju.per_sample_jacobian(model, x, variables=[theta_var])
with fails_with(TypeError):  # the tensor itself is refused even earlier
    ju.per_sample_jacobian(model, x, variables=[theta])

# %% [markdown]
# **The fix.** Differentiate with respect to the variables the model reads;
# the columns come out in `flat_params(model)` order, so nothing needs
# flattening first. Proof that the order is that of the flat vector: nudge
# one entry of `theta` and the outputs move along that column of `J`.

# %%
theta0 = ju.flat_params(model)
p, step = 100, 1e-2
ju.set_flat_params(model, theta0 + step * (np.arange(m) == p))
moved = model(x).numpy()
ju.set_flat_params(model, theta0)
np.testing.assert_allclose(moved - model(x).numpy(), step * J_ref[:, :, p],
                           atol=1e-5)
print(f"column {p} of J predicts the move of parameter {p}: True")

# %% [markdown]
# ## 4 · `training=True`: Dropout and BatchNormalization
#
# Some answers call the model with `training=True`. For a plain stack of
# Dense layers that changes nothing; with Dropout or BatchNormalization it
# changes everything.
#
# ### Dropout: the Jacobian of a random function

# %%
keras.utils.set_random_seed(seed)
dropout_model = keras.Sequential([
    keras.Input((10,)),
    keras.layers.Dense(16, activation="relu"),
    keras.layers.Dropout(0.5, name="dropout"),
    keras.layers.Dense(2),
])


def tape_jacobian(model, x, training):
    # A loop over the rows, not pfor: eager pfor traces a new function on
    # every call, the cost that section 5 measures.
    with tf.GradientTape(persistent=True) as tape:
        y = model(x, training=training)
    blocks = tape.jacobian(y, model.trainable_variables,
                           experimental_use_pfor=False)
    return np.concatenate(
        [b.numpy().reshape(len(x), -1, b.shape[2:].num_elements())
         for b in blocks], axis=2)


first = tape_jacobian(dropout_model, x, training=True)
second = tape_jacobian(dropout_model, x, training=True)
print("two calls, same x, same weights - equal:",
      np.array_equal(first, second))

# %% [markdown]
# **What went wrong.** In training mode Dropout zeroes a new random half of
# its inputs on every call. Each call returns the exact Jacobian of a
# different random network - none of them the network that predicts.
#
# `jacutil` warns (it does not refuse: per-sample gradients *of dropout
# training* are a legitimate wish). The warning is shown here as text:

# %%
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ju.per_sample_jacobian(dropout_model, x, training=True)
for warning in caught:
    print(f"{warning.category.__name__}: {warning.message}")

# %% [markdown]
# **The fix.** `training=False` - `jacutil`'s default - the network that
# predicts and that an optimizer fits. Two calls agree, bit for bit:

# %%
first = tape_jacobian(dropout_model, x, training=False)
second = tape_jacobian(dropout_model, x, training=False)
np.testing.assert_array_equal(first, second)
np.testing.assert_allclose(first, ju.per_sample_jacobian(dropout_model, x),
                           rtol=1e-5, atol=1e-6)
print("training=False: two calls equal, and equal to jacutil: True")

# %% [markdown]
# ### BatchNormalization: the samples are no longer independent
#
# In training mode BatchNormalization normalizes with the mean and variance
# *of the batch*. So sample 0's outputs depend on sample 1. Move only
# sample 1 and watch sample 0's Jacobian:

# %%
keras.utils.set_random_seed(seed)
bn_model = keras.Sequential([
    keras.Input((10,)),
    keras.layers.Dense(16, activation="tanh"),
    keras.layers.BatchNormalization(name="batch_norm"),
    keras.layers.Dense(2),
])
bn_model(x)  # build
moving_mean = bn_model.get_layer("batch_norm").moving_mean.numpy().copy()
x_moved = x.copy()
x_moved[1] += 1.0  # sample 1 only

J_a = tape_jacobian(bn_model, x, training=True)
J_b = tape_jacobian(bn_model, x_moved, training=True)
print("sample 0's Jacobian changed when sample 1 moved:",
      not np.allclose(J_a[0], J_b[0]))
print("and the layer's moving mean changed:", not np.allclose(
    bn_model.get_layer("batch_norm").moving_mean.numpy(), moving_mean))

# %% [markdown]
# The same coupling breaks `tape.batch_jacobian` (derivatives with respect
# to the *inputs*), which assumes that output `i` depends on input `i`
# only. What it returns for sample `j` is the sum over every sample `i` of
# $\partial y_i / \partial x_j$: sample `j`'s influence on *all* the
# outputs of the batch, not on its own outputs alone.

# %%
def input_jacobians(model, x, training):
    x = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = model(x, training=training)
    full = tape.jacobian(y, x, experimental_use_pfor=False).numpy()
    diagonal = np.stack([full[i, :, i] for i in range(len(x))])  # (n, l, 10)
    batch = tape.batch_jacobian(y, x, experimental_use_pfor=False)
    return batch.numpy(), diagonal, full  # full: (n, l, n, 10), all i, j


batch_jac, diagonal, full = input_jacobians(bn_model, x, training=True)
print("d y[0] / d x[1] is zero:", bool(np.allclose(full[0, :, 1], 0)))
print("batch_jacobian == the per-sample blocks:",
      np.allclose(batch_jac, diagonal, atol=1e-5))
influence = full.sum(axis=0).transpose(1, 0, 2)  # [j] = sum_i d y_i / d x_j
np.testing.assert_allclose(batch_jac, influence, rtol=1e-4, atol=1e-5)
print("batch_jacobian[j] == sum over i of d y[i] / d x[j]: True")

# %% [markdown]
# **What went wrong.** With batch statistics there is no per-sample
# Jacobian to compute: a sample's row depends on the whole batch. Stages
# that take one sample at a time normalize a batch of one, and return zero
# columns for every layer before the normalization; every call also
# overwrites the moving mean and variance that predictions use. Nothing right
# can come out, so `jacutil` refuses:

# %%
with fails_with(ValueError):
    ju.per_sample_jacobian(bn_model, x, training=True)

# %% [markdown]
# The guard that says so, `ju.core.guards.check_training_mode`, runs in
# every stage on a Keras model, nested models and layers inside custom
# layers included.
#
# **The fix.** `training=False`: the layer uses its moving statistics, a
# fixed affine map, and each sample depends on itself alone.

# %%
J_a = tape_jacobian(bn_model, x, training=False)
J_b = tape_jacobian(bn_model, x_moved, training=False)
np.testing.assert_allclose(J_a[0], J_b[0], rtol=1e-6)
batch_jac, diagonal, full = input_jacobians(bn_model, x, training=False)
np.testing.assert_allclose(batch_jac, diagonal, rtol=1e-6, atol=1e-7)
np.testing.assert_allclose(J_a, ju.per_sample_jacobian(bn_model, x),
                           rtol=1e-5, atol=1e-6)
print("sample 0 independent of sample 1, batch_jacobian right: True")

# %% [markdown]
# ## 5 · Retracing: paying the first call again and again
#
# TensorFlow turns Python into a graph (a *trace*), and XLA compiles a graph
# for one concrete shape. Both cost far more than running the result. Three
# ways to pay them on every call:
#
# **(a) Eager `tape.jacobian`.** Outside `tf.function`, `tape.jacobian`
# vectorizes the backward pass (pfor) again on every call. The same code,
# compiled once, does not:

# %% tags=["nbval-ignore-output"]
x_batch, _ = ju.regression_data(n_samples, seed=seed)
x_tensor = tf.constant(x_batch)


def eager_jacobian(x):
    with tf.GradientTape() as tape:
        y = model(x, training=False)
    return tape.jacobian(y, variables)


with tf_warnings() as tf_warned:  # TensorFlow's retracing warnings, as text
    eager = ju.time_call(eager_jacobian, x_tensor, repeats=repeats)
compiled_batch = ju.compiled_jacobian(model, method="batch")
compiled = ju.time_call(compiled_batch, x_batch, repeats=repeats)
print(f"eager tape.jacobian: {eager.median:.3f} s per call, every call")
print(f"compiled:            {compiled.median:.3f} s per call "
      f"(first call {compiled.first:.2f} s)")
print(f"Finding: eager tape.jacobian re-vectorizes every call: "
      f"{eager.median / compiled.median:.0f}x the compiled call "
      f"(n = {n_samples})")
claim("eager-slower-than-compiled", eager.median > compiled.median,
      f"a warm eager call ({eager.median:.3f} s) costs more than a warm "
      f"compiled one ({compiled.median:.4f} s)")
print("TensorFlow's retracing warning in this run:",
      "given (above)" if any("retracing" in m for m in tf_warned)
      else "not given (too few eager calls)")


# %% [markdown]
# TensorFlow notices too: it warns when one function has been traced five
# times within its last ten calls. Each eager `tape.jacobian` traces pfor's
# vectorizing function anew - the eager calls of sections 2 and 3 count as
# well - so enough eager calls cross that line, and its warning, caught and
# printed as text, names this very trap (the last line above says whether
# this run's calls crossed it).
#
# **(b) `tf.function` without an input signature** traces once per new
# input shape - here, per batch size. Count the traces with a Python side
# effect (it runs only while tracing):

# %%
traced_sizes = []


@tf.function
def unsigned_jacobian(x):
    traced_sizes.append(x.shape[0])  # runs once per trace
    with tf.GradientTape() as tape:
        y = model(x, training=False)
    return tape.jacobian(y, variables)


call_sizes = [4, 5, 6, 5, 7]
seconds = []
for size in call_sizes:
    start = time.perf_counter()
    unsigned_jacobian(x_tensor[:size])
    seconds.append(time.perf_counter() - start)
print("calls with batch sizes:", call_sizes)
print("traces for sizes:      ", traced_sizes)

# %% tags=["nbval-ignore-output"]
for size, s in zip(call_sizes, seconds, strict=True):
    print(f"batch of {size}: {s:.3f} s")
traced = [s for k, s in enumerate(seconds) if call_sizes[k] not in call_sizes[:k]]
repeated = [s for k, s in enumerate(seconds) if call_sizes[k] in call_sizes[:k]]
claim("trace-costs-more", max(repeated) < min(traced),
      f"each call that traced ({min(traced):.3f} s or more) costs more than "
      f"the repeat of a size already traced ({max(repeated):.3f} s)")

# %% [markdown]
# **The fix.** An input signature whose batch dimension is `None`: one
# trace for every batch size. That is what `ju.compiled_jacobian` builds.

# %%
jac = ju.compiled_jacobian(model)
for size in call_sizes:
    J_size = jac(x_batch[:size])
np.testing.assert_allclose(J_size[:4], J_ref, rtol=1e-5, atol=1e-6)
print("compiled_jacobian: traces =", jac.trace_count,
      "for sizes", call_sizes)

# %% [markdown]
# **(c) XLA compiles per concrete shape**, even with a `None` batch
# dimension in the signature: every new batch size is a new compile.

# %% tags=["nbval-ignore-output"]
@tf.function(input_signature=[tf.TensorSpec([None, 10], tf.float32)],
             jit_compile=True)
def xla_jacobian(x):  # one trace: the signature's batch dimension is None
    with tf.GradientTape() as tape:
        y = model(x, training=False)
    return tape.jacobian(y, variables)


xla_seconds = []
for size in (4, 4, 5, 5):
    start = time.perf_counter()
    xla_jacobian(x_tensor[:size])
    xla_seconds.append(time.perf_counter() - start)
    print(f"XLA, batch of {size}: {xla_seconds[-1]:.3f} s")
claim("xla-compile-per-size", xla_seconds[1] < xla_seconds[0]
      and xla_seconds[3] < xla_seconds[2],
      "at each new size the first call (a compile) costs more than the repeat")

# %% [markdown]
# The first call at each new size pays a compile; the repeat does not.
# `ju.compiled_jacobian(model, jit_compile=True)` pads each batch to the
# next power of two, and a batch of one to two, so sizes 1 to 8 cost three
# compiles (at 2, 4 and 8), not eight:

# %%
jac_xla = ju.compiled_jacobian(model, jit_compile=True)
for size in range(1, xla_sizes + 1):
    J_xla = jac_xla(x_batch[:size])
np.testing.assert_allclose(
    J_xla, ju.per_sample_jacobian(model, x_batch[:xla_sizes]),
    rtol=1e-5, atol=1e-6)
print(f"sizes 1..{xla_sizes}: XLA compiled for batch sizes",
      sorted(jac_xla.compiled_shapes), "- traces:", jac_xla.trace_count)

# %% [markdown]
# **(d) A compiled Jacobian built inside the loop.** Each
# `ju.compiled_jacobian(model)` is a new function, so each traces once -
# the signature cannot help. `jacutil` counts traces per model and warns
# past `ju.core.guards.RETRACE_LIMIT`:

# %%
batches = [ju.regression_data(8, seed=seed + b)[0] for b in range(n_batches)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    start = time.perf_counter()
    for batch in batches:
        J_batch = ju.compiled_jacobian(model)(batch)  # the trap
    in_loop = time.perf_counter() - start
for warning in caught:
    print(f"{warning.category.__name__}: {warning.message}")
print("warnings:", len(caught), " limit:", ju.core.guards.RETRACE_LIMIT)

# %% [markdown]
# **The fix.** Build it once, outside the loop:

# %%
jac_once = ju.compiled_jacobian(model)
once_seconds = []  # each batch apart: the first one traces
for batch in batches:
    start = time.perf_counter()
    J_batch_once = jac_once(batch)
    once_seconds.append(time.perf_counter() - start)
once = sum(once_seconds)
np.testing.assert_allclose(J_batch_once, J_batch, rtol=1e-6, atol=1e-7)
print("built once: traces =", jac_once.trace_count, " same Jacobian: True")

# %% tags=["nbval-ignore-output"]
first_once, warm_once = once_seconds[0], float(np.median(once_seconds[1:]))
print(f"{n_batches} batches, compiled Jacobian built in the loop: "
      f"{in_loop:.2f} s, a trace in every batch ({in_loop / n_batches:.3f} s "
      "a batch)")
print(f"built once: {once:.2f} s = the first batch {first_once:.3f} s (its "
      f"trace) + {n_batches - 1} warm batches at {warm_once:.4f} s each")
claim("loop-retraces-every-batch", in_loop / n_batches > 5 * warm_once,
      f"a batch in the loop ({in_loop / n_batches:.3f} s) costs "
      f"{in_loop / n_batches / warm_once:.0f}x a warm batch of the Jacobian "
      f"built once ({warm_once:.4f} s)")
print(f"Finding: building the compiled Jacobian inside the loop costs "
      f"{in_loop / once:.1f}x building it once ({n_batches} batches; the "
      "ratio grows with the batches, since the loop traces in every one)")

# %% [markdown]
# The costs of this section, side by side:

# %% tags=["nbval-ignore-output"]
retrace = np.median([s for s, size in zip(seconds, call_sizes, strict=True)
                     if call_sizes.count(size) == 1])
rows = [
    ("eager tape.jacobian, per call", eager.median),
    ("compiled tape.jacobian, per call", compiled.median),
    ("one trace (new batch size, no signature)", retrace),
    ("compiled Jacobian built per batch, per batch", in_loop / n_batches),
    ("compiled Jacobian built once, first batch", first_once),
    ("compiled Jacobian built once, later batches", warm_once),
]
print(f"{'what':<46} {'seconds':>8}")
for what, s in rows:
    print(f"{what:<46} {s:8.3f}")

# %% [markdown]
# ## 6 · float32 against finite differences
#
# A correct float32 Jacobian, checked against central finite differences of
# the same float32 network, "fails". A smaller network (10 → 8 → 2, 106
# parameters) keeps the finite differences quick: they cost two forward
# passes per parameter.

# %%
keras.utils.set_random_seed(seed)
small = ju.question_mlp(hidden=(8,), seed=seed)
x_small, _ = ju.regression_data(3, seed=seed)
J32 = ju.per_sample_jacobian(small, x_small)
J32_fd = ju.finite_difference_jacobian(small, x_small)  # step 1e-6
claim("float32-check-fails", not np.allclose(J32, J32_fd, rtol=1e-5, atol=1e-6),
      "the float32 check against finite differences fails (rtol=1e-5, "
      "atol=1e-6)")

# %% tags=["nbval-ignore-output"]
print(f"largest difference: {np.abs(J32 - J32_fd).max():.2g}"
      f" (entries of J up to {np.abs(J32).max():.2g})")

# %% [markdown]
# **What went wrong - not the Jacobian.** A central difference
# $\frac{f(\theta + h) - f(\theta - h)}{2h}$ makes two errors.
#
# - *Rounding*: each $f$ is computed to within about $\varepsilon |f|$, and
#   the quotient divides the difference of the two by $2h$: an error of
#   about $R/h$ with $R = \varepsilon |f|$. float32 keeps
#   $\varepsilon \approx 1.2 \cdot 10^{-7}$, so with $h = 10^{-6}$ the
#   rounding error alone is about $0.1\,|f|$ - the largest difference
#   printed above.
# - *Truncation*: the Taylor terms the quotient leaves out,
#   $f(\theta \pm h) = f \pm h f' + \tfrac{h^2}{2} f'' \pm
#   \tfrac{h^3}{6} f''' + \dots$, leave $T h^2$ with $T = |f'''| / 6$.
#
# Their sum $R/h + T h^2$ is smallest where its derivative
# $-R/h^2 + 2 T h$ is zero:
#
# $$h^* = \left(\frac{R}{2T}\right)^{1/3}
#       = \left(\frac{3 \varepsilon |f|}{|f'''|}\right)^{1/3},
#   \qquad E^* = \frac{R}{h^*} + T {h^*}^2 = \frac{3}{2} \frac{R}{h^*}.$$
#
# The rule of thumb "$h^* \approx \varepsilon^{1/3}$, error
# $\approx \varepsilon^{2/3}$" sets both constants to 1. Where $|f'''|$ is
# small next to $3|f|$ - as along the direction below - the best step lies
# to the right of $\varepsilon^{1/3}$ and its error is below
# $\varepsilon^{2/3}$; exercise 3 measures the constants and predicts both.
# (A forward difference, $(f(\theta + h) - f(\theta))/h$, has truncation
# $\propto h$: its best step is near $\sqrt{\varepsilon}$.) Either way
# the constants, so the best step, are not known in advance: a float32
# check *passes* (meets the tolerance asserted above, `rtol=1e-5,
# atol=1e-6`) only if its step happens to lie near a best step that must
# first be found by scanning. The Finding below says whether the best step
# of the scan meets that tolerance.
#
# Below: the error of a directional derivative $J v$ of the loop
# question's network against the step, in float32 and float64, with the rule of thumb
# $\varepsilon^{1/3}$ dotted. Rounding falls as $1/h$ on the left,
# truncation rises as $h^2$ on the right. At the largest steps both curves
# jump: there the step crosses a ReLU's kink, where the Taylor expansion
# stops holding. (At the smallest, float32 cannot represent
# $\theta \pm h v$ apart from $\theta$: the quotient is zero and the error
# is $|J v|$ itself.)

# %% tags=["nbval-ignore-output"]
model64 = ju.question_mlp(seed=seed, dtype="float64")
model64.set_weights(model.get_weights())
direction = np.random.default_rng(seed).standard_normal(m)
direction /= np.linalg.norm(direction)
x64 = x.astype("float64")
exact = ju.per_sample_jacobian(model64, x64) @ direction  # J v, (n, l)
steps = np.logspace(-9, -1, 17)
errors = {}
for name, net in (("float32", model), ("float64", model64)):
    theta_net = ju.flat_params(net).astype("float64")
    errs = []
    for h in steps:
        outputs = []
        for sign in (1, -1):
            ju.set_flat_params(net, theta_net + sign * h * direction)
            outputs.append(net(x.astype(net.dtype)).numpy().astype("float64"))
        ju.set_flat_params(net, theta_net)
        errs.append(np.abs((outputs[0] - outputs[1]) / (2 * h) - exact).max())
    errors[name] = errs
fig, ax = plt.subplots(figsize=(8.5, 4))
for name, errs in errors.items():
    ax.loglog(steps, errs, "o-", label=name)
for name, dtype in (("float64", np.float64), ("float32", np.float32)):
    ax.axvline(np.finfo(dtype).eps ** (1 / 3), ls=":", color="grey",
               label="eps ** (1/3), float64\nthen float32: the rule\nof thumb"
               if name == "float64" else None)
ax.set_xlabel("step h")
ax.set_ylabel("largest error of the difference quotient")
ax.set_title("Central differences: rounding (left) against truncation")
ax.grid(True, which="both", alpha=0.3)
ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))  # beside the curves
fig.tight_layout()
for name, errs in errors.items():
    best = int(np.argmin(errs))
    eps = np.finfo(name).eps
    tolerance = 1e-6 + 1e-5 * np.abs(exact).max()  # the check's, above
    at = int(np.argmin(np.abs(np.log(steps / 1e-6))))  # the reference's step
    print(f"Finding: {name} finite differences are at best "
          f"{errs[best]:.2g} off (step {steps[best]:.0e}, "
          f"{steps[best] / eps ** (1 / 3):.0f} x eps^(1/3); "
          f"eps^(2/3) = {eps ** (2 / 3):.0e}); the check's tolerance "
          f"{tolerance:.2g} {'met' if errs[best] <= tolerance else 'missed'} "
          f"there, {'met' if errs[at] <= tolerance else 'missed'} at the "
          f"reference's step {steps[at]:.0e}")
err32, err64 = np.array(errors["float32"]), np.array(errors["float64"])
claim("float32-fd-misses", err32[at] > tolerance >= err64[at],
      f"at the reference's step, float32 misses the tolerance "
      f"({err32[at]:.2g} > {tolerance:.2g}) and float64 meets it "
      f"({err64[at]:.2g})")
claim("float32-fd-best-not-safe", err32.min() > tolerance / 10,
      f"at its best step float32 is {err32.min() / tolerance:.2g}x the "
      f"tolerance, not ten times below it (float64: "
      f"{err64.min() / tolerance:.0e}x)")

# %% [markdown]
# **The check that settles it.** Copy the network to float64 and compare
# there: at the reference's step $h = 10^{-6}$ the rounding error is about
# $10^{-10}\,|f|$, and autodiff and finite differences agree within the
# tolerance asserted below. Then
# the float32 Jacobian matches the float64 one to float32 precision - so it
# was right all along.

# %%
small64 = ju.question_mlp(hidden=(8,), seed=seed, dtype="float64")
small64.set_weights(small.get_weights())
x_small64 = x_small.astype("float64")
J64 = ju.per_sample_jacobian(small64, x_small64)
J64_fd = ju.finite_difference_jacobian(small64, x_small64)
np.testing.assert_allclose(J64, J64_fd, rtol=1e-6, atol=1e-9)
np.testing.assert_allclose(J32, J64, rtol=1e-5, atol=1e-6)
print("float64: autodiff == finite differences: True")
print("float32 Jacobian == float64 Jacobian to float32 precision: True")

# %% [markdown]
# ## 7 · The quadratic memory of `tape.jacobian` over a batch
#
# `tape.jacobian(y, variables)` with `y` of shape `(n, l)` runs one backward
# pass per output row - `n·l` of them, vectorized - and **each row is
# back-propagated through the whole batch**: its intermediate tensors hold
# all `n` samples, although only one contributes. Time and memory grow like
# $n^2$: ten times the samples, a hundred times the memory. The memory
# model that `02-vectorized` measured at sizes that fit predicts the loop
# question's network at larger n (nothing big is run):

# %%
for n_big in (1_000, 10_000):
    need = ju.core.memory.predicted_bytes(n_big, "batch")
    print(f"n = {n_big:>6,}: tape.jacobian over the batch needs about "
          f"{need / 2**30:,.1f} GiB")

# %% [markdown]
# The fixes are the next stages: differentiate each
# sample through itself only (`ju.per_sample_jacobian`, linear in n,
# `02-vectorized`), and cut the batch into chunks whose working memory fits
# a budget (`ju.chunked_jacobian`, `04-chunked`).

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** A colleague's TF1 code computes one loss per sample,
# `losses = tf.reduce_sum((model(x) - y) ** 2, axis=1)`, and calls
# `tf.gradients(losses, variables)` inside a `tf.function`: the sum of
# the samples' gradients. Get one gradient row per sample instead (the
# check compares them with a loop of tapes). (Hint: `ju.per_sample_jacobian` takes any
# callable with `variables=`, and it may call it on one sample at a time,
# so each sample's target must travel with its input: join them into one
# array, `np.concatenate([x, y_true], axis=1)`, and split it again inside
# your function.)
# `answer`: the per-sample gradients of `x` and its targets `y_true`
# (below), shape `(n, m)`, columns in `flat_params(model)` order.

# %%
_, y_true = ju.regression_data(4, seed=seed)  # the targets of x

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: hand jacutil the per-sample loss as an (n, 1) output. jacutil
# may call it on one sample at a time, so the targets travel with the
# inputs: one array [x, y], split inside.
xy = np.concatenate([x, y_true], axis=1)  # (n, 10 + 2)


def per_sample_loss(xy):
    x, y = xy[:, :10], xy[:, 10:]
    return tf.reduce_sum((model(x, training=False) - y) ** 2,
                         axis=1, keepdims=True)


answer = ju.per_sample_jacobian(per_sample_loss, xy,
                                variables=variables)[:, 0]
print("per-sample gradients:", answer.shape)

# %%
check.exercise("06-1", answer, model=model, x=x, y=y_true)

# %% [markdown]
# **2.** You want to keep a BatchNormalization layer *and* have a
# per-sample Jacobian in "training mode". `bn_fresh` below is a new copy of
# section 4's model. Freeze its BatchNormalization layer
# (`layer.trainable = False`) and ask `jacutil` for the Jacobian with
# `training=True`: does it still refuse? Is sample 0's Jacobian still
# independent of sample 1 (`x_moved`)? Why? `answer`: that Jacobian of `x`,
# shape `(n, l, columns)`.

# %%
keras.utils.set_random_seed(seed)
bn_fresh = keras.Sequential([
    keras.Input((10,)),
    keras.layers.Dense(16, activation="tanh"),
    keras.layers.BatchNormalization(name="batch_norm"),
    keras.layers.Dense(2),
])

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: a frozen BatchNormalization uses its moving statistics even in
# training mode (Keras 3), so it is a fixed affine map: accepted, and each
# sample depends on itself alone. Its gamma and beta leave the Jacobian's
# columns, since they are no longer trainable.
bn_fresh.get_layer("batch_norm").trainable = False
answer = ju.per_sample_jacobian(bn_fresh, x, training=True)
J_moved = ju.per_sample_jacobian(bn_fresh, x_moved, training=True)
np.testing.assert_allclose(answer[0], J_moved[0], rtol=1e-6)
print("accepted, columns:", answer.shape[2], " sample 0 independent: True")

# %%
check.exercise("06-2", answer, model=bn_fresh, x=x)

# %% [markdown]
# **3.** Put the formula of section 6 to work on a type the figure does
# not show: float16. The curves give the constants: rounding
# $R = \varepsilon |f|$, with $|f|$ the largest output of the network on
# `x` (`np.abs(model64(x64)).max()`), and truncation $T$ from the float64
# curve where it rises as $h^2$: the error divided by $h^2$ at
# $h = 10^{-3}$ (`errors["float64"][12]`, `steps[12]`). With float16's
# $\varepsilon$ (`np.finfo("float16").eps`), predict its best step $h^*$
# and the error $E^*$ there. Could a float16 check against finite
# differences tell a right Jacobian from a wrong one? `answer`:
# `[h*, E*]` of float16.

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: h* = (R / 2T)^(1/3), E* = 3/2 R / h*. float16's epsilon is
# 2**13 times float32's, so h* is 2**(13/3) (about 20) times float32's: a
# step that crosses ReLU kinks, where the formula stops holding, and even
# its E* is not small next to J v. No: float16 cannot settle a check.
f_size = np.abs(model64(x64).numpy()).max()
T = errors["float64"][12] / steps[12] ** 2
R = np.finfo("float16").eps * f_size
h_star = (R / (2 * T)) ** (1 / 3)
answer = [h_star, 1.5 * R / h_star]
print(f"float16: h* {h_star:.1e}, E* {answer[1]:.1e} = "
      f"{answer[1] / np.abs(exact).max():.0%} of the largest entry of J v")

# %%
check.exercise("06-3", answer, model=model64, x=x, direction=direction)

# %% [markdown]
# ## Keypoints
#
# - `tf.gradients` (graph only) differentiates the **sum** of its targets:
#   no per-sample rows. Use a per-sample Jacobian.
# - Do not `tape.watch` Keras 3 variables (it raises, and is not needed);
#   run the forward pass **inside** the tape, or the Jacobian is `None`.
# - Differentiate with respect to the variables the model reads, never a
#   flattened copy: that gives `None`, silent zeros, or a cryptic error.
#   `jacutil` refuses it with an error that says what to do.
# - Use `training=False`. Dropout in training mode gives the Jacobian of a
#   random function (`jacutil` warns); BatchNorm couples the samples and
#   rewrites its statistics (`jacutil` refuses).
# - Trace once: compile with a `None` batch dimension, pad for XLA, and
#   build the compiled Jacobian outside the loop (`jacutil` warns past
#   `RETRACE_LIMIT` traces): each trace costs more than many warm calls.
#   <!-- claim: trace-costs-more, loop-retraces-every-batch -->
# - Check Jacobians against finite differences in **float64**; in float32
#   a correct Jacobian misses the tolerance at the reference's step, and
#   even the best step of a scan, which must be found first, does not bring
#   it safely below (the float32 Finding says by how much).
#   <!-- claim: float32-fd-misses, float32-fd-best-not-safe -->
#   The best step of a central difference is
#   $(3\varepsilon|f|/|f'''|)^{1/3}$: $\varepsilon^{1/3}$ only when $|f'''|$
#   is about $3|f|$.
# - `tape.jacobian` over a whole batch needs $n^2$ memory: see
#   `02-vectorized` and `04-chunked`.
