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
# - How do I compute a Jacobian larger than the memory I may use, and prove
#   it right?
#
# **Objectives**
# - Measure the memory model: the result's bytes plus working memory per
#   sample.
# - Compute a Jacobian larger than a memory budget into a memory-mapped
#   `.npy`, chunk by chunk, measure that the run stays within the budget,
#   and prove the file equal to the unchunked result.
#
# *Going further* (optional, after the exercise): peak memory and time
# against the chunk size, for both vectorizations inside a chunk; data as
# `model.fit` takes it; a Jacobian written in two runs, as after a restart.
#
# *Teaching: 19 min · Exercises: 12 min · Going further: 40 min*

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
from jacutil.teaching.claims import claim

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_samples = 6000  # samples in the Jacobian written to disk
budget_mib = 64  # memory budget for the chunks, MiB
n_sweep = 2048  # samples in the sweeps over chunk sizes
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
# The rows of `c` samples at once need the rows themselves, the
# per-variable blocks before they are joined, and TensorFlow's pool: a
# multiple of `c · l · m · itemsize`. The multiple was **measured** on nine
# models, with a margin, and is stored as
# `jacutil.core.planner.WORKING_MEMORY_FACTOR`. A chunk size is then one
# division:

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
# `chunk_size_for` is that division (by `bytes_per_sample`). It adds
# `activations` (one sample's forward pass, for models such as notebook
# 08's CNN), the `c²` of `method="batch"`, and an error for a budget too
# small for one sample:

# %%
ju.teaching.notebook.show_source(ju.chunk_size_for, plain=plain_chunk_size)

# %% [markdown]
# Measure it again, in a fresh process (TensorFlow keeps the memory it
# grew; see `02-vectorized`): `chunked_jacobian` of `n_sweep` samples for
# each chunk size, and a fit `peak = b · chunk + c`, `b` the working memory
# per sample, `c` a fixed cost.

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
# writing to it writes to the file, whose pages the kernel writes back and
# drops when RAM runs short. Write the chunks into it, one at a time; in
# plain Python around the compiled Jacobian of notebook 03:

# %% tags=["plain-version"]
def plain_chunked_jacobian(model, x, chunk_size, out):
    """J in chunks of chunk_size samples, each written into out (n, l, m)."""
    jac = ju.compiled_jacobian(model)
    for start in range(0, len(x), chunk_size):
        out[start : start + chunk_size] = jac(x[start : start + chunk_size])
    return out


folder = tempfile.TemporaryDirectory()
x_plain = x[:500]
out_plain = np.lib.format.open_memmap(
    Path(folder.name) / "plain.npy", mode="w+", dtype="float32",
    shape=(len(x_plain), n_outputs, n_params))
np.testing.assert_array_equal(
    plain_chunked_jacobian(model, x_plain, chunk, out_plain),
    ju.chunked_jacobian(model, x_plain, chunk_size=chunk, progress=False))
print("plain_chunked_jacobian == chunked_jacobian, bit for bit: True")
del out_plain

# %% [markdown]
# `chunked_jacobian` plans the chunks from `memory_budget` and runs this
# loop, `run_chunks`, with a progress bar; given a path as `out`, it keeps
# a ledger and can resume after a crash (notebook 10):

# %%
ju.teaching.notebook.show_source(ju.core.planner.run_chunks,
                                 plain=plain_chunked_jacobian)

# %% [markdown]
# Now the whole Jacobian of `n_samples`, larger than the budget, with
# `memory_budget=budget`, in a fresh process as for the sweep:
# `chunked_to_disk_in_fresh_process` traces on two samples, then writes the
# file and measures how far the process's peak resident memory (the
# kernel's high-water mark) rose. The file's own mapped pages count in it;
# the rest is the working memory that the budget bounds.

# %% tags=["nbval-ignore-output"]
path = Path(folder.name) / "jacobian.npy"
run = ju.teaching.memory_sweeps.chunked_to_disk_in_fresh_process(
    path, x[:n_samples], memory_budget=budget, seed=seed)
MiB = 2**20
print(f"file: {run['file_bytes'] / MiB:,.1f} MiB, written in "
      f"{run['seconds']:.2f} s; budget {budget_mib} MiB")
print(f"peak resident memory rose {run['peak'] / MiB:,.1f} MiB: the file's "
      f"pages {run['file_pages'] / MiB:,.1f} MiB, working memory "
      f"{run['working'] / MiB:.1f} MiB (the fit above predicts "
      f"{fitted.predict([chunk])[0] / MiB:.1f} MiB for chunks of {chunk})")
claim("file-larger-than-budget", run["file_bytes"] > budget,
      f"the file ({run['file_bytes'] / MiB:,.1f} MiB) is larger than the "
      f"budget ({budget_mib} MiB)")
claim("within-budget", run["working"] <= budget,
      f"the working memory ({run['working'] / MiB:.1f} MiB) stayed within "
      f"the budget ({budget_mib} MiB)")

# %% [markdown]
# The budget, not the size of the file, bounds the working memory. The
# file's pages are the kernel's to drop, so the same run writes a file
# larger than RAM. (The budget is a model, not a hard limit: leave a
# margin.)
#
# ### Proof: the same as the unchunked result
#
# Read the file back and compare every entry with `compiled_jacobian` of
# `03` over the whole batch, the same model (the same seed) in this
# process.

# %%
unchunked = ju.compiled_jacobian(model)(x[:n_samples])
on_disk = np.load(path, mmap_mode="r")
np.testing.assert_allclose(on_disk, unchunked, rtol=1e-5, atol=1e-6)
print("chunked on disk", on_disk.shape, "== unchunked: True")
del on_disk, unchunked

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
x64 = x[:300].astype("float64")
answer = (c64, ju.chunked_jacobian(model64, x64, chunk_size=c64, progress=False))

# %%
check.exercise("04-1", answer, model=model, x=x[:300])

# %% [markdown]
# ## Going further: peak memory and time against the chunk size
#
# Left: the peak memory of the per-sample chunks, measured above, and the
# fitted line `b · chunk + c` (on log-log axes the fixed cost `c` bends it
# at small chunks). Right: the time of both methods inside a chunk. Larger
# per-sample chunks mean fewer calls; with the batch-wide tape inside each
# chunk (`method="batch"`) the work *inside* a chunk is quadratic, so a
# large chunk must cost it time again: the Finding says where its best
# chunk fell in this run. Neither time curve is a power law, so no slope is
# fitted to them. The batch tape's memory, quadratic in the chunk, was
# measured in `02-vectorized`; `chunk_size_for(..., method="batch")` sizes
# its chunks with a `c²` term for it.

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
small, large = chunk_sizes[-2], chunk_sizes[-1]
print(f"Finding: n = {n_sweep:,}: per-sample chunks of {best} take "
      f"{times['per_sample', best]:.2f} s; the batch tape's best chunk is "
      f"{best_batch} ({times['batch', best_batch]:.2f} s), its largest "
      f"{max(batch_chunk_sizes)} takes "
      f"{times['batch', max(batch_chunk_sizes)]:.2f} s. Per-sample chunks of "
      f"{large} against {small}: {peaks[-1] / peaks[-2]:.1f}x the peak memory, "
      f"{times['per_sample', large] / times['per_sample', small]:.2f}x the time")

# %% [markdown]
# The Finding's last sentence is the trade: what a larger chunk costs in
# memory against what it saves in time. Pick the chunk from the budget.

# %% [markdown]
# ## Going further: data as `model.fit` takes it
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
#   larger than the budget, and its working memory stays within the budget:
#   measure that in a fresh process. <!-- claim: file-larger-than-budget, within-budget -->
# - Prove the chunked result equal to the unchunked one.
# - Pick the chunk from the budget; the going-further sweep shows what a
#   larger chunk costs in memory and saves in time.
