"""Chunks on Dask workers (127.0.0.1): equal to one process, faults survived,
bad starts reported in bounded time, and no process left behind."""

import json
import socket
import threading
import time

import numpy as np
import psutil
import pytest

import jacutil as ju
from jacutil.core.resume import LEDGER_SUFFIX, RunFileError
from jacutil.scale.distributed import (
    DistributedLeastSquares,
    LocalWorkers,
    WorkerStartError,
    distributed_jacobian,
)
from jacutil.scale.workers import leftovers
from tests.architectures import ARCHITECTURES, build


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_all_stopped(pids, address=None):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], "processes left behind"
    if address is not None:  # also any we did not see: by their environment
        assert not leftovers(address)


class Started:
    """Every pid a LocalWorkers ran (spawned ones, and workers seen running)."""

    def __init__(self, workers):
        self.workers = workers
        self.pids = {p.pid for p in workers.processes}
        self.see()

    def see(self):
        self.pids |= set(self.workers.worker_pids().values())


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(2, start_timeout=120) as running:
        started = Started(running)
        yield running
        started.see()
    _assert_all_stopped(started.pids, started.workers.address)
    assert not running._logs.exists(), "the workers' logs were left in /tmp"


def test_every_process_listens_on_loopback_only(workers):
    pids = {p.pid for p in workers.processes} | set(workers.worker_pids().values())
    listening = [
        (c.pid, c.laddr.ip)
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]
    assert len({pid for pid, _ in listening}) == len(pids) == 5  # 1 + 2 x 2
    assert {ip for _, ip in listening} == {"127.0.0.1"}


def test_rows_equal_one_process_bit_for_bit(workers, tmp_path):
    model, (x, _) = ju.question_mlp(seed=2), ju.regression_data(1000, seed=4)
    one = ju.chunked_jacobian(model, x, chunk_size=125, method="rules", progress=False)
    in_memory = distributed_jacobian(model, x, workers, chunk_size=125, progress=False)
    on_disk = distributed_jacobian(
        model, x, workers, chunk_size=125, out=tmp_path / "J.npy", progress=False
    )
    assert np.array_equal(in_memory, one) and np.array_equal(on_disk, one)
    assert json.loads((tmp_path / ("J.npy" + LEDGER_SUFFIX)).read_text())["done"] == [
        [0, 8]
    ]


def test_a_run_started_in_one_process_is_finished_on_workers(workers, tmp_path):
    """The same ledger: chunks 3.. left by a one-process run, done by workers."""
    model, (x, _) = ju.question_mlp(seed=2), ju.regression_data(400, seed=5)
    path = tmp_path / "J.npy"
    ju.chunked_jacobian(
        model, x, chunk_size=50, out=path, method="rules", progress=False
    )
    ledger = tmp_path / ("J.npy" + LEDGER_SUFFIX)
    state = json.loads(ledger.read_text())
    state["done"] = [[0, 3]]
    ledger.write_text(json.dumps(state))
    lost = np.lib.format.open_memmap(path, mode="r+")
    lost[150:] = np.nan
    lost.flush()
    finished = distributed_jacobian(model, x, workers, out=path, progress=False)
    one = ju.chunked_jacobian(model, x, chunk_size=50, method="rules", progress=False)
    assert np.array_equal(finished, one)


def test_a_path_without_chunk_size(workers, tmp_path):
    """A new file takes n / (4 x workers) samples a chunk (a resumed one its
    own: above)."""
    model, (x, _) = ju.question_mlp(seed=2), ju.regression_data(100, seed=4)
    path = tmp_path / "J.npy"
    J = distributed_jacobian(model, x, workers, out=path, progress=False)
    one = ju.chunked_jacobian(model, x, chunk_size=13, method="rules", progress=False)
    assert np.array_equal(J, one)
    state = json.loads((tmp_path / ("J.npy" + LEDGER_SUFFIX)).read_text())
    assert state["chunk_size"] == 13 and state["done"] == [[0, 8]]  # 100 / (4 x 2)


def test_workers_refuse_a_folder_that_is_not_the_runs(workers, tmp_path, monkeypatch):
    """The token the workers are given must be the one in the run.json they see
    (a single .npy is written by this process: no worker writes into it)."""
    from jacutil.scale import distributed

    real = distributed.open_chunk_folder

    def other_token(*args):
        folder = real(*args)
        folder.token = "not-the-runs"
        return folder

    monkeypatch.setattr(distributed, "open_chunk_folder", other_token)
    model, (x, _) = ju.question_mlp(seed=2), ju.regression_data(40, seed=4)
    with pytest.raises(RunFileError, match="shared file system"):
        distributed_jacobian(
            model, x, workers, chunk_size=10, out=tmp_path / "J", progress=False
        )
    assert not list((tmp_path / "J").glob("rows-*"))  # no worker wrote a chunk


REFUSED = {"custom_layer", "subclassed", "sequential_subclass", "shared_layer"}
# On the workers: one model of each kind (convolution, recurrent, several
# inputs and heads, attention) and one refused; every zoo model goes through
# the same task in this process below, which is where architectures differ.
ON_WORKERS = [
    "attention",
    "convolution",
    "lstm",
    "shared_layer",
    "two_inputs_two_heads",
]


def _zoo_rows(name, compute):
    """Rows of zoo model ``name`` by ``compute(model, x)``, against one process;
    a model the workers cannot rebuild must be refused with what to do."""
    case = build(name)
    x = case.batch(5)
    if case.variables64 is not None:
        with pytest.raises(TypeError):
            compute(case.model64, x)
        return
    try:
        J = compute(case.model64, x)
    except TypeError as error:
        assert "register_keras_serializable" in str(error) or (
            "computes other outputs than yours" in str(error)
        )
        assert name in REFUSED
        return
    assert name not in REFUSED
    one = ju.chunked_jacobian(
        case.model64, x, chunk_size=2, method="rules", progress=False
    )
    np.testing.assert_allclose(J, one, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_zoo_rebuilt_from_what_workers_receive(name):
    """The worker's task, run here: rebuilt from to_json + weights, checked."""
    from jacutil.scale import distributed

    def rows(model, x):
        distributed.check_sendable(model)
        distributed.forget_models()
        spec = distributed.model_spec(model, x)
        options = {"training": False, "jit_compile": False, "method": "rules"}
        return distributed.rows_task(spec, distributed.as_numpy(x), options=options)

    _zoo_rows(name, rows)


@pytest.mark.parametrize("name", ON_WORKERS)
def test_zoo_on_workers(workers, name):
    _zoo_rows(
        name,
        lambda model, x: distributed_jacobian(
            model, x, workers, chunk_size=2, progress=False
        ),
    )


def test_normal_equations_and_one_levenberg_marquardt_step(workers):
    model = ju.question_mlp(seed=2, hidden=(16,))
    x, y = ju.regression_data(600, seed=6)
    one = ju.least_squares_problem(model, x, y, chunk_size=100)
    spread = DistributedLeastSquares(model, x, y, workers, chunk_size=100)
    theta = one.theta0
    for a, b in zip(
        one.normal_equations(theta), spread.normal_equations(theta), strict=True
    ):
        # BLAS sums J.T @ J in an order that depends on its thread count
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12 * np.abs(a).max())
    steps = [ju.levenberg_marquardt(p, theta, max_steps=2) for p in (one, spread)]
    np.testing.assert_allclose(steps[1]["theta"], steps[0]["theta"], rtol=1e-9)
    assert steps[0]["history"][-1, 1] < steps[0]["history"][0, 1]


@pytest.mark.parametrize("at_once", [1, 2])
def test_killed_workers_lose_nothing(tmp_path, at_once):
    """SIGKILL one worker, or both at once (every worker that was sent the
    model: it must be sent again), while they hold chunks: the chunks are
    rerun and the file equals the uninterrupted result, bit for bit."""
    model, (x, _) = ju.question_mlp(seed=2), ju.regression_data(6000, seed=7)
    one = ju.chunked_jacobian(
        model, x, chunk_size=100, method="per_sample", progress=False
    )
    path = tmp_path / "J.npy"
    with LocalWorkers(2, start_timeout=120) as running:
        started = Started(running)
        # warm both workers (TensorFlow imported, model traced) so the kill
        # lands while chunks are being computed, not while starting
        distributed_jacobian(
            model, x[:400], running, chunk_size=100, method="per_sample", progress=False
        )
        killed = []

        def kill():
            for _ in range(at_once):
                address, pid, held = running.kill_busy_worker(timeout=30)
                killed.append((pid, held, ju.core.resume.finished_chunks(path)))

        killer = threading.Thread(target=kill)
        killer.start()
        J = distributed_jacobian(
            model,
            x,
            running,
            chunk_size=100,
            out=path,
            method="per_sample",
            progress=False,
            deadline=240,  # about 15 s here: a stall is an error, not a hang
        )
        killer.join()
        assert len({pid for pid, _, _ in killed}) == at_once
        for pid, held, (done, n_chunks) in killed:
            assert held, "the killed worker held no chunk"
            assert done < n_chunks, "the run ended before the kill"
            assert not _alive(pid)
        assert np.array_equal(J, one)
        started.see()  # the nannies' new workers too
    _assert_all_stopped(started.pids, started.workers.address)


def test_a_worker_that_never_starts_is_an_error_in_bounded_time(monkeypatch):
    spawn = LocalWorkers._spawn

    def hanging_workers(self, name, arguments):
        if name.startswith("worker"):
            arguments = ["-c", "import time; time.sleep(600)"]
        return spawn(self, name, arguments)

    monkeypatch.setattr(LocalWorkers, "_spawn", hanging_workers)
    seen, addresses = [], []
    monkeypatch.setattr(
        LocalWorkers,
        "close",
        lambda self, real=LocalWorkers.close: (
            seen.extend(p.pid for p in self.processes),
            addresses.append(self.address),
            real(self),
        ),
    )
    started = time.monotonic()
    with pytest.raises(WorkerStartError, match="did not start within start_timeout"):
        LocalWorkers(2, start_timeout=8)
    assert time.monotonic() - started < 30
    assert len(seen) == 3  # the scheduler and two workers that hung
    _assert_all_stopped(seen, addresses[0])


def test_a_worker_that_crashes_at_start_is_reported_with_its_log(monkeypatch):
    spawn = LocalWorkers._spawn

    def crashing_workers(self, name, arguments):
        if name.startswith("worker"):
            arguments = ["-c", "import sys; print('no GPU here'); sys.exit(3)"]
        return spawn(self, name, arguments)

    monkeypatch.setattr(LocalWorkers, "_spawn", crashing_workers)
    with pytest.raises(WorkerStartError, match=r"exited with code 3(.|\n)*no GPU here"):
        LocalWorkers(1, start_timeout=60)


def test_a_taken_port_is_an_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(
            WorkerStartError, match=f"port {port} on 127.0.0.1 is taken"
        ):
            LocalWorkers(1, port=port)
        assert time.monotonic() - started < 5
