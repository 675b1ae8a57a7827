"""Argument checks every entry shares, with one set of messages
(notebook 06-pitfalls).

Each entry that takes a chunk size, a memory budget or data checks them
here, once (a list of variables: ``jacutil.core.target.variable_list``), so
that ``chunk_size=-2`` or NaN in ``y`` gets the same clear error from
``chunked_jacobian``, ``ggn_operator`` or ``per_sample_gradients`` - never a
silent zero or a raw NumPy message.
"""

import math

import numpy as np

from ._tf import tf

SHOWN = 5  # sample indices named in a message


def check_chunk_size(chunk_size, name="chunk_size"):
    """A chunk size: None, or a whole number >= 1 (``name`` in the message)."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"{name} must be a whole number; got {chunk_size!r}.")
    if chunk_size <= 0:
        raise ValueError(
            f"{name} must be at least 1; got {chunk_size}. Leave it as None "
            "to choose it from memory_budget."
        )
    return int(chunk_size)


def check_memory_budget(memory_budget, name="memory_budget"):
    """A memory budget: None, or a positive, finite number of bytes, as an
    ``int`` (``name`` in the message)."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(
        memory_budget, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"{name} must be a number of bytes (e.g. 2**30 for 1 GiB); got "
            f"{memory_budget!r}."
        )
    if not math.isfinite(memory_budget) or memory_budget < 1:
        raise ValueError(
            f"{name} must be a positive number of bytes (e.g. 2**30 for 1 GiB); "
            f"got {memory_budget}. Leave it as None for the entry's default "
            "(its docstring says which)."
        )
    return int(memory_budget)


def refuse_non_finite(values, name):
    """Refuse NaN or infinity in an input or target, naming the samples.

    A NaN sample turns per-sample gradients, G and a DP-SGD step into NaN
    without a word; this says where it is instead. Symbolic tensors (inside
    a ``tf.function``) are not checked: the eager caller checked them.

    Args:
        values: an array or tensor (or a structure of them) with the samples
            first; integer leaves are skipped.
        name: how the argument is named in the message (``"x"``, ``"y"``).
    """
    for leaf in tf.nest.flatten(values):
        if isinstance(leaf, tf.Tensor) and not hasattr(leaf, "numpy"):
            continue  # traced: no values to look at
        array = np.asarray(leaf)
        if array.dtype.kind not in "fc" or array.size == 0:
            continue
        finite = np.isfinite(array)
        if finite.all():
            continue
        rows = finite.reshape(len(array), -1).all(axis=1) if array.ndim else finite
        bad = np.flatnonzero(~np.atleast_1d(rows))
        shown = ", ".join(map(str, bad[:SHOWN])) + (", ..." if len(bad) > SHOWN else "")
        raise ValueError(
            f"{name} holds NaN or infinity in {len(bad)} sample(s) (indices "
            f"{shown}). Every quantity computed from them would be NaN: drop or "
            f"fix those samples first, e.g. keep = np.isfinite({name}).all(axis=1)."
        )
