# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Chunked: a Jacobian of any size in bounded memory
#
# **Questions**
# - How much memory does the Jacobian of n samples need, and where does it
#   go?
# - How do I choose a chunk size from a memory budget?
# - How do I compute a Jacobian larger than memory, and prove it right?
#
# **Objectives**
# - Measure the memory model: the result's bytes plus working memory per
#   sample.
# - Compute a Jacobian larger than the budget into a memory-mapped `.npy`,
#   chunk by chunk, with a progress bar, and prove it equal to the
#   unchunked result.
#
# *Going further* (optional, after the exercise): peak memory and time
# against the chunk size, for both vectorizations inside a chunk; a
# Jacobian written in two runs, as after a restart.
#
# *Teaching: 21 min · Exercises: 10 min · Going further: 27 min*

# %% [markdown]
# ## Setup

# %%
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import jacutil as ju
from jacutil import tf  # TensorFlow, imported by jacutil without its start-up log
from jacutil.teaching import check

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_samples = 12000  # samples in the Jacobian written to disk
budget_mib = 64  # memory budget for the chunks, MiB
n_sweep = 10000  # samples in the sweeps over chunk sizes
chunk_sizes = [32, 128, 512, 2048]  # per-sample method
batch_chunk_sizes = [16, 64, 256]  # batch tape inside each chunk
seed = 0

# %%
model = ju.question_mlp(seed=seed)
x, y = ju.regression_data(max(n_samples, n_sweep), seed=seed)
n_outputs, n_params, itemsize = 2, ju.flat_params(model).size, 4
row_bytes = n_outputs * n_params * itemsize  # one sample's rows of J
print(f"one sample's rows: {n_outputs} x {n_params:,} x {itemsize} bytes "
      f"= {row_bytes:,} bytes")
print(f"J of {n_samples:,} samples: {n_samples * row_bytes / 2**20:,.0f} MiB;"
      f" budget {budget_mib} MiB")

# %% [markdown]
# ## The memory model
#
# Computing the rows of `c` samples at once needs the rows themselves, the
# per-variable blocks before they are joined, and what TensorFlow keeps in
# its pool: a multiple of `c · l · m · itemsize`. The multiple was
# **measured** (not guessed) on nine models, rounded up by a margin, and is
# stored in `jacutil.core.planner` as `WORKING_MEMORY_FACTOR` (the comment
# above it there says how). A chunk size is then one division:

# %% tags=["plain-version"]
def plain_chunk_size(budget, n_outputs, n_params, itemsize):
    """The most samples whose working memory fits in budget bytes."""
    factor = ju.core.planner.WORKING_MEMORY_FACTOR
    return int(budget // (factor * n_outputs * n_params * itemsize))


print("WORKING_MEMORY_FACTOR =", ju.core.planner.WORKING_MEMORY_FACTOR)
for mib in (1, 16, 64, 1024):
    assert plain_chunk_size(mib * 2**20, n_outputs, n_params, itemsize) == (
        ju.chunk_size_for(mib * 2**20, n_outputs, n_params, itemsize))
print("plain_chunk_size == chunk_size_for at 1, 16, 64 and 1024 MiB: True")

# %% [markdown]
# `jacutil`'s two functions are that division, split in two. What they add:
# `activations`, the numbers of one sample's forward pass, counted for
# models whose activations are large beside their parameters (a CNN's, in
# notebook 08), weighted by a second measured multiple,
# `ACTIVATION_FACTOR`; `method="batch"`, the tape over the whole chunk of
# notebook 02, whose memory grows as `c²`, so the chunk solves a quadratic;
# and an error that says what to do when not even one sample fits:

# %%
ju.teaching.notebook.show_source(ju.core.planner.bytes_per_sample)
ju.teaching.notebook.show_source(ju.chunk_size_for)

# %% [markdown]
# Measure it again. Each chunk size runs `chunked_jacobian` of `n_sweep`
# samples into a memory-mapped file, in a fresh process (TensorFlow keeps
# the memory it grew; see `02-vectorized`), and we fit
# `peak = b · chunk + c`: `b` is the working memory per sample, `c` a fixed
# cost (the pool, the code) that dominates the ratio at the smallest chunk.

# %% tags=["nbval-ignore-output"]
peaks = ju.teaching.memory_sweeps.measure_in_fresh_process(
    "chunked", chunk_sizes, n_samples=n_sweep)
fitted = ju.core.memory.MemoryModel.fit(chunk_sizes, peaks, quadratic=False)
for c, peak in zip(chunk_sizes, peaks, strict=True):
    print(f"chunk {c:>5}: peak {peak / 2**20:7.1f} MiB "
          f"= {peak / (c * row_bytes):4.1f} x the chunk's rows")
factor = fitted.linear / row_bytes
print(f"Finding: working memory per sample = {factor:.1f} x its rows "
      f"({fitted.linear / 1e3:.0f} kB); stored factor "
      f"{ju.core.planner.WORKING_MEMORY_FACTOR}")

# %% [markdown]
# ## A chunk size from a budget

# %%
budget = budget_mib * 2**20
chunk = ju.chunk_size_for(budget, n_outputs, n_params, itemsize)
print(f"budget {budget_mib} MiB -> chunks of {chunk} samples, "
      f"{-(-n_samples // chunk)} chunks")

# %% [markdown]
# ## A Jacobian larger than the budget, on disk
#
# `np.lib.format.open_memmap` creates a `.npy` file and maps it into memory:
# writing to it writes to the file, and the kernel keeps only what fits.
# `chunked_jacobian` writes each chunk into it and shows a progress bar. A
# call on two samples first traces the compiled function, so that the
# trace's own memory is not measured. (Give `out` a path instead, and the
# run keeps a ledger of finished chunks and can be resumed after a crash:
# notebook 10.) The idea, in plain Python around the compiled Jacobian of
# notebook 03:

# %% tags=["plain-version"]
def plain_chunked_jacobian(model, x, chunk_size, out):
    """J in chunks of chunk_size samples, each written into out (n, l, m)."""
    jac = ju.compiled_jacobian(model)
    for start in range(0, len(x), chunk_size):
        out[start : start + chunk_size] = jac(x[start : start + chunk_size])
    return out


x_plain = x[:500]
J_plain = plain_chunked_jacobian(
    model, x_plain, chunk, np.empty((len(x_plain), 2, n_params), "float32"))
np.testing.assert_array_equal(J_plain, ju.chunked_jacobian(
    model, x_plain, chunk_size=chunk, progress=False))
print("plain_chunked_jacobian == chunked_jacobian, bit for bit: True")

# %% [markdown]
# `chunked_jacobian` is that loop, split in two: `plan_chunks` checks the
# arguments and picks the chunk size from `memory_budget` (above) when none
# is given; `run_chunks` (below it) is the loop itself. What they add: `out`
# as an array, a memory-mapped file, or a path (then the run is resumable:
# `resumable_chunks`, notebook 10); a progress bar; and, with XLA, each chunk
# padded to a power of two (notebook 03). Every entry of `jacutil` that goes
# over samples in chunks plans with the same two functions.

# %%
ju.teaching.notebook.show_source(ju.chunked_jacobian)
ju.teaching.notebook.show_source(ju.core.planner.run_chunks)

# %% tags=["nbval-ignore-output"]
ju.chunked_jacobian(model, x[:2], progress=False)  # trace once, before
folder = tempfile.TemporaryDirectory()
path = Path(folder.name) / "jacobian.npy"
out = np.lib.format.open_memmap(path, mode="w+", dtype="float32",
                                shape=(n_samples, n_outputs, n_params))
use = ju.core.memory.peak_memory(ju.chunked_jacobian, model, x[:n_samples],
                            memory_budget=budget, out=out)
out.flush()
print(f"wrote {path.stat().st_size / 2**20:,.0f} MiB in {use.seconds:.2f} s;"
      f" peak memory {use.peak / 2**20:.0f} MiB (budget {budget_mib} MiB)")
print(f"Finding: a {out.nbytes / 2**20:,.0f} MiB Jacobian written to disk in "
      f"{use.seconds:.2f} s with peak memory {use.peak / 2**20:.0f} MiB "
      f"(budget {budget_mib} MiB)")

# %%
print("result is the memory-mapped array:", use.result is out)

# %% [markdown]
# Compare the Finding's peak with the budget and with the size of the
# result: the budget, not n, sets the peak, since it bounds the chunks. It
# is a model, not a hard limit - a few MiB of fixed cost (the progress bar,
# the pool) come on top, so leave a margin.

# %% [markdown]
# ### Proof: the same as the unchunked result
#
# The unchunked Jacobian is `compiled_jacobian` of `03` over the whole batch.
# Read the file back and compare every entry.

# %%
del use, out  # close the map; the data are in the file
unchunked = ju.compiled_jacobian(model)(x[:n_samples])
on_disk = np.load(path, mmap_mode="r")
np.testing.assert_allclose(on_disk, unchunked, rtol=1e-5, atol=1e-6)
print("chunked on disk", on_disk.shape, "== unchunked: True")
del on_disk, unchunked

# %% [markdown]
# ## Data as `model.fit` takes it
#
# A Keras user's data is often a `tf.data.Dataset` of batches, not one array.
# `chunked_jacobian` (and `jacobian`, the per-sample gradients of notebook 09,
# the curvature of notebook 11) takes it as `model.fit` does: batches of `x`,
# or of `(x, y)` - the Jacobian reads only `x`. It reads the batches once,
# in order, into one array (x is small next to J, which has l·m numbers per
# sample), then chunks by the memory budget as before. Given an `out` array
# or memmap, it streams instead: each batch's rows go to `out` as the batch
# arrives, so a source larger than memory never sits in it whole. The proof:
# the same numbers as from the array, both ways.

# %%
batches = tf.data.Dataset.from_tensor_slices((x[:300], y[:300])).batch(64)
from_batches = ju.chunked_jacobian(model, batches, progress=False)
from_array = ju.chunked_jacobian(model, x[:300], progress=False)
print("from a tf.data.Dataset of (x, y) batches:", from_batches.shape,
      "== from the array:", np.array_equal(from_batches, from_array))
streamed = np.empty_like(from_array)
ju.chunked_jacobian(model, batches, out=streamed, progress=False)  # batch by batch
np.testing.assert_allclose(streamed, from_array, rtol=1e-5, atol=1e-6)
print("streamed into out, a batch at a time == from the array (float32): True")

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** Your budget is 16 MiB and the model is in float64. What chunk size
# does `chunk_size_for` give? Run `chunked_jacobian` with that chunk size
# on a float64 copy of the model (`ju.question_mlp(seed=seed,
# dtype="float64")` with `model`'s weights) for the first 300 samples,
# `x[:300]`. Put both in `answer = (chunk, J)`: the chunk size (a number)
# and the float64 Jacobian, shape `(300, l, m)`; the check compares J with
# `per_sample_jacobian`.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: float64 doubles the bytes per sample, so the chunk halves.
model64 = ju.question_mlp(seed=seed, dtype="float64")
model64.set_weights(model.get_weights())
c64 = ju.chunk_size_for(16 * 2**20, n_outputs, n_params, 8)
J64 = ju.chunked_jacobian(model64, x[:300].astype("float64"),
                          chunk_size=c64, progress=False)
answer = (c64, J64)

# %%
check.exercise("04-1", answer, model=model, x=x[:300])

# %% [markdown]
# ## Going further: peak memory and time against the chunk size
#
# Left: the peak memory of the per-sample chunks, measured above, and the
# fitted line `b · chunk + c`: memory grows linearly with the chunk (on
# log-log axes the fixed cost `c` bends the line at small chunks). Right: the
# time of both methods inside a chunk. The per-sample time falls as chunks
# grow (fewer calls), then flattens. With the batch-wide tape inside each
# chunk (`method="batch"`), the work *inside* a chunk is quadratic, so its
# time falls and then rises again: its best chunk is small. Neither time
# curve is a power law, so no slope is fitted to them. Only the per-sample
# memory is measured here; the batch tape's memory, quadratic in the chunk,
# was measured in `02-vectorized`, and `chunk_size_for(...,
# method="batch")` sizes its chunks with a `c²` term for it.

# %% tags=["nbval-ignore-output"]
sweep = np.lib.format.open_memmap(Path(folder.name) / "sweep.npy", mode="w+",
                                  dtype="float32",
                                  shape=(n_sweep, n_outputs, n_params))
times = {}
for method, sizes in [("per_sample", chunk_sizes),
                      ("batch", batch_chunk_sizes)]:
    for c in sizes:
        timing = ju.time_call(ju.chunked_jacobian, model, x[:n_sweep],
                              chunk_size=c, out=sweep, method=method,
                              progress=False, repeats=1)
        times[method, c] = timing.median
        print(f"{method:<10} chunk {c:>5}: {timing.median:6.2f} s "
              f"(first call {timing.first:.2f} s)")
del sweep
folder.cleanup()  # the temporary files are deleted
print("temporary folder deleted:", not Path(folder.name).exists())

# %% tags=["nbval-ignore-output"]
all_sizes = sorted(set(chunk_sizes) | set(batch_chunk_sizes))
fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(12, 4))
ju.teaching.plots.loglog_scaling(
    chunk_sizes,
    {"measured peak": [p / 2**20 for p in peaks],
     "fit b*chunk + c": list(fitted.predict(chunk_sizes) / 2**20)},
    xlabel="chunk size", ylabel="peak MiB", ax=ax_m, slopes=False)
ax_m.set_title(f"memory, per-sample chunks, n = {n_sweep:,}")
ju.teaching.plots.loglog_scaling(
    all_sizes,
    {f'method="{m}"': [times.get((m, c), np.nan) for c in all_sizes]
     for m in ["per_sample", "batch"]},
    xlabel="chunk size", ax=ax_t, slopes=False)  # not power laws: no slopes
ax_t.set_title(f"time, both methods, n = {n_sweep:,}")
ax_t.legend(loc="upper left", bbox_to_anchor=(1.02, 1))  # beside the curves
fig.tight_layout()
best = min(chunk_sizes, key=lambda c: times["per_sample", c])
best_batch = min(batch_chunk_sizes, key=lambda c: times["batch", c])
print(f"Finding: n = {n_sweep:,}: per-sample chunks of {best} take "
      f"{times['per_sample', best]:.2f} s; the batch tape's best chunk is "
      f"{best_batch} ({times['batch', best_batch]:.2f} s), its largest "
      f"{max(batch_chunk_sizes)} takes "
      f"{times['batch', max(batch_chunk_sizes)]:.2f} s")

# %% [markdown]
# Pick the chunk from the budget: beyond a few hundred samples a larger chunk
# buys little time and costs memory in proportion. The per-sample method is
# the default inside a chunk; the batch tape is quadratic in the chunk.

# %% [markdown]
# **2.** A long job can stop half-way. Fill a memory-mapped file with the
# Jacobian of the first 400 samples, `x[:400]`, in two calls - the first
# half of the samples, then the second, each into its slice of the file
# (`out=mm[:half]`) - and close and reopen the file between the two, as
# after a restart. Check that the file equals one call over all samples,
# and put its contents in `answer` (`np.load(file)`, shape
# `(400, l, m)`) before the temporary folder is deleted.

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: a slice of a memmap is a memmap; open it again with mode="r+"
# (mode="w+" would start a new, empty file) to resume after a restart.
with tempfile.TemporaryDirectory() as tmp:
    file = Path(tmp) / "J.npy"
    n_ex = len(x[:400])
    half = n_ex // 2
    mm = np.lib.format.open_memmap(file, mode="w+", dtype="float32",
                                   shape=(n_ex, n_outputs, n_params))
    ju.chunked_jacobian(model, x[:half], chunk_size=64, out=mm[:half],
                        progress=False)
    del mm  # stopped here; resume:
    mm = np.lib.format.open_memmap(file, mode="r+")
    ju.chunked_jacobian(model, x[half:n_ex], chunk_size=64, out=mm[half:],
                        progress=False)
    del mm  # closed: the rows are in the file
    answer = np.load(file)
np.testing.assert_allclose(answer, ju.chunked_jacobian(model, x[:n_ex],
                                                       progress=False),
                           rtol=1e-5, atol=1e-6)
print("two halves == one call:", answer.shape)

# %%
check.exercise("04-2", answer, model=model, x=x[:400])

# %% [markdown]
# ## Keypoints
#
# - Memory of the per-sample Jacobian = the result (`n · l · m · itemsize`)
#   plus working memory for one chunk, about
#   `WORKING_MEMORY_FACTOR` times the chunk's rows - measured, in a fresh
#   process, as resident memory.
# - `chunk_size_for` turns a budget into a chunk size; `chunked_jacobian`
#   writes chunk by chunk into any array, including a memory-mapped `.npy`
#   larger than memory.
# - Prove the chunked result equal to the unchunked one.
# - Larger chunks cost memory in proportion and buy little time; with the
#   batch tape inside a chunk, keep chunks small.
