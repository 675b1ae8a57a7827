"""The empirical NTK (jacutil.curvature.ntk) against the formed float64 J J.T."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest

import jacutil as ju
from jacutil.core.resume import (
    FileBusy,
    ResumeMismatch,
    finished_chunks,
    writer_lock,
)
from jacutil.curvature import ntk

sys.path.insert(0, str(Path(__file__).parent))
import architectures  # noqa: E402

# a Dense MLP, a CNN, a residual functional model with LayerNorm, an LSTM,
# two inputs, and a plain callable with explicit variables
NAMES = ["mlp", "convolution", "attention", "lstm", "two_inputs"]
NAMES += ["explicit_nontrainable"]


def _case(name):
    case = architectures.build(name, seed=1)
    return case.model64, case.variables64, case.batch


def _reference(model, variables, x, x2):
    """J(x) J(x2).T from the formed float64 Jacobians, sample-major rows."""
    J = np.asarray(ju.jacobian(model, x, variables=variables), dtype=np.float64)
    J2 = np.asarray(ju.jacobian(model, x2, variables=variables), dtype=np.float64)
    m = J.shape[-1]
    return J.reshape(-1, m) @ J2.reshape(-1, m).T, J


class _Counter:
    """Wraps ntk._jacobian_rows: the number of samples of each J formed."""

    def __init__(self, monkeypatch):
        self.sizes = []
        real = ntk._jacobian_rows

        def counted(model, x, variables, budget):
            J = real(model, x, variables, budget)
            self.sizes.append(J.shape[0])
            return J

        monkeypatch.setattr(ntk, "_jacobian_rows", counted)


def _smallest_budget(function, *args, **options):
    """The smallest budget, read from the error for a budget of 1 byte."""
    with pytest.raises(ValueError, match="too small for even one sample") as error:
        function(*args, memory_budget=1, **options)
    found = re.search(r"Pass memory_budget=([\d,]+)", str(error.value))
    return int(found[1].replace(",", ""))


@pytest.mark.parametrize("name", NAMES)
def test_equals_brute_force_in_chunk_pairs(name, monkeypatch):
    model, variables, batch = _case(name)
    x, x2 = batch(6), batch(4)
    ref, J = _reference(model, variables, x, x2)
    ref_xx, _ = _reference(model, variables, x, x)
    n, n_out = J.shape[:2]

    whole = ntk.empirical_ntk(model, x, x2, variables=variables)
    assert whole.shape == (n * n_out, 4 * n_out)
    np.testing.assert_allclose(whole, ref, rtol=1e-10, atol=1e-12)

    # a budget for about two samples a chunk: several chunk pairs
    budget = 2 * _smallest_budget(ntk.empirical_ntk, model, x, x2, variables=variables)
    counter = _Counter(monkeypatch)
    chunked = ntk.empirical_ntk(model, x, x2, variables=variables, memory_budget=budget)
    np.testing.assert_allclose(chunked, ref, rtol=1e-10, atol=1e-12)
    assert max(counter.sizes) < 4 and len(counter.sizes) >= 4, counter.sizes

    counter.sizes.clear()
    sym = ntk.empirical_ntk(model, x, variables=variables, memory_budget=budget)
    np.testing.assert_allclose(sym, ref_xx, rtol=1e-10, atol=1e-12)
    assert np.array_equal(sym, sym.T)  # exactly symmetric
    assert max(counter.sizes) < 6 and len(counter.sizes) >= 3, counter.sizes


def test_each_chunk_formed_as_the_docstring_says(monkeypatch):
    model, variables, batch = _case("mlp")
    x, x2 = batch(12), batch(9)
    counter = _Counter(monkeypatch)
    # a large budget: all of J(x2) is kept, every J chunk is formed once
    theta = ntk.empirical_ntk(model, x, x2, variables=variables, chunk_size=4)
    # row 0, then the columns (kept), then rows 1 and 2
    assert counter.sizes == [4] + [4, 4, 1] + [4, 4]
    np.testing.assert_allclose(theta, _reference(model, variables, x, x2)[0])
    counter.sizes.clear()
    # x2=None: chunk i of x serves as row and column, formed once
    ntk.empirical_ntk(model, x, variables=variables, chunk_size=4)
    assert counter.sizes == [4, 4, 4]
    counter.sizes.clear()
    # the smallest budget: one sample a chunk, J(x2) not kept: n + n * n2 formed
    smallest = _smallest_budget(
        ntk.empirical_ntk, model, x[:3], x2[:2], variables=variables
    )
    ntk.empirical_ntk(model, x[:3], x2[:2], variables=variables, memory_budget=smallest)
    assert counter.sizes == [1] * (3 + 3 * 2)


def test_symmetric_equals_x2_given_exactly():
    model, variables, batch = _case("convolution")
    x = batch(6)
    one = ntk.empirical_ntk(model, x, variables=variables, chunk_size=4)
    two = ntk.empirical_ntk(model, x, x.copy(), variables=variables, chunk_size=4)
    assert np.array_equal(one, two) and np.array_equal(one, one.T)


def test_out_array_and_npy_path_equal_memory(tmp_path):
    model, variables, batch = _case("convolution")
    x, x2 = batch(6), batch(4)
    in_memory = ntk.empirical_ntk(model, x, x2, variables=variables, chunk_size=2)
    out = np.full(in_memory.shape, np.nan)
    given = ntk.empirical_ntk(model, x, x2, variables=variables, chunk_size=2, out=out)
    assert given is out and np.array_equal(out, in_memory)
    path = tmp_path / "theta.npy"
    on_disk = ntk.empirical_ntk(
        model, x, x2, variables=variables, chunk_size=2, out=path
    )
    assert np.array_equal(on_disk, in_memory) and not on_disk.flags.writeable
    assert finished_chunks(path) == (3, 3)
    sym_path = tmp_path / "sym.npy"
    sym = ntk.empirical_ntk(model, x, variables=variables, chunk_size=4, out=sym_path)
    expected = ntk.empirical_ntk(model, x, variables=variables, chunk_size=4)
    assert np.array_equal(sym, expected)


class _Crash(RuntimeError):
    pass


@pytest.mark.parametrize("symmetric", [False, True])
def test_npy_resumes_after_a_partial_run(tmp_path, monkeypatch, symmetric):
    model, variables, batch = _case("mlp")
    x = batch(10)
    x2 = None if symmetric else batch(7)
    path = tmp_path / "theta.npy"
    rows = []
    real = ntk._block_row

    def crashing(setup, i, *args):
        if len(rows) == 2:
            raise _Crash("the machine was lost")
        rows.append(i)
        return real(setup, i, *args)

    monkeypatch.setattr(ntk, "_block_row", crashing)
    with pytest.raises(_Crash):
        ntk.empirical_ntk(model, x, x2, variables=variables, chunk_size=3, out=path)
    assert finished_chunks(path) == (2, 4)

    rows.clear()
    monkeypatch.setattr(
        ntk, "_block_row", lambda setup, i, *a: rows.append(i) or real(setup, i, *a)
    )
    resumed = ntk.empirical_ntk(model, x, x2, variables=variables, out=path)
    assert rows == [2, 3]  # only the missing block-rows, with the file's chunk size
    with pytest.raises(ResumeMismatch, match="started with chunk_size=3 samples"):
        ntk.empirical_ntk(model, x, x2, variables=variables, chunk_size=2, out=path)
    expected = _reference(model, variables, x, x if x2 is None else x2)[0]
    np.testing.assert_allclose(resumed, expected, rtol=1e-10, atol=1e-12)
    if symmetric:
        assert np.array_equal(resumed, resumed.T)


def test_npy_refuses_another_x_and_a_second_writer(tmp_path):
    model, variables, batch = _case("mlp")
    x, x2 = batch(6), batch(4)
    path = tmp_path / "theta.npy"
    ntk.empirical_ntk(model, x, x2, variables=variables, chunk_size=2, out=path)
    with pytest.raises(ResumeMismatch, match="other model weights, inputs x"):
        ntk.empirical_ntk(model, x + 1e-3, x2, variables=variables, out=path)
    with pytest.raises(ResumeMismatch, match="other model weights, inputs x"):
        ntk.empirical_ntk(model, x, x2 + 1e-3, variables=variables, out=path)
    with pytest.raises(ResumeMismatch):  # Theta(x, x): another shape, another run
        ntk.empirical_ntk(model, x, variables=variables, out=path)
    with writer_lock(path), pytest.raises(FileBusy):
        ntk.empirical_ntk(model, x, x2, variables=variables, out=path)


def test_plain_function_to_a_file_needs_a_key(tmp_path):
    model, variables, batch = _case("explicit_nontrainable")
    x = batch(4)
    with pytest.raises(TypeError, match="needs key="):
        ntk.empirical_ntk(model, x, variables=variables, out=tmp_path / "t.npy")
    theta = ntk.empirical_ntk(
        model, x, variables=variables, out=tmp_path / "t.npy", key="tanh-v1"
    )
    np.testing.assert_allclose(theta, _reference(model, variables, x, x)[0])


@pytest.mark.parametrize("name", ["mlp", "convolution", "lstm", "two_inputs"])
def test_trace_and_diagonal_equal_brute_force(name, monkeypatch):
    model, variables, batch = _case(name)
    x = batch(7)
    J = np.asarray(ju.jacobian(model, x, variables=variables))
    blocks = np.einsum("ikp,ijp->ikj", J, J)
    counter = _Counter(monkeypatch)
    diagonal = ntk.ntk_diagonal(model, x, variables=variables)
    np.testing.assert_allclose(diagonal, blocks, rtol=1e-12, atol=1e-12)
    assert counter.sizes == [7]
    trace = ntk.ntk_trace(model, x, variables=variables)
    np.testing.assert_allclose(trace, np.sum(J**2), rtol=1e-12)

    # a small budget: several chunks, the same result
    budget = 2 * _smallest_budget(ntk.ntk_diagonal, model, x, variables=variables)
    counter.sizes.clear()
    small = ntk.ntk_diagonal(model, x, variables=variables, memory_budget=budget)
    assert len(counter.sizes) > 1
    np.testing.assert_allclose(small, blocks, rtol=1e-12, atol=1e-12)
    small_trace = ntk.ntk_trace(model, x, variables=variables, memory_budget=budget)
    np.testing.assert_allclose(small_trace, trace, rtol=1e-12)
    theta = ntk.empirical_ntk(model, x, variables=variables)
    np.testing.assert_allclose(np.trace(theta), trace, rtol=1e-12)


def test_bad_input_is_refused_with_advice():
    model, variables, batch = _case("lstm")
    x = batch(4)
    with pytest.raises(ValueError, match="x2's samples have shape"):
        ntk.empirical_ntk(model, x, x[:, :3], variables=variables)
    plain, plain_variables, plain_batch = _case("explicit_nontrainable")
    with pytest.raises(ValueError, match=r"x2's samples have shape \(4,\), x's"):
        ntk.empirical_ntk(
            plain, plain_batch(3), np.ones((2, 4)), variables=plain_variables
        )
    n_out = ntk.empirical_ntk(model, x, variables=variables).shape[0] // 4
    shape = (4 * n_out, 4 * n_out)
    with pytest.raises(ValueError, match="this Theta needs"):
        ntk.empirical_ntk(model, x, variables=variables, out=np.empty((4, 4)))
    with pytest.raises(ValueError, match="dtype float64"):
        ntk.empirical_ntk(
            model, x, variables=variables, out=np.empty(shape, np.float32)
        )
    with pytest.raises(ValueError, match="too small for even one sample"):
        ntk.ntk_trace(model, x, variables=variables, memory_budget=100)
    with pytest.raises(ValueError, match="chunk_size must be at least 1"):
        ntk.empirical_ntk(model, x, variables=variables, chunk_size=0)
    with pytest.raises(ValueError, match="key= names a resumable run"):
        ntk.empirical_ntk(model, x, variables=variables, key="k")


def test_float32_model_gives_float32_theta():
    model, (x, _) = ju.question_mlp(), ju.regression_data(30, seed=2)
    theta = ntk.empirical_ntk(model, x, chunk_size=8)
    assert theta.dtype == np.float32 and theta.shape == (60, 60)
    J = np.asarray(ju.jacobian(model, x), dtype=np.float64).reshape(60, -1)
    np.testing.assert_allclose(theta, J @ J.T, rtol=1e-4, atol=1e-4)
