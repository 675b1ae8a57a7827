"""Small models of different shapes, each buildable in float32 and float64."""

import numpy as np

import jacutil as ju
from jacutil import keras


def _dense(width, activation=None, **kwargs):
    return keras.layers.Dense(width, activation=activation, **kwargs)


def mlp(dtype):
    """The question's architecture, made small enough for finite differences."""
    return ju.question_mlp(n_inputs=4, n_outputs=3, hidden=(8, 6), dtype=dtype)


def matrix_output(dtype):
    """Per-sample output of shape (4, 2): n_outputs = 8 after flattening."""
    return keras.Sequential(
        [
            keras.Input((4, 3), dtype=dtype),
            _dense(5, "tanh", dtype=dtype),
            _dense(2, dtype=dtype),
        ]
    )


def frozen_layer(dtype):
    """A frozen Dense layer and BatchNorm (inference mode) before a trainable one."""
    frozen = _dense(6, "tanh", dtype=dtype, trainable=False)
    return keras.Sequential(
        [
            keras.Input((5,), dtype=dtype),
            frozen,
            keras.layers.BatchNormalization(dtype=dtype),
            _dense(2, dtype=dtype),
        ]
    )


def convolution(dtype):
    return keras.Sequential(
        [
            keras.Input((6, 6, 2), dtype=dtype),
            keras.layers.Conv2D(3, 3, activation="tanh", dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            _dense(2, dtype=dtype),
        ]
    )


ARCHITECTURES = {
    "mlp": mlp,
    "matrix_output": matrix_output,
    "frozen_layer": frozen_layer,
    "convolution": convolution,
}


def build(name, seed=0):
    """(float32 model, float64 copy with the same weights, input batch maker)."""
    keras.utils.set_random_seed(seed)
    model32 = ARCHITECTURES[name]("float32")
    model64 = ARCHITECTURES[name]("float64")
    weights = model32.get_weights()
    # Move BatchNorm's moving statistics away from 0 and 1 so that they matter.
    weights = [
        w + 0.1 * np.random.default_rng(seed).standard_normal(w.shape) for w in weights
    ]
    model32.set_weights([w.astype("float32") for w in weights])
    model64.set_weights([w.astype("float64") for w in weights])
    feature_shape = tuple(model32.inputs[0].shape[1:])

    def batch(n_samples, dtype="float64"):
        rng = np.random.default_rng(seed + n_samples)
        return rng.standard_normal((n_samples, *feature_shape)).astype(dtype)

    return model32, model64, batch
