"""The hand-derived Dense path (the layer rules, Dense only) equals finite
differences in float64 and the per-sample stage in float32; every other model,
and one whose rules hold on sample 0 only, falls back to the per-sample stage
with the reason, and its rows are still right."""

import re

import numpy as np
import pytest

import jacutil as ju
import jacutil.stages.dense as dense_module
from jacutil import keras, tf
from jacutil.core.target import resolve_target
from jacutil.rules import rules_tensor
from jacutil.stages.dense import (
    compiled_dense_jacobian,
    dense_jacobian,
    dense_plan,
)
from tests.architectures import build

FLOAT64 = {"rtol": 1e-6, "atol": 1e-8}


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


def deep_mixed(dtype):
    """Four activations the Dense rule knows: by formula, and elu by autodiff."""
    layers = [keras.Input((4,), dtype=dtype)]
    for width, activation in [(7, "tanh"), (5, "sigmoid"), (6, "elu"), (3, "relu")]:
        layers.append(keras.layers.Dense(width, activation, dtype=dtype))
    layers.append(keras.layers.Dense(2, dtype=dtype))
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
    "deep_mixed": deep_mixed,
    "functional_sigmoid_out": functional_sigmoid_out,
    "frozen_and_no_bias": frozen_and_no_bias,
    "single_linear": single_linear,
}


@pytest.fixture
def no_fallback(monkeypatch):
    """The eager path may not fall back to the per-sample stage."""

    def refuse(*args, **kwargs):
        raise AssertionError("dense_jacobian fell back to the per-sample stage")

    monkeypatch.setattr(dense_module, "per_sample_jacobian", refuse)


def eager(model, x):
    return dense_jacobian(model, x)


def graph(model, x):
    jac = compiled_dense_jacobian(model)
    J = jac(x)
    assert jac.fallback is None and jac.plan is not None
    return J


def xla(model, x):
    jac = compiled_dense_jacobian(model, jit_compile=True)
    J = jac(x)
    assert jac.fallback is None and jac.plan is not None
    return J


PATHS = {"eager": eager, "graph": graph, "xla": xla}


@pytest.fixture(scope="module", params=sorted(DENSE))
def problem(request):
    model32, model64, x = _seeded(DENSE[request.param])
    return model32, model64, x, ju.finite_difference_jacobian(model64, x)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_float64_equals_finite_differences(problem, path, no_fallback):
    _, model64, x, reference = problem
    J = PATHS[path](model64, x)
    assert J.dtype == np.float64 and J.shape == reference.shape
    assert np.abs(reference).max() > 0.1  # the reference is not trivially zero
    np.testing.assert_allclose(J, reference, **FLOAT64)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_float32_equals_per_sample_stage(problem, path, no_fallback):
    model32, _, x, reference = problem
    J = PATHS[path](model32, x)
    assert J.dtype == np.float32
    np.testing.assert_allclose(
        J, ju.per_sample_jacobian(model32, x), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(J, reference, rtol=1e-4, atol=1e-5)


def test_every_step_is_the_dense_rule():
    model = ju.question_mlp()
    plan, reason = dense_plan(model, resolve_target(model))
    assert reason is None
    assert [rule for _, rule in plan.layers()] == ["dense+relu", "dense+relu", "dense"]


def test_frozen_layer_is_not_a_column(no_fallback):
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
    np.testing.assert_allclose(jac.tensor(x), expected, rtol=1e-5, atol=1e-6)
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


def test_bias_apart_from_its_kernel_keeps_the_variable_order(no_fallback):
    """A bias frozen on its own: its kernel's columns come without it."""
    _, model64, x = _seeded(question_small)
    model64.layers[1].bias.trainable = False
    np.testing.assert_allclose(
        dense_jacobian(model64, x), ju.finite_difference_jacobian(model64, x), **FLOAT64
    )


def test_explicit_variables_are_columns_of_the_dense_path(no_fallback):
    model = ju.question_mlp(dtype="float64")
    x = ju.regression_data(3, dtype="float64")[0]
    last = model.layers[-1].trainable_variables
    reference = ju.finite_difference_jacobian(model, x)[:, :, -66:]
    np.testing.assert_allclose(dense_jacobian(model, x, variables=last), reference)
    jac = compiled_dense_jacobian(model, variables=last)
    np.testing.assert_allclose(jac(x), reference, **FLOAT64)
    assert jac.fallback is None


# --- a model right on sample 0 only -------------------------------------------


def clipped_hidden_layer():
    """A Dense whose call was replaced on the instance: it clips its output to
    [-0.3, 0.3], which its rule does not know. Sample 0 is near zero, so no unit
    of it is clipped and the rule holds there; the other samples are clipped."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(8, "tanh", dtype="float64"),
            keras.layers.Dense(2, dtype="float64"),
        ]
    )
    hidden = model.layers[0]
    plain_call = hidden.call
    hidden.call = lambda inputs, *args, **kwargs: tf.clip_by_value(
        plain_call(inputs), -0.3, 0.3
    )
    x = np.random.default_rng(0).standard_normal((12, 4)) * 3
    x[0] *= 1e-3
    return model, x


def test_rules_right_on_sample_0_only_fall_back_to_right_rows():
    model, x = clipped_hidden_layer()
    reference = ju.finite_difference_jacobian(model, x)
    # The trap is real: the Dense rules give sample 0 right and the others wrong.
    plan, reason = dense_plan(model, resolve_target(model))
    assert reason is None
    rules = rules_tensor(plan, tf.constant(x)).numpy()
    np.testing.assert_allclose(rules[0], reference[0], **FLOAT64)
    assert not np.allclose(rules[1:], reference[1:], rtol=1e-3, atol=1e-3)

    jac = compiled_dense_jacobian(model)
    assert jac.fallback is None  # before the first call it looks like a chain
    J = jac(x)
    assert "differ from autodiff" in jac.fallback and jac.plan is None
    assert re.search(r"on sample [1-9]", jac.fallback)  # not on sample 0
    np.testing.assert_allclose(J, reference, **FLOAT64)
    np.testing.assert_allclose(dense_jacobian(model, x), reference, **FLOAT64)


class ClippedDense(keras.layers.Dense):
    """A Dense subclass: its call may do anything, so it has no Dense rule."""

    def call(self, inputs, training=None):
        return tf.clip_by_value(super().call(inputs), -0.3, 0.3)


def test_a_dense_subclass_falls_back():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            ClippedDense(8, "tanh", dtype="float64"),
            keras.layers.Dense(2, dtype="float64"),
        ]
    )
    x = np.random.default_rng(0).standard_normal((6, 4)) * 3
    reference = ju.finite_difference_jacobian(model, x)
    jac = compiled_dense_jacobian(model)
    assert "is a ClippedDense" in jac.fallback and jac.plan is None
    np.testing.assert_allclose(jac(x), reference, **FLOAT64)
    np.testing.assert_allclose(dense_jacobian(model, x), reference, **FLOAT64)


# --- other models -------------------------------------------------------------


@pytest.mark.parametrize(
    "name, reason",
    [
        ("convolution", "is a Conv2D"),
        ("frozen_layer", "is a BatchNormalization"),
        ("matrix_output", "not one flat"),
        ("activation_layers", "is a Activation"),
        ("shared_layer", "used more than once"),
        ("sequential_subclass", "is a subclass"),
    ],
)
def test_other_models_fall_back_to_the_per_sample_stage(name, reason):
    case = build(name)
    model32, model64, x = case.model32, case.model64, case.batch(4)
    assert reason in dense_plan(model64, resolve_target(model64))[1]
    reference = ju.finite_difference_jacobian(model64, x)
    np.testing.assert_allclose(dense_jacobian(model64, x), reference, **FLOAT64)
    jac = compiled_dense_jacobian(model32)
    assert reason in jac.fallback and jac.plan is None
    np.testing.assert_allclose(
        jac(x), ju.per_sample_jacobian(model32, x), rtol=1e-6, atol=1e-7
    )


def test_training_mode_falls_back():
    model = ju.question_mlp()
    x, _ = ju.regression_data(3)
    jac = compiled_dense_jacobian(model, training=True)
    assert "training=True" in jac.fallback
    np.testing.assert_allclose(
        jac(x), ju.per_sample_jacobian(model, x, training=True), rtol=1e-6
    )
