"""The models users bring: each defect found by trying them, guarded by a test.

Every stage on every zoo model equals finite differences in test_stages.py;
here: the layout of several outputs, refusals that name what is wrong, the
variables that are watched, the hand-derived path's limits, XLA padding, the
compiled-function cache, mixed precision, logging, and Dropout's semantics.
"""

import gc
import subprocess
import sys
import warnings
import weakref

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from tests.architectures import build

ALL_STAGES = {
    "loop": ju.loop_jacobian,
    "vectorized": ju.vectorized_jacobian,
    "per_sample": ju.per_sample_jacobian,
    "compiled": lambda model, x, **kw: ju.compiled_jacobian(model, **kw)(x),
    "compiled_xla": lambda model, x, **kw: ju.compiled_jacobian(
        model, jit_compile=True, **kw
    )(x),
    "compiled_batch": lambda model, x, **kw: ju.compiled_jacobian(
        model, method="batch", **kw
    )(x),
    "chunked": lambda model, x, **kw: ju.chunked_jacobian(
        model, x, chunk_size=2, progress=False, **kw
    ),
    "hand_derived": lambda model, x, **kw: ju.compiled_dense_jacobian(model, **kw)(x),
    "finite_differences": ju.finite_difference_jacobian,
}
STAGE_NAMES = sorted(ALL_STAGES)


# --- several outputs: one layout ------------------------------------------------


def _heads(dtype="float64"):
    """Two heads of different widths, as a list, and each head as its own model."""
    keras.utils.set_random_seed(3)
    x = keras.Input((3,), dtype=dtype)
    hidden = keras.layers.Dense(4, activation="tanh", dtype=dtype)(x)
    wide = keras.layers.Dense(3, dtype=dtype)(hidden)
    narrow = keras.layers.Dense(2, activation="sigmoid", dtype=dtype)(hidden)
    return keras.Model(x, [narrow, wide]), keras.Model(x, narrow), keras.Model(x, wide)


def _columns_of(model, part):
    """Column indices in ``model``'s flat_params of ``part``'s variables."""
    starts, start = {}, 0
    for v in model.trainable_variables:
        starts[id(v)] = (start, start + int(np.prod(v.shape)))
        start += int(np.prod(v.shape))
    return np.concatenate([np.arange(*starts[id(v)]) for v in part.trainable_variables])


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_rows_are_the_heads_flattened_in_order(stage):
    both, narrow, wide = _heads()
    x = np.random.default_rng(0).standard_normal((4, 3))
    J = ALL_STAGES[stage](both, x)
    assert J.shape == (4, 2 + 3, both.count_params())
    for rows, head in ((slice(0, 2), narrow), (slice(2, 5), wide)):
        alone = ju.loop_jacobian(head, x)
        columns = _columns_of(both, head)
        np.testing.assert_allclose(J[:, rows][:, :, columns], alone, atol=1e-8)
        unused = np.setdiff1d(np.arange(J.shape[2]), columns)
        np.testing.assert_array_equal(J[:, rows][:, :, unused], 0.0)


def test_split_outputs_gives_back_the_model_structure():
    case = build("dict_heads")
    x = case.batch(3)
    J = ju.per_sample_jacobian(case.model64, x)
    parts = ju.split_outputs(J, case.model64, x)
    outputs = case.model64(x)
    assert sorted(parts) == sorted(outputs)
    m = J.shape[2]
    for name, part in parts.items():
        assert part.shape == (3, *outputs[name].shape[1:], m)
    order = sorted(outputs)  # tf.nest.flatten sorts dict keys
    first = int(np.prod(outputs[order[0]].shape[1:]))
    np.testing.assert_array_equal(parts[order[0]].reshape(3, -1, m), J[:, :first])
    matrix = build("matrix_output")
    x = matrix.batch(2)
    J = ju.per_sample_jacobian(matrix.model64, x)
    assert ju.split_outputs(J, matrix.model64, x).shape == (2, 4, 2, J.shape[2])


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_an_output_without_a_sample_axis_is_refused(stage):
    model = ju.question_mlp(n_inputs=3, hidden=(4,), dtype="float64")
    for reduce in (
        lambda y: tf.reduce_mean(y, axis=0),
        lambda y: tf.reduce_mean(y, axis=0, keepdims=True),
    ):

        def batch_mean(x, reduce=reduce):
            return reduce(model(x))

        with pytest.raises(ValueError, match="not the number of samples"):
            ALL_STAGES[stage](
                batch_mean, np.ones((4, 3)), variables=model.trainable_variables
            )


def test_integer_output_is_refused():
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    with pytest.raises(ValueError, match="only floating-point outputs"):
        ju.per_sample_jacobian(
            lambda x: tf.argmax(model(x), axis=1)[:, None],
            np.ones((2, 3)),
            variables=model.trainable_variables,
        )


# --- several inputs -------------------------------------------------------------


@pytest.mark.parametrize(
    "x, message",
    [
        (lambda a, b: [a], r"takes 2 inputs \(a, b\); got 1 arrays"),
        (lambda a, b: a, r"takes 2 inputs \(a, b\); got one ndarray"),
        (lambda a, b: [a, b[:3]], r"different numbers of samples \(x\[0\]: 4"),
        (lambda a, b: [a, np.ones((4, 5))], r"x\[1\] has shape \(4, 5\)"),
        (lambda a, b: {"a": a, "c": b}, r"or a dict with keys \['a', 'b'\]"),
    ],
)
def test_several_inputs_wrongly_passed_are_refused_clearly(x, message):
    x_a = keras.Input((3,), name="a")
    x_b = keras.Input((2,), name="b")
    joined = keras.layers.Concatenate()([x_a, x_b])
    model = keras.Model([x_a, x_b], keras.layers.Dense(2)(joined))
    a, b = np.ones((4, 3)), np.ones((4, 2))
    for stage in (ju.per_sample_jacobian, ju.loop_jacobian):
        with pytest.raises(ValueError, match=message):
            stage(model, x(a, b))


def test_dict_inputs_for_a_dict_model():
    case = build("two_inputs_two_heads")
    x = case.batch(3)
    assert isinstance(x, dict)
    J = ju.chunked_jacobian(case.model64, x, chunk_size=2, progress=False)
    np.testing.assert_allclose(
        J, ju.finite_difference_jacobian(case.model64, x), rtol=1e-6, atol=1e-8
    )


def test_a_sequence_model_takes_any_length():
    """Input((None, 3)): the first length seen does not stick."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((None, 3)), keras.layers.LSTM(2), keras.layers.Dense(2)]
    )
    rng = np.random.default_rng(0)
    jac = ju.compiled_jacobian(model)
    for steps in (4, 6, 4):
        x = rng.standard_normal((3, steps, 3)).astype("float32")
        expected = ju.loop_jacobian(model, x)
        np.testing.assert_allclose(jac(x), expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            ju.chunked_jacobian(model, x, chunk_size=2, progress=False),
            expected,
            rtol=1e-5,
            atol=1e-6,
        )
    assert jac.trace_count == 2  # one per length
    assert "unrolled" in jac.formulation


# --- which variables are differentiated ---------------------------------------


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_non_trainable_variables_asked_for_are_differentiated(stage):
    """BatchNorm's moving mean, passed explicitly: its true (non-zero) columns."""
    case = build("frozen_layer")
    model = case.model64
    norm = next(
        layer
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    )
    variables = [norm.moving_mean, *model.layers[-1].trainable_variables]
    x = case.batch(3)
    J = ALL_STAGES[stage](model, x, variables=variables)
    reference = ju.finite_difference_jacobian(model, x, variables=variables)
    assert np.abs(reference[:, :, :6]).min() > 1e-3
    np.testing.assert_allclose(J, reference, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_variables_as_a_generator_are_read_once(stage):
    case = build("mlp")
    x = case.batch(2)
    J = ALL_STAGES[stage](
        case.model64, x, variables=(v for v in case.model64.trainable_variables)
    )
    np.testing.assert_allclose(
        J, ju.finite_difference_jacobian(case.model64, x), rtol=1e-6, atol=1e-8
    )


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_duplicate_and_mixed_dtype_variables_are_refused(stage):
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    kernel = model.trainable_variables[0]
    with pytest.raises(ValueError, match="appears twice in variables="):
        ALL_STAGES[stage](model, np.ones((2, 3)), variables=[kernel, kernel])
    other = tf.Variable(np.ones(2))  # float64 beside float32

    def f(x):
        return model(x) + tf.cast(other, "float32")

    with pytest.raises(TypeError, match="the variables have 2 dtypes"):
        ALL_STAGES[stage](f, np.ones((2, 3)), variables=[kernel, other])


def test_duplicate_variable_is_refused_by_the_scipy_bridge():
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    kernel = model.trainable_variables[0]
    with pytest.raises(ValueError, match="appears twice"):
        ju.least_squares_problem(
            model, np.ones((2, 3)), np.ones((2, 2)), variables=[kernel, kernel]
        )


# --- the hand-derived path takes only what it understands ----------------------


@pytest.mark.parametrize(
    "name, reason",
    [
        ("sequential_subclass", "is a subclass"),
        ("subclassed", "is a subclass"),
        ("shared_layer", "used more than once"),
        ("activation_layers", "is a Activation"),
    ],
)
def test_hand_derived_path_falls_back_with_the_reason(name, reason):
    case = build(name)
    jac = ju.compiled_dense_jacobian(case.model64)
    assert reason in jac.fallback
    x = case.batch(3)
    np.testing.assert_allclose(
        jac(x), ju.finite_difference_jacobian(case.model64, x), rtol=1e-6, atol=1e-8
    )


def test_hand_derived_path_checks_its_rules_against_autodiff():
    """A Dense whose call was replaced on the instance: the structure looks fine."""
    model = ju.question_mlp(n_inputs=3, hidden=(4,), dtype="float64")
    last = model.layers[-1]
    plain_call = last.call
    last.call = lambda inputs, *args, **kwargs: 3 * plain_call(inputs)
    x = np.random.default_rng(0).standard_normal((4, 3))
    jac = ju.compiled_dense_jacobian(model)
    assert jac.fallback is None  # before the first call it looks like a chain
    J = jac(x)
    assert "differ from autodiff" in jac.fallback
    reference = ju.finite_difference_jacobian(model, x)
    np.testing.assert_allclose(J, reference, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(ju.dense_jacobian(model, x), reference, rtol=1e-6)


# --- XLA padding ---------------------------------------------------------------


@pytest.mark.parametrize("method", ["batch", "per_sample"])
def test_xla_padding_uses_a_real_sample(method):
    """log is not finite at 0: padding with zeros put NaN into real rows."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="softplus"),
            keras.layers.Lambda(keras.ops.log),
            keras.layers.Dense(2),
        ]
    )
    x = np.random.default_rng(0).standard_normal((3, 3)).astype("float32")
    expected = ju.loop_jacobian(model, x)
    jac = ju.compiled_jacobian(model, jit_compile=True, method=method)
    J = jac(x)  # 3 samples padded to 4
    assert jac.compiled_shapes == {4}
    assert np.isfinite(J).all()
    np.testing.assert_allclose(J, expected, rtol=1e-5, atol=1e-6)
    J = ju.chunked_jacobian(
        model, x, chunk_size=2, jit_compile=True, method=method, progress=False
    )
    np.testing.assert_allclose(J, expected, rtol=1e-5, atol=1e-6)


# --- the compiled-function cache ----------------------------------------------


def test_cache_follows_the_variables_after_freezing_a_layer():
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    x, y = np.ones((5, 3), "float32"), np.zeros((5, 2), "float32")
    assert ju.chunked_jacobian(model, x, progress=False).shape == (5, 2, 26)
    model.layers[0].trainable = False
    assert ju.chunked_jacobian(model, x, progress=False).shape == (5, 2, 10)
    problem = ju.least_squares_problem(model, x, y)
    assert problem.jac(problem.theta0).shape == (5 * 2, 10)
    model.layers[0].trainable = True  # the problem keeps its columns
    assert problem.jac(problem.theta0).shape == (5 * 2, 10)


def test_cache_does_not_keep_models_alive():
    x = np.ones((3, 3), "float32")
    model = ju.question_mlp(n_inputs=3, hidden=(4,))
    ju.chunked_jacobian(model, x, progress=False)
    ju.least_squares_problem(model, x, np.zeros((3, 2))).jac(ju.flat_params(model))
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_compiled_jacobian_keeps_its_model():
    jac = ju.compiled_jacobian(ju.question_mlp(n_inputs=3, hidden=(4,)))
    gc.collect()
    assert jac(np.ones((2, 3))).shape == (2, 2, 26)


# --- precision, logging, Dropout ------------------------------------------------


def test_mixed_precision_warns():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = ju.question_mlp(n_inputs=3, hidden=(4,), dtype=None)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    with pytest.warns(ju.core.target.PrecisionWarning, match="computes in float16"):
        J = ju.per_sample_jacobian(model, np.ones((2, 3)))
    assert J.dtype == np.float32


def test_full_precision_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ju.per_sample_jacobian(
            ju.question_mlp(n_inputs=3, hidden=(4,)), np.ones((2, 3))
        )


def test_import_leaves_tensorflow_logging_alone():
    code = (
        "import logging, tensorflow as tf; before = tf.get_logger().level; "
        "import jacutil; print(before, tf.get_logger().level)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    before, after = done.stdout.split()
    assert before == after


def _dropout_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(3),
        ]
    )


@pytest.mark.parametrize(
    "stage", [s for s in STAGE_NAMES if s not in ("finite_differences",)]
)
def test_dropout_in_training_mode_one_mask_per_sample(stage):
    """Every stage: each sample its own mask, shared by all of its outputs."""
    model = _dropout_model()
    x = np.ones((6, 3), "float32")  # identical samples: only the masks differ
    with pytest.warns(ju.core.guards.TrainingModeWarning):
        J = ALL_STAGES[stage](model, x, training=True)
    # Columns of the last kernel: hidden unit q feeds output k through W[q, k];
    # the derivative is the unit's (masked, rescaled) activation: 0 where dropped.
    last = J[:, :, -(16 * 3 + 3) : -3].reshape(6, 3, 16, 3)
    kept = np.stack([last[:, k, :, k] != 0 for k in range(3)], axis=1)  # (6, 3, 16)
    assert (kept == kept[:, :1]).all(), "a sample's outputs saw different masks"
    masks = kept[:, 0]
    assert len({m.tobytes() for m in masks}) > 1, "every sample had the same mask"


ATTENTION = """
import sys
import numpy as np
import jacutil as ju
from jacutil import keras

keras.utils.set_random_seed(0)
x_in = keras.Input((8, 16))
attended = keras.layers.MultiHeadAttention(2, key_dim=8)(x_in, x_in)
y = keras.layers.LayerNormalization()(attended + x_in)
model = keras.Model(x_in, keras.layers.Dense(2)(keras.layers.Flatten()(y)))
x = np.random.default_rng(0).standard_normal((64, 8, 16)).astype("float32")
jac = ju.compiled_jacobian(model)
J = jac(x)
for n in (1, 2, 3, 5, 64):
    J = jac(x[:n])
J = ju.chunked_jacobian(model, x, chunk_size=7, progress=False)
reference = ju.loop_jacobian(model, x[:3])
np.testing.assert_allclose(J[:3], reference, rtol=1e-4, atol=1e-5)
print(jac.formulation)
"""


def test_attention_does_not_crash_the_process():
    """oneDNN's batch matmul corrupted the heap on pfor's attention gradient
    (malloc errors, segfaults: tensorflow#117700); run in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-c", ATTENTION], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-1500:]
    assert "under XLA" in done.stdout


ATTENTION_INSIDE_A_LAYER = """
import numpy as np
import jacutil as ju
from jacutil import keras


class SelfAttention(keras.layers.Layer):  # as KerasHub's TransformerEncoder
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
        self.norm = keras.layers.LayerNormalization()

    def call(self, h):
        return self.norm(h + self.attention(h, h))


keras.utils.set_random_seed(0)
tokens = keras.Input((8,), dtype="int32")
h = SelfAttention()(keras.layers.Embedding(50, 16)(tokens))
pooled = keras.layers.GlobalAveragePooling1D()(h)
model = keras.Model(tokens, keras.layers.Dense(2)(pooled))
x = np.random.default_rng(0).integers(1, 50, (4, 8)).astype("int32")
J, choice = ju.jacobian(model, x, explain=True)
np.testing.assert_allclose(J, ju.loop_jacobian(model, x), rtol=1e-4, atol=1e-5)
print(choice.path)
"""


def test_attention_inside_a_layer_the_rules_pass_through_does_not_crash():
    """The rules' autodiff of a layer without a rule (a whole attention
    block) ran pfor's broadcasting batch matmul with oneDNN: a segfault while
    the plan was checked (issue 56); now under the same guard as the stages."""
    done = subprocess.run(
        [sys.executable, "-c", ATTENTION_INSIDE_A_LAYER], capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-1500:]
    assert "layer rules" in done.stdout


# --- float32 rounding named as such (issue 56, point 6) --------------------------


def _normalized_raw_inputs():
    """LayerNormalization straight on inputs far from zero (raw values):
    float32 loses digits in its forward pass; float64 does not."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.LayerNormalization(), keras.layers.Dense(3)]
    )
    x = (1e4 + np.random.default_rng(0).normal(size=(8, 8))).astype("float32")
    return model, x


def test_a_float32_rounding_disagreement_is_named_with_what_float64_gives():
    model, x = _normalized_raw_inputs()
    jac = ju.compiled_jacobian(model, method="rules")
    J = jac(x)
    assert jac.fallback.startswith("float32 rounding"), jac.fallback
    assert "in float64 (the same model and weights) they agree to" in jac.fallback
    assert "do not say" not in jac.fallback
    # the path taken instead is autodiff's, sample by sample
    np.testing.assert_allclose(J, ju.per_sample_jacobian(model, x), rtol=1e-5)


def test_a_wrong_float32_layer_is_not_excused_as_rounding():
    """A Dense whose call was replaced on the instance: its float64 copy (from
    its config) computes the true Dense, so the copy is another model - on
    inputs where float32 rounds too."""
    model, x = _normalized_raw_inputs()
    last = model.layers[-1]
    plain_call = last.call
    last.call = lambda inputs, *args, **kwargs: 3 * plain_call(inputs)
    jac = ju.compiled_jacobian(model, method="rules")
    jac(x)
    assert "do not say" in jac.fallback, jac.fallback
