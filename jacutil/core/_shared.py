"""Small helpers that several modules need (internal).

One copy of each small idea: element counts of shapes and variables, ceiling
division, gradients that are None (not connected) as zeros, and "is ``out``
a path". Shapes follow the package's n (samples), l (outputs), m
(parameters) convention.
"""

import os

import numpy as np

from ._tf import tf


def size_of(value):
    """The number of elements (an ``int``) of a shape, or of anything with a
    ``.shape``.

    >>> size_of((3, 2)), size_of(np.zeros((4, 5, 6))), size_of(())
    (6, 120, 1)
    """
    shape = getattr(value, "shape", value)
    return int(np.prod(tuple(shape), dtype=np.int64))


def sizes_of(variables):
    """The element count of each variable (or shape): its columns of J."""
    return [size_of(v) for v in variables]


def count_params(variables):
    """m: the number of parameters in ``variables``, every one flattened."""
    return sum(sizes_of(variables))


def ceil_div(a, b):
    """``a / b`` rounded up, in whole numbers: the chunks of b that cover a.

    >>> ceil_div(10, 4), ceil_div(8, 4), ceil_div(0, 4)
    (3, 2, 0)
    """
    return -(-a // b)


def or_zeros(value, like):
    """``value`` as a dense tensor, or zeros like ``like`` where it is None (a
    gradient or tangent not connected: its true value is zero)."""
    return tf.zeros_like(like) if value is None else tf.convert_to_tensor(value)


def joined_gradients(grads, sizes, dtype):
    """Gradients of one scalar (None: zeros of ``dtype``), each of ``sizes``
    (:func:`sizes_of`) flattened and joined: a tensor (m,)."""
    parts = [
        tf.zeros([size], dtype)
        if g is None
        else tf.reshape(tf.convert_to_tensor(g), [-1])
        for g, size in zip(grads, sizes, strict=True)
    ]
    return tf.concat(parts, 0)


def is_path(out):
    """Whether ``out=`` names a file (a ``str`` or ``os.PathLike``: a
    resumable ``.npy``), not an array."""
    return isinstance(out, (str, os.PathLike))


def few_names(names, shown=3):
    """``names`` joined for a message, cut to the first ``shown`` and a count,
    so that a model of fifty layers does not bury the advice after them.

    Examples:
        >>> few_names(["bn1", "bn2"])
        'bn1, bn2'
        >>> few_names([f"bn{k}" for k in range(1, 51)])
        'bn1, bn2, bn3 and 47 more'
    """
    names = list(names)
    if len(names) <= shown + 1:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"
