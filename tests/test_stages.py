"""Every stage equals finite differences (float64) and every other stage (float32)."""

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


def compiled(model, x, **kw):
    return ju.compiled_jacobian(model, **kw)(x)


def compiled_xla(model, x, **kw):
    return ju.compiled_jacobian(model, jit_compile=True, **kw)(x)


def compiled_batch(model, x, **kw):
    return ju.compiled_jacobian(model, method="batch", **kw)(x)


STAGES = {
    "loop": ju.loop_jacobian,
    "vectorized": ju.vectorized_jacobian,
    "per_sample": ju.per_sample_jacobian,
    "compiled": compiled,
    "compiled_xla": compiled_xla,
    "compiled_batch": compiled_batch,
    "chunked": chunked,
    "chunked_xla": chunked_xla,
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def problem(request):
    """A model in float32 and float64, a batch, and the float64 reference."""
    model32, model64, batch = build(request.param)
    x = batch(5)
    reference = ju.finite_difference_jacobian(model64, x)
    return model32, model64, x, reference


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_float64_stage_equals_finite_differences(problem, stage):
    _, model64, x, reference = problem
    J = STAGES[stage](model64, x)
    assert J.dtype == np.float64
    assert J.shape == reference.shape
    assert np.abs(reference).max() > 0.1  # the reference is not trivially zero
    np.testing.assert_allclose(J, reference, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_float32_stage_matches_float64(problem, stage):
    model32, _, x, reference = problem
    J = STAGES[stage](model32, x)
    assert J.dtype == np.float32
    np.testing.assert_allclose(J, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_single_sample(stage):
    model32, model64, batch = build("mlp")
    x = batch(1)
    expected = ju.finite_difference_jacobian(model64, x)
    np.testing.assert_allclose(
        STAGES[stage](model64, x), expected, rtol=1e-6, atol=1e-8
    )
    assert STAGES[stage](model32, x).shape == (1, 3, expected.shape[2])


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
    _, model, batch = build("mlp")
    x = batch(4)
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
    model32, _, _ = build("frozen_layer")
    n_params = sum(int(np.prod(v.shape)) for v in model32.trainable_variables)
    # BatchNorm's gamma and beta (12) and the last Dense (14); the frozen Dense is out.
    assert n_params == 12 + 14


def test_training_flag_reaches_the_model():
    model = ju.keras.Sequential(
        [
            ju.keras.Input((3,)),
            ju.keras.layers.Dense(4),
            ju.keras.layers.Dropout(0.5),
            ju.keras.layers.Dense(2),
        ]
    )
    x = np.ones((3, 3), "float32")
    inference = [ju.per_sample_jacobian(model, x) for _ in range(2)]
    np.testing.assert_array_equal(inference[0], inference[1])
    with pytest.warns(ju.guards.TrainingModeWarning):
        training = [ju.vectorized_jacobian(model, x, training=True) for _ in range(2)]
    assert not np.array_equal(training[0], training[1])
