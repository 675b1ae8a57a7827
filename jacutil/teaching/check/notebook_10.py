"""Checks of 10-beyond-one-machine's exercises.

The reference is computed here, in this process, by ``chunked_jacobian`` in
memory: no Dask worker is started. The answers may be large (a file of rows
opened as a memmap); they are compared a block of samples at a time.
"""

from os import PathLike

import numpy as np

from ...engine.rows import chunked_jacobian
from . import Hint, answered, checks, shape_of

_BLOCK = 1000  # samples compared at a time


def _compare_rows(answer, model, x, what, unfinished, wrong):
    """``answer`` against the in-memory Jacobian, block by block."""
    words = "(n samples, l outputs, m parameters)"
    answered(answer, f"{what}, an array of shape {words}")
    if isinstance(answer, (str, PathLike)):
        raise Hint(
            "that is the file's path; put the array that chunked_jacobian "
            "returns in `answer` (or np.load(path, mmap_mode='r'))."
        )
    expected = chunked_jacobian(model, x, method="per_sample", progress=False)
    shape = shape_of(answer)
    if shape != expected.shape:
        raise Hint(
            f"expected {what} of shape {words} = {expected.shape}; got "
            f"{shape}: all of x_resume's samples, every output and parameter."
        )
    zero_rows, differs = [], False
    for start in range(0, len(expected), _BLOCK):
        block = np.asarray(answer[start : start + _BLOCK], dtype="float64")
        if not np.all(np.isfinite(block)):
            raise Hint(f"{what} holds NaN or inf.")
        right = expected[start : start + _BLOCK]
        empty = ~block.reshape(len(block), -1).any(axis=1)
        empty &= right.reshape(len(right), -1).any(axis=1)
        zero_rows.extend(start + np.flatnonzero(empty))
        differs |= not np.allclose(block[~empty], right[~empty], rtol=1e-5, atol=1e-7)
    if zero_rows:
        raise Hint(
            f"the rows of {len(zero_rows):,} of {len(expected):,} samples "
            f"are all zeros (from sample {zero_rows[0]:,} on): {unfinished}"
        )
    if differs:
        raise Hint(wrong)


@checks("10-1")
def resumed_rows(answer, model, x):
    """The killed run's file, finished by resuming with the file's chunks."""
    _compare_rows(
        answer,
        model,
        x,
        "the resumed Jacobian",
        unfinished="chunks that were never finished. The ledger lists what "
        "is done; resuming with the file's own chunk size computes the rest.",
        wrong="it differs from the Jacobian of `model` on `x_resume` "
        "computed here in memory. Were the model's weights put back after "
        "the ResumeMismatch demonstration?",
    )


@checks("10-2")
def rows_despite_lost_workers(answer, model, x):
    """The workers' Jacobian, computed while both workers were killed."""
    _compare_rows(
        answer,
        model,
        x,
        "the Jacobian from the workers",
        unfinished="chunks that no worker delivered. distributed_jacobian "
        "returns only when every chunk is in: take what it returns.",
        wrong="it differs from the Jacobian of `model` on `x_resume` "
        "computed here in memory. Did the workers get `model` and "
        "`x_resume`?",
    )
