"""Stage 1: the nested loop of the original question (notebook 01-nested-loop)."""

import numpy as np
from tqdm.auto import tqdm

from ..core._tf import tf
from ..core.batch import as_batch, take
from ..core.guards import random_layers
from ..core.outputs import output_layout
from ..core.target import resolve_target, stack_columns


def loop_jacobian(model, x, *, variables=None, training=False, progress=False):
    """Per-sample Jacobian by a loop over samples and outputs.

    For every sample ``i`` and every output ``k`` a fresh tape records the
    forward pass of that one sample, and ``tape.gradient`` returns the row
    ``d f(x)[i, k] / d theta``. Correct, and slow: n * l forward and backward
    passes, each paying Python's and eager TensorFlow's overhead. (With
    random layers in training mode one tape serves all of a sample's outputs,
    so that they share one random mask, as in every stage.) Introduced in
    notebook ``01-nested-loop``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        x: the n samples (an array, or a list or dict of arrays).
        variables: the variables to differentiate (default: trainable ones).
        training: run the model in training mode.
        progress: show a progress bar over samples.

    Returns:
        A NumPy array of shape (n, l, m) in the model's float dtype.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, loop_jacobian
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> loop_jacobian(model, x).shape  # (n, l, m): m = 3 * 2 + 2
        (4, 2, 8)
    """
    target = resolve_target(model, variables, training, x)
    x = as_batch(x, target)
    n_samples = int(tf.nest.flatten(x)[0].shape[0])
    n_outputs = output_layout(target, x).n_outputs
    shared = bool(training and random_layers(target.layers))
    J = np.empty((n_samples, n_outputs, target.n_params), target.dtype)
    for i in tqdm(range(n_samples), disable=not progress, unit="sample"):
        for k in range(n_outputs):
            if k == 0 or not shared:
                tape, y = _record(target, take(x, i, i + 1), persistent=shared)
            grads = tape.gradient(y[k], target.variables)
            # None (not connected) stays None: stack_columns makes its zeros
            grads = [
                None if g is None else tf.convert_to_tensor(g)[None, None]
                for g in grads
            ]
            J[i, k] = stack_columns(grads, target.variables, 1)[0, 0]
    return J


def _record(target, sample, persistent):
    """A tape that recorded one sample's forward pass, and its outputs."""
    with tf.GradientTape(persistent=persistent) as tape:
        target.watch(tape)
        y = tf.unstack(target.forward(sample)[0])
    return tape, y
