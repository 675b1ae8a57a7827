"""Stage 1: the nested loop of the original question (notebook 01-nested-loop)."""

import numpy as np
from tqdm.auto import tqdm

from ._tf import tf
from .target import as_batch, resolve_target, stack_columns


def loop_jacobian(model, x, *, variables=None, training=False, progress=False):
    """Per-sample Jacobian by a loop over samples and outputs.

    For every sample ``i`` and every output ``k`` a fresh tape records the
    forward pass of that one sample, and ``tape.gradient`` returns the row
    ``d f(x)[i, k] / d theta``. Correct, and slow: n * l forward and backward
    passes, each paying Python's and eager TensorFlow's overhead.

    Returns an array of shape (n_samples, n_outputs, n_params) in the model's
    float dtype. Introduced in notebook ``01-nested-loop``.
    """
    target = resolve_target(model, variables, training, x)
    x = as_batch(x, target)
    n_samples = x.shape[0]
    n_outputs = target.forward(x[:1]).shape[1]
    J = np.empty((n_samples, n_outputs, target.n_params), target.dtype)
    for i in tqdm(range(n_samples), disable=not progress, unit="sample"):
        for k in range(n_outputs):
            with tf.GradientTape() as tape:
                y = target.forward(x[i : i + 1])[0, k]
            grads = tape.gradient(y, target.variables)
            grads = [None if g is None else g[None, None] for g in grads]
            J[i, k] = stack_columns(grads, target.variables, 1)[0, 0]
    return J
