"""Data as Keras users hold it: what ``model.fit`` takes, read into arrays
(notebook 04-chunked).

Every entry that takes ``x`` (and ``y``) also takes a ``tf.data.Dataset`` or a
``keras.utils.PyDataset`` whose batches are ``x``, ``(x,)``, ``(x, y)`` or
``(x, y, sample_weight)``, as ``model.fit`` reads them (``x`` and ``y`` may be
lists or dicts of arrays for several inputs or heads). :func:`read_data`
reads its batches once, in order, into arrays; the entry then runs as on
arrays, in chunks sized by its memory budget. The inputs are usually far
smaller than what is computed from them (J has l * m numbers per sample), so
reading them whole costs little; the result is what the chunks bound.

A source that never ends (``.repeat()``) is refused, and so is a resumable
``out=`` over a dataset whose order changes from one pass to the next (a
``shuffle`` without a seed): a run resumes only on the same samples in the
same order.
"""

import numpy as np

from ._tf import keras, tf


def is_data_source(x):
    """Whether ``x`` is a dataset (``tf.data`` or a Keras ``PyDataset``) or a
    Python iterator, rather than arrays."""
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        return True
    return hasattr(x, "__next__") and not isinstance(x, (np.ndarray, tf.Tensor))


def _batches(source):
    """Each batch of ``source``, in order."""
    if isinstance(source, keras.utils.PyDataset):
        n = source.num_batches
        if n is None:
            raise ValueError(
                "this PyDataset never ends (its num_batches is None): give it a "
                "__len__ (the number of batches), as model.predict needs."
            )
        for k in range(n):
            yield source[k]
        return
    if isinstance(source, tf.data.Dataset):
        if int(source.cardinality()) == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "this tf.data.Dataset never ends (.repeat() without a count): "
                "pass it without .repeat(), or with .take(steps)."
            )
        yield from source.as_numpy_iterator()
        return
    raise TypeError(
        "a generator or iterator has no length, and reading it to the end may "
        "never end: wrap it as model.fit's data, e.g. "
        "tf.data.Dataset.from_generator(make, output_signature=...).take(steps), "
        "or pass arrays."
    )


def _parts(batch):
    """``(x, y, sample_weight)`` of one batch, as ``model.fit`` unpacks it."""
    if isinstance(batch, tuple):
        if not 1 <= len(batch) <= 3:
            raise ValueError(
                "each batch must be x, (x,), (x, y) or (x, y, sample_weight), as "
                f"model.fit takes them; got a tuple of {len(batch)}."
            )
        return (*batch, None, None)[:3]
    return batch, None, None


def _joined(pieces, what):
    """The batches' pieces joined along the samples (None where every batch
    has none)."""
    present = [p is not None for p in pieces]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"some batches have {what} and others do not.")
    return tf.nest.map_structure(
        lambda *leaves: np.concatenate([np.asarray(leaf) for leaf in leaves]), *pieces
    )


def _read(source):
    batches = [_parts(b) for b in _batches(source)]
    if not batches:
        raise ValueError("the dataset is empty: it gave no batch.")
    return tuple(
        _joined([b[k] for b in batches], what)
        for k, what in enumerate(("x", "y", "sample_weight"))
    )


def read_data(x, y=None, sample_weight=None, *, repeatable=False):
    """``(x, y, sample_weight)`` as arrays, from arrays (a structure of them,
    given back as they are) or a ``tf.data.Dataset`` or
    ``keras.utils.PyDataset`` of ``model.fit``'s batches, which carries its
    own ``y`` and ``sample_weight``. With ``repeatable`` (the caller writes a
    resumable file) a dataset must give the same samples in the same order
    each time it is read. ValueError or TypeError for a source that cannot be
    read so (module docstring). Introduced in ``04-chunked``.
    """
    if not is_data_source(x):
        return x, y, sample_weight
    pairs = (("y", y), ("sample_weight", sample_weight))
    given = [name for name, value in pairs if value is not None]
    if given:
        raise ValueError(
            f"{' and '.join(given)} must not be given with a dataset: as in "
            "model.fit, its batches carry them: (x, y) or (x, y, sample_weight)."
        )
    read = _read(x)
    if repeatable and isinstance(x, tf.data.Dataset):
        again = tf.nest.flatten(_read(x))
        if not all(map(np.array_equal, tf.nest.flatten(read), again)):
            raise ValueError(
                "this dataset gives its samples in another order each time it "
                "is read (a shuffle without a seed, or reshuffle_each_iteration"
                "): a resumable out= file can only be continued on the same "
                "samples in the same order. Shuffle with a seed and "
                "reshuffle_each_iteration=False, leave the shuffle out, or pass "
                "arrays."
            )
    return read
