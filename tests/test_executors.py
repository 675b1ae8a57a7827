"""Where chunks run (jacutil.scale.executors, chunk_files, dask_arrays): every
backend and every output equal to one process bit for bit; clocks that stop a
run keep what arrived; lost workers are an error in bounded time; a
dask.array x never comes to the driver; the scheduler needs nothing of ours."""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import jacutil as ju
from jacutil.core.resume import LEDGER_SUFFIX, ResumeMismatch, RunFileError
from jacutil.scale import executors
from jacutil.scale.chunk_files import chunk_name, read_chunks, write_chunk
from jacutil.scale.dask_arrays import lazy_jacobian
from jacutil.scale.distributed import LocalWorkers, distributed_jacobian
from jacutil.scale.executors import (
    ChunkTimeoutError,
    ProcessExecutor,
    WorkersLostError,
    as_arrived,
)
from jacutil.scale.workers import free_port

pytestmark = pytest.mark.xdist_group("workers")


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(2, start_timeout=120) as running:
        yield running


def _run(n=400, seed=4):
    model, (x, _) = ju.question_mlp(seed=2), ju.regression_data(n, seed=seed)
    one = ju.chunked_jacobian(model, x, chunk_size=50, method="rules", progress=False)
    return model, x, one


# --- a test executor: tasks in threads, some held back ------------------------


class HeldBack:
    """The executor interface in threads; chunks from ``held`` on never end
    (a stalled worker); ``threads`` as a Dask cluster would report them."""

    def __init__(self, held=None, threads=None, workers=2):
        self.pool = concurrent.futures.ThreadPoolExecutor(2)
        self.held, self._threads, self.workers = held, threads or {}, workers

    def share(self, value, name=None):
        return value

    def submit(self, fn, spec, samples, start, name=None):
        if self.held is not None and start >= self.held:
            return concurrent.futures.Future()  # never finishes
        return self.pool.submit(fn, spec, samples, start)

    def wait(self, pending, seconds):
        return concurrent.futures.wait(
            pending, seconds, concurrent.futures.FIRST_COMPLETED
        ).done

    def cancel(self, futures):
        for future in futures:
            future.cancel()

    def n_workers(self):
        return self.workers

    def threads(self):
        return self._threads


def _at(seconds):
    """Futures that finish at the given times."""
    futures = [concurrent.futures.Future() for _ in seconds]
    for future, at in zip(futures, seconds, strict=True):
        finish = lambda f=future, at=at: f.cancelled() or f.set_result(at)  # noqa: E731
        timer = threading.Timer(at, finish)
        timer.daemon = True
        timer.start()
    return futures


def test_timeout_is_the_wait_for_the_next_chunk_not_the_run():
    """A run of 3 s whose chunks arrive 0.3 s apart passes timeout=1.5."""
    started = time.monotonic()
    arrived = list(
        as_arrived(HeldBack(), _at([0.3 * k for k in range(1, 11)]), timeout=1.5)
    )
    assert len(arrived) == 10 and time.monotonic() - started > 2.9


def test_deadline_bounds_the_whole_run():
    started = time.monotonic()
    with pytest.raises(ChunkTimeoutError, match="deadline=1 seconds with [2-7] chunks"):
        list(as_arrived(HeldBack(), _at([0.3 * k for k in range(1, 9)]), deadline=1))
    assert time.monotonic() - started < 3.0


class LostResult:
    """A future a Dask cluster reports finished whose worker then died:
    fetching its result fails ``lost`` times (Dask runs it again), or waits
    forever when ``lost`` is None; ``result()`` without a limit is a hang."""

    def __init__(self, value, lost):
        self.value, self.lost, self.fetches = value, lost, 0
        self.cancelled = False

    def cancel(self):
        self.cancelled = True

    def exception(self, timeout=None):
        return None

    def result(self, timeout=None):
        if timeout is None:
            time.sleep(20)
            raise AssertionError("a result was waited for without a limit")
        self.fetches += 1
        if self.lost is None or self.fetches <= self.lost:
            time.sleep(timeout)
            raise TimeoutError
        return self.value


class Finished(HeldBack):
    """Every future is finished at once (as ``wait`` sees it)."""

    def wait(self, pending, seconds):
        return set(pending)


def test_a_finished_chunk_whose_worker_died_is_fetched_again(monkeypatch):
    monkeypatch.setattr(executors, "FETCH_SECONDS", 0.05)
    futures = [LostResult(0, lost=0), LostResult(1, lost=2), LostResult(2, lost=0)]
    arrived = dict(as_arrived(Finished(), futures, timeout=5))
    assert sorted(arrived.values()) == [0, 1, 2]
    # its fetches had growing limits: 0.05 s, 0.1 s, then 0.2 s, which worked
    assert futures[1].fetches == 3


@pytest.mark.parametrize("clock", ["timeout", "deadline"])
def test_a_result_that_never_comes_cannot_outlast_the_clocks(monkeypatch, clock):
    """Every worker died after its chunk finished, and none comes back: the
    run ends with the clock (issue 37: it waited in future.result())."""
    monkeypatch.setattr(executors, "FETCH_SECONDS", 0.05)
    started = time.monotonic()
    futures = [LostResult(0, lost=0), LostResult(1, lost=None)]
    with pytest.raises(ChunkTimeoutError, match=f"{clock}=1 seconds"):
        list(as_arrived(Finished(), futures, **{clock: 1}))
    assert time.monotonic() - started < 5
    assert futures[1].cancelled


def test_a_fetch_ends_with_the_clock(monkeypatch):
    """A fetch's limit is cut to what is left of the run's clocks: a
    deadline of 1 s is not overrun by a 10 s fetch."""
    started = time.monotonic()
    with pytest.raises(ChunkTimeoutError, match="deadline=1 seconds"):
        list(as_arrived(Finished(), [LostResult(1, lost=None)], deadline=1))
    assert time.monotonic() - started < 3


class DiesAfterFinishing(Finished):
    """Chunks from ``held`` on finish, and then their worker dies for good:
    their results can never be fetched."""

    def submit(self, fn, spec, samples, start, name=None):
        value = fn(spec, samples, start)
        return LostResult(value, lost=None if start >= self.held else 0)


@pytest.mark.parametrize("clock", ["timeout", "deadline"])
def test_workers_dead_after_finishing_end_the_run_and_free_the_file(
    tmp_path, monkeypatch, clock
):
    """Issue 37: every worker killed after its chunks finished hung the run in
    ``future.result()`` past both clocks, holding the file's lock. Now the
    clock ends it, the arrived chunks are on disk, and the next call resumes."""
    monkeypatch.setattr(executors, "FETCH_SECONDS", 0.05)
    model, x, one = _run()
    path = tmp_path / "J.npy"
    started = time.monotonic()
    with pytest.raises(ChunkTimeoutError, match=f"{clock}=2 seconds") as caught:
        distributed_jacobian(
            model,
            x,
            DiesAfterFinishing(held=200),
            out=path,
            chunk_size=50,
            progress=False,
            **{clock: 2},
        )
    assert time.monotonic() - started < 10
    assert caught.value.done == [0, 1, 2, 3]
    J = distributed_jacobian(model, x, HeldBack(), out=path, progress=False)
    np.testing.assert_array_equal(J, one)


@pytest.mark.parametrize(
    "chunk_size, error, words",
    [
        (-5, ValueError, "chunk_size must be at least 1; got -5"),
        (0, ValueError, "chunk_size must be at least 1; got 0"),
        (2.5, TypeError, "chunk_size must be a whole number; got 2.5"),
        ("100", TypeError, "chunk_size must be a whole number; got '100'"),
    ],
)
def test_a_bad_chunk_size_is_refused_as_the_stages_refuse_it(
    tmp_path, chunk_size, error, words
):
    """Issue 37: -5 returned zeros (and wrote a ledger of -400 chunks that a
    second call "resumed"), 0 meant the default, 2.5 and "100" raw errors."""
    model, x, _ = _run(n=60)
    for out in (None, tmp_path / "J.npy"):
        with pytest.raises(error, match=words):
            distributed_jacobian(
                model, x, HeldBack(), chunk_size=chunk_size, out=out, progress=False
            )
    assert not (tmp_path / "J.npy").exists()
    with pytest.raises(error, match=words):  # the lazy dask.array too (2.5 was 2)
        lazy_jacobian(model, x, chunk_size=chunk_size)


def test_a_ledger_without_chunks_is_refused(tmp_path):
    model, x, _ = _run(n=60)
    path = tmp_path / "J.npy"
    distributed_jacobian(model, x, HeldBack(), chunk_size=20, out=path, progress=False)
    ledger = tmp_path / ("J.npy" + LEDGER_SUFFIX)
    state = json.loads(ledger.read_text())
    ledger.write_text(json.dumps({**state, "chunk_size": -5, "n_chunks": -12}))
    with pytest.raises(ResumeMismatch, match="not a readable ledger.*at least 1"):
        distributed_jacobian(model, x, HeldBack(), out=path, progress=False)


def test_a_file_of_another_method_names_the_method(tmp_path):
    """Issue 37: a .npy started by distributed_jacobian (method "rules") and
    continued by chunked_jacobian (its default: "per_sample") was refused for
    "other model weights, inputs x or options"; the message names the method,
    and with it the file is finished."""
    model, x, one = _run()
    path = tmp_path / "J.npy"
    with pytest.raises(ChunkTimeoutError):
        distributed_jacobian(
            model, x, HeldBack(held=200), out=path, chunk_size=50, timeout=3,
            progress=False,
        )  # fmt: skip
    with pytest.raises(
        ResumeMismatch, match=r"method='rules' \(this run: method='per_sample'\)"
    ):
        ju.chunked_jacobian(model, x, out=path, progress=False)
    J = ju.chunked_jacobian(model, x, out=path, method="rules", progress=False)
    np.testing.assert_array_equal(J, one)


def test_a_stalled_chunk_stops_the_run_and_what_arrived_is_kept(tmp_path):
    model, x, one = _run()
    # warm: the model rebuilt from its spec and compiled, so that each chunk
    # arrives within the timeout on a busy machine too
    distributed_jacobian(model, x[:50], HeldBack(), progress=False)
    with pytest.raises(ChunkTimeoutError, match="timeout=3 seconds") as caught:
        distributed_jacobian(
            model, x, HeldBack(held=200), chunk_size=50, timeout=3, progress=False
        )
    assert caught.value.done == [0, 1, 2, 3]
    np.testing.assert_array_equal(caught.value.out[:200], one[:200])
    assert "kept in error.out" in str(caught.value)
    # into a file: the arrived chunks are on disk, and a second run finishes it
    path = tmp_path / "J.npy"
    with pytest.raises(ChunkTimeoutError, match="kept on disk in J.npy"):
        distributed_jacobian(
            model,
            x,
            HeldBack(held=200),
            out=path,
            chunk_size=50,
            timeout=3,
            progress=False,
        )
    ledger = (tmp_path / ("J.npy" + LEDGER_SUFFIX)).read_text()
    assert '"done": [[0, 4]]' in ledger
    J = distributed_jacobian(model, x, HeldBack(), out=path, progress=False)
    np.testing.assert_array_equal(J, one)


def test_a_chunk_that_fails_cancels_the_rest():
    """A worker's error (here chunk 1's) ends the run at once: the chunks
    still to come are cancelled, not left running."""

    class Failing(HeldBack):
        def submit(self, fn, spec, samples, start, name=None):
            if start == 50:
                failed = concurrent.futures.Future()
                failed.set_exception(RunFileError("a worker sees another folder"))
                return failed
            future = super().submit(fn, spec, samples, start)
            self.submitted.append(future)
            return future

    failing = Failing(held=100)
    failing.submitted = []
    model, x, _ = _run(400)
    with pytest.raises(RunFileError, match="another folder"):
        distributed_jacobian(model, x, failing, chunk_size=50, progress=False)
    held = failing.submitted[1:]  # chunks 2..7 never finish by themselves
    assert held and all(future.cancelled() for future in held)


def test_lost_workers_are_an_error_in_bounded_time(monkeypatch):
    monkeypatch.setattr(executors, "WORKERS_LOST_AFTER", 1.0)
    model, x, _ = _run(100)
    started = time.monotonic()
    with pytest.raises(WorkersLostError, match="no worker has been connected"):
        distributed_jacobian(
            model, x, HeldBack(held=0, workers=0), chunk_size=50, progress=False
        )
    assert time.monotonic() - started < 8  # WORKERS_LOST_AFTER + polls, busy too


def test_several_threads_per_worker_are_warned_about():
    model, x, one = _run(100)
    with pytest.warns(UserWarning, match="--nthreads 1"):
        J = distributed_jacobian(
            model, x, HeldBack(threads={"tls://w": 4}), chunk_size=50, progress=False
        )
    np.testing.assert_array_equal(J, one[:100])


def test_a_killed_scheduler_is_workers_lost_and_the_rows_that_arrived_are_kept():
    """Issue 37 item 8: a scheduler killed mid-run gave Dask's raw
    CommClosedError, and with out=None the chunks that had arrived were lost."""
    model, (x, _) = ju.question_mlp(seed=2), ju.regression_data(20000, seed=7)
    options = {"chunk_size": 50, "method": "per_sample", "progress": False}
    with LocalWorkers(1, start_timeout=120) as running:
        distributed_jacobian(model, x[:100], running, **options)  # warm
        scheduler = next(p for p in running.processes if p.name == "scheduler")
        arrived = []

        def kill(k):
            arrived.append(k)
            if len(arrived) == 10:
                os.kill(scheduler.pid, signal.SIGKILL)

        started = time.monotonic()
        with pytest.raises(
            WorkersLostError, match="connection to the cluster"
        ) as caught:
            distributed_jacobian(
                model, x, running, on_chunk=kill, timeout=60, **options
            )
        assert time.monotonic() - started < 30
    done = caught.value.done
    assert "chunks that arrived are kept in error.out" in str(caught.value)
    assert len(done) >= 10 and sorted(arrived) == done
    one = ju.chunked_jacobian(model, x[: 50 * (max(done) + 1)], **options)
    for k in done:
        rows = slice(50 * k, 50 * (k + 1))
        np.testing.assert_array_equal(caught.value.out[rows], one[rows])


# --- a process pool -------------------------------------------------------------


def _pool_folders():
    return list(Path(tempfile.gettempdir()).glob(f"jacutil-pool-{os.getpid()}-*"))


def test_a_process_pool_equals_one_process(tmp_path):
    model, x, one = _run()
    with ProcessExecutor(2, threads=1) as pool:
        J = distributed_jacobian(model, x, pool, chunk_size=50, progress=False)
        folder = distributed_jacobian(
            model, x, pool, chunk_size=50, out=tmp_path / "J", progress=False
        )
    np.testing.assert_array_equal(J, one)
    np.testing.assert_array_equal(folder.compute(), one)
    np.testing.assert_array_equal(read_chunks(tmp_path / "J"), one)
    assert not _pool_folders(), "the pool's results folder was left behind"


def test_a_killed_pool_process_is_workers_lost_with_arrivals_kept(tmp_path):
    model, (x, _) = ju.question_mlp(seed=2), ju.regression_data(3000, seed=4)
    pool = concurrent.futures.ProcessPoolExecutor(
        1, mp_context=__import__("multiprocessing").get_context("spawn")
    )
    killed = []

    def kill(k):
        if k == 1:
            pid = next(iter(pool._processes))
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    try:
        with pytest.raises(WorkersLostError, match="process of the pool died"):
            distributed_jacobian(
                model,
                x,
                pool,
                chunk_size=100,
                out=tmp_path / "J.npy",
                on_chunk=kill,
                progress=False,
            )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    assert killed
    assert not _pool_folders(), "the pool's results folder was left behind"
    done, of = ju.core.resume.finished_chunks(tmp_path / "J.npy")
    assert 2 <= done < of == 30


# --- a folder of chunk files ----------------------------------------------------


def test_a_chunk_folder_resumes_and_checks_each_file(workers, tmp_path):
    model, x, one = _run()
    folder = tmp_path / "J"
    J = distributed_jacobian(
        model, x, workers, chunk_size=50, out=folder, progress=False
    )
    np.testing.assert_array_equal(J.compute(), one)
    files = sorted(p.name for p in folder.glob("rows-*.npy"))
    assert files == [chunk_name(s, s + 50) for s in range(0, 400, 50)]
    (folder / chunk_name(100, 150)).unlink()  # lost
    with open(folder / chunk_name(300, 350), "r+b") as cut:  # cut short
        cut.truncate(1000)
    with pytest.raises(ResumeMismatch, match=r"2 of the 8 chunks .* \(chunks 2, 6\)"):
        read_chunks(folder)
    seen = []
    again = distributed_jacobian(
        model, x, workers, out=folder, on_chunk=seen.append, progress=False
    )
    assert sorted(seen) == [2, 6]
    np.testing.assert_array_equal(again.compute(), one)
    with pytest.raises(ResumeMismatch, match="other model weights, inputs x"):
        distributed_jacobian(model, x[::-1], workers, out=folder, progress=False)


def test_a_worker_that_sees_another_folder_fails(tmp_path):
    other = tmp_path / "node" / "J"  # what another node sees at that path
    other.mkdir(parents=True)
    rows = np.zeros((5, 1, 3), "float32")
    with pytest.raises(RunFileError, match="no run.json in it"):
        write_chunk(other, 0, rows, "the-runs-token")
    (other / "run.json").write_text('{"token": "another"}')
    with pytest.raises(RunFileError, match="another run's run.json"):
        write_chunk(other, 0, rows, "the-runs-token")
    assert not list(other.glob("rows-*"))


def test_a_chunk_that_arrives_after_its_run_ended_is_not_written(tmp_path, monkeypatch):
    """ChunkFolder.end: the token is checked again before the file takes its
    name, so a run's count of its files stays true (issue 37 item 7)."""
    from jacutil.scale import chunk_files

    folder = chunk_files.open_chunk_folder(
        tmp_path / "J", (10, 1, 3), "float32", {"key": "k"}, 5, 5
    )
    rows = np.ones((5, 1, 3), "float32")
    write_chunk(folder.path, 0, rows, folder.token)
    real, calls = chunk_files._check_token, []

    def ended_while_writing(*args):  # the driver ends the run mid-write
        calls.append(args)
        if len(calls) == 2:
            folder.end()
        return real(*args)

    monkeypatch.setattr(chunk_files, "_check_token", ended_while_writing)
    with pytest.raises(chunk_files.RunEndedError, match="calling .* again"):
        write_chunk(folder.path, 5, rows, folder.token)
    assert len(calls) == 2 and folder.complete() == [0]
    assert sorted(p.name for p in folder.path.iterdir()) == [
        chunk_name(0, 5),
        "run.json",
    ]


def test_a_deadline_in_folder_mode_counts_the_files_and_stops_the_writes(
    workers, tmp_path
):
    """Workers write their own files, so more chunks can be done than have
    arrived: the error counts the files, no file appears after it, and the
    run resumes (issue 37 item 7)."""
    model, (x, _) = ju.question_mlp(seed=2), ju.regression_data(20000, seed=7)
    options = {"chunk_size": 50, "method": "per_sample", "progress": False}
    distributed_jacobian(model, x[:200], workers, **options)  # warm both workers
    folder = tmp_path / "J"
    with pytest.raises(ChunkTimeoutError, match="chunks complete on disk") as caught:
        distributed_jacobian(model, x, workers, out=folder, deadline=1, **options)
    counted = int(str(caught.value).split("The ")[1].split(" chunks")[0])
    time.sleep(3)  # a task still running when the run ended has finished now
    files = sorted(folder.glob("rows-*.npy"))
    assert len(files) == counted == len(caught.value.done)
    assert 0 < counted < 400  # about 3 s for all 400 here
    J = distributed_jacobian(model, x, workers, out=folder, **options)
    one = ju.chunked_jacobian(model, x, **options)
    np.testing.assert_array_equal(J.compute(), one)


# --- data on the workers --------------------------------------------------------

WIDE = 256  # inputs per sample: x is 8 MB, J 33 MB


def test_a_dask_array_x_never_comes_to_the_driver(workers, tmp_path):
    import dask.array as da

    keras = ju.keras
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((WIDE,)), keras.layers.Dense(4, "tanh"), keras.layers.Dense(1)]
    )
    driver = os.getpid()

    def block(block_info=None):
        """Block k of x, made where it is computed (a closure: pickled by
        value, so the scheduler imports nothing for it), never on the driver."""
        if os.getpid() == driver:
            raise AssertionError("a block of x was computed on the driver")
        k = block_info[None]["chunk-location"][0]
        return np.random.default_rng(k).standard_normal((1000, WIDE), "float32")

    x = da.map_blocks(block, chunks=((1000,) * 8, (WIDE,)), dtype="float32")
    # warm: the compiled Jacobian, Dask's client-side machinery
    distributed_jacobian(model, x[:1000], workers, out=tmp_path / "J0", progress=False)
    tracemalloc.start()
    J = distributed_jacobian(
        model, x, workers, chunk_size=500, out=tmp_path / "J", progress=False
    )
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < x.nbytes / 4, f"the driver held {peak:,} bytes of x's {x.nbytes:,}"
    x_here = np.concatenate(
        [
            np.random.default_rng(k).standard_normal((1000, WIDE), "float32")
            for k in range(8)
        ]
    )
    one = ju.chunked_jacobian(
        model, x_here, chunk_size=500, method="rules", progress=False
    )
    # each process runs its first chunk eagerly, the next ones in the traced
    # graph (issue 64): equal to float32 rounding, not bit for bit
    np.testing.assert_allclose(J.compute(), one, rtol=1e-5, atol=1e-6)


def test_lazy_jacobian_and_futures_equal_one_process(workers):
    import dask.array as da

    from jacutil.scale.dask_arrays import jacobian_futures, lazy_jacobian

    model, x, one = _run()
    client = workers.client
    lazy = lazy_jacobian(
        model, da.from_array(x, chunks=37), chunk_size=50, client=client
    )
    assert lazy.chunks[0] == (50,) * 8 and lazy.shape == one.shape
    np.testing.assert_array_equal(client.compute(lazy).result(), one)
    x_future = client.scatter(x)
    futures = jacobian_futures(model, x_future, workers, chunk_size=50)
    np.testing.assert_array_equal(np.concatenate(client.gather(futures)), one)


# --- Dask's own habits ------------------------------------------------------------


def test_the_current_client_is_used_when_none_is_given(workers):
    """As Dask's own functions: inside ``with LocalWorkers(...)`` (or
    ``with Client(...)``) workers= may be left out (issue 37)."""
    import dask.array as da
    from distributed import default_client

    from jacutil.scale.dask_arrays import jacobian_futures, lazy_jacobian

    model, x, one = _run()
    with workers.client.as_current():
        assert default_client() is workers.client
        J = distributed_jacobian(model, x, chunk_size=50, progress=False)
        lazy = lazy_jacobian(model, da.from_array(x, chunks=37), chunk_size=50)
        futures = jacobian_futures(model, x, chunk_size=50)
        np.testing.assert_array_equal(lazy.compute(), one)
        np.testing.assert_array_equal(
            np.concatenate(workers.client.gather(futures)), one
        )
    np.testing.assert_array_equal(J, one)


def test_no_workers_and_no_current_client_says_what_to_pass(monkeypatch):
    import distributed

    def none_current():
        raise ValueError("No clients found")

    monkeypatch.setattr(distributed, "default_client", none_current)
    model, x, _ = _run(n=10)
    with pytest.raises(TypeError, match="no Dask client is current: pass workers="):
        distributed_jacobian(model, x, progress=False)


def test_tasks_carry_readable_keys(workers):
    """The dashboard and Dask's logs say what runs: jacobian-chunk-000003."""
    from distributed import get_task_stream

    model, x, one = _run()
    with get_task_stream(workers.client) as stream:
        J = distributed_jacobian(model, x, workers, chunk_size=50, progress=False)
    np.testing.assert_array_equal(J, one)
    keys = [str(task["key"]) for task in stream.data]
    chunks = sorted(k.split("-")[2] for k in keys if k.startswith("jacobian-chunk-"))
    assert chunks == [f"{k:06d}" for k in range(8)]
    assert any(k.startswith("jacobian-model-") for k in keys)
    assert any(k.startswith("jacobian-samples-000007-") for k in keys)


def test_retries_and_readable_keys_reach_dask():
    class Recording:
        def submit(self, *args, **kwargs):
            self.kwargs = kwargs

    client = Recording()
    executors.DaskExecutor(client, retries=2).submit(len, "x", name="jacobian-chunk-1")
    assert client.kwargs["retries"] == 2
    assert client.kwargs["key"].startswith("jacobian-chunk-1-")


@pytest.mark.parametrize(
    "retries, error, words",
    [
        (1, ValueError, "retries=1 asks Dask to run a failed chunk again; HeldBack"),
        (-1, ValueError, "retries must be 0 or more; got -1"),
        (1.5, TypeError, "retries must be a whole number; got 1.5"),
    ],
)
def test_retries_are_refused_where_nothing_reruns_or_when_not_a_count(
    retries, error, words
):
    model, x, _ = _run(n=10)
    with pytest.raises(error, match=words):
        distributed_jacobian(model, x, HeldBack(), retries=retries, progress=False)


# --- the scheduler needs nothing of ours ----------------------------------------

BLOCKER = """
import sys
import tempfile
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"jacutil", "tensorflow", "keras", "tests"}:
            raise ImportError(f"the scheduler imported {name}")
sys.meta_path.insert(0, Refuse())
from distributed.cli.dask_scheduler import main
sys.argv = ["dask-scheduler", "--host", "127.0.0.1", "--port", PORT, "--no-dashboard"]
main()
"""


def test_the_scheduler_needs_neither_jacutil_nor_tensorflow():
    from distributed import Client

    port = str(free_port())
    address = f"tcp://127.0.0.1:{port}"
    started = [
        subprocess.Popen(
            [sys.executable, "-c", BLOCKER.replace("PORT", repr(port))],
            start_new_session=True,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        time.sleep(2)
        worker = [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            address,
            "--host",
            "127.0.0.1",
            "--nthreads",
            "1",
            "--no-dashboard",
        ]
        started.append(
            subprocess.Popen(worker, start_new_session=True, stderr=subprocess.DEVNULL)
        )
        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=120)
            model, x, one = _run(200)
            J = distributed_jacobian(model, x, client, chunk_size=50, progress=False)
            np.testing.assert_array_equal(J, one[:200])
            y = ju.regression_data(200, seed=4)[1]
            problem = ju.DistributedLeastSquares(model, x, y, client, chunk_size=50)
            problem.normal_equations(problem.theta0)
            imported = client.run_on_scheduler(
                lambda: sorted(
                    m
                    for m in sys.modules
                    if m.split(".")[0] in {"jacutil", "tensorflow", "keras"}
                )
            )
            assert imported == []
    finally:
        for process in started:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(30)


# --- a worker's model cache -----------------------------------------------------


def test_a_workers_model_takes_new_weights_and_threads_never_mix_them():
    """One rebuilt model per architecture: new weights (each step of a fit)
    are set and checked, and two tasks in two threads with other weights
    each get their own rows."""
    from jacutil.scale import distributed

    options = {"training": False, "jit_compile": False, "method": "rules"}
    x = ju.regression_data(200, seed=4)[0]
    model = ju.question_mlp(seed=1)
    specs, expected = [], []
    for scale in (1.0, 1.01):  # a step of a fit: the same model, new weights
        model.set_weights([w * scale for w in model.get_weights()])
        specs.append(distributed.model_spec(model, x))
        expected.append(ju.chunked_jacobian(model, x, method="rules", progress=False))
    assert not np.array_equal(*expected)
    distributed.forget_models()
    for spec, rows in zip(specs * 2, expected * 2, strict=True):
        J = distributed.rows_task(spec, x, options=options)
        np.testing.assert_array_equal(J, rows)
    assert len(distributed._rebuilt) == 1  # one architecture: one model
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(distributed.rows_task, specs[k % 2], x, options=options)
            for k in range(8)
        ]
        for k, run in enumerate(runs):
            np.testing.assert_array_equal(run.result(), expected[k % 2])


class FakeClient:
    """What client.run returns: each worker's answer, or its error."""

    def __init__(self, answers):
        self.answers = answers

    def run(self, function, *args, on_error="raise"):
        assert on_error == "return"
        return self.answers


def test_a_worker_of_other_versions_is_named_before_a_run():
    from jacutil.scale.executors import VERSIONS, WorkerMismatchError, check_workers

    mine = eval(VERSIONS)  # noqa: S307
    other = (mine[0], "2.16.1", *mine[2:])
    missing = ModuleNotFoundError("No module named 'jacutil'")
    check_workers(FakeClient({"tls://a:1": mine, "tls://b:2": mine}))  # all alike
    with pytest.raises(WorkerMismatchError) as refused:
        check_workers(
            FakeClient({"tls://a:1": mine, "tls://b:2": other, "tls://c:3": missing})
        )
    said = str(refused.value)
    assert said.startswith("2 of 3 workers cannot run this driver's chunks")
    assert f"tls://b:2: tensorflow 2.16.1 (driver: {mine[1]})" in said
    assert "tls://c:3: cannot import them (ModuleNotFoundError: No module" in said
    assert "tls://a:1" not in said
