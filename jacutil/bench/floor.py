"""The write floor: the least time any Jacobian of shape (n, l, m) can take.

Whatever computes J must at least write its n * l * m numbers. The *floor*
is filling a preallocated float32 array of J's shape (``fill_floor``,
allocated and touched once, outside the timing): memory bandwidth alone.
Beside it, ``write_floor`` allocates a fresh array and writes it
(``np.full``), which any function that returns a new Jacobian must also do:
the difference is the cost of fresh pages. Introduced in ``07-benchmark``.
"""

import numpy as np

FLOOR = "floor"  # fill a preallocated array: the floor every ratio is to
FLOOR_NEW = "floor_new"  # np.full: a fresh array, allocated and written
LABELS = {
    FLOOR: "write floor (fill a preallocated array)",
    FLOOR_NEW: "write floor, new array (np.full)",
}


def preallocated(shape, dtype=np.float32):
    """An array of J's shape whose pages are already touched.

    Args:
        shape: (n, l, m).
        dtype: the array's dtype.

    Returns:
        A NumPy array of zeros.
    """
    out = np.empty(shape, dtype)
    out.fill(0.0)  # touch every page now, so the timing does not fault them in
    return out


def fill_floor(out):
    """The floor: write every element of the preallocated ``out`` once.

    Args:
        out: the array (see :func:`preallocated`).

    Returns:
        ``out``, every element 1.
    """
    out.fill(1.0)
    return out


def write_floor(shape, dtype=np.float32):
    """A fresh array of the Jacobian's shape, every element written once.

    Args:
        shape: (n, l, m).
        dtype: the array's dtype.

    Returns:
        A new NumPy array of ones.
    """
    return np.full(shape, 1.0, dtype)
