"""The bench's own models beyond the teaching ones, and targets for a loss.

``residual_mlp`` (a functional MLP with ``Add`` skips) and ``two_head``
(one trunk, two Dense heads, two outputs) are built here, once, so that
``make bench-peers`` and notebook ``07-benchmark`` time the same networks;
``targets`` gives seeded targets of any model's output shape for the
per-sample gradient rows. Introduced in ``07-benchmark``.
"""

import numpy as np

from ..core._tf import keras


def _dense(width, seed, dtype, name, activation=None):
    return keras.layers.Dense(
        width,
        activation=activation,
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        bias_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=seed + 100),
        dtype=dtype,
        name=name,
    )


def residual_mlp(n_inputs=32, width=56, blocks=3, *, seed=0, dtype="float32"):
    """A residual MLP: Dense(width), then ``blocks`` x [Dense(width, relu) + skip].

    Functional: each block adds its input back (``keras.layers.Add``), and a
    Dense(1) reads the last. With the defaults 32 -> 56 -> 3 blocks -> 1:
    11,481 parameters. Introduced in ``07-benchmark``.

    Args:
        n_inputs: features per sample.
        width: the width of every hidden layer.
        blocks: the residual blocks.
        seed: the initializers' seed.
        dtype: the layers' dtype.

    Returns:
        A built functional ``keras.Model`` named ``residual_mlp``.
    """
    inputs = keras.Input((n_inputs,), dtype=dtype)
    a = _dense(width, seed, dtype, "stem")(inputs)
    for i in range(blocks):
        z = _dense(width, seed + 1 + i, dtype, f"block_{i}", "relu")(a)
        a = keras.layers.Add(dtype=dtype, name=f"skip_{i}")([a, z])
    outputs = _dense(1, seed + 1 + blocks, dtype, "head")(a)
    return keras.Model(inputs, outputs, name="residual_mlp")


def two_head(n_inputs=10, hidden=(64, 32), heads=(2, 1), *, seed=0, dtype="float32"):
    """One trunk of ReLU Dense layers, then two Dense heads: two outputs.

    The model returns the list ``[head_0, head_1]``; a Jacobian's rows are
    head 0's outputs, then head 1's (``tf.nest.flatten`` order, see
    ``jacutil/core/outputs.py``). With the defaults 10 -> 64 -> 32 -> (2, 1):
    2,883 parameters. Introduced in ``07-benchmark``.

    Args:
        n_inputs: features per sample.
        hidden: the widths of the trunk's ReLU layers.
        heads: the outputs of each head.
        seed: the initializers' seed.
        dtype: the layers' dtype.

    Returns:
        A built functional ``keras.Model`` named ``two_head``.
    """
    inputs = keras.Input((n_inputs,), dtype=dtype)
    a = inputs
    for i, width in enumerate(hidden):
        a = _dense(width, seed + i, dtype, f"trunk_{i}", "relu")(a)
    outputs = [
        _dense(width, seed + len(hidden) + k, dtype, f"head_{k}")(a)
        for k, width in enumerate(heads)
    ]
    return keras.Model(inputs, outputs, name="two_head")


def flat_data(n_samples, n_inputs, *, seed=0, dtype="float32"):
    """Seeded standard normal inputs of ``dtype``, shape (n_samples, n_inputs)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n_samples, n_inputs)).astype(dtype)


def targets(model, n_samples, *, seed=0):
    """Seeded targets for a squared-error loss: (n_samples, *output shape).

    Standard normal, in the model's dtype; for a built model with one output.
    """

    shape = tuple(model.outputs[0].shape[1:])
    rng = np.random.default_rng(seed + 1000)
    return rng.standard_normal((n_samples, *shape)).astype(model.dtype)
