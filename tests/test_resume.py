"""Resumable out-of-core runs: killed part-way, resumed, equal bit for bit."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jacutil as ju
import jacutil.engine.rows
from jacutil import tf
from jacutil.core import resume
from jacutil.core.resume import (
    LEDGER_SUFFIX,
    LOCK_SUFFIX,
    FileBusy,
    ResumeMismatch,
    finished_chunks,
)
from jacutil.teaching.drills import kill_part_way

N, CHUNK = 4000, 20  # 200 chunks: long enough to be killed part-way

RUN_ROWS = """
import jacutil as ju
x, _ = ju.regression_data({n}, seed=3)
ju.chunked_jacobian(ju.question_mlp(seed=1), x, chunk_size={chunk}, out={path!r},
                    progress=False)
"""

RUN_SUMS = """
import jacutil as ju
x, y = ju.regression_data({n}, seed=3)
model = ju.question_mlp(seed=1, hidden=(16,))
problem = ju.least_squares_problem(model, x, y, chunk_size={chunk})
problem.normal_equations(problem.theta0, checkpoint={path!r})
"""


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    path = tmp_path / "J.npy"
    done = kill_part_way(
        RUN_ROWS.format(n=N, chunk=CHUNK, path=str(path)),
        lambda: finished_chunks(path)[0],
        at_least=3,
    )
    n_chunks = N // CHUNK
    assert 3 <= done < n_chunks, "the run was not killed part-way"
    computed = []
    real = jacutil.engine.rows.chunk_rows
    monkeypatch.setattr(
        jacutil.engine.rows,
        "chunk_rows",
        lambda jac, x, c, start: computed.append(start) or real(jac, x, c, start),
    )
    model, (x, _) = ju.question_mlp(seed=1), ju.regression_data(N, seed=3)
    resumed = ju.chunked_jacobian(model, x, out=path, progress=False)
    assert len(computed) == n_chunks - done  # the finished chunks were skipped
    monkeypatch.undo()
    whole = ju.chunked_jacobian(model, x, chunk_size=CHUNK, progress=False)
    assert np.array_equal(resumed, whole)
    assert isinstance(resumed, np.memmap) and not resumed.flags.writeable
    # called again, a finished file is returned as it is
    again = ju.chunked_jacobian(model, x, chunk_size=CHUNK, out=path, progress=False)
    assert np.array_equal(again, whole)


def test_changed_weights_or_inputs_are_refused(tmp_path):
    model, (x, _) = ju.question_mlp(seed=1), ju.regression_data(50, seed=3)
    path = tmp_path / "J.npy"
    ju.chunked_jacobian(model, x, chunk_size=10, out=path, progress=False)
    before, weights = np.load(path).copy(), model.get_weights()
    model.layers[0].kernel.assign(model.layers[0].kernel + 1e-3)
    with pytest.raises(ResumeMismatch, match="other model weights, inputs x"):
        ju.chunked_jacobian(model, x, chunk_size=10, out=path, progress=False)
    model.set_weights(weights)
    x2 = x.copy()
    x2[7, 0] += 1
    with pytest.raises(ResumeMismatch, match="delete J.npy and J.npy.progress"):
        ju.chunked_jacobian(model, x2, chunk_size=10, out=path, progress=False)
    with pytest.raises(ResumeMismatch, match="chunk_size=10"):
        ju.chunked_jacobian(model, x, chunk_size=5, out=path, progress=False)
    with pytest.raises(ResumeMismatch, match="options"):
        ju.chunked_jacobian(model, x, out=path, method="batch", progress=False)
    assert np.array_equal(np.load(path), before)  # never mixed, never touched


def test_a_file_without_ledger_is_not_overwritten(tmp_path):
    path = tmp_path / "J.npy"
    np.save(path, np.zeros(3))
    model, (x, _) = ju.question_mlp(seed=1), ju.regression_data(5)
    with pytest.raises(ResumeMismatch, match="not written by a resumable run"):
        ju.chunked_jacobian(model, x, out=path, progress=False)
    assert np.array_equal(np.load(path), np.zeros(3))


def _sums_done(path):
    try:
        with np.load(path) as saved:
            return int(saved["next_chunk"])
    except (FileNotFoundError, ValueError, OSError, KeyError):
        return 0


def test_killed_normal_equations_resume_to_the_same_sums(tmp_path):
    path = tmp_path / "sums.npz"
    done = kill_part_way(
        RUN_SUMS.format(n=N, chunk=CHUNK, path=str(path)),
        lambda: _sums_done(path),
        at_least=3,
    )
    assert 3 <= done < N // CHUNK, "the run was not killed part-way"
    x, y = ju.regression_data(N, seed=3)
    model = ju.question_mlp(seed=1, hidden=(16,))
    problem = ju.least_squares_problem(model, x, y, chunk_size=CHUNK)
    JtJ, Jtr = problem.normal_equations(problem.theta0, checkpoint=path)
    whole_JtJ, whole_Jtr = problem.normal_equations(problem.theta0)
    assert np.array_equal(JtJ, whole_JtJ) and np.array_equal(Jtr, whole_Jtr)
    with pytest.raises(ResumeMismatch, match="different computation"):
        problem.normal_equations(problem.theta0 * 1.01, checkpoint=path)


# --- files you can trust: the lock, the checks, the token ---------------------

HOLD_LOCK = """
import sys, time
from jacutil.core.resume import writer_lock
with writer_lock({path!r}):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_lock_held_by_another_process_is_refused_and_dies_with_it(tmp_path):
    model, (x, _) = ju.question_mlp(seed=1), ju.regression_data(40, seed=3)
    path = tmp_path / "J.npy"
    with subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK.format(path=str(path))],
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdout.readline().strip() == "locked"
            with pytest.raises(FileBusy, match="another run is writing J.npy"):
                ju.chunked_jacobian(model, x, chunk_size=10, out=path, progress=False)
            assert not path.exists()  # refused before anything was written
        finally:
            holder.kill()  # SIGKILL: no clean-up, the lock file stays
    assert (tmp_path / ("J.npy" + LOCK_SUFFIX)).exists()
    J = ju.chunked_jacobian(model, x, chunk_size=10, out=path, progress=False)
    # the same chunks in memory: another chunk size may round differently
    in_memory = ju.chunked_jacobian(model, x, chunk_size=10, progress=False)
    assert np.array_equal(J, in_memory)
    assert not (tmp_path / ("J.npy" + LOCK_SUFFIX)).exists()  # removed after


def test_temporary_files_are_per_process_and_per_call(tmp_path):
    path = tmp_path / "J.npy.progress.json"
    first, second = resume._temporary(path), resume._temporary(path)
    assert first != second and str(os.getpid()) in first.name
    assert first.parent == path.parent
    model, (x, _) = ju.question_mlp(seed=1), ju.regression_data(40, seed=3)
    ju.chunked_jacobian(model, x, chunk_size=10, out=tmp_path / "J.npy", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "J.npy",
        "J.npy.progress.json",
    ]


@pytest.mark.parametrize("change", ["grown", "cut", "other shape"])
def test_a_finished_file_changed_outside_the_run_is_refused(tmp_path, change):
    model, (x, _) = ju.question_mlp(seed=1), ju.regression_data(40, seed=3)
    path = tmp_path / "J.npy"
    J = ju.chunked_jacobian(model, x, chunk_size=10, out=path, progress=False)
    size, shape = path.stat().st_size, J.shape
    del J
    if change == "grown":
        with open(path, "ab") as file:
            file.write(b"\0" * 8)
    elif change == "cut":
        os.truncate(path, size - 4)
    else:  # another array of the same number of bytes
        np.save(path, np.zeros((shape[0] * shape[1], shape[2]), "float32"))
    expected = "header says shape" if change == "other shape" else "bytes"
    with pytest.raises(ResumeMismatch, match=expected) as error:
        ju.chunked_jacobian(model, x, chunk_size=10, out=path, progress=False)
    assert "changed or truncated outside the run" in str(error.value)
    assert "delete J.npy and J.npy.progress.json" in str(error.value)


def test_a_ledger_with_missing_keys_says_what_to_do(tmp_path):
    model, (x, _) = ju.question_mlp(seed=1), ju.regression_data(40, seed=3)
    path = tmp_path / "J.npy"
    ju.chunked_jacobian(model, x, chunk_size=10, out=path, progress=False)
    ledger = tmp_path / ("J.npy" + LEDGER_SUFFIX)
    state = json.loads(ledger.read_text())
    del state["done"]
    ledger.write_text(json.dumps(state))
    with pytest.raises(ResumeMismatch, match="no 'done'(.|\n)*delete J.npy"):
        ju.chunked_jacobian(model, x, chunk_size=10, out=path, progress=False)


def test_a_resumed_run_keeps_its_token_a_new_one_gets_another(tmp_path):
    model, (x, _) = ju.question_mlp(seed=1), ju.regression_data(40, seed=3)
    path, ledger = tmp_path / "J.npy", tmp_path / ("J.npy" + LEDGER_SUFFIX)
    ju.chunked_jacobian(model, x, chunk_size=10, out=path, progress=False)
    state = json.loads(ledger.read_text())
    state["done"] = [[0, 2]]
    ledger.write_text(json.dumps(state))
    ju.chunked_jacobian(model, x, out=path, progress=False)  # resumed
    assert json.loads(ledger.read_text())["token"] == state["token"]
    path.unlink()  # a new file: a new run
    ju.chunked_jacobian(model, x, chunk_size=10, out=path, progress=False)
    assert json.loads(ledger.read_text())["token"] != state["token"]


def test_a_variable_of_no_model_is_known_by_its_value(tmp_path):
    """Not among the model's weights: no position, so its shape and value."""
    w = tf.Variable(np.ones((3, 2)))
    x = np.random.default_rng(1).standard_normal((10, 3))
    path = tmp_path / "J.npy"

    def f(t):
        return tf.tanh(t @ w)

    ju.chunked_jacobian(f, x, out=path, variables=[w], key="f", progress=False)
    w.assign(w * 2)
    with pytest.raises(ResumeMismatch, match="other model weights"):
        ju.chunked_jacobian(f, x, out=path, variables=[w], key="f", progress=False)
    with pytest.raises(ValueError, match="key= names a resumable run"):
        ju.chunked_jacobian(f, x, variables=[w], key="f", progress=False)


def test_a_folder_it_cannot_write_in_is_named_not_the_lock(tmp_path, monkeypatch):
    """Issue 37: a read-only folder gave PermissionError on J.npy.lock, a
    file the user never asked for. (Root writes in any folder, so the refusal
    is made by os.open, as a read-only folder makes it.)"""
    model, x = ju.question_mlp(seed=1), ju.regression_data(20)[0]
    real_open = os.open

    def denied(path, *args, **kwargs):
        if str(path).endswith(LOCK_SUFFIX):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(PermissionError, match="cannot write in .*Choose a folder"):
        ju.chunked_jacobian(model, x, out=tmp_path / "J.npy", progress=False)
