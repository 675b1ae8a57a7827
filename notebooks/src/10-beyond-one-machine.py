# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · Beyond one machine, and nothing lost
#
# **Questions**
# - My out-of-core Jacobian takes an hour to write. What happens when the
#   kernel dies half-way?
# - How do I spread the chunks over several processes or machines, and what
#   happens when one of them dies?
# - How much faster will N machines be?
#
# **Objectives**
# - Interrupt a chunked run on purpose (`SIGKILL`), resume it, and prove the
#   file equal to an uninterrupted run, bit for bit.
# - Compute the same chunks on 2 Dask worker processes (TLS, ending with
#   this process), prove the answer equal, then kill a worker mid-run and
#   see the run complete.
# - Stop a run at a deadline and resume it; keep `x` and J on the workers
#   (a `dask.array`, a folder of chunk files).
# - Sum JᵀJ and Jᵀr on the workers for a Gauss–Newton step.
# - Write down the cost model for N workers and put the 2-worker measurement
#   beside it.
#
# *Teaching: 58 min · Exercises: 33 min*

# %% [markdown]
# ## Setup

# %%
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import dask.array as da
import distributed
import matplotlib.pyplot as plt
import numpy as np

import jacutil as ju
from jacutil import keras
from jacutil.teaching import check
from jacutil.teaching.claims import claim

# Dask (set up when `distributed` is imported) logs a warning for each chunk
# it reruns; the cells below print what happened instead
logging.getLogger("distributed.client").setLevel(logging.ERROR)
print("Dask", distributed.__version__)

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_samples = 20_000  # samples of the one- against two-worker measurement
chunk_size = 2_500  # samples per chunk on the workers and in one process
n_workers = 2  # worker processes on this machine
resume_samples = 10_000  # samples of the interrupted run
resume_chunk = 500  # its chunk size
gn_samples = 3_000  # samples of the Gauss-Newton step
gn_chunk = 1_000  # its chunk size
deadline_share = 0.25  # the deadline: this share of the measured run time
seed = 0

# %% [markdown]
# Everything is written into a temporary folder, removed at the end (and
# by Python if the notebook stops half-way). The question's network, 2,850
# parameters and 2 outputs:

# %%
scratch = tempfile.TemporaryDirectory(prefix="jacutil-10-")
folder = Path(scratch.name)
model = ju.question_mlp(seed=seed)
x, y = ju.regression_data(n_samples, seed=seed)
m = ju.flat_params(model).size
print(f"J for {n_samples:,} samples: {n_samples:,} x 2 x {m:,} float32 = "
      f"{n_samples * 2 * m * 4 / 2**30:.1f} GiB")

# %% [markdown]
# ## Nothing lost: a resumable run
#
# Give `chunked_jacobian` a path instead of an array, and it writes the rows
# into that `.npy` file and keeps a small ledger beside it,
# `J.npy.progress.json`: a fingerprint of the model's weights, `x` and the
# options, and the chunks finished so far. After each chunk the rows are
# flushed to disk *first*, then the ledger is replaced in one atomic step, so
# whatever instant the run dies at, every chunk the ledger lists is complete.
# In plain Python, the idea:

# %% tags=["plain-version"]
def plain_resumable(model, x, path, chunk):
    """Rows into a .npy file; after each chunk, the list of finished ones."""
    jac, ledger = ju.compiled_jacobian(model), Path(f"{path}.done.json")
    done = set(json.loads(ledger.read_text())) if ledger.exists() else set()
    shape = (len(x), *jac(x[:2]).shape[1:])
    out = np.lib.format.open_memmap(path, "r+" if done else "w+", "float32", shape)
    for k in sorted(set(range(-(-len(x) // chunk))) - done):  # the rest only
        out[k * chunk : (k + 1) * chunk] = jac(x[k * chunk : (k + 1) * chunk])
        out.flush()  # the rows on disk first ...
        done.add(k)
        Path(f"{ledger}.tmp").write_text(json.dumps(sorted(done)))
        os.replace(f"{ledger}.tmp", ledger)  # ... then the ledger, in one step
    return out


plain_J = plain_resumable(model, x[:2_000], folder / "plain.npy", 500)
np.testing.assert_array_equal(plain_J, ju.chunked_jacobian(
    model, x[:2_000], chunk_size=500, progress=False))
print("plain_resumable == chunked_jacobian, bit for bit: True")

# %% [markdown]
# `resumable_chunks` is that loop. What it adds: the ledger holds a
# fingerprint of the weights, `x` and the options, so a file of another
# computation is refused instead of mixed in; a lock, so a second writer
# is refused; its own temporary names, checked for a cut or grown file;
# and the finished chunks kept as runs `[first, last + 1)`:

# %%
ju.teaching.notebook.show_source(ju.core.planner.resumable_chunks,
                                 plain=plain_resumable)

# %% [markdown]
# Now the drill. A fresh Python process starts the run, and is killed with
# `SIGKILL` - no clean-up, like a machine that is pre-empted - once a few
# chunks are on disk:

# %% tags=["nbval-ignore-output"]
def start_and_kill(path, at_least):
    """Start the run into `path` in a new process; SIGKILL it part-way."""
    script = f"""
import jacutil as ju
x, _ = ju.regression_data({resume_samples}, seed={seed})
ju.chunked_jacobian(ju.question_mlp(seed={seed}), x,
                    chunk_size={resume_chunk}, out={str(path)!r},
                    method="per_sample", progress=False)
"""
    finished = ju.teaching.drills.kill_part_way(
        script, lambda: ju.core.resume.finished_chunks(path)[0], at_least=at_least)
    assert finished < n_chunks, (
        "the run finished before it was killed: raise resume_samples")
    return finished


n_chunks = -(-resume_samples // resume_chunk)
path = folder / "J.npy"
finished = start_and_kill(path, at_least=3)
ledger = json.loads(Path(str(path) + ju.core.resume.LEDGER_SUFFIX).read_text())
print(f"killed with {finished} of {n_chunks} chunks finished; "
      "the ledger says:")
print({key: ledger[key] for key in ("chunk_size", "n_chunks", "done")})

# %% [markdown]
# The ledger's `done` lists the finished chunks as runs `[first, last + 1)`,
# like Python's `range`. The same call again, in this process, skips them
# (the progress bar starts part-way) and completes the rest. Then it is
# compared with a run that was never interrupted, in memory:

# %% tags=["nbval-ignore-output"]
x_resume = x[:resume_samples]
resumed = ju.chunked_jacobian(model, x_resume, chunk_size=resume_chunk,
                              out=path, method="per_sample")

# %%
whole = ju.chunked_jacobian(model, x_resume, chunk_size=resume_chunk,
                            method="per_sample", progress=False)
claim("resumed-equals-whole", np.array_equal(resumed, whole),
      "the resumed file equals an uninterrupted run, bit for bit")

# %% [markdown]
# A run may only resume what it started: change one weight (or one sample,
# or the chunk size) and the fingerprint differs, so the file is refused
# rather than mixed:

# %%
weights = model.get_weights()
model.layers[0].kernel.assign(model.layers[0].kernel * 1.001)
refused = False
try:
    ju.chunked_jacobian(model, x_resume, chunk_size=resume_chunk, out=path,
                        method="per_sample")
except ju.core.resume.ResumeMismatch as error:
    refused = True
    print("ResumeMismatch:", error)
model.set_weights(weights)
claim("changed-model-refused", refused,
      "the file of another model's weights is refused, not resumed")
del resumed, whole

# %% [markdown]
# The file itself is checked too. Before a run resumes, and before it
# returns a finished file, the `.npy`'s header, shape, dtype and size must
# match the ledger: a copy cut short or a full disk is refused, never read
# as rows of zeros. While a run writes, it holds a lock (`J.npy.lock`) that
# dies with its process: a second run on the same file is refused at once,
# and a killed run can be resumed straight away. Here a finished file is
# cut to a quarter behind the run's back:

# %%
cut = folder / "cut.npy"
ju.chunked_jacobian(model, x[:2_000], chunk_size=resume_chunk, out=cut,
                    method="per_sample", progress=False)
os.truncate(cut, os.path.getsize(cut) // 4)
try:
    ju.chunked_jacobian(model, x[:2_000], out=cut, method="per_sample")
except ju.core.resume.ResumeMismatch as error:
    print("ResumeMismatch:", error)

# %% [markdown]
# The normal equations of notebook 05 resume the same way:
# `problem.normal_equations(theta, checkpoint="sums.npz")` saves the partial
# sums after each chunk and, called again, adds the remaining chunks in the
# same order, so the sums are the same to the last bit (the tests kill it
# part-way too).

# %% [markdown]
# ## Chunks on worker processes
#
# One machine is too slow for some jobs; then the chunks go to other
# processes, on this machine or others. We use Dask's distributed
# scheduler: it hands each chunk to a worker and, when a worker dies while
# holding one, gives that chunk to another.
#
# Why Dask? TensorFlow's own `ParameterServerStrategy` with a
# `ClusterCoordinator` also reruns a lost worker's function, but it waits
# forever - holding Python's lock, so nothing can time it out - for a worker
# that never starts or whose port is taken, and its servers listen on every
# network interface. Ray retries tasks too, at the cost of a far larger
# install and a slower start. Keras's `MultiWorkerMirroredStrategy` is made
# for `fit` (and broken with Keras 3 since TF 2.16), not for scheduling
# chunks.
#
# `LocalWorkers` starts a scheduler and `n_workers` worker processes - the
# same `dask scheduler` and `dask worker` commands a cluster runs. They
# listen on 127.0.0.1 only and speak TLS with a certificate made for this
# run: Dask's messages are pickles, so whoever connects can run code, and
# no other program on this machine can. They stop when the `with` block or
# `close()` ends, and if this process is killed they stop on their own
# within seconds: each one watches this process.
#
# A Keras model does not pickle well between processes, so each worker
# rebuilds it from `model.to_json()` and the weights, and checks on one
# sample that it computes what yours does. The scheduler only passes tasks
# along: they reach it as bytes, so it needs neither jacutil nor
# TensorFlow. Each chunk is this task on a worker. Writing into a folder of
# chunk files (below), it first checks the run's random token in the
# folder's `run.json`: a worker that sees another folder at that path (a
# disk of its own instead of the shared one) fails, rather than write rows
# nobody reads. In plain Keras, what a worker does with a chunk:

# %% tags=["plain-version"]
def plain_rows_task(config, weights, x_chunk):
    """On a worker: the model rebuilt from what travelled, then its rows."""
    rebuilt = keras.models.model_from_json(config)
    rebuilt.set_weights(weights)
    return ju.chunked_jacobian(rebuilt, x_chunk, chunk_size=len(x_chunk),
                               progress=False)


rows = plain_rows_task(model.to_json(), model.get_weights(), x[:1_000])
np.testing.assert_array_equal(rows, ju.chunked_jacobian(model, x[:1_000], progress=False,
                                                        chunk_size=1_000))
print("plain_rows_task == chunked_jacobian here, bit for bit: True")

# %% [markdown]
# `rows_task` adds what a worker that serves many runs needs: `model_from`
# keeps one rebuilt model per architecture and only sets new weights,
# checked against the spec's fingerprint; the options travel with the
# task; and the rows go back, or into the run's folder after its token is
# checked:

# %%
ju.teaching.notebook.show_source(ju.scale.distributed.rows_task,
                                 plain=plain_rows_task)

# %% tags=["nbval-ignore-output"]
start = time.perf_counter()
workers = ju.LocalWorkers(n_workers)
started_in = time.perf_counter() - start
warm_x = x[: 2 * n_workers * min(chunk_size, 1000)]
start = time.perf_counter()
ju.distributed_jacobian(model, warm_x, workers, progress=False)
first_call = time.perf_counter() - start
print(workers)
print("every process speaks TLS:", workers.address.startswith("tls://"))
print(f"started in {started_in:.1f} s; first chunks (TensorFlow imported and "
      f"the model rebuilt on each worker) in {first_call:.1f} s")

# %% [markdown]
# The measurement: the whole Jacobian onto disk, once by one process
# (`chunked_jacobian`, into one `.npy`) and once by the workers, each
# writing its own chunks into a folder of chunk files, with the same chunks
# and the layer-rules path in both:

# %% tags=["nbval-ignore-output"]
def timed(run):
    os.sync()  # each measurement starts with earlier writes on disk
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


one_path, two_path = folder / "one.npy", folder / "two"
J_one, t_one = timed(lambda: ju.chunked_jacobian(
    model, x, chunk_size=chunk_size, out=one_path, method="rules",
    progress=False))
J_two, t_two = timed(lambda: ju.distributed_jacobian(
    model, x, workers, chunk_size=chunk_size, out=two_path, progress=False))
print(f"one process: {t_one:.1f} s; {n_workers} workers: {t_two:.1f} s "
      f"({t_two / t_one:.2f}x the one-process time)")

# %%
# each chunk read here (scheduler="threads"), not shipped from the workers
same = all(np.array_equal(J_one[i:i + chunk_size],
                          J_two[i:i + chunk_size].compute(scheduler="threads"))
           for i in range(0, n_samples, chunk_size))
claim("workers-equal-one-process", same,
      f"{n_workers} workers' J equals one process's, bit for bit")
print(f"{two_path.name}/ holds", sorted(p.name for p in two_path.iterdir())[:3],
      "...")

# %% [markdown]
# Why a folder? Each chunk is its own file, written under a temporary name
# and renamed when complete, so no two machines ever write the same file.
# On a shared file system (NFS) that matters: a client writes back whole
# pages, and two machines writing the rows on either side of a page
# boundary of *one* file can overwrite each other's. `J_two` reads the
# folder back as one lazy array (`ju.scale.chunk_files.read_chunks` does
# it too). With `out="J.npy"` the rows come back to this process instead,
# which writes the one file alone; with `out=None`, into memory.

# %% [markdown]
# Read the ratio above. On this machine the workers share the cores that
# the one process already used, so they cannot compute faster: the ratio
# shows the engine's overhead (sending chunks, the scheduler's round trips)
# and how writing from two processes at once compares with writing from
# one. The cost model below takes the two apart and says what to expect on
# real machines.

# %% [markdown]
# ## A worker lost
#
# Now kill a worker while it holds a chunk: `kill_busy_worker` waits for a
# worker process with work assigned and sends it `SIGKILL`. It runs in a
# thread beside the run, so it strikes as the first chunks are handed out.
# The worker's *nanny* (the small Dask process that watches each worker)
# starts a new one, and the scheduler gives the lost chunks to a live
# worker:

# %% tags=["nbval-ignore-output"]
fault_path = folder / "fault.npy"
killed = []
killer = threading.Thread(
    target=lambda: killed.append(workers.kill_busy_worker()))
killer.start()
J_fault = ju.distributed_jacobian(
    model, x_resume, workers, chunk_size=resume_chunk, out=fault_path,
    method="per_sample", progress=False)
killer.join()
address, pid, held = killed[0]
print(f"killed worker {address} (pid {pid}), which held {len(held)} chunk(s)")

# %%
whole = ju.chunked_jacobian(model, x_resume, chunk_size=resume_chunk,
                            method="per_sample", progress=False)
claim("lost-worker-loses-nothing", np.array_equal(J_fault, whole),
      "with a worker killed part-way, the run's J equals an uninterrupted "
      "run, bit for bit")
del J_fault

# %% [markdown]
# ## A deadline, and workers that never come back
#
# Two clocks bound a run, both off by default: `timeout=` is the longest
# wait for the *next* chunk (it starts again at each arrival), `deadline=`
# the whole run's. When one passes, the run stops with `ChunkTimeoutError`
# and keeps the chunks that arrived: in `error.out` in memory, or on disk,
# where the same call resumes. If every worker is gone for
# `ju.scale.executors.WORKERS_LOST_AFTER` seconds (a nanny restarts a
# killed worker within seconds; a lost cluster does not come back), the run
# stops with `WorkersLostError`, keeping its chunks the same way.
#
# A deadline shorter than the run needs must come from the run's own time:
# a typed number of seconds is too short on a slow machine and too long on
# a fast one. So the same run is timed first, on the same workers, and the
# deadline is a share of that time (`deadline_share`). The faster of two
# runs is taken, so that a pause of the machine does not stretch it:

# %% tags=["nbval-ignore-output"]
def run_seconds():
    start = time.perf_counter()
    ju.distributed_jacobian(model, x_resume, workers, chunk_size=resume_chunk,
                            method="per_sample", progress=False)
    return time.perf_counter() - start


needs = min(run_seconds() for _ in range(2))
deadline = deadline_share * needs
print(f"the run needs {needs:.2f} s for {n_chunks} chunks on {n_workers} "
      f"workers; deadline = {deadline_share:g} x that = {deadline:.2f} s")
deadline_path = folder / "deadline.npy"
stopped = False
try:
    ju.distributed_jacobian(model, x_resume, workers, chunk_size=resume_chunk,
                            out=deadline_path, method="per_sample",
                            deadline=deadline, progress=False)
except ju.scale.executors.ChunkTimeoutError as error:
    stopped = True
    print("ChunkTimeoutError:", error)
done, of = ju.core.resume.finished_chunks(deadline_path)
claim("deadline-stops", stopped and done < of,
      f"the run stopped at its deadline ({deadline:.2f} s) with {done} of "
      f"{of} chunks on disk")

# %% [markdown]
# The same call without the deadline computes only the rest:

# %%
J_deadline = ju.distributed_jacobian(
    model, x_resume, workers, chunk_size=resume_chunk, out=deadline_path,
    method="per_sample", progress=False)
claim("deadline-resumed-equals-whole", np.array_equal(J_deadline, whole),
      "stopped at the deadline, then resumed: equal to an uninterrupted "
      "run, bit for bit")
del J_deadline, whole

# %% [markdown]
# ## Data that stays on the workers
#
# So far `x` went from this process to the workers, chunk by chunk. When
# `x` is larger than this process's memory, make it a `dask.array`: its
# blocks are computed or loaded on the workers and handed to the chunks
# that need them; one sample comes here, to check the model. J can stay
# there too: `lazy_jacobian` returns it as a lazy `dask.array`, chunked by
# samples, and nothing runs until it is computed, persisted on the workers
# (`client.persist`) or stored (`.to_zarr`). (`jacobian_futures` starts every
# chunk at once and returns a future for each, for asynchronous use.) Here
# only each sample's `‖J_i‖` comes back, one number per sample:

# %%
x_far = da.random.default_rng(seed).standard_normal(
    (resume_samples, x.shape[1]), chunks=4 * resume_chunk).astype("float32")
J_far = ju.scale.dask_arrays.lazy_jacobian(
    model, x_far, chunk_size=resume_chunk, client=workers.client)
print(J_far)
row_norms = workers.client.compute(
    da.sqrt((J_far ** 2).sum(axis=(1, 2)))).result()
print(f"{row_norms.size:,} row norms came back ({row_norms.nbytes:,} bytes; "
      f"J itself is {J_far.nbytes / 2**20:,.0f} MiB)")
x_here = workers.client.compute(x_far[:resume_chunk]).result()
here = ju.chunked_jacobian(model, x_here, method="rules", progress=False)
claim("far-norms-equal-one-process", np.allclose(
    row_norms[:resume_chunk], np.sqrt((here.astype("float64") ** 2).sum(axis=(1, 2))),
    rtol=1e-5), "the first chunk's norms from the workers equal one process's")

# %% [markdown]
# ## Gauss–Newton steps on the workers
#
# For notebook 05's Levenberg–Marquardt, the workers compute each chunk's
# `J_k.T @ J_k` and `J_k.T @ r_k` (m × m and m numbers: far less to send
# than the chunk's rows) and this process adds them in chunk order.
# `DistributedLeastSquares` is a `LeastSquaresProblem` whose
# `normal_equations` does that, so `levenberg_marquardt` takes it unchanged:

# %% tags=["nbval-ignore-output"]
x_gn, y_gn = x[:gn_samples], y[:gn_samples]
one = ju.least_squares_problem(model, x_gn, y_gn, chunk_size=gn_chunk)
spread = ju.DistributedLeastSquares(model, x_gn, y_gn, workers,
                                    chunk_size=gn_chunk)
(JtJ, Jtr), (JtJ_w, Jtr_w) = (p.normal_equations(one.theta0)
                              for p in (one, spread))
difference = max(np.abs(JtJ_w - JtJ).max() / np.abs(JtJ).max(),
                 np.abs(Jtr_w - Jtr).max() / np.abs(Jtr).max())
assert difference < 1e-12, "the workers' sums differ by more than rounding"
print(f"JtJ and Jtr from the workers against one process: largest difference "
      f"{difference:.0e} of the largest entry")
# started well damped
fit = ju.levenberg_marquardt(spread, max_steps=2, damping=1.0)
assert fit["history"][-1, 1] < fit["history"][0, 1], (
    "no step lowered the loss")
print(f"{fit['n_steps']} steps on the workers ({fit['n_accepted']} "
      f"accepted): MSE {fit['history'][0, 1]:.4f} -> "
      f"{fit['history'][-1, 1]:.4f}")
model.set_weights(weights)

# %% [markdown]
# The sums need not be bit for bit those of one process here: NumPy's matrix
# product adds in an order that depends on how many threads BLAS uses, and
# each worker runs one. The difference printed above is rounding; a run that
# loses a worker adds the same parts here, in the same chunk order (a rerun
# chunk is computed the same way, on one thread).

# %% [markdown]
# ## On a real cluster, and what to expect
#
# - **Starting workers.** `docs/cluster.md` is the guide to copy: make
#   credentials once (`python -m jacutil.scale.credentials creds`), then
#   `dask scheduler` and `dask worker` with TLS, `--host` on the cluster's
#   private interface, no dashboard and `--nthreads 1` (TensorFlow already
#   uses every core for one chunk: more threads make chunks compete for the
#   same cores, and `distributed_jacobian` warns). The tests start exactly its commands
#   and check every listening socket. Only the workers need jacutil,
#   TensorFlow and your custom layers; in the notebook pass
#   `Client("tls://SCHEDULER:8786", security=...)` where we passed
#   `workers`. Nothing else changes.
# - **Where the output lives.** A folder of chunk files (`out="J"`) is
#   written by the workers, so it must be on a file system every machine
#   sees at the same path (NFS, Lustre, an object store mounted as one).
#   `out="J.npy"` and `out=None` bring the rows back to this process.
# - **One machine, many cores, no Dask.** `with
#   ju.scale.executors.ProcessExecutor(4) as pool:` then
#   `ju.distributed_jacobian(model, x, pool)`: the same chunks in a process
#   pool. A process that dies breaks the pool (Python's rule): the run stops
#   with `WorkersLostError`, its arrived chunks kept.
# - **GPUs.** Each worker process sees the GPUs of its own machine, and
#   TensorFlow takes all of them by default. On a machine with k GPUs start
#   k workers, each with `CUDA_VISIBLE_DEVICES=i` (and
#   `TF_FORCE_GPU_ALLOW_GROWTH=true`), so each owns one. `LocalWorkers` gives
#   its workers this process's environment, so it suits CPUs and one GPU.
#
# The time of a run on N machines, each as fast as this process:
#
# `T_N ≈ T_compute / s(N) + T_write + K · τ`
#
# where `T_compute` is the computing alone, `s(N)` its speed-up (N on N
# machines; about 1 here, where the workers share this machine's cores),
# `T_write` the time spent putting the rows into the file beyond the
# computing, `K` the number of chunks and `τ` the scheduler's cost per
# chunk.
#
# `T_write` is not one number. One process writes alone: it copies a
# chunk's rows into the file and waits until they are on disk before it
# computes the next chunk. Call that `T_out`: the one-process time less
# `T_compute`. Several processes overlap it: while one waits on the disk,
# another computes or copies, and several flushes are on their way at once.
# So workers can finish in less than `T_out`, and `T_out` is not a floor
# (the measurement below says whether they did here).
# `T_w`, the writing as the workers did it, is their time less the
# computing (s = 1 here) and `K · τ`. More writers may write faster still,
# up to what the storage can take; that is not measured here, so the model
# gives N machines a range between two cases: writing as the workers did
# (`T_w`) and as one process did (`T_out`). We measure `T_compute` (the
# same chunks, rows computed and dropped) and `τ` (tasks that do nothing):

# %% tags=["nbval-ignore-output"]
jac = ju.compiled_jacobian(model, method="rules")
jac(x[:chunk_size], copy=False)  # traced before the clock starts
_, t_compute = timed(lambda: [jac(x[i:i + chunk_size], copy=False)
                              for i in range(0, n_samples, chunk_size)])
no_ops = [workers.client.submit(int, k, pure=False) for k in range(200)]
_, t_tasks = timed(lambda: workers.client.gather(no_ops))
tau = t_tasks / len(no_ops)
K = -(-n_samples // chunk_size)
t_out = max(t_one - t_compute, 0.0)  # one process: writes after computing
t_w = max(t_two - t_compute - K * tau, 0.0)  # the workers: writes overlap
print(f"T_compute {t_compute:.1f} s, tau {1e3 * tau:.1f} ms, K = {K} chunks")
print(f"writing beyond the computing: one process (T_out) {t_out:.1f} s, "
      f"{n_workers} workers at once (T_w) {t_w:.1f} s: here the workers "
      f"wrote {'faster' if t_w < t_out else 'no faster'} than one process")
machines = np.array([1, 2, 4, 8, 16])
by_out = t_compute / machines + t_out + K * tau  # writing as one process
by_w = t_compute / machines + t_w + K * tau  # writing as the workers did
low, high = np.minimum(by_out, by_w), np.maximum(by_out, by_w)
fast = min(t_out, t_w)
print(f"the model against one process ({t_one:.1f} s):")
for N, lo, hi in zip(machines[1:], low[1:], high[1:], strict=True):
    print(f"  N = {N:2d} machines: {lo:.1f} to {hi:.1f} s, "
          f"a speed-up of {t_one / hi:.2f} to {t_one / lo:.2f}")

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(6.5, 3.5))
ax.fill_between(machines[1:], low[1:], high[1:], color="C0", alpha=0.25,
                label="model: N machines, one shared disk")
ax.plot(machines, by_out, "o-", color="C0",
        label="  writing as one process did (T_out)")
ax.plot(machines[1:], by_w[1:], "o--", color="C0",
        label=f"  writing as the {n_workers} workers did (T_w)")
ax.plot([1], [t_one], "s", color="C1", label="measured: one process")
ax.plot([n_workers], [t_two], "^", color="C2",
        label=f"measured: {n_workers} workers, one machine")
ax.set_xscale("log", base=2)
ax.set_xticks(machines, [str(n) for n in machines])
ax.set_ylim(bottom=0)
ax.set_xlabel("machines N")
ax.set_ylabel("seconds")
ax.set_title(f"J of {n_samples:,} samples onto disk, {K} chunks")
ax.legend(fontsize="small")
fig.tight_layout()
print(f"Finding: run time against machines N; the model gives "
      f"{machines[-1]} machines {low[-1]:.1f} to {high[-1]:.1f} s, "
      f"a speed-up of {t_one / high[-1]:.2f} to {t_one / low[-1]:.2f} over "
      f"one process ({t_one:.1f} s), and no number of machines more than "
      f"{t_one / (fast + K * tau):.2f} while the writing stays; measured, "
      f"{n_workers} workers sharing this machine's cores took {t_two:.1f} s, "
      f"a speed-up of {t_one / t_two:.2f}")

# %% [markdown]
# Read the Finding line: it answers "how much faster on N machines?" for
# this network and this disk. More machines shrink only `T_compute`; the
# band flattens on the writing unless the storage grows with the machines.
# So the larger `T_compute` is against the writing (a bigger network
# computes longer for each byte it writes), the more machines pay. The
# measured two-worker point is drawn at N = 2 but ran on one machine: its
# computing did not split (s = 1), so it stands `T_compute / 2` above the
# dashed `T_w` line, which assumes two machines. That point does not test
# the model: `T_w` was computed from this very run, so where it lands
# follows by arithmetic. A test needs a run the model did not see. Where in
# the band a cluster lands is for its own file system to say: time the same
# run with 2, 4 and 8 workers there, take `T_w` from the 2-worker run, and
# see whether the 4- and 8-worker points fall in the band. The
# scheduler's cost, `K · τ`, stays small while chunks take far longer than
# `τ`: keep chunks at seconds, not milliseconds.

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer). The
# checks compute their own Jacobian in this process; they start no workers.
#
# **1.** The cell below starts the drill's run again, into a new file
# `path_ex`, and kills it part-way. Resume it with another chunk size:
# call `ju.chunked_jacobian(model, x_resume, chunk_size=resume_chunk // 2,
# out=path_ex)`. What does the error tell you to do? Do it, and put the
# finished Jacobian in `answer`.

# %%
path_ex = folder / "exercise.npy"
start_and_kill(path_ex, at_least=2)
print(f"{path_ex.name}: killed part-way; its ledger lists the chunks done")

# %% tags=["solution"] jupyter={"source_hidden": true}
# Solution: the file was started with chunk_size=resume_chunk; resuming
# needs the same chunks (leave chunk_size out to take the file's), or
# delete both files and start afresh.
try:
    ju.chunked_jacobian(model, x_resume, chunk_size=resume_chunk // 2,
                        out=path_ex, method="per_sample", progress=False)
except ju.core.resume.ResumeMismatch as error:
    print(error)
answer = ju.chunked_jacobian(model, x_resume, out=path_ex,
                             method="per_sample", progress=False)
print("resumed with the file's own chunk size:", answer.shape)

# %%
check.exercise("10-1", answer, model=model, x=x_resume)

# %% [markdown]
# **2.** Kill *both* workers at once, as the run starts (call
# `kill_busy_worker` twice in the thread), and put the Jacobian the workers
# return in `answer`: is it still complete and equal? What would happen if
# the workers kept dying (think of Dask's
# `distributed.scheduler.allowed-failures`, 3 by default)?

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: each lost chunk is rerun once the nannies have restarted the
# workers, and the model is sent again (it was the result of a task, which the
# scheduler reruns). A chunk whose workers die more than allowed-failures
# times is given up with a KilledWorker error: a chunk that kills every
# worker is a bug, not bad luck.
kills = []
killer = threading.Thread(
    target=lambda: kills.extend(workers.kill_busy_worker() for _ in range(2)))
killer.start()
answer = ju.distributed_jacobian(model, x_resume, workers,
                                 chunk_size=resume_chunk,
                                 method="per_sample", progress=False)
killer.join()
print(f"{len(kills)} workers killed; the rows of {len(answer):,} samples")

# %%
check.exercise("10-2", answer, model=model, x=x_resume)

# %% [markdown]
# ## Clean-up
#
# Stop the workers and the scheduler, and remove the temporary folder
# with its files:

# %%
workers.close()
del J_one, J_two
scratch.cleanup()
print("temporary folder removed:", not folder.exists())
print("processes left behind:", ju.scale.workers.leftovers(workers.address))

# %% [markdown]
# ## Keypoints
#
# - `chunked_jacobian(model, x, out="J.npy")` keeps a ledger of finished
#   chunks; after any interruption the same call finishes the file, and a
#   changed model or `x` is refused, never mixed.
#   <!-- claim: resumed-equals-whole, changed-model-refused -->
# - `LocalWorkers` starts a Dask scheduler and workers on 127.0.0.1, with
#   TLS, that end with this process; `distributed_jacobian` gives them the
#   chunks and equals one process bit for bit. On a cluster, pass a
#   `Client` instead (`docs/cluster.md`). <!-- claim: workers-equal-one-process -->
# - A worker that dies loses nothing: its chunks are rerun elsewhere. A
#   deadline (taken from a measured run time, never typed) stops the run
#   with the arrived chunks kept, and the same call resumes it; `timeout=`
#   and a lost cluster end a run the same way.
#   <!-- claim: lost-worker-loses-nothing, deadline-stops, deadline-resumed-equals-whole -->
# - `x` as a `dask.array` and J as a folder of chunk files or a lazy
#   `dask.array` stay on the workers.
# - `T_N ≈ T_compute / s(N) + T_write + K · τ`: machines shrink the
#   computing, not the writing, so the speed-up is bounded by
#   `T_1 / (T_write + K · τ)` (the Finding gives this run's bound). What
#   several writers gain on the writing is for the cluster's own storage
#   to say: measure it there, and keep chunks long against `τ`.
