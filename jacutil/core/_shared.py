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
    """The number of elements of a shape, or of anything with a ``.shape``.

    Args:
        value: a shape (tuple, list, ``tf.TensorShape``) or a variable, tensor
            or array.

    Returns:
        An ``int``: the product of the shape's dimensions (1 for a scalar).

    >>> size_of((3, 2)), size_of(np.zeros((4, 5, 6))), size_of(())
    (6, 120, 1)
    """
    shape = getattr(value, "shape", value)
    return int(np.prod(tuple(shape), dtype=np.int64))


def sizes_of(variables):
    """The element count of each variable: its columns of J, in order.

    Args:
        variables: variables, tensors or arrays (or shapes).

    Returns:
        A list of ``int``, one per variable; their sum is m.
    """
    return [size_of(v) for v in variables]


def count_params(variables):
    """m: the number of parameters in ``variables``, every one flattened.

    Args:
        variables: variables, tensors or arrays (or shapes).

    Returns:
        An ``int``.
    """
    return sum(sizes_of(variables))


def ceil_div(a, b):
    """``a / b`` rounded up, in whole numbers: the chunks of b that cover a.

    Args:
        a: a whole number (samples, rows).
        b: a positive whole number (the chunk size).

    Returns:
        An ``int``.

    >>> ceil_div(10, 4), ceil_div(8, 4), ceil_div(0, 4)
    (3, 2, 0)
    """
    return -(-a // b)


def or_zeros(value, like):
    """``value`` as a tensor, or zeros of ``like``'s shape where it is None.

    A gradient or tangent that TensorFlow returns as None is not connected to
    what was differentiated: its true value is zero.

    Args:
        value: a tensor, ``tf.IndexedSlices`` or None.
        like: a tensor whose shape and dtype the zeros take.

    Returns:
        A dense tensor of ``like``'s shape.
    """
    return tf.zeros_like(like) if value is None else tf.convert_to_tensor(value)


def joined_gradients(grads, sizes, dtype):
    """Gradients of one scalar, each flattened and joined: a row of length m.

    Args:
        grads: one gradient per variable (a tensor, ``tf.IndexedSlices`` or
            None for a variable not connected to the scalar).
        sizes: each variable's element count (:func:`sizes_of`).
        dtype: the dtype of the zeros that stand for None.

    Returns:
        A tensor of shape (m,), in ``flat_params`` order.
    """
    parts = [
        tf.zeros([size], dtype)
        if g is None
        else tf.reshape(tf.convert_to_tensor(g), [-1])
        for g, size in zip(grads, sizes, strict=True)
    ]
    return tf.concat(parts, 0)


def is_path(out):
    """Whether ``out`` names a file (a resumable ``.npy``), not an array.

    Args:
        out: what a caller passed as ``out=``.

    Returns:
        ``True`` for a ``str`` or ``os.PathLike``.
    """
    return isinstance(out, (str, os.PathLike))
