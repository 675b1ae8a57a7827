"""Every stage, on every model of the zoo, equals float64 central differences.

The zoo (tests/architectures.py) holds the models users bring: recurrent,
convolutional, attention, several heads and inputs, Embedding, subclassed,
a layer used twice, explicit non-trainable variables. The reference itself is
checked against a Jacobian written by hand.
"""

import json
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import jacutil as ju
from tests.architectures import ARCHITECTURES, build


def chunked(model, x, **kw):
    return ju.chunked_jacobian(model, x, chunk_size=2, progress=False, **kw)


def chunked_xla(model, x, **kw):
    return ju.chunked_jacobian(
        model, x, chunk_size=3, progress=False, jit_compile=True, **kw
    )


def chunked_resumable(model, x, **kw):
    """Into a .npy with its ledger; then chunk 1 lost (NaN, unrecorded) and resumed."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "J.npy"
        run = partial(
            ju.chunked_jacobian, model, x, chunk_size=2, out=path, progress=False,
            key="zoo", **kw,
        )  # fmt: skip
        run()
        lost = np.lib.format.open_memmap(path, mode="r+")
        lost[2:4] = np.nan
        lost.flush()
        ledger = Path(folder) / "J.npy.progress.json"
        state = json.loads(ledger.read_text())
        state["done"] = [[0, 1], [2, state["n_chunks"]]]
        ledger.write_text(json.dumps(state))
        return np.array(run())


def compiled(model, x, **kw):
    return ju.compiled_jacobian(model, **kw)(x)


def compiled_xla(model, x, **kw):
    return ju.compiled_jacobian(model, jit_compile=True, **kw)(x)


def compiled_batch(model, x, **kw):
    return ju.compiled_jacobian(model, method="batch", **kw)(x)


def hand_derived(model, x, **kw):
    return ju.compiled_dense_jacobian(model, **kw)(x)


def rules(model, x, **kw):
    return ju.compiled_jacobian(model, method="rules", **kw)(x)


def entry(model, x, **kw):
    return ju.jacobian(model, x, **kw)


STAGES = {
    "loop": ju.loop_jacobian,
    "vectorized": ju.vectorized_jacobian,
    "per_sample": ju.per_sample_jacobian,
    "compiled": compiled,
    "compiled_xla": compiled_xla,
    "compiled_batch": compiled_batch,
    "chunked": chunked,
    "chunked_xla": chunked_xla,
    "chunked_resumable": chunked_resumable,
    "hand_derived": hand_derived,
    "rules": rules,
    "jacobian": entry,
}


# Each model's tests run in one worker (make test: --dist loadgroup), so that
# its reference and its compiled functions are made once, not once per worker.
@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=pytest.mark.xdist_group(name))
        for name in sorted(ARCHITECTURES)
    ],
)
def problem(request):
    """A zoo case, a batch of 5, and the float64 reference."""
    case = build(request.param)
    x = case.batch(5)
    reference = ju.finite_difference_jacobian(
        case.model64, x, variables=case.variables64
    )
    return case, x, reference


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_float64_stage_equals_finite_differences(problem, stage):
    case, x, reference = problem
    J = STAGES[stage](case.model64, x, variables=case.variables64)
    assert J.dtype == np.float64
    assert J.shape == reference.shape == (5, case.n_outputs, reference.shape[2])
    assert np.abs(reference).max() > 0.1  # the reference is not trivially zero
    np.testing.assert_allclose(J, reference, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "stage", ["per_sample", "compiled_xla", "chunked", "rules", "jacobian"]
)
def test_float32_stage_matches_float64(problem, stage):
    """float32 models (the casts, the dtype of J) on the three main paths."""
    case, x, reference = problem
    J = STAGES[stage](case.model32, x, variables=case.variables32)
    assert J.dtype == np.float32
    np.testing.assert_allclose(J, reference, rtol=1e-4, atol=1e-5)


SINGLE_SAMPLE = [("mlp", stage) for stage in sorted(STAGES)] + [
    ("lstm", "compiled"),  # pfor's unrolled gradient fails on one sample: padded
    ("lstm", "chunked"),
    ("two_inputs_two_heads", "per_sample"),
    ("two_inputs_two_heads", "loop"),
]


@pytest.mark.parametrize("name, stage", SINGLE_SAMPLE)
def test_single_sample(name, stage):
    case = build(name)
    x = case.batch(1)
    expected = ju.finite_difference_jacobian(
        case.model64, x, variables=case.variables64
    )
    J = STAGES[stage](case.model64, x, variables=case.variables64)
    np.testing.assert_allclose(J, expected, rtol=1e-6, atol=1e-8)


def test_reference_equals_a_jacobian_written_by_hand():
    """f(x) = x W + b: d f_k / d W[p, q] = x_p [k = q] and d f_k / d b[q] = [k = q]."""
    rng = np.random.default_rng(0)
    W = ju.tf.Variable(rng.standard_normal((3, 2)))
    b = ju.tf.Variable(rng.standard_normal(2))
    x = rng.standard_normal((4, 3))
    J = ju.finite_difference_jacobian(
        lambda x: ju.tf.matmul(x, W) + b, x, variables=[W, b]
    )
    by_hand = np.zeros((4, 2, 3 * 2 + 2))
    for i in range(4):
        for k in range(2):
            for p in range(3):
                by_hand[i, k, p * 2 + k] = x[i, p]  # W[p, k], row-major
            by_hand[i, k, 6 + k] = 1.0  # b[k]
    np.testing.assert_allclose(J, by_hand, rtol=1e-9, atol=1e-9)


def test_question_network_stages_agree():
    """The question's own network, 2,850 parameters: all stages give one answer."""
    model = ju.question_mlp()
    x, _ = ju.regression_data(6)
    expected = ju.loop_jacobian(model, x)
    assert expected.shape == (6, 2, 2850)
    for name, stage in STAGES.items():
        np.testing.assert_allclose(
            stage(model, x), expected, rtol=1e-5, atol=1e-6, err_msg=name
        )


def test_columns_follow_flat_params_order():
    """Bumping theta[p] through set_flat_params moves the outputs by J[:, :, p]."""
    model = build("mlp").model64
    x = build("mlp").batch(4)
    J = ju.per_sample_jacobian(model, x)
    theta = ju.flat_params(model)
    step = 1e-6
    for p in (0, 7, len(theta) // 2, len(theta) - 1):
        outputs = []
        for sign in (1, -1):
            bumped = theta.copy()
            bumped[p] += sign * step
            ju.set_flat_params(model, bumped)
            outputs.append(model(x).numpy())
        ju.set_flat_params(model, theta)
        np.testing.assert_allclose(
            J[:, :, p], (outputs[0] - outputs[1]) / (2 * step), rtol=1e-6, atol=1e-8
        )


def test_frozen_layer_is_not_a_column():
    model32 = build("frozen_layer").model32
    n_params = sum(int(np.prod(v.shape)) for v in model32.trainable_variables)
    # BatchNorm's gamma and beta (12) and the last Dense (14); the frozen Dense is out.
    assert n_params == 12 + 14
