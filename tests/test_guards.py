"""The guards of notebook 06-pitfalls: each trap is caught, and only the trap."""

import gc
import warnings

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from jacutil.core import guards


def compiled(model, x, **kw):
    return ju.compiled_jacobian(model, **kw)(x)


def chunked(model, x, **kw):
    return ju.chunked_jacobian(model, x, chunk_size=2, progress=False, **kw)


STAGES = {
    "loop": ju.loop_jacobian,
    "vectorized": ju.vectorized_jacobian,
    "per_sample": ju.per_sample_jacobian,
    "compiled": compiled,
    "compiled_xla": lambda m, x, **kw: compiled(m, x, jit_compile=True, **kw),
    "compiled_batch": lambda m, x, **kw: compiled(m, x, method="batch", **kw),
    "chunked": chunked,
    "chunked_xla": lambda m, x, **kw: chunked(m, x, jit_compile=True, **kw),
    "chunked_batch": lambda m, x, **kw: chunked(m, x, method="batch", **kw),
}
ALL = pytest.mark.parametrize("stage", sorted(STAGES))


def dense(*layers, n_inputs=3):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((n_inputs,)),
            keras.layers.Dense(4, activation="tanh"),
            *layers,
            keras.layers.Dense(2),
        ]
    )


def batch(n_samples=4, n_inputs=3, dtype="float32"):
    rng = np.random.default_rng(n_samples)
    return rng.standard_normal((n_samples, n_inputs)).astype(dtype)


# Guard 1: nothing connected ------------------------------------------------


@ALL
def test_flattened_copy_is_refused_by_every_stage(stage):
    """tf.concat of the flattened variables, as a Variable: the model never reads it."""
    model = dense()
    flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    with pytest.raises(ValueError, match="None of the 1 variables") as error:
        STAGES[stage](model, batch(), variables=[tf.Variable(flat)])
    assert "Pass the model itself" in str(error.value)


@ALL
def test_callable_that_ignores_its_variables_is_refused(stage):
    W = keras.Variable(np.ones((3, 2), "float32"))
    with pytest.raises(ValueError, match="None of the 1 variables reaches"):
        STAGES[stage](lambda x: 2.0 * x, batch(), variables=[W])


def test_require_connected_accepts_one_unused_variable():
    variables = [keras.Variable(np.ones(2)), keras.Variable(np.ones(3))]
    guards.require_connected([None, tf.ones((1, 1, 3))], variables)
    with pytest.raises(ValueError, match="None of the 2 variables"):
        guards.require_connected([None, None], variables)


# Guard 2: training mode ----------------------------------------------------


@ALL
def test_batchnorm_in_training_mode_is_an_error(stage):
    model = dense(keras.layers.BatchNormalization(name="bn"))
    moving_mean = model.get_layer("bn").moving_mean.numpy().copy()
    with pytest.raises(ValueError, match=r"BatchNormalization \(bn\).*training=False"):
        STAGES[stage](model, batch(), training=True)
    # Refused before any forward pass in training mode could move its statistics.
    np.testing.assert_array_equal(model.get_layer("bn").moving_mean, moving_mean)


def test_a_long_refusal_names_a_few_layers_and_keeps_its_advice():
    """Fifty BatchNormalization layers listed buried the advice (issue 56)."""
    layers = [keras.Input((4,))]
    for k in range(50):
        norm = keras.layers.BatchNormalization(name=f"bn{k}")
        layers += [keras.layers.Dense(4), norm]
    model = keras.Sequential(layers)
    with pytest.raises(ValueError) as refused:
        ju.jacobian(model, batch(n_inputs=4), training=True)
    said = str(refused.value)
    assert "(bn0, bn1, bn2 and 47 more)" in said and "bn49" not in said
    assert "Use training=False" in said and len(said) < 700


def test_batchnorm_really_couples_the_samples():
    """Why it is an error: sample 0's Jacobian depends on sample 1; stages disagree."""
    model = dense(keras.layers.BatchNormalization())
    variables = model.trainable_variables

    def training_mode(x):
        return model(x, training=True)

    x = batch()
    x_moved = x.copy()
    x_moved[1] += 1.0
    J = ju.vectorized_jacobian(training_mode, x, variables=variables)
    J_moved = ju.vectorized_jacobian(training_mode, x_moved, variables=variables)
    assert not np.allclose(J[0], J_moved[0], atol=1e-3)
    one_at_a_time = ju.per_sample_jacobian(training_mode, x, variables=variables)
    assert not np.allclose(J, one_at_a_time, atol=1e-3)
    # In inference mode the samples are independent again.
    J = ju.vectorized_jacobian(model, x)
    np.testing.assert_allclose(J[0], ju.vectorized_jacobian(model, x_moved)[0])


@ALL
def test_dropout_in_training_mode_warns(stage):
    model = dense(keras.layers.Dropout(0.5, name="drop"))
    with pytest.warns(guards.TrainingModeWarning, match=r"drop \(Dropout\)"):
        STAGES[stage](model, batch(), training=True)


@pytest.mark.parametrize(
    "layer",
    [
        keras.layers.GaussianNoise(0.1),
        keras.layers.GaussianDropout(0.2),
        keras.layers.AlphaDropout(0.2),
    ],
    ids=lambda layer: type(layer).__name__,
)
def test_other_random_layers_warn(layer):
    with pytest.warns(guards.TrainingModeWarning, match=type(layer).__name__):
        ju.per_sample_jacobian(dense(layer), batch(), training=True)


def test_spatial_dropout_warns():
    model = keras.Sequential(
        [
            keras.Input((5, 3)),
            keras.layers.SpatialDropout1D(0.3, name="spatial"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    with pytest.warns(guards.TrainingModeWarning, match="spatial"):
        ju.per_sample_jacobian(model, np.ones((2, 5, 3)), training=True)


def test_nested_layers_are_found():
    """Inside a nested model, and inside a custom layer that holds one."""

    class Noisy(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = keras.layers.Dropout(0.5, name="hidden_drop")

        def call(self, x, training=False):
            return self.inner(x, training=training)

    inner = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2)(inner(keras.layers.Dense(4)(inputs)))
    with pytest.raises(ValueError, match="BatchNormalization"):
        ju.per_sample_jacobian(keras.Model(inputs, outputs), batch(), training=True)
    with pytest.warns(guards.TrainingModeWarning, match="hidden_drop"):
        ju.per_sample_jacobian(dense(Noisy()), batch(), training=True)


def test_harmless_training_mode_is_accepted_and_right():
    """Rate 0 and a frozen BatchNorm run as in inference: no warning, same J."""
    frozen = keras.layers.BatchNormalization()
    frozen.trainable = False
    model = dense(keras.layers.Dropout(0.0), frozen)
    x = batch()
    model(x)  # build
    frozen.moving_mean.assign([0.3, -0.2, 0.1, 0.5])
    frozen.moving_variance.assign([2.0, 0.5, 1.5, 0.8])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        J = ju.per_sample_jacobian(model, x, training=True)
    np.testing.assert_allclose(J, ju.per_sample_jacobian(model, x), rtol=1e-6)
    assert np.abs(J).max() > 0.1


def test_inference_mode_is_silent():
    model = dense(keras.layers.Dropout(0.5), keras.layers.BatchNormalization())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        J = ju.per_sample_jacobian(model, batch())
    np.testing.assert_array_equal(J, ju.per_sample_jacobian(model, batch()))


def test_explicit_callable_opts_out_of_the_dropout_warning():
    model = dense(keras.layers.Dropout(0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ju.per_sample_jacobian(
            lambda x: model(x, training=True),
            batch(),
            variables=model.trainable_variables,
        )


# Guard 3: retracing --------------------------------------------------------


def test_one_compiled_jacobian_never_warns(monkeypatch):
    monkeypatch.setattr(guards, "RETRACE_LIMIT", 1)
    jac = ju.compiled_jacobian(dense())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n_samples in range(1, 6):
            assert jac(batch(n_samples)).shape == (n_samples, 2, 26)
    assert jac.trace_count == 1


def test_building_the_same_compiled_jacobian_again_warns(monkeypatch):
    monkeypatch.setattr(guards, "RETRACE_LIMIT", 3)
    model, x = dense(), batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            ju.compiled_jacobian(model)(x)
        ju.compiled_jacobian(model, method="batch")(x)  # other options: own count
        ju.compiled_jacobian(dense())(x)  # another model: its own count
    with pytest.warns(guards.RetracingWarning, match="traced 4 times") as record:
        for _ in range(3):  # the 4th trace warns; the 5th and 6th do not again
            ju.compiled_jacobian(model)(x)
    assert len(record) == 1
    assert "Build it once" in str(record[0].message)


def test_trace_counts_are_forgotten_with_the_variables():
    variable = keras.Variable(np.ones(2, "float32"))
    key = (id(variable), 1, ("per_sample", False))
    assert guards.note_trace([variable], key[2]) == 1
    assert guards.note_trace([variable], key[2]) == 2
    del variable
    gc.collect()
    assert key not in guards._trace_counts
