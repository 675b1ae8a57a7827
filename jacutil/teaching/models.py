"""The question's network and seeded synthetic data. Nothing is downloaded."""

import numpy as np

from ..core._tf import keras


def question_mlp(n_inputs=10, n_outputs=2, hidden=(64, 32), *, seed=0, dtype="float32"):
    """The network of the loop question: 10 -> Dense 64 relu -> 32 relu -> l.

    Weights are drawn from seeded initializers, so the same seed gives the same
    model in every run. With the defaults it has 2,850 parameters.
    Introduced in ``00-welcome``.

    Returns a built ``keras.Sequential`` named ``question_mlp``: ``n_inputs``
    features per sample, ReLU layers of widths ``hidden``, ``n_outputs`` (l)
    outputs. In every builder here, ``seed`` seeds the initializers (or the
    generator) and ``dtype`` is the layers' (or the arrays').
    """
    layers = [keras.Input((n_inputs,), dtype=dtype)]
    for i, width in enumerate((*hidden, n_outputs)):
        last = i == len(hidden)
        layers.append(
            keras.layers.Dense(
                width,
                activation=None if last else "relu",
                kernel_initializer=keras.initializers.GlorotUniform(seed=seed + i),
                bias_initializer=keras.initializers.RandomNormal(
                    stddev=0.1, seed=seed + 100 + i
                ),
                dtype=dtype,
                name=f"dense_{i}",
            )
        )
    return keras.Sequential(layers, name="question_mlp")


def regression_data(
    n_samples, n_inputs=10, n_outputs=2, *, seed=0, noise=0.05, dtype="float32"
):
    """Seeded synthetic regression data ``(x, y)`` for the question's network.

    ``x`` is standard normal, shape (n_samples, n_inputs); ``y`` a smooth
    function of ``x`` plus Gaussian noise of standard deviation ``noise``,
    shape (n_samples, n_outputs).
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_samples, n_inputs))
    mix = rng.standard_normal((n_inputs, n_outputs)) / np.sqrt(n_inputs)
    z = x @ mix
    y = np.sin(z) + 0.5 * z**2 / (1 + z**2)
    y += noise * rng.standard_normal(y.shape)
    return x.astype(dtype), y.astype(dtype)


def sequence_lstm(
    n_steps=16, n_features=4, units=16, n_outputs=2, *, seed=0, dtype="float32"
):
    """A recurrent model: LSTM(units) -> Dense(n_outputs) on sequences.

    A built ``keras.Sequential`` named ``sequence_lstm``, taking ``n_steps``
    time steps of ``n_features`` features. With the defaults: 16 steps of 4
    features, 1,378 parameters, seeded. Introduced in ``08-your-own-model``.
    """
    return keras.Sequential(
        [
            keras.Input((n_steps, n_features), dtype=dtype),
            keras.layers.LSTM(
                units,
                kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
                recurrent_initializer=keras.initializers.Orthogonal(seed=seed + 1),
                bias_initializer=keras.initializers.RandomNormal(
                    stddev=0.1, seed=seed + 2
                ),
                dtype=dtype,
                name="lstm",
            ),
            keras.layers.Dense(
                n_outputs,
                kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 3),
                dtype=dtype,
                name="head",
            ),
        ],
        name="sequence_lstm",
    )


def sequence_data(n_samples, n_steps=16, n_features=4, *, seed=0, dtype="float32"):
    """Seeded sequences, shape (n_samples, n_steps, n_features): a noisy sine."""
    rng = np.random.default_rng(seed)
    phase = rng.uniform(0, 2 * np.pi, (n_samples, 1, n_features))
    steps = np.arange(n_steps)[None, :, None]
    x = np.sin(0.4 * steps + phase) + 0.1 * rng.standard_normal(
        (n_samples, n_steps, n_features)
    )
    return x.astype(dtype)


def small_cnn(size=12, channels=8, n_outputs=4, *, seed=0, dtype="float32"):
    """A small CNN on size x size images: two 3x3 convolutions, then Dense.

    With the defaults 2,716 parameters, and activations (8 feature maps of
    10 x 10 and 8 x 8) that outweigh one sample's Jacobian rows.
    Introduced in ``08-your-own-model``.

    A built ``keras.Sequential`` named ``small_cnn``, taking images of shape
    (size, size, 1), with ``channels`` feature maps in each convolution.
    """
    conv = {"dtype": dtype}
    return keras.Sequential(
        [
            keras.Input((size, size, 1), dtype=dtype),
            keras.layers.Conv2D(
                channels,
                3,
                activation="relu",
                kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
                **conv,
            ),
            keras.layers.Conv2D(
                channels,
                3,
                activation="tanh",
                kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1),
                **conv,
            ),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(
                n_outputs,
                kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 2),
                dtype=dtype,
            ),
        ],
        name="small_cnn",
    )


def image_data(n_samples, size=12, *, seed=0, dtype="float32"):
    """Seeded images, shape (n_samples, size, size, 1): smooth blobs and noise."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(-1, 1, size)
    centres = rng.uniform(-0.5, 0.5, (n_samples, 2, 1, 1))
    blob = np.exp(
        -(
            (grid[None, :, None] - centres[:, 0]) ** 2
            + (grid[None, None] - centres[:, 1]) ** 2
        )
        / 0.2
    )
    x = blob + 0.1 * rng.standard_normal((n_samples, size, size))
    return x[..., None].astype(dtype)
