"""Checks of 03-compiled's exercises."""

import numpy as np

from ...core._tf import tf
from ...engine.compiled import bucket_size
from . import Hint, answered, as_number, checks, close_number


def xla_shapes(sizes, block_size):
    """The padded batch shapes (a set of ``int``) XLA compiles for the batch
    sizes ``sizes``, by compiled_jacobian's rule for its ``block_size``."""
    shapes = set()
    for n in sizes:
        for start in range(0, n, block_size):  # blocks; one when n <= block_size
            shapes.add(bucket_size(min(block_size, n - start), block_size))
    return shapes


@checks("03-2")
def shapes_xla_compiles(answer, sizes, block_size):
    """Powers of two up to block_size: larger batches run in blocks."""
    what = "the sorted list of batch shapes XLA compiles"
    answered(answer, what)
    try:
        values = [float(v) for v in np.asarray(answer, dtype=object).ravel()]
    except (TypeError, ValueError):
        raise Hint(f"expected {what}: a list of whole numbers.") from None
    if not values or any(v != int(v) or v < 1 for v in values):
        raise Hint(f"expected {what}: a list of whole numbers, each at least 1.")
    shapes = {int(v) for v in values}
    expected = xla_shapes([int(n) for n in sizes], int(block_size))
    if shapes == expected:
        return
    if any(s > block_size for s in shapes):
        raise Hint(
            f"no compiled shape is larger than block_size = {block_size}: a "
            "larger batch runs in blocks of block_size, and only its last, "
            "partial block is padded (to its own padded size)."
        )
    if 1 in shapes - expected:
        raise Hint(
            "a batch of one sample is padded too, to two: pfor fails on some "
            "graphs with a single sample, so compiled_jacobian never runs one."
        )
    if shapes - expected:
        raise Hint(
            "XLA never sees most batch sizes: each batch (or block) is padded "
            "with copies of its last sample to the next power of two, capped at "
            "block_size. Some numbers in your list are not such padded sizes."
        )
    raise Hint(
        f"{len(expected - shapes)} shape(s) are missing. Apply the padding "
        "rule to every size of the range, the smallest included, and to the "
        "blocks of the sizes above block_size."
    )


@checks("03-1")
def traces_with_reduce_retracing(answer, sizes):
    """(the traces of a tiny reduce_retracing tf.function over ``sizes``, the
    batch dimension its last trace recorded: None for "any")."""
    traces = []

    def tiny(x):
        traces.append(x.shape[0])  # a Python side effect: once per trace
        return 2 * x

    relaxed = tf.function(tiny, reduce_retracing=True)
    for n in sizes:
        relaxed(tf.zeros([int(n), 1]))
    answered(answer, "(traces, batch dimension)")
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        raise Hint(
            "expected two things, answer = (traces, batch): the number of "
            "traces, then the batch dimension that the last trace recorded "
            "(a number, or None), which says why there are no more."
        )
    count, batch = answer
    count = as_number(count, "the number of traces")
    distinct = len(set(sizes))
    if count == distinct and count != len(traces):
        raise Hint(
            "that is one trace per batch size, a plain tf.function's count. "
            "With reduce_retracing=True, TensorFlow generalises the shape "
            "after it has seen more than one: which batch dimension does the "
            "second trace record (print `traces`)?"
        )
    if count == 1 and len(traces) > 1:
        raise Hint(
            "the first call cannot know that the batch size will change: it "
            "traces for the exact shape it sees. What happens at the next size?"
        )
    close_number(count, len(traces), 0, "your number of traces")
    if batch != traces[-1]:
        if traces[-1] is None:
            raise Hint(
                f"the last trace did not record {batch!r}: a graph traced for "
                "one batch size could not serve the sizes after it. Print "
                "`traces`: what is its last entry?"
            )
        raise Hint(f"the last trace recorded {traces[-1]}, one size: print `traces`.")
