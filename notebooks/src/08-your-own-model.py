# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · Your own model: a CNN, an LSTM, two heads and two inputs
#
# **Questions**
# - Do the stages of notebooks 01-04 work on the model *I* bring - a CNN, an
#   LSTM, a model with two inputs and two heads?
# - Where do several outputs go in `J`, and how do I get them back?
# - What changes inside TensorFlow for a recurrent layer, and what falls
#   back to a slower path?
# - How do I give my own layer a rule of its own, and prove it?
#
# **Objectives**
# - Compute the per-sample Jacobian of a CNN, an LSTM and a two-input,
#   two-head model with every stage, each proved equal to the loop.
# - Read the rows of `J` for several outputs and split them back with
#   `split_outputs`.
# - Explain why pfor cannot vectorize an LSTM's `while_loop`, and read
#   `jac.formulation` to see what jacutil did instead.
# - Size chunks for a model whose activations outweigh its Jacobian rows.
# - Write a rule for your own layer, prove it alone with `check_rule`, and
#   use it with `registered`.
# - Read what a first call spends (`explain=True`) and why the third call
#   is the one to time.
#
# *Teaching: 69 min · Exercises: 45 min*

# %% [markdown]
# ## Setup

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

import jacutil as ju
from jacutil import keras, tf
from jacutil.teaching import check
from jacutil.teaching.claims import claim

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_check = 4  # samples in the proofs against the loop
steps = 8  # time steps of the LSTM's sequences
n_time = 500  # samples in the timings
n_map = 100  # samples for the slow tf.map_fn formulation
repeats = 3  # timed calls after the first
budget_mib = 16  # memory budget of the CNN's chunks, MiB
n_memory = 1000  # samples in the CNN's memory measurement
seed = 0

# %% [markdown]
# ## Three models a user brings
#
# A small CNN on grey images, an LSTM on sequences of `steps` steps (both from
# `jacutil.teaching.models`, seeded), and a functional model with **two inputs** - a
# vector and a small matrix - and **two heads** of different widths.

# %%
cnn = ju.small_cnn(seed=seed)
lstm = ju.sequence_lstm(n_steps=steps, seed=seed)

keras.utils.set_random_seed(seed)
vector = keras.Input((6,), name="vector")
matrix = keras.Input((3, 4), name="matrix")
joined = keras.layers.Concatenate()([vector, keras.layers.Flatten()(matrix)])
hidden = keras.layers.Dense(16, activation="tanh")(joined)
score = keras.layers.Dense(2, name="score")(hidden)
probabilities = keras.layers.Dense(3, activation="softmax",
                                   name="probs")(hidden)
two_heads = keras.Model([vector, matrix], [score, probabilities])

rng = np.random.default_rng(seed)
inputs = {
    "cnn": ju.image_data(n_time, seed=seed),
    "lstm": ju.sequence_data(n_time, n_steps=steps, seed=seed),
    "two_heads": [rng.standard_normal((n_time, 6)).astype("float32"),
                  rng.standard_normal((n_time, 3, 4)).astype("float32")],
}
models = {"cnn": cnn, "lstm": lstm, "two_heads": two_heads}


def first(x, n):
    """The first n samples of one input, or of each of several."""
    return tf.nest.map_structure(lambda a: a[:n], x)


for name, model in models.items():
    J = ju.per_sample_jacobian(model, first(inputs[name], 2))
    print(f"{name:>9}: J of 2 samples has shape {J.shape}  "
          f"(l = {J.shape[1]} outputs, m = {J.shape[2]:,} parameters)")

# %% [markdown]
# ## Several inputs and outputs: one layout
#
# Several inputs go in as the model takes them: a list (or a dict by input
# name) of arrays that share their first dimension, the samples. The
# outputs may be any nest. Each sample's row is **every output leaf,
# flattened, joined in `tf.nest.flatten` order** (a list in its order, a
# dict by sorted keys), so the two heads above give `l = 2 + 3 = 5`. In
# plain TensorFlow, the rule is one line:

# %% tags=["plain-version"]
def plain_as_rows(y, n):
    """Every output leaf flattened per sample, joined in tf.nest order: (n, l)."""
    return tf.concat([tf.reshape(leaf, [n, -1]) for leaf in tf.nest.flatten(y)], 1)


# %% [markdown]
# This is the rule in the code every stage runs; what it adds are errors
# that say what is wrong with an output that has no per-sample Jacobian (a
# scalar, a leaf whose first dimension is not the samples, integers) and
# one dtype for heads of several:

# %%
ju.teaching.notebook.show_source(ju.core.outputs.as_rows, plain=plain_as_rows)

# %% [markdown]
# Prove it: rows 0-1 of `J` must be the Jacobian of the `score` head alone,
# and rows 2-4 that of the `probs` head - with zeros in the columns of the
# other head's layer, which it does not use.

# %%
x_two = first(inputs["two_heads"], n_check)
J_two = ju.per_sample_jacobian(two_heads, x_two)
y_two = two_heads(x_two)
np.testing.assert_array_equal(plain_as_rows(y_two, n_check),
                              ju.core.outputs.as_rows(y_two, n_check))
score_only = keras.Model(two_heads.inputs, score)
probs_only = keras.Model(two_heads.inputs, probabilities)
columns, start = {}, 0
for v in two_heads.trainable_variables:
    columns[id(v)] = np.arange(start, start + int(np.prod(v.shape)))
    start += int(np.prod(v.shape))
for rows, head in [(slice(0, 2), score_only), (slice(2, 5), probs_only)]:
    own = np.concatenate([columns[id(v)] for v in head.trainable_variables])
    np.testing.assert_allclose(J_two[:, rows][:, :, own],
                               ju.loop_jacobian(head, x_two),
                               rtol=1e-5, atol=1e-6)
    others = np.setdiff1d(np.arange(J_two.shape[2]), own)
    assert not J_two[:, rows][:, :, others].any()
print("rows 0-1 = the score head, rows 2-4 = the probs head: True")

# %% [markdown]
# `split_outputs` gives the rows back in the model's own structure, each
# output with its per-sample shape and then the parameters. In plain
# NumPy, from the outputs themselves:

# %% tags=["plain-version"]
def plain_split_outputs(J, y):
    """J's rows back into the outputs' structure: (n, *shape, m) per output."""
    leaves = tf.nest.flatten(y)
    ends = np.cumsum([int(np.prod(leaf.shape[1:])) for leaf in leaves])
    parts = [J[:, end - int(np.prod(leaf.shape[1:])) : end].reshape(
                 len(J), *leaf.shape[1:], J.shape[2])
             for end, leaf in zip(ends, leaves, strict=True)]
    return tf.nest.pack_sequence_as(y, parts)


# %% [markdown]
# `jacutil`'s reads the structure from one forward pass of the model (so
# it needs the model and `x`, not the outputs), and checks J's shape
# against it first:

# %%
ju.teaching.notebook.show_source(ju.split_outputs, plain=plain_split_outputs)

# %%
parts = ju.split_outputs(J_two, two_heads, x_two)
for ours, plain in zip(parts, plain_split_outputs(J_two, y_two), strict=True):
    np.testing.assert_array_equal(plain, ours)
for name, part in zip(["score", "probs"], parts, strict=True):
    print(f"{name}: {part.shape}")

# %% [markdown]
# An output that does not keep the samples first - a mean over the batch -
# has no per-sample Jacobian. Every stage says so instead of returning
# numbers. (Each stage first runs the model on one sample and on two to
# read the layout of its outputs; hence "a batch of 1 sample" below.)

# %%
def batch_mean(x):
    return tf.reduce_mean(two_heads(x)[0], axis=0)


try:
    ju.per_sample_jacobian(batch_mean, x_two,
                           variables=two_heads.trainable_variables)
except ValueError as error:
    print("ValueError:", str(error)[:118], "...")

# %% [markdown]
# ## Every stage, on every model, equals the loop
#
# The loop of `01` is the reference: slow, and written with nothing but
# `tape.gradient`. Each faster stage must give the same numbers. The
# hand-derived path of `07` takes only chains of `Dense` layers; on these
# models it falls back to autodiff and says why (`jac.fallback`). (The
# tests prove every stage, XLA included, on many more models.)

# %%
jacs = {name: ju.compiled_jacobian(model) for name, model in models.items()}
stages = {
    "vectorized": ju.vectorized_jacobian,
    "per_sample": ju.per_sample_jacobian,
    "compiled": lambda m, x: jacs[name](x),
    "chunked": lambda m, x: ju.chunked_jacobian(
        m, x, chunk_size=max(1, n_check // 2), progress=False),
    "hand-derived": lambda m, x: dense(x),
}
for name, model in models.items():
    x_check = first(inputs[name], n_check)
    reference = ju.loop_jacobian(model, x_check)
    dense = ju.compiled_dense_jacobian(model)
    for stage in stages.values():
        np.testing.assert_allclose(stage(model, x_check), reference,
                                   rtol=1e-4, atol=1e-5)
    fallback = dense.fallback
    print(f"{name:>9}: {len(stages)} stages == loop_jacobian: True; "
          f"hand-derived path: {fallback}")

# %% [markdown]
# ## The LSTM: pfor and the `while_loop`
#
# A Keras LSTM runs its time steps in a `tf.while_loop`. `tf.vectorized_map`
# (pfor) vectorizes the per-sample Jacobian by rewriting every operation for
# a batch - but it cannot rewrite the *gradient* of a `while_loop` inside
# another pfor (the Jacobian's own, over the outputs). Tried directly:

# %%
target = ju.core.target.resolve_target(lstm)
x_lstm = tf.constant(first(inputs["lstm"], n_check))
with ju.core.formulation.pfor_log():  # pfor logs each op it fails on; keep it
    try:
        tf.function(lambda x: ju.stages.vectorized.per_sample_tape_jacobian(
            target, x))(x_lstm)
    except ValueError as error:
        last = str(error).strip().splitlines()[-1].strip()
        print("ValueError:", last.removeprefix("ValueError: ")[:100], "...")

# %% [markdown]
# The cure: while the Jacobian is *traced* (`tf.function`'s trace:
# "TensorFlow words" in 00-welcome), set each RNN layer's `unroll`
# flag - the same layer, the same weights. Unrolled, the time steps become
# copies of the step's operations, which pfor vectorizes. The flag is put
# back afterwards. In plain TensorFlow, for a model whose recurrent layers
# are its own layers:

# %% tags=["plain-version"]
def rows_of_one(model):
    """As in 02: a function of one sample that returns its (l, m) rows."""
    def rows(x_i):
        with tf.GradientTape() as tape:
            y = model(x_i[None])[0]
        blocks = tape.jacobian(y, model.trainable_variables)
        return tf.concat([tf.reshape(b, [y.shape[0], -1]) for b in blocks], 1)
    return rows


def plain_unrolled_jacobian(model, x):
    """The per-sample Jacobian of 02, traced with every RNN layer unrolled."""
    rnns = [layer for layer in model.layers if isinstance(layer, keras.layers.RNN)]
    saved = [layer.unroll for layer in rnns]
    for layer in rnns:
        layer.unroll = True  # only while the function is traced
    try:
        return tf.function(lambda x: tf.vectorized_map(rows_of_one(model), x))(x)
    finally:
        for layer, flag in zip(rnns, saved, strict=True):
            layer.unroll = flag


J_unrolled = plain_unrolled_jacobian(lstm, x_lstm).numpy()
np.testing.assert_allclose(J_unrolled, ju.per_sample_jacobian(lstm, x_lstm),
                           rtol=1e-5, atol=1e-6)
print("plain_unrolled_jacobian == per_sample_jacobian: True")

# %% [markdown]
# `jacutil`'s `unrolled` is that flag and its restoring, as a context
# manager, for the recurrent layers found anywhere in the model
# (`recurrent_layers` looks inside wrappers and nested models):

# %%
ju.teaching.notebook.show_source(ju.core.formulation.unrolled,
                                 plain=plain_unrolled_jacobian)

# %% [markdown]
# `per_sample_tensor` picks the formulation for each model and says which
# one it used; the compiled and chunked stages call it, and
# `jac.formulation` keeps its answer. Its idea in plain TensorFlow: pfor
# where it can, sample by sample where it cannot:

# %% tags=["plain-version"]
def plain_per_sample_tensor(rows_of_one, x):
    """(J, formulation): tf.vectorized_map, or tf.map_fn when pfor fails."""
    try:
        return tf.function(lambda x: tf.vectorized_map(rows_of_one, x))(x), "pfor"
    except ValueError:  # pfor cannot rewrite an operation (the LSTM's loop)
        shape = tf.TensorSpec(None, x.dtype)
        return tf.function(lambda x: tf.map_fn(rows_of_one, x,
                                               fn_output_signature=shape))(x), "map_fn"


with ju.core.formulation.pfor_log():  # as above: pfor's log of its failure
    J_plain, how = plain_per_sample_tensor(rows_of_one(lstm), x_lstm)
np.testing.assert_allclose(J_plain, ju.per_sample_jacobian(lstm, x_lstm),
                           rtol=1e-5, atol=1e-6)
print(f"plain_per_sample_tensor ({how}) == per_sample_jacobian: True")

# %% [markdown]
# `jacutil`'s adds the reasons a model needs `tf.map_fn` before pfor is
# tried (random layers in training mode draw one mask per sample; a
# recurrent layer that must keep its loop), the unrolling above, and the
# formulation it used, in words:

# %%
ju.teaching.notebook.show_source(ju.stages.vectorized.per_sample_tensor,
                                 plain=plain_per_sample_tensor)

# %%
for name, jac in jacs.items():
    print(f"{name:>9}: {jac.formulation}")
claim("formulations-read", "unrolled" in jacs["lstm"].formulation
      and "Conv2DBackpropFilter" in jacs["cnn"].formulation,
      "the LSTM's Jacobian was traced unrolled, and the CNN's "
      "Conv2DBackpropFilter ran in a while_loop (the lines above)")

# %% [markdown]
# Two lines to read (the claim under them checks both). The LSTM was
# unrolled. The CNN's gradient of a
# convolution with respect to its filters (`Conv2DBackpropFilter`) has no
# pfor rule, so pfor runs that one operation sample by sample in a
# `while_loop`: correct, and the slow part of the CNN's Jacobian.
#
# How do the ways to compute the LSTM's Jacobian compare? Unrolled pfor
# (`tf.function`), the batch tape in chunks of 32 (quadratic inside
# a chunk, but no pfor over a `while_loop`), and `tf.map_fn`, one sample per
# loop step - timed on fewer samples (`n_map`) and scaled, as it is slow.
# The one-off cost of tracing and compiling (the first call less a later
# one) is reported apart.

# %% tags=["nbval-ignore-output"]
x_time = inputs["lstm"]
map_fn = tf.function(lambda x: ju.core.formulation.map_fn_jacobian(target, x))
ways = {
    "vectorized_map, unrolled (tf.function)": (ju.compiled_jacobian(lstm),
                                               n_time),
    "tape.jacobian in chunks of 32": (
        lambda x: ju.chunked_jacobian(lstm, x, chunk_size=32, method="batch",
                                      progress=False), n_time),
    "tf.map_fn, one sample a step": (lambda x: map_fn(x).numpy(), n_map),
}
rows = []
for label, (jac, n) in ways.items():
    start = time.perf_counter()
    jac(x_time[:n])
    first_call = time.perf_counter() - start
    median = ju.time_call(jac, x_time[:n], repeats=repeats).median
    trace = max(first_call - median, 0.0)  # tracing and compiling only
    rows.append((label, trace, median * n_time / n))
    print(f"{label:<40} trace/compile {trace:6.2f} s   "
          f"n = {n_time:,}: {1e3 * median * n_time / n:8.1f} ms")
fastest = min(rows, key=lambda r: r[2])
slowest = max(rows, key=lambda r: r[2])
once = min(rows, key=lambda r: r[1] + r[2])
print(f"Finding: LSTM, n = {n_time:,}, each call after the first: "
      f"{fastest[0]} is fastest ({1e3 * fastest[2]:.0f} ms), "
      f"{slowest[2] / fastest[2]:.0f}x faster than {slowest[0]}")
print(f"Finding: LSTM, n = {n_time:,}, one call with its trace: {once[0]} "
      f"is cheapest ({once[1] + once[2]:.1f} s)")

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(9, 3.2))
where = np.arange(len(rows))
ax.barh(where - 0.2, [r[2] for r in rows], height=0.4, color="tab:blue",
        label=f"each call, n = {n_time:,}")
ax.barh(where + 0.2, [max(r[1], 1e-3) for r in rows], height=0.4,
        color="tab:orange", label="once: trace and compile")
ax.set_yticks(where, [r[0] for r in rows])
ax.set_xscale("log")
ax.set_xlabel("seconds (log scale)")
ax.invert_yaxis()
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
ax.set_title(f"LSTM(16) on {steps} steps: {len(rows)} ways to the same Jacobian")
fig.tight_layout()
print(f"Finding: the figure, log scale: per call at n = {n_time:,} (blue), "
      f"from {1e3 * fastest[2]:.0f} ms ({fastest[0]}) to "
      f"{1e3 * slowest[2]:.0f} ms ({slowest[0]}); trace and compile once "
      f"(orange), longest for {max(rows, key=lambda r: r[1])[0]} "
      f"({max(r[1] for r in rows):.1f} s)")

# %% [markdown]
# Unrolling puts its cost into the *first* call: its trace holds a copy of
# the step's operations for every time step, so it should grow with the
# sequence. Traced alone (no call), at two lengths, the unrolled Jacobian:

# %% tags=["nbval-ignore-output"]
def unrolled_trace(n_steps):
    """(seconds, graph operations) to trace the unrolled Jacobian at n_steps."""
    model = ju.sequence_lstm(n_steps=n_steps, seed=seed)
    spec = tf.TensorSpec([n_check, n_steps, 4], tf.float32)
    start = time.perf_counter()
    with ju.core.formulation.unrolled(ju.core.formulation.recurrent_layers(model)):
        traced = tf.function(lambda x: tf.vectorized_map(rows_of_one(model), x))
        graph = traced.get_concrete_function(spec).graph
    return time.perf_counter() - start, len(graph.get_operations())


lengths = [1, 4]  # time steps: cheap to trace, and 4x apart
traces = {k: unrolled_trace(k) for k in lengths}
for k, (seconds, operations) in traces.items():
    print(f"{k} time steps: {operations:,} operations, traced in {seconds:.1f} s")
(short_s, short_ops), (long_s, long_ops) = traces.values()
claim("unrolled-trace-grows", long_ops > short_ops and long_s > short_s,
      f"{lengths[1]} steps instead of {lengths[0]}: {long_ops / short_ops:.1f}x "
      f"the operations, {long_s / short_s:.1f}x the trace time")

# %% [markdown]
# Every call after the first is fast. For a Jacobian you need many times
# (at every step of a fit) the blue bars decide; for one you need once,
# add the orange bar: the second Finding line names the cheapest single
# call at this length. The batch tape and `tf.map_fn` keep the loop: their
# traces hold one copy of the step, whatever the length.

# %% [markdown]
# ## The CNN: memory goes to activations too
#
# A chunk of `c` samples holds `c · l` back-propagated signals through
# every layer. For the MLP of `04` those are tiny beside the Jacobian's
# rows; a convolution's feature maps are not. `chunked_jacobian` counts one
# sample's activations from the model's traced forward pass and sizes the
# chunk with both terms. In plain Python, 04's rule with a second term:

# %% tags=["plain-version"]
def plain_bytes_per_sample(n_outputs, n_params, itemsize, activations):
    """One sample's working memory: its rows and its back-propagated signals."""
    rows = ju.core.planner.WORKING_MEMORY_FACTOR * n_params
    signals = ju.core.planner.ACTIVATION_FACTOR * activations
    return int(itemsize * n_outputs * (rows + signals))


# %% [markdown]
# `jacutil`'s, the same two terms (both factors were measured, as 04 says):

# %%
ju.teaching.notebook.show_source(ju.core.planner.bytes_per_sample,
                                 plain=plain_bytes_per_sample)

# %%
x_cnn = inputs["cnn"]
n_outputs, n_params = 4, cnn.count_params()
activations = ju.core.memory.activation_elements(cnn, x_cnn[:1])
budget = budget_mib * 2**20
planner = ju.core.planner  # the module shown above: its two factors
per_sample = planner.bytes_per_sample(n_outputs, n_params, 4, activations)
assert plain_bytes_per_sample(n_outputs, n_params, 4, activations) == per_sample
rows_alone = planner.bytes_per_sample(n_outputs, n_params, 4)
rows_only = ju.chunk_size_for(budget, n_outputs, n_params, 4)
with_activations = ju.chunk_size_for(budget, n_outputs, n_params, 4,
                                     activations=activations)
assert (budget // per_sample, budget // rows_alone) == (with_activations,
                                                        rows_only)
print(f"one sample: {n_outputs} x {n_params:,} Jacobian entries, "
      f"{activations:,} activations")
print(f"WORKING_MEMORY_FACTOR = {planner.WORKING_MEMORY_FACTOR}, "
      f"ACTIVATION_FACTOR = {planner.ACTIVATION_FACTOR}")
print(f"bytes per sample = 4 x {n_outputs} x "
      f"({planner.WORKING_MEMORY_FACTOR} x {n_params:,} + "
      f"{planner.ACTIVATION_FACTOR} x {activations:,}) = {per_sample:,}; "
      f"rows only: {rows_alone:,}")
print(f"chunk for {budget_mib} MiB: {budget:,} // {per_sample:,} = "
      f"{with_activations} counting the activations too; "
      f"{budget:,} // {rows_alone:,} = {rows_only} counting the rows only")

# %% [markdown]
# Notebook 04's model is linear through zero: a chunk of `c` samples needs
# `c` times the bytes per sample. Measure the peak at both chunk sizes and
# a few more, in one fresh process (an empty memory pool), in increasing
# order, each peak above the level before the first: what the process had
# to grow to. A straight line through the peaks separates what grows with
# the chunk from a fixed part:

# %% tags=["nbval-ignore-output"]
chunks = sorted({max(1, with_activations // 2), with_activations, rows_only,
                 2 * with_activations})
peaks = dict(zip(chunks, ju.teaching.memory_sweeps.measure_in_fresh_process(
    "chunked", chunks, n_samples=n_memory, model="small_cnn"), strict=True))
slope, fixed = np.polyfit(chunks, [peaks[c] for c in chunks], 1)
for c in chunks:
    print(f"chunks of {c:>4}: peak {peaks[c] / 2**20:5.1f} MiB "
          f"= {peaks[c] / budget:.2f} x the budget; the line "
          f"{(fixed + slope * c) / 2**20:5.1f} MiB, the model "
          f"{c * per_sample / 2**20:5.1f} MiB")
scatter = max(abs(peaks[c] - fixed - slope * c) for c in chunks)
print(f"Finding: CNN, {budget_mib} MiB budget: chunks of {with_activations} "
      f"peak at {peaks[with_activations] / budget:.2f}x the budget; sized by "
      f"the rows alone ({rows_only}), {peaks[rows_only] / budget:.2f}x")
print(f"Finding: CNN, a chunk {rows_only / with_activations:.2f}x larger "
      f"peaks {peaks[rows_only] / peaks[with_activations]:.2f}x higher; the "
      f"line: {fixed / 2**20:.1f} MiB fixed + {slope / 2**10:.0f} KiB per "
      f"sample (the model: 0 + {per_sample / 2**10:.0f} KiB), whose ratio is "
      f"{(fixed + slope * rows_only) / (fixed + slope * with_activations):.2f}"
      f"x; single peaks lie up to {scatter / 2**20:.1f} MiB off the line")
claim("activation-chunk-within-budget",
      peaks[with_activations] <= budget and slope < per_sample,
      f"chunks of {with_activations}, sized with the activations, peak at "
      f"{peaks[with_activations] / 2**20:.1f} MiB within the {budget_mib} MiB "
      f"budget; the model's {per_sample / 2**10:.0f} KiB a sample lies above "
      f"the line's slope, {slope / 2**10:.0f} KiB")

# %% [markdown]
# Two things the linear model leaves out make two peaks' ratio differ from
# their chunks' ratio. A fixed part, the line's intercept: what a run needs
# whatever its chunk (the graph's buffers, the pool's first blocks); a
# positive one makes the ratio smaller, a negative one larger. And the
# scatter: a peak is the resident memory the allocator grew to, in blocks,
# so a single reading can sit off the line by the amount printed. Compare
# the measured ratio with the line's: where they differ by about the
# scatter, the difference is the allocator, not the model. The model's
# bytes per sample are set above the line's slope on purpose: a budget
# must hold with the fixed part on top.

# %% [markdown]
# ## Your own layer, your own rule
#
# The layer rules of `07` know Keras's layers. A layer of your own, such as
# `Scale` below (`y = x * s`, one learned scale per feature), gets autodiff
# inside the rules' plan:

# %%
class Scale(keras.layers.Layer):
    """y = x * s, one learned scale per feature."""

    def build(self, input_shape):
        self.s = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.s


keras.utils.set_random_seed(seed)
scaled = keras.Sequential([keras.Input((4,)),
                           keras.layers.Dense(8, activation="tanh"),
                           Scale(), keras.layers.Dense(2)])
x_scaled = rng.standard_normal((n_check, 4)).astype("float32")
plan, _ = ju.rules.plan_for(scaled, scaled.trainable_variables)
print(plan.describe())

# %% [markdown]
# A rule is a subclass of `ju.rules.Rule` with two methods. `_forward(a)`
# returns the output and what the backward step needs. `_backward` gets
# `delta`, the signal at the output, shape `(n, l, features)`: row `k` is
# d y_k / d (this layer's output). It returns the blocks of the wanted
# variables, keyed by variable, each `(n, l, size)`, and the signal at the
# input. Here d y_k / d s_j = delta_kj a_j and d y_k / d a_j = delta_kj s_j:

# %%
class ScaleRule(ju.rules.Rule):
    name = "scale"

    def __init__(self, layer):
        super().__init__(layer)
        self.variables = [layer.s]  # the columns this rule writes

    def _forward(self, a):
        return a * self.layer.s, a  # the output, and a for _backward

    def _backward(self, a, delta, wanted, need_signal):
        blocks = ju.rules.Blocks()
        if self.layer.s in wanted:
            blocks[self.layer.s] = delta * a[:, None]  # (n, l, features)
        below = delta * self.layer.s if need_signal else None
        return blocks, below


# %% [markdown]
# Prove it alone before any model uses it. `check_rule` builds the layer in
# float64 on a few random samples and compares the rule with autodiff in
# random directions: `vjp` (the blocks against the tape's gradients),
# `jvp` (against forward mode), `signal` (the signal at the input),
# `norms` (the per-sample gradient norms that DP clipping uses, against the
# blocks' own: a rule may compute them without the blocks, notebook 09).
# Each number is the largest relative error:

# %%
print(ju.testing.check_rule(Scale(dtype="float64"), ScaleRule,
                            input_shape=(4,)).line())

# %% [markdown]
# A rule that forgets the factor `a` in its block is caught, and the
# report says which check failed and by how much:

# %%
class WrongScaleRule(ScaleRule):
    def _backward(self, a, delta, wanted, need_signal):
        blocks, below = super()._backward(a, delta, wanted, need_signal)
        if self.layer.s in wanted:
            blocks[self.layer.s] = delta  # a is missing
        return blocks, below


wrong = ju.testing.check_rule(Scale(dtype="float64"), WrongScaleRule,
                              input_shape=(4,), raise_on_failure=False)
print(wrong.line())
print("passed:", wrong.passed)

# %% [markdown]
# Use the proved rule with `registered`: inside the `with` block it is the
# rule for `Scale`, and the registry is restored afterwards. (`register`
# makes it permanent; it refuses a type that already has a rule.)

# %%
with ju.rules.registered(Scale, ScaleRule):
    J_scaled, choice = ju.jacobian(scaled, x_scaled, explain=True)
print(choice.path, [rule for _, rule in choice.layers])
difference = np.abs(J_scaled - ju.loop_jacobian(scaled, x_scaled)).max()
print(f"largest difference from loop_jacobian: {difference:.1e}")

# %% [markdown]
# ## The first call, and the calls after it
#
# A user meets the first call: a notebook cell, a script run once. On
# inputs of a shape it has not seen, `ju.jacobian` does three things before
# the answer. It proves the layer rules, layer by layer: each rule against
# autodiff of its own layer, on two samples. It counts the activations that
# size its chunks. And it runs the rules eagerly, without tracing a graph.
# The second call traces; from the third on, the graph runs alone.
#
# A layer's proof is kept: in this process, and in a folder under your
# cache directory (`JACUTIL_CHECK_CACHE` names another; `0` turns it off),
# for this TensorFlow, Keras and jacutil. Below the folder is a new one of
# this notebook's own, so you see the first proof; a second model built of
# the same layers, with other weights, needs none. `explain=True` says what
# each call spent:

# %%
import os
import tempfile

verdicts_folder = tempfile.TemporaryDirectory(prefix="jacutil-verdicts-")
your_folder = os.environ.get("JACUTIL_CHECK_CACHE")  # put back below
os.environ["JACUTIL_CHECK_CACHE"] = verdicts_folder.name
ju.rules.verdicts.forget_in_process()  # as in a new process
x_first = x_cnn[:n_time]
calls = {}
for name, model_seed in (("a CNN", seed + 1), ("its twin", seed + 2)):
    model = ju.small_cnn(seed=model_seed)  # the same layers, other weights
    for call in ("first", "second", "third"):
        start = time.perf_counter()
        _, how = ju.jacobian(model, x_first, explain=True)
        calls[name, call] = (time.perf_counter() - start, how)
        print(f"{name}, {call} call: {str(how).splitlines()[-1]}")
    print(f"   {calls[name, 'first'][1].check}")
if your_folder is None:
    del os.environ["JACUTIL_CHECK_CACHE"]
else:
    os.environ["JACUTIL_CHECK_CACHE"] = your_folder
verdicts_folder.cleanup()

first_s, third_s = calls["a CNN", "first"][0], calls["a CNN", "third"][0]
twin = calls["its twin", "first"][1].check
claim("warm-after-first", third_s < first_s and "0 layer rules proved now" in twin,
      f"the third call took {third_s * 1e3:.0f} ms against the first's "
      f"{first_s * 1e3:.0f} ms, and the twin's first call proved no layer again")

# %% [markdown]
# The first call proved each layer and ran eagerly; the second paid the
# trace; the third ran the graph alone, and the twin reused every proof
# (the claim under the cell checks both). A layer configured differently
# (another width, activation or input shape) is proved again on its first
# use, and a rule that is wrong is caught there. Timing a function? Time
# the third call, and say what the first one cost.
# <!-- claim: warm-after-first -->

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** A GRU with `return_sequences=True` outputs one vector per time
# step. The cell below builds `Input((5, 3)) → GRU(4,
# return_sequences=True) → Dense(2)` and three sequences `x_gru`. How many
# rows per sample does its Jacobian have? Split them back into `answer`, an
# array of shape `(n, 5, 2, m)` (sample, step, output, parameter), and
# check step 0's rows against a model that outputs step 0 alone.

# %%
keras.utils.set_random_seed(seed)
seq_in = keras.Input((5, 3))
gru_out = keras.layers.GRU(4, return_sequences=True)(seq_in)
steps_out = keras.layers.Dense(2)(gru_out)
gru = keras.Model(seq_in, steps_out)
x_gru = np.random.default_rng(seed).standard_normal((3, 5, 3))
x_gru = x_gru.astype("float32")

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: l = 5 steps x 2 outputs = 10 rows per sample, step 0's first.
J_gru = ju.compiled_jacobian(gru)(x_gru)
answer = ju.split_outputs(J_gru, gru, x_gru)
step0 = keras.Model(seq_in, steps_out[:, 0])
np.testing.assert_allclose(answer[:, 0], ju.loop_jacobian(step0, x_gru),
                           rtol=1e-5, atol=1e-6)
print("rows per sample:", J_gru.shape[1], " split:", answer.shape,
      " step 0 == its own model: True")

# %%
check.exercise("08-1", answer, model=gru, x=x_gru)

# %% [markdown]
# **2.** Give the two-head model's outputs as a dict
# `{"score": ..., "probs": ...}` instead of a list (`keras.Model(
# two_heads.inputs, {...})` with the heads `score` and `probabilities` of
# the cell that built it). Which rows of `J` hold `score` now? Put their
# indices in `answer` (a list of integers, counted from 0) and check with
# `split_outputs`.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: dict keys are sorted, so "probs" (3 rows) comes before "score".
as_dict = keras.Model(two_heads.inputs,
                      {"score": score, "probs": probabilities})
J_dict = ju.per_sample_jacobian(as_dict, x_two)
by_name = ju.split_outputs(J_dict, as_dict, x_two)
answer = [3, 4]
np.testing.assert_array_equal(J_dict[:, answer], by_name["score"])
# The dict model lists its variables in another order, so its columns are
# permuted: compare each row's length, which the order does not change.
np.testing.assert_allclose(np.linalg.norm(by_name["score"], axis=-1),
                           np.linalg.norm(J_two[:, 0:2], axis=-1),
                           rtol=1e-5)
print("score is rows", answer, "of the dict model's J: True")

# %%
check.exercise("08-2", answer)

# %% [markdown]
# **3.** Differentiate with respect to a variable that is *not* trainable:
# the moving mean of a `BatchNormalization` (inference mode), in the
# float64 model below. Pass `variables=[...]`, put the Jacobian
# d outputs / d moving_mean in `answer` (shape `(4, 2, 3)`: samples,
# outputs, moving-mean entries), and compare it with
# `finite_difference_jacobian`.

# %%
keras.utils.set_random_seed(seed)
bn_model = keras.Sequential([keras.Input((3,), dtype="float64"),
                             keras.layers.BatchNormalization(dtype="float64"),
                             keras.layers.Dense(2, dtype="float64")])
norm = bn_model.layers[0]
x_bn = np.random.default_rng(seed).standard_normal((4, 3))

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: every variable passed in variables= is watched by the tape,
# trainable or not.
answer = ju.per_sample_jacobian(bn_model, x_bn, variables=[norm.moving_mean])
reference = ju.finite_difference_jacobian(bn_model, x_bn,
                                          variables=[norm.moving_mean])
np.testing.assert_allclose(answer, reference, rtol=1e-6, atol=1e-9)
print("d outputs / d moving_mean:", answer.shape,
      " == finite differences: True")

# %%
check.exercise("08-3", answer, model=bn_model, x=x_bn,
               variable=norm.moving_mean)

# %% [markdown]
# ## Keypoints
#
# - Every stage takes the models users bring: several inputs as a list or a
#   dict, any nest of outputs, recurrent and convolutional layers, attention,
#   `Embedding`, subclassed models, explicit non-trainable variables.
# - One sample's row is every output leaf flattened, in `tf.nest.flatten`
#   order; `split_outputs` gives the structure back. An output without the
#   samples first is an error.
# - pfor cannot vectorize the gradient of a `while_loop`: jacutil unrolls
#   recurrent layers while tracing, and `jac.formulation` says what it did.
# - Activations count towards a chunk's memory; the chunk size comes from
#   both the Jacobian's rows and one sample's traced forward pass, and such
#   a chunk stays within its budget. <!-- claim: activation-chunk-within-budget -->
# - Prove every stage against the loop on *your* model before you trust it.
# - A rule of your own writes `_forward` and `_backward` (blocks keyed by
#   variable); prove it alone with `ju.testing.check_rule`, then use it with
#   `ju.rules.registered`.
