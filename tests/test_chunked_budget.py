"""chunked_jacobian: no extra forward pass, one chunk without a copy, bounded memory."""

import numpy as np
import pytest

import jacutil as ju
from jacutil.core.memory import peak_memory


def counting_mlp():
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    calls = []

    def f(x):
        calls.append(1)  # runs eagerly, or once per trace
        return model(x, training=False)

    return model, f, calls


@pytest.mark.parametrize("size", [{"chunk_size": 3}, {"memory_budget": 2**20}])
def test_a_second_call_runs_no_eager_forward_pass(size):
    model, f, calls = counting_mlp()
    x = np.random.default_rng(0).standard_normal((10, 3))
    variables = model.trainable_variables
    kw = dict(variables=variables, progress=False, **size)
    first = ju.chunked_jacobian(f, x, **kw)
    calls.clear()
    second = ju.chunked_jacobian(f, x, **kw)
    assert calls == []  # traced once, already; no forward pass to count outputs
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(
        second, ju.per_sample_jacobian(model, x), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("chunk_size", [1, 4, 10, 50])
def test_any_chunk_size_gives_the_same_jacobian(chunk_size):
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    x = np.random.default_rng(1).standard_normal((10, 3))
    J = ju.chunked_jacobian(model, x, chunk_size=chunk_size, progress=False)
    assert J.shape == (10, 2, 26)
    np.testing.assert_allclose(
        J, ju.per_sample_jacobian(model, x), rtol=1e-5, atol=1e-6
    )


def test_one_chunk_into_a_given_out_fills_it():
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    x = np.random.default_rng(2).standard_normal((5, 3))
    out = np.full((5, 2, 26), np.nan, "float32")
    result = ju.chunked_jacobian(model, x, chunk_size=8, out=out, progress=False)
    assert result is out
    np.testing.assert_allclose(
        out, ju.per_sample_jacobian(model, x), rtol=1e-5, atol=1e-6
    )


def test_chunk_size_fits_the_measured_working_memory():
    per_sample = ju.core.planner.bytes_per_sample(2, 2850, 4)
    assert per_sample == ju.core.planner.WORKING_MEMORY_FACTOR * 2 * 2850 * 4
    chunk = ju.chunk_size_for(2**26, 2, 2850, 4)
    assert chunk * per_sample <= 2**26 < (chunk + 1) * per_sample


def test_memory_stays_near_the_budget(tmp_path):
    """A 228 MB Jacobian into a memory-mapped file, with a 32 MiB budget."""
    model = ju.question_mlp()
    x, _ = ju.regression_data(10_000)
    budget = 32 * 2**20
    ju.chunked_jacobian(model, x[:10], memory_budget=budget, progress=False)
    out = np.lib.format.open_memmap(
        tmp_path / "J.npy", mode="w+", dtype="float32", shape=(10_000, 2, 2850)
    )
    use = peak_memory(
        ju.chunked_jacobian, model, x, memory_budget=budget, out=out, progress=False
    )
    assert use.result is out
    assert out.nbytes > 200 * 2**20
    assert use.peak < 2 * budget
    np.testing.assert_allclose(
        out[-7:], ju.per_sample_jacobian(model, x[-7:]), rtol=1e-5, atol=1e-6
    )


# Run in a fresh process: TensorFlow keeps memory it grew pooled, so a peak
# measured after other tests would hide what this call needs.
PROBE = """
import json, sys, tempfile
import numpy as np
import jacutil as ju
from jacutil import keras
from jacutil.core.memory import peak_memory

kind, method, n, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
keras.utils.set_random_seed(0)
if kind == "cnn":
    model = keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Conv2D(8, 3, activation="tanh"),
        keras.layers.Flatten(),
        keras.layers.Dense(4),
    ])
    x = np.random.default_rng(0).standard_normal((n, 12, 12, 1)).astype("float32")
else:
    model = ju.question_mlp()
    x = ju.regression_data(n)[0]
options = dict(memory_budget=budget, method=method, progress=False)
ju.chunked_jacobian(model, x[:3], **options)  # the trace, outside the measure
shape = (n, *ju.chunked_jacobian(model, x[:1], **options).shape[1:])
folder = tempfile.TemporaryDirectory()
out = np.lib.format.open_memmap(
    folder.name + "/J.npy", mode="w+", dtype="float32", shape=shape
)
use = peak_memory(ju.chunked_jacobian, model, x, out=out, **options)
print(json.dumps({"peak": use.peak, "result": out.nbytes}))
"""


def _peak_in_fresh_process(kind, method, n, budget):
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", PROBE, kind, method, str(n), str(budget)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "kind, method, n, budget",
    [
        ("cnn", "per_sample", 4000, 16 * 2**20),  # activations dominate l * m
        ("mlp", "batch", 6000, 64 * 2**20),  # memory grows with chunk**2
    ],
)
def test_the_budget_holds_where_activations_dominate(kind, method, n, budget):
    measured = _peak_in_fresh_process(kind, method, n, budget)
    assert measured["result"] > 2 * budget  # the result itself does not fit
    assert measured["peak"] < 1.25 * budget, measured


def test_the_default_budget_of_the_batch_method_fits_its_own_model():
    """Sized like the per-sample method, it asked for ~10 GiB (notebook 02's model)."""
    model = ju.question_mlp()
    jac = ju.engine.compiled.compiled_for(model, None, False, False, "batch")
    x = ju.core.batch.as_batch(ju.regression_data(3)[0], jac.target)
    budget = ju.core.planner.SMALL_BYTES  # the least the default budget is
    chunk = ju.chunk_size_for(
        budget,
        2,
        2850,
        4,
        activations=jac.activation_elements(x),
        method="batch",
    )
    predicted = ju.core.memory.predicted_bytes(chunk, "batch")
    assert 100 < chunk and predicted < budget
