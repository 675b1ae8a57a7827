"""Resumable out-of-core runs: killed part-way, resumed, equal bit for bit."""

import numpy as np
import pytest

import jacutil as ju
import jacutil.chunked
from jacutil.resume import ResumeMismatch, finished_chunks, kill_part_way

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
    real = jacutil.chunked.chunk_rows
    monkeypatch.setattr(
        jacutil.chunked,
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
