"""A model's outputs as rows: one layout for any nest (notebook 00-welcome).

Outputs: whatever nest the model returns; one sample's row is every output
leaf flattened and joined in ``tf.nest.flatten`` order (dict keys sorted), so
``n_outputs`` counts them all. :func:`jacutil.split_outputs` splits a
Jacobian's rows back into the model's output structure.
"""

from dataclasses import dataclass

import numpy as np

from ._shared import count_params, sizes_of
from ._tf import tf
from .batch import n_samples, signature_key, take
from .guards import JacobianError


@dataclass(frozen=True)
class OutputLayout:
    """Where each output leaf sits in a sample's row (see :func:`output_layout`).

    ``structure`` is the model's output nest, each leaf replaced by its index
    in ``tf.nest.flatten`` order; ``shapes`` the per-sample shape of each
    leaf, in that order; ``n_outputs``, l, the elements of all of them.
    """

    structure: object
    shapes: tuple
    n_outputs: int

    def slices(self):
        """One ``slice`` of a sample's row per output leaf, in flatten order."""
        sizes = sizes_of(self.shapes)
        ends = np.cumsum(sizes)
        return [slice(int(e - s), int(e)) for s, e in zip(sizes, ends, strict=True)]


def as_rows(y, n):
    """Output nest -> (n, n_outputs): every leaf flattened per sample and joined.

    A leaf whose first dimension is not the number of samples (a batch mean,
    a sum over samples) has no per-sample Jacobian: that is an error.
    """
    leaves = tf.nest.flatten(y)
    if not leaves:
        raise JacobianError("the model returned no outputs.")
    rows = []
    for i, leaf in enumerate(leaves):
        leaf = tf.convert_to_tensor(leaf)
        where = "the model's output" if len(leaves) == 1 else f"output leaf {i}"
        if leaf.shape.rank == 0:
            raise JacobianError(
                f"{where} is a scalar; a per-sample Jacobian needs one output "
                "row per sample, shape (n_samples, ...). Return the per-sample "
                "outputs, not a loss summed over the batch."
            )
        first = leaf.shape[0]
        static_n = n if isinstance(n, int) else None
        if first is not None and (static_n is None or first != static_n):
            _not_per_sample(where, leaf.shape, static_n)
        if not leaf.dtype.is_floating:
            raise JacobianError(
                f"{where} has dtype {leaf.dtype.name}; only floating-point "
                "outputs have derivatives. Return the float scores (logits), "
                "not argmax or a cast to integers."
            )
        rows.append(tf.reshape(leaf, [n, -1]))
    dtype = max((r.dtype for r in rows), key=lambda d: d.size)
    return tf.concat([tf.cast(r, dtype) for r in rows], axis=1)


def _not_per_sample(where, shape, n):
    batch = "a batch" if n is None else f"a batch of {n} sample{'s' * (n != 1)}"
    raise JacobianError(
        f"{where} has shape {tuple(shape)} for {batch}: its first dimension "
        "is not the number of samples. A per-sample Jacobian needs every "
        "output to keep the samples first: a mean or sum over the batch mixes "
        "the samples and has no per-sample rows. Return per-sample outputs and "
        "reduce them outside the model."
    )


def output_layout(target, x):
    """The :class:`OutputLayout` of the model on batch ``x``.

    Runs the model eagerly on the first sample and the first two, once per
    input signature, and checks that every output leaf has one row per
    sample (JacobianError as in :func:`as_rows`). ``target.layouts`` caches
    the answer per input signature.
    """
    key = signature_key(x)
    if key not in target.layouts:
        # One sample and two: an output whose first dimension is not the
        # number of samples (a batch mean of width 2, say) fails one of them.
        for count in sorted({1, min(2, int(n_samples(x)))}):
            y = target.call(take(x, 0, count))
            as_rows(y, count)  # the checks, with a static number of samples
        shapes = tuple(
            tuple(tf.convert_to_tensor(t).shape[1:]) for t in tf.nest.flatten(y)
        )
        structure = tf.nest.pack_sequence_as(y, list(range(len(shapes))))
        n_outputs = count_params(shapes)
        target.layouts[key] = OutputLayout(structure, shapes, n_outputs)
    return target.layouts[key]
