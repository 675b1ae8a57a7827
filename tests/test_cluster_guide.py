"""docs/cluster.md, run as a cluster user copies it.

The guide's blocks marked ```bash credentials, ```bash scheduler and
```bash worker run with bash exactly as written, each in its own session,
with the guide's variables set: SCHEDULER_HOST and WORKER_HOST a loopback
address other than 127.0.0.1 where the system has one (127.0.0.2 on Linux)
standing in for the cluster's private interface, PORT a free port, CREDS a
temporary folder. The scheduler runs where jacutil cannot be imported, as on
a machine with dask[distributed] only. The guide's ```python driver block
connects; then the cluster must listen on that address only (each HTTP server
on 127.0.0.1, with no dashboard), refuse whoever lacks the certificate, run
one thread per worker, compute the Jacobian of one process bit for bit, and
stop, with every process, when the guide's ```python stop block runs.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest

import jacutil as ju
from jacutil.scale.executors import WorkerMismatchError

pytestmark = pytest.mark.xdist_group("dask")  # processes of its own: one at a time

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "cluster.md"
START_TIMEOUT = 90  # seconds for the scheduler, then for its worker
MARKER = "JACUTIL_CLUSTER_GUIDE_TEST"  # in the environment of every process run


def guide_block(text, info):
    """The body of the one fenced block of the guide whose info string is
    ``info`` (``"bash scheduler"``)."""
    pattern = rf"^```{re.escape(info)}[ \t]*\n(.*?)^```[ \t]*$"
    found = re.findall(pattern, text, re.MULTILINE | re.DOTALL)
    assert len(found) == 1, (
        f"{GUIDE.name} must have exactly one block fenced ```{info}; "
        f"it has {len(found)}"
    )
    return found[0]


def private_host():
    """A loopback address that is not 127.0.0.1, if this system has one, so
    that the guide's --host is told apart from its 127.0.0.1 dashboards."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.2", 0))
        except OSError:
            return "127.0.0.1"
    return "127.0.0.2"


def free_port(host):
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def host_port(address):
    """``("127.0.0.2", 8786)`` from ``"tls://127.0.0.2:8786"``."""
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    return host.strip("[]"), int(port)


class Started:
    """The guide's commands, each run with bash in its own session."""

    def __init__(self, folder, env):
        self.folder, self.env, self.processes = folder, env, []

    def start(self, name, script, env=None):
        with open(self.folder / f"{name}.log", "wb") as log:
            process = subprocess.Popen(
                ["bash", "-c", script],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env or self.env,
                start_new_session=True,
            )
        process.name = name
        self.processes.append(process)
        return process

    def logs(self):
        return "\n".join(
            f"--- {p.name}.log (last lines):\n"
            + "\n".join(
                (self.folder / f"{p.name}.log")
                .read_text(errors="replace")
                .splitlines()[-15:]
            )
            for p in self.processes
        )

    def check_alive(self, what, deadline):
        for process in self.processes:
            if process.poll() is not None:
                pytest.fail(
                    f"{process.name} exited with code {process.returncode} while "
                    f"waiting for {what}.\n{self.logs()}"
                )
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {START_TIMEOUT} s.\n{self.logs()}")

    def pids(self):
        """Every live process of the started sessions: its group's members,
        their descendants, and any process with the test's marker."""
        groups = {p.pid for p in self.processes}
        found = set()
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) in groups:
                    found.add(proc.pid)
                elif proc.environ().get(MARKER) == self.env[MARKER]:
                    found.add(proc.pid)
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        for pid in list(found) + [p.pid for p in self.processes]:
            try:
                found |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
            except psutil.Error:
                continue
        return {pid for pid in found if _alive(pid)}

    def stop(self):
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            for process in self.processes:
                try:
                    os.killpg(process.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            left = self.pids()
            for pid in left:  # those that left the group too
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            if not _wait_gone(self, grace):
                continue
            break
        for process in self.processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                pass


def without_jacutil(env, folder):
    """``env`` for a machine without jacutil (the guide's scheduler): a
    ``jacutil`` ahead of the installed one on PYTHONPATH that fails to import."""
    shadow = folder / "no-jacutil" / "jacutil"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ImportError('jacutil is not installed on the scheduler "
        "(tests/test_cluster_guide.py): it needs only dask[distributed]')\n"
    )
    path = [str(shadow.parent), env.get("PYTHONPATH", "")]
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, path))}


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(started, seconds):
    deadline = time.monotonic() + seconds
    while started.pids():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _listening(pids):
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    }


def _http(host, port, path):
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, ""


def _refused(address, **kwargs):
    from distributed import Client

    try:
        client = Client(address, timeout=5, **kwargs)
    except (OSError, TypeError) as error:  # no connection, or no TLS at all
        return error
    client.close()
    pytest.fail(f"a client connected to {address} with {kwargs or 'no security'}")


def test_the_guides_cluster(monkeypatch):
    from distributed import Security

    text = GUIDE.read_text()
    blocks = {
        name: guide_block(text, info)
        for name, info in [
            ("credentials", "bash credentials"),
            ("scheduler", "bash scheduler"),
            ("worker", "bash worker"),
            ("driver", "python driver"),
            ("stop", "python stop"),
        ]
    }
    host = private_host()
    folder = Path(tempfile.mkdtemp(prefix="jacutil-cluster-guide-"))
    creds = folder / "creds"
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        "SCHEDULER_HOST": host,
        "WORKER_HOST": host,
        "PORT": str(free_port(host)),
        "CREDS": str(creds),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        MARKER: str(folder),
    }
    for name in ("SCHEDULER_HOST", "PORT", "CREDS"):  # the driver's environment
        monkeypatch.setenv(name, env[name])
    started = Started(folder, env)
    client = None
    try:
        made = subprocess.run(
            ["bash", "-c", blocks["credentials"]],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stdout + made.stderr
        assert creds.stat().st_mode & 0o777 == 0o700
        for name in ("ca.pem", "cert.pem", "key.pem"):
            assert (creds / name).stat().st_mode & 0o777 == 0o600, name

        deadline = time.monotonic() + START_TIMEOUT
        started.start("scheduler", blocks["scheduler"], without_jacutil(env, folder))
        while True:  # its port taken: it is listening
            try:
                socket.create_connection((host, int(env["PORT"])), 1).close()
                break
            except OSError:
                started.check_alive("scheduler", deadline)
                time.sleep(0.2)
        deadline = time.monotonic() + START_TIMEOUT
        started.start("worker", blocks["worker"])
        namespace = {}
        exec(blocks["driver"], namespace)  # noqa: S102 - the guide's own lines
        client = namespace["client"]
        while not 1 <= len(client.scheduler_info()["workers"]) <= 2:
            started.check_alive("worker", deadline)
            time.sleep(0.2)
        info = client.scheduler_info()
        workers = info["workers"]

        # Listening: the comm ports on --host, HTTP servers on 127.0.0.1 only.
        comm = {host_port(info["address"])}
        comm |= {host_port(address) for address in workers}
        comm |= {host_port(w["nanny"]) for w in workers.values() if w.get("nanny")}
        assert len(comm) == 1 + 2 * len(workers), comm  # a nanny per worker
        assert {ip for ip, _ in comm} == {host}
        listening = _listening(started.pids())
        http = listening - comm
        assert comm <= listening, (comm, listening)
        assert {ip for ip, _ in http} <= {"127.0.0.1"}, (
            f"an HTTP server listens beyond loopback: {sorted(http)}"
        )
        for ip, port in http:  # Dask's health and metrics; no dashboard
            assert _http(ip, port, "/health") == (200, "ok"), (ip, port)
            assert _http(ip, port, "/status")[0] == 404, (ip, port)
            for internal in ("/json/identity.json", "/info/main/workers.html"):
                assert _http(ip, port, internal)[0] == 404, (ip, port, internal)

        # Without the certificate: refused.
        _refused(f"tcp://{host}:{env['PORT']}")
        _refused(f"tls://{host}:{env['PORT']}")
        _refused(f"tls://{host}:{env['PORT']}", security=Security.temporary())

        # One thread per worker; TensorFlow's threads are the machine's cores.
        assert {w["nthreads"] for w in workers.values()} == {1}
        nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout
        threads = client.run(os.getenv, "TF_NUM_INTRAOP_THREADS")  # on each
        assert set(threads.values()) == {nproc.strip()}

        model = ju.question_mlp(seed=2)
        x = ju.regression_data(64, seed=4)[0]
        J = ju.distributed_jacobian(model, x, client, chunk_size=8, progress=False)
        one = ju.chunked_jacobian(
            model, x, chunk_size=8, method="rules", progress=False
        )
        np.testing.assert_array_equal(J, one)

        # A worker that cannot import jacutil joins: the next run is refused
        # before any chunk is sent, naming that worker (issue 37).
        before = set(client.scheduler_info()["workers"])
        deadline = time.monotonic() + START_TIMEOUT
        started.start("worker-without-jacutil", blocks["worker"],
                      without_jacutil(env, folder / "second"))  # fmt: skip
        while not set(client.scheduler_info()["workers"]) - before:
            started.check_alive("the second worker", deadline)
            time.sleep(0.2)
        (newcomer,) = set(client.scheduler_info()["workers"]) - before
        with pytest.raises(WorkerMismatchError) as refused:
            ju.distributed_jacobian(model, x, client, chunk_size=8, progress=False)
        assert f"{newcomer}: cannot import them (ImportError" in str(refused.value)
        assert re.search(r"\b1 of \d+ workers", str(refused.value)), refused.value

        # The guide's stop: every process goes.
        exec(blocks["stop"], {"client": client})  # noqa: S102
        assert _wait_gone(started, 30), (
            f"left running after client.shutdown(): {sorted(started.pids())}\n"
            f"{started.logs()}"
        )
    finally:
        if client is not None:
            try:
                client.close(timeout=5)
            except Exception:  # noqa: BLE001 - closing: the processes go anyway
                pass
        started.stop()
        left = started.pids()
        shutil.rmtree(folder, ignore_errors=True)
    assert not left, f"processes left behind: {sorted(left)}"
