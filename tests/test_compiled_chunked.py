"""The compiled stage does not retrace; the chunked stage writes where it is told."""

import numpy as np

import jacutil as ju
from jacutil.engine.compiled import compiled_for


def test_new_batch_size_does_not_retrace():
    model = ju.question_mlp()
    jac = ju.compiled_jacobian(model)
    for n_samples in (1, 3, 7, 20):
        assert jac(ju.regression_data(n_samples)[0]).shape == (n_samples, 2, 2850)
    assert jac.trace_count == 1


def test_xla_compiles_few_shapes():
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    jac = ju.compiled_jacobian(model, jit_compile=True, block_size=8)
    for n_samples in range(1, 21):
        jac(np.ones((n_samples, 3)))
    assert jac.compiled_shapes == {2, 4, 8}  # one sample runs as two
    assert jac.trace_count == 1


def test_set_flat_params_is_seen_without_retracing():
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    x = np.random.default_rng(1).standard_normal((5, 3))
    jac = ju.compiled_jacobian(model)
    before = jac(x)
    ju.set_flat_params(model, 2 * ju.flat_params(model))
    after = jac(x)
    np.testing.assert_allclose(
        after, ju.per_sample_jacobian(model, x), rtol=1e-5, atol=1e-6
    )
    assert not np.allclose(before, after)
    assert jac.trace_count == 1


def test_chunked_reuses_one_compiled_function():
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    for n_samples in (4, 9, 13):
        ju.chunked_jacobian(
            model, np.ones((n_samples, 3)), chunk_size=3, progress=False
        )
    jac = compiled_for(model, None, False, False, "per_sample")
    assert jac.trace_count == 1


def test_chunked_xla_pads_the_last_chunk():
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    x = np.random.default_rng(2).standard_normal((10, 3))
    J = ju.chunked_jacobian(model, x, chunk_size=4, progress=False, jit_compile=True)
    np.testing.assert_allclose(
        J, ju.per_sample_jacobian(model, x), rtol=1e-5, atol=1e-6
    )
    # chunks of 4, 4 and 2: the short last chunk is padded to 2, not to 4
    jac = compiled_for(model, None, False, True, "per_sample")
    assert jac.compiled_shapes == {2, 4}


def test_chunk_size_from_memory_budget():
    n_outputs, n_params = 2, 2850
    per_sample = ju.core.planner.bytes_per_sample(n_outputs, n_params, 4)
    assert ju.chunk_size_for(10 * per_sample, n_outputs, n_params, 4) == 10
    assert ju.chunk_size_for(10 * per_sample - 1, n_outputs, n_params, 4) == 9


def test_chunked_into_memmap(tmp_path):
    model = ju.question_mlp()
    x, _ = ju.regression_data(50)
    path = tmp_path / "jacobian.npy"
    out = np.lib.format.open_memmap(
        path, mode="w+", dtype="float32", shape=(50, 2, 2850)
    )
    per_sample = ju.core.planner.bytes_per_sample(2, 2850, 4)
    result = ju.chunked_jacobian(
        model, x, memory_budget=16 * per_sample, out=out, progress=False
    )
    assert result is out
    out.flush()
    del out, result
    np.testing.assert_allclose(
        np.load(path), ju.per_sample_jacobian(model, x), rtol=1e-5, atol=1e-6
    )
