"""Layouts of the Jacobian and the flat parameter vector (notebook 00-welcome).

``J[i, k, p]`` (n_samples, n_outputs, n_params) is the layout every stage
returns. SciPy-style code often wants the (l*m) x n matrix instead: row
``k*m + p``, column ``i``. The parameter axis follows ``flat_params``: each
trainable variable flattened in row-major order, in ``trainable_variables``
order.
"""

import numpy as np

from ._shared import size_of
from ._tf import tf
from .batch import as_batch
from .outputs import output_layout
from .target import resolve_target


def to_lm_by_n(J):
    """(n, l, m) -> the (l*m) x n matrix: row ``k*m + p``, column ``i``.

    Returns a NumPy array of shape (l * m, n) (a copy, or a view where NumPy
    can make one). Introduced in ``00-welcome``.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, jacobian, to_lm_by_n
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> to_lm_by_n(jacobian(model, x)).shape  # (l * m, n)
        (16, 4)
    """
    J = np.asarray(J)
    if J.ndim != 3:
        raise ValueError(
            f"J must have shape (n_samples, n_outputs, n_params); got shape {J.shape}."
        )
    n_samples, n_outputs, n_params = J.shape
    return J.transpose(1, 2, 0).reshape(n_outputs * n_params, n_samples)


def from_lm_by_n(M, n_outputs):
    """The (l*m) x n matrix ``M`` -> (n, l, m), ``n_outputs`` = l; the inverse
    of :func:`to_lm_by_n`."""
    M = np.asarray(M)
    if M.ndim != 2:
        raise ValueError(f"M must be a 2-D (l*m) x n matrix; got shape {M.shape}.")
    if n_outputs <= 0 or M.shape[0] % n_outputs:
        raise ValueError(
            f"M has {M.shape[0]} rows, which is not n_outputs={n_outputs} times a "
            "whole number of parameters."
        )
    n_params = M.shape[0] // n_outputs
    return M.reshape(n_outputs, n_params, M.shape[1]).transpose(2, 0, 1)


def split_outputs(J, model, x, *, variables=None, training=False):
    """Split a Jacobian's rows back into the model's output structure.

    ``J`` is (n, l, m), its rows every output leaf flattened and joined in
    ``tf.nest.flatten`` order (dict keys sorted). Returns the model's output
    nest (a list, a dict, or one array) with, for each output of per-sample
    shape ``s``, an array of shape ``(n, *s, m)``. One forward pass of the
    first samples of ``x`` tells the structure. Introduced in
    ``08-your-own-model``.

    Args:
        J: the Jacobian, shape (n, l, m).
        model: the Keras model (or callable) it is of.
        x: the n samples (the first ones tell the structure).
        variables: the variables differentiated (default: trainable ones).
        training: run the model in training mode.

    Returns:
        The model's output nest of arrays, each of shape ``(n, *s, m)``.
    """
    J = np.asarray(J)
    target = resolve_target(model, variables, training, x)
    layout = output_layout(target, as_batch(x, target))
    if J.ndim != 3 or J.shape[1] != layout.n_outputs:
        raise ValueError(
            f"J has shape {J.shape}; this model's outputs give "
            f"{layout.n_outputs} rows per sample, so J should have shape "
            f"(n_samples, {layout.n_outputs}, n_params)."
        )
    n_rows, _, n_params = J.shape
    blocks = [
        J[:, rows].reshape(n_rows, *shape, n_params)
        for rows, shape in zip(layout.slices(), layout.shapes, strict=True)
    ]
    return tf.nest.pack_sequence_as(layout.structure, blocks)


def flat_params(model, *, variables=None):
    """All trainable variables, flattened and joined: theta, length m.

    Each variable is flattened in row-major order, in
    ``trainable_variables`` order: the order of J's last axis. Introduced in
    ``00-welcome``. ``variables=`` joins those instead (a callable needs it).

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, flat_params
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> flat_params(model).shape  # kernel 3 x 2, then bias 2
        (8,)
    """
    target = resolve_target(model, variables)
    return np.concatenate([np.ravel(v.numpy()) for v in target.variables])


def set_flat_params(model, theta, *, variables=None):
    """Write a flat vector ``theta`` of shape (m,), in ``flat_params`` order,
    back into the model's trainable variables (or ``variables=``)."""
    target = resolve_target(model, variables)
    theta = np.asarray(theta)
    if theta.shape != (target.n_params,):
        raise ValueError(
            f"theta must be a flat vector of {target.n_params:,} parameters; got "
            f"shape {theta.shape}. Make one with flat_params(model)."
        )
    start = 0
    for v in target.variables:
        size = size_of(v)
        v.assign(theta[start : start + size].reshape(v.shape).astype(target.dtype))
        start += size
