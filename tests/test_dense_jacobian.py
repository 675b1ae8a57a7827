"""The hand-derived Dense Jacobian equals finite differences and the autodiff stages,
and falls back to the autodiff per-sample stage for every other model."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras
from jacutil.rules.dense_jacobian import (
    compiled_dense_jacobian,
    dense_chain,
    dense_jacobian,
)
from tests.architectures import build


def _seeded(make, seed=0):
    """(float32 model, float64 copy with the same weights, a float64 batch)."""
    keras.utils.set_random_seed(seed)
    model32, model64 = make("float32"), make("float64")
    rng = np.random.default_rng(seed)
    weights = [w + 0.3 * rng.standard_normal(w.shape) for w in model32.get_weights()]
    model32.set_weights([w.astype("float32") for w in weights])
    model64.set_weights(weights)
    n_features = model32.inputs[0].shape[1]
    x = rng.standard_normal((5, n_features))
    return model32, model64, x


def deep_tanh(dtype):
    layers = [keras.Input((4,), dtype=dtype)]
    for width, activation in [(7, "tanh"), (5, "sigmoid"), (6, "relu"), (3, None)]:
        layers.append(keras.layers.Dense(width, activation, dtype=dtype))
    return keras.Sequential(layers)


def functional_sigmoid_out(dtype):
    """Functional API, an activation on the last layer, one output."""
    inputs = keras.Input((3,), dtype=dtype)
    hidden = keras.layers.Dense(5, "relu", dtype=dtype)(inputs)
    outputs = keras.layers.Dense(1, "sigmoid", dtype=dtype)(hidden)
    return keras.Model(inputs, outputs)


def frozen_and_no_bias(dtype):
    """A frozen first layer (no columns) and a layer without a bias."""
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(6, "tanh", dtype=dtype, trainable=False),
            keras.layers.Dense(5, "relu", use_bias=False, dtype=dtype),
            keras.layers.Dense(4, dtype=dtype),
        ]
    )


def single_linear(dtype):
    return keras.Sequential(
        [keras.Input((3,), dtype=dtype), keras.layers.Dense(2, dtype=dtype)]
    )


def question_small(dtype):
    return ju.question_mlp(n_inputs=4, n_outputs=3, hidden=(8, 6), dtype=dtype)


DENSE = {
    "question_small": question_small,
    "deep_tanh": deep_tanh,
    "functional_sigmoid_out": functional_sigmoid_out,
    "frozen_and_no_bias": frozen_and_no_bias,
    "single_linear": single_linear,
}


def eager(model, x):
    return dense_jacobian(model, x)


def graph(model, x):
    return compiled_dense_jacobian(model)(x)


def xla(model, x):
    return compiled_dense_jacobian(model, jit_compile=True)(x)


PATHS = {"eager": eager, "graph": graph, "xla": xla}


@pytest.fixture(scope="module", params=sorted(DENSE))
def problem(request):
    model32, model64, x = _seeded(DENSE[request.param])
    assert dense_chain(model64)[0] is not None  # the hand-derived path applies
    return model32, model64, x, ju.finite_difference_jacobian(model64, x)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_float64_equals_finite_differences(problem, path):
    _, model64, x, reference = problem
    J = PATHS[path](model64, x)
    assert J.dtype == np.float64 and J.shape == reference.shape
    assert np.abs(reference).max() > 0.1  # the reference is not trivially zero
    np.testing.assert_allclose(J, reference, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_float32_equals_per_sample_stage(problem, path):
    model32, _, x, reference = problem
    J = PATHS[path](model32, x)
    assert J.dtype == np.float32
    np.testing.assert_allclose(
        J, ju.per_sample_jacobian(model32, x), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(J, reference, rtol=1e-4, atol=1e-5)


def test_frozen_layer_is_not_a_column():
    model, _, x = _seeded(frozen_and_no_bias)
    # 5*6 (no bias) + 5*4 + 4; the frozen 4 -> 6 layer has no columns.
    assert dense_jacobian(model, x).shape == (5, 4, 30 + 24)


def test_question_network_and_one_sample():
    model = ju.question_mlp()
    x, _ = ju.regression_data(7)
    expected = ju.loop_jacobian(model, x)
    jac = compiled_dense_jacobian(model)
    np.testing.assert_allclose(jac(x), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jac(x[:1]), expected[:1], rtol=1e-5, atol=1e-6)
    assert jac.trace_count == 1  # a new n did not retrace
    assert jac.fallback is None


def test_result_is_a_view_unless_copied():
    model = ju.question_mlp()
    x, _ = ju.regression_data(3)
    jac = compiled_dense_jacobian(model)
    assert not jac(x).flags.writeable
    copy = jac(x, copy=True)
    copy[0, 0, 0] = 1.0  # writable
    with pytest.raises(ValueError, match="read-only"):
        jac(x)[0, 0, 0] = 1.0


def test_bias_apart_from_its_kernel_keeps_the_variable_order():
    """A bias frozen on its own: its kernel's columns come without it."""
    model32, model64, x = _seeded(question_small)
    model64.layers[1].bias.trainable = False
    assert dense_chain(model64)[0] is not None
    np.testing.assert_allclose(
        dense_jacobian(model64, x),
        ju.finite_difference_jacobian(model64, x),
        rtol=1e-6,
        atol=1e-8,
    )


def elu_activation(dtype):
    return keras.Sequential(
        [
            keras.Input((3,), dtype=dtype),
            keras.layers.Dense(4, "elu", dtype=dtype),
            keras.layers.Dense(2, dtype=dtype),
        ]
    )


@pytest.mark.parametrize(
    "name, reason",
    [
        ("convolution", "Conv2D"),
        ("frozen_layer", "BatchNormalization"),
        ("matrix_output", "not one flat"),
    ],
)
def test_other_models_fall_back_to_the_per_sample_stage(name, reason):
    case = build(name)
    model32, model64, batch = case.model32, case.model64, case.batch
    chain, why = dense_chain(model64)
    assert chain is None and reason in why
    x = batch(4)
    reference = ju.finite_difference_jacobian(model64, x)
    np.testing.assert_allclose(
        dense_jacobian(model64, x), reference, rtol=1e-6, atol=1e-8
    )
    jac = compiled_dense_jacobian(model32)
    assert reason in jac.fallback
    np.testing.assert_allclose(
        jac(x), ju.per_sample_jacobian(model32, x), rtol=1e-6, atol=1e-7
    )


def test_unknown_activation_falls_back():
    model32, model64, x = _seeded(elu_activation)
    assert "activation" in dense_chain(model64)[1]
    np.testing.assert_allclose(
        dense_jacobian(model64, x),
        ju.finite_difference_jacobian(model64, x),
        rtol=1e-6,
        atol=1e-8,
    )


def test_explicit_variables_fall_back_to_autodiff():
    model = ju.question_mlp()
    x, _ = ju.regression_data(3)
    last = model.layers[-1].trainable_variables
    J = dense_jacobian(model, x, variables=last)
    np.testing.assert_allclose(J, ju.per_sample_jacobian(model, x)[:, :, -66:])
