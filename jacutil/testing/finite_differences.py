"""An independent reference: central finite differences, in the model's dtype.

Use a float64 model. In float32 a correct Jacobian and its finite differences
disagree by the rounding error eps * |f| / step (about 0.1 at the default step
of 1e-6) and, at the best step, by about eps**(2/3) - which proves nothing
(notebook 06-pitfalls derives both).
"""

import numpy as np

from ..core.batch import as_batch
from ..core.target import resolve_target


def finite_difference_jacobian(model, x, *, variables=None, training=False, step=1e-6):
    """(n, l, m) Jacobian by central differences, one parameter at a time.

    2 * n_params forward passes of the whole batch: slow, simple, and sharing
    no code with the autodiff stages, which is the point of a reference.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables``.
        x: the n samples: an array, or a list or dict of arrays.
        variables: the variables to differentiate (default: the model's
            trainable variables); each is bumped and restored.
        training: run the model in training mode.
        step: the difference step h.

    Returns:
        J, a float64 array of shape (n, l, m), columns in ``flat_params``
        order.
    """
    target = resolve_target(model, variables, training, x)
    x = as_batch(x, target)
    columns = []
    for v in target.variables:
        original = v.numpy()
        flat = original.ravel()
        for p in range(flat.size):
            outputs = []
            for sign in (1, -1):
                bumped = flat.copy()
                bumped[p] += sign * step
                v.assign(bumped.reshape(original.shape))
                outputs.append(target.forward(x).numpy().astype(np.float64))
            v.assign(original)
            columns.append((outputs[0] - outputs[1]) / (2 * step))
    return np.stack(columns, axis=2)
