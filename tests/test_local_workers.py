"""LocalWorkers: its processes end with the process that started them, however
it ends; only a client holding its key connects; it listens on 127.0.0.1 only,
with no dashboard unless asked; its scheduler never imports jacutil (TensorFlow)."""

import asyncio
import gc
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from jacutil.scale.workers import STOP_BOUND, LocalWorkers, leftovers

pytestmark = pytest.mark.xdist_group("workers")  # one LocalWorkers at a time

ROOT = Path(__file__).resolve().parents[1]

# The driver: it prints what it started, then waits; "exit" ends it normally
# (sys.exit, no close()) when its stdin closes.
DRIVER = """
import json, sys, time, psutil
from jacutil.scale.workers import LocalWorkers
workers = LocalWorkers(2, start_timeout=120)
pids = {p.pid for p in workers.processes} | set(workers.worker_pids().values())
for pid in list(pids):  # the nannies' workers and resource trackers too
    pids |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
print(json.dumps({"address": workers.address, "pids": sorted(pids),
                  "folder": str(workers._logs)}), flush=True)
if sys.argv[1] == "exit":
    sys.stdin.read()
    sys.exit(0)
time.sleep(600)
"""


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass


def _read_line(process, timeout):
    """The driver's first line of output, or a failure within ``timeout``."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        process.kill()
        pytest.fail(f"the driver printed nothing within {timeout} s")
    line = process.stdout.readline()
    if not line:
        pytest.fail(f"the driver ended with code {process.wait()}")
    return json.loads(line)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "exit"])
def test_processes_and_folder_end_with_the_driver(how):
    """SIGTERM (Slurm, timeout), SIGKILL (an out-of-memory killer), or a
    normal exit without close(): within STOP_BOUND seconds no process is
    left and the folder (logs and TLS key) is gone."""
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, how],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    started = _read_line(driver, timeout=150)
    pids, address, folder = started["pids"], started["address"], started["folder"]
    try:
        assert len(pids) >= 5 and all(map(_alive, pids))  # 1 + 2 x (nanny, worker)
        assert Path(folder, "credentials", "key.pem").exists()
        if how == "exit":
            driver.stdin.close()
        else:
            driver.send_signal(getattr(signal, how))
        driver.wait(30)
        ended = time.monotonic()
        deadline = ended + STOP_BOUND + 5  # the documented bound, and a margin
        while time.monotonic() < deadline and (
            any(map(_alive, pids)) or leftovers(address) or os.path.exists(folder)
        ):
            time.sleep(0.1)
        took = time.monotonic() - ended
        print(f"{how}: {took:.1f} s from the driver's end to nothing left")
        assert not [pid for pid in pids if _alive(pid)], "processes left behind"
        assert not leftovers(address), "processes left behind"
        assert not os.path.exists(folder), "the folder (logs, key) left in /tmp"
        assert took <= STOP_BOUND
    finally:  # never leave them running, even when the test fails
        driver.kill()
        _kill([*pids, *(p.pid for p in leftovers(address))])
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(2, start_timeout=120) as running:
        yield running
    assert not leftovers(running.address)
    assert not running._logs.exists()


def _addresses(workers):
    """Every Dask address: the scheduler's, each worker's and each nanny's."""
    info = workers.client.scheduler_info()["workers"]
    return [workers.address, *info, *(w["nanny"] for w in info.values())]


def _pids(workers):
    pids = {p.pid for p in workers.processes} | set(workers.worker_pids().values())
    for pid in list(pids):
        pids |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
    return pids


async def _try_plain_tcp(address):
    from distributed.comm import connect

    comm = await connect(address, timeout=3)
    try:  # a real exchange: the handshake went through, now a call
        await comm.write({"op": "identity"})
        return await asyncio.wait_for(comm.read(), 3)
    finally:
        await comm.close()


def test_a_client_without_the_key_is_refused(workers):
    from distributed import Client, Security

    addresses = _addresses(workers)
    assert len(addresses) == 5 and all(a.startswith("tls://") for a in addresses)
    started = time.monotonic()
    for address in addresses:  # the scheduler, the workers, the nannies
        with pytest.raises(Exception):  # noqa: B017 - refused, whichever way
            asyncio.run(_try_plain_tcp(address.replace("tls://", "tcp://")))
    # A Client whose start failed is closed by its __del__ when collected;
    # collected inside the next Client's start (in its new loop thread), it
    # waits for the lock that start holds (distributed.utils.LoopRunner._lock,
    # one for the class): a deadlock. So each is collected here, at once.
    with pytest.raises(Exception):  # noqa: B017
        Client(workers.address.replace("tls://", "tcp://"), timeout=3)
    gc.collect()
    with pytest.raises(Exception):  # noqa: B017 - TLS, but no certificate
        Client(workers.address, timeout=3)
    gc.collect()
    with pytest.raises(Exception):  # noqa: B017 - a key of one's own
        Client(workers.address, security=Security.temporary(), timeout=3)
    gc.collect()
    assert time.monotonic() - started < 60
    with Client(workers.address, security=workers.security, timeout=30) as second:
        pids = second.run(os.getpid)
    assert sorted(pids.values()) == sorted(workers.worker_pids().values())


def test_every_process_listens_on_loopback_only_and_serves_no_dashboard(workers):
    pids = _pids(workers)
    listening = [
        c
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]
    ports = {int(a.rsplit(":", 1)[1]) for a in _addresses(workers)}
    assert ports <= {c.laddr.port for c in listening}
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}
    # Dask always serves HTTP too (scheduler, workers): /health, nothing more
    for connection in listening:
        for page in ("/status", "/info/main/workers.html", "/json/identity.json"):
            url = f"http://127.0.0.1:{connection.laddr.port}{page}"
            try:
                with urllib.request.urlopen(url, timeout=3) as answer:
                    status = answer.status
            except urllib.error.HTTPError as error:
                status = error.code
            except OSError:  # a TLS port: no HTTP
                continue
            assert status == 404, f"{url} answers {status}: a dashboard"


def _status(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_dashboard_on_request_on_loopback_without_logs_or_call_stacks():
    """Issue 37: dashboard=True opens Dask's dashboard on 127.0.0.1; the
    scheduler's logs, call stacks and identity stay off."""
    with LocalWorkers(1, dashboard=True, start_timeout=120) as running:
        link = running.dashboard_link
        assert link.startswith("http://127.0.0.1:") and link.endswith("/status")
        assert running.client.dashboard_link == link
        assert _status(link) == 200
        root = link.rsplit("/", 1)[0]
        for page in ("/info/main/workers.html", "/json/identity.json"):
            assert _status(root + page) == 404, page
        port = int(link.split(":")[2].split("/")[0])
        scheduler = next(p for p in running.processes if p.name == "scheduler")
        served = [
            c.laddr.ip
            for c in psutil.Process(scheduler.pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        assert served == ["127.0.0.1"]


def test_a_dashboard_without_bokeh_is_refused_before_any_process(tmp_path):
    python = tmp_path / "python"  # an interpreter that cannot import bokeh
    python.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'raise ImportError' \"$@\"\n"
    )
    python.chmod(0o755)
    with pytest.raises(ImportError, match="pip install bokeh"):
        LocalWorkers(1, dashboard=True, python=str(python))


def test_the_scheduler_and_nannies_never_load_tensorflow(workers):
    """The scheduler loads parent_watch.py as a file, not the jacutil package
    (which imports TensorFlow, ~780 MB)."""
    for process in workers.processes:  # the scheduler and the nannies
        maps = Path(f"/proc/{process.pid}/maps").read_text()
        assert "tensorflow" not in maps, f"{process.name} loaded TensorFlow"


def test_a_worker_does_not_inherit_the_pipe_number(workers):
    """The nanny's watchdog takes JACUTIL_PARENT_FD out of its environment
    before it starts its worker, where that number is some other file."""
    for pid in workers.worker_pids().values():
        assert "JACUTIL_PARENT_FD" not in psutil.Process(pid).environ()


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    """parent_watch.py alone (as Dask loads it: a file, by path): the driver's
    end of the pipe closes, SIGTERM is ignored, SIGKILL follows GRACE seconds
    later, and the folder is removed."""
    from jacutil.scale import parent_watch, workers

    read_end, write_end = os.pipe()
    folder = tmp_path / "logs"
    folder.mkdir()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import runpy, signal, sys, time;"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            "runpy.run_path(sys.argv[1]);"
            "print('watching', flush=True); time.sleep(60)",
            workers.PARENT_WATCH,
        ],
        env={
            **os.environ,
            workers.FD_VARIABLE: str(read_end),
            workers.FOLDER_VARIABLE: str(folder),
        },
        pass_fds=(read_end,),
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    os.close(read_end)
    try:
        assert child.stdout.readline() == b"watching\n"
        os.close(write_end)
        ended = time.monotonic()
        child.wait(parent_watch.GRACE + 10)
        took = time.monotonic() - ended
        assert child.returncode == -signal.SIGKILL
        assert parent_watch.GRACE <= took <= STOP_BOUND
        assert not folder.exists()
    finally:
        child.kill()


def test_a_dead_owners_folder_is_removed_at_the_next_start():
    """Issue 37: a run killed with all its processes left its folder for good,
    and make test's last check then failed on a machine where one once died.
    The next LocalWorkers or pool removes folders left before its process
    started; one left since stays, for that check to see (leftover_folders
    with ``since``: only this run's)."""
    import tempfile

    from jacutil.scale.executors import ProcessExecutor
    from jacutil.scale.workers import leftover_folders

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    assert not psutil.pid_exists(pid)
    temp = Path(tempfile.gettempdir())
    old = temp / f"jacutil-workers-{pid}-killedlongago"
    new = temp / f"jacutil-pool-{pid}-killedjustnow"
    try:
        for folder in (old, new):
            folder.mkdir()
            (folder / "scheduler.log").write_text("...")
        an_hour_ago = psutil.Process().create_time() - 3600
        os.utime(old, (an_hour_ago, an_hour_ago))
        assert {old, new} <= set(leftover_folders())
        assert old not in leftover_folders(since=an_hour_ago + 60)
        with ProcessExecutor(1):
            pass
        assert not old.exists()
        assert new in leftover_folders()
    finally:
        for folder in (old, new):
            shutil.rmtree(folder, ignore_errors=True)
