"""Data as Keras users hold it: what ``model.fit`` takes, read into arrays
(notebook 04-chunked).

Every entry that takes ``x`` (and ``y``) also takes what ``model.fit`` and
``model.predict`` read: a ``tf.data.Dataset`` (batched or not, ``padded_batch``
too), a ``keras.utils.PyDataset`` (its ``workers`` and
``use_multiprocessing`` as Keras uses them) or a generator, whose batches are
``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` (a list reads as a
tuple; ``x`` and ``y`` may be lists or dicts of arrays for several inputs or
heads). :func:`read_data` reads them through Keras's own data adapter and
``keras.utils.unpack_x_y_sample_weight``, once, in order, into arrays; the
entry then runs as on arrays, in chunks sized by its memory budget. The
inputs are usually far smaller than what is computed from them (J has l * m
numbers per sample), so reading them whole costs little; the result is what
the chunks bound. Where the result goes into a given array or memmap, the
source is streamed instead (:func:`stream_rows`): one batch of inputs in
memory at a time, however large the source.

A source whose end is not known is refused at once, unless ``steps`` says
how many batches to read (as ``model.predict`` takes it): ``.repeat()``, a
generator, ``Dataset.from_generator`` or a ``filter``. Batches of different
shapes (``padded_batch``, each padded to its own longest sequence) cannot
be joined: :class:`BatchesOfShapes` holds them by shape, for an entry that
computes each group apart. A resumable ``out=`` over a dataset whose order
changes from one pass to the next (a ``shuffle`` without a seed) is refused:
its first batch is read again and compared, not the whole source.
"""

import numpy as np
from tqdm.auto import tqdm

from ._tf import keras, tf
from .internals import data_adapter


class BatchesOfShapes(ValueError):
    """The source's batches differ in per-sample shape (``padded_batch``):
    ``groups`` holds ``(x, y, sample_weight)`` per run of batches of one
    shape, in order, each joined."""

    def __init__(self, groups):
        self.groups = groups
        shapes = sorted({_shapes(g[0]) for g in groups})
        super().__init__(
            f"the dataset's batches have {len(shapes)} different shapes (e.g. "
            f"{', '.join(map(str, shapes[:3]))}: padded_batch pads each batch to "
            "its own length), so they cannot be joined into one array. Pad "
            "every batch to one length (padded_batch(..., padded_shapes=...) "
            "with a fixed length), or compute batch by batch."
        )


def _shapes(x):
    return tuple(np.shape(leaf)[1:] for leaf in tf.nest.flatten(x))


def is_data_source(x):
    """Whether ``x`` is a dataset (``tf.data`` or a Keras ``PyDataset``) or a
    Python iterator, rather than arrays."""
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        return True
    return hasattr(x, "__next__") and not isinstance(x, (np.ndarray, tf.Tensor))


UNBATCHED_BATCH = 256  # samples a batch, where a dataset gives single samples


def _batched(source, inputs):
    """A ``tf.data.Dataset`` of single samples (a scalar target, or inputs of
    one rank less than the model's) batched, as ``model.fit`` needs it."""
    if not isinstance(source, tf.data.Dataset):
        return source
    element = keras.utils.unpack_x_y_sample_weight(source.element_spec)
    ranks = [spec.shape.rank for spec in tf.nest.flatten(element[0])]
    declared = [len(t.shape) for t in tf.nest.flatten(inputs)] if inputs else []
    scalar_y = element[1] is not None and any(
        spec.shape.rank == 0 for spec in tf.nest.flatten(element[1])
    )
    one_less = len(declared) == len(ranks) and all(
        r is not None and r == d - 1 for r, d in zip(ranks, declared, strict=True)
    )
    return source.batch(UNBATCHED_BATCH) if scalar_y or one_less else source


def _batches(source, steps):
    """Each batch of ``source`` as ``(x, y, sample_weight)``, in order, by
    Keras's own data adapter."""
    if isinstance(source, tf.data.Dataset) and steps is None:
        cardinality = int(source.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "this tf.data.Dataset never ends (.repeat() without a count): "
                "pass steps= (the number of batches to read, as model.predict "
                "takes it), or .take(steps)."
            )
        if cardinality == tf.data.UNKNOWN_CARDINALITY:
            raise ValueError(
                "this tf.data.Dataset does not know its length (from_generator, "
                "filter, ...), and reading it to the end may never end: pass "
                "steps= (the number of batches to read), or give it its length "
                "with .apply(tf.data.experimental.assert_cardinality(batches))."
            )
    elif isinstance(source, keras.utils.PyDataset) and steps is None:
        if source.num_batches is None:
            raise ValueError(
                "this PyDataset never ends (its num_batches is None): give it a "
                "__len__ (the number of batches), or pass steps=."
            )
    elif not isinstance(source, (tf.data.Dataset, keras.utils.PyDataset)):
        if steps is None:
            raise TypeError(
                "a generator or iterator has no length, and reading it to the "
                "end may never end: pass steps= (the number of batches to "
                "read, as model.predict takes it), wrap it as "
                "tf.data.Dataset.from_generator(make, output_signature=...)"
                ".take(steps), or pass arrays."
            )
    adapter = data_adapter(source, steps)
    adapter.on_epoch_begin()  # a PyDataset's workers start here
    try:
        for k, batch in enumerate(adapter.get_numpy_iterator()):
            if steps is not None and k >= steps:
                break
            yield keras.utils.unpack_x_y_sample_weight(batch)
    finally:
        adapter.on_epoch_end()


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


def _join(batches):
    return tuple(
        _joined([b[k] for b in batches], what)
        for k, what in enumerate(("x", "y", "sample_weight"))
    )


def _read(source, steps):
    batches = list(_batches(source, steps))
    if not batches:
        raise ValueError("the dataset is empty: it gave no batch.")
    runs = [[batches[0]]]
    for batch in batches[1:]:
        same = _shapes(batch[0]) == _shapes(runs[-1][-1][0])
        runs[-1].append(batch) if same else runs.append([batch])
    if len(runs) > 1:
        raise BatchesOfShapes([_join(run) for run in runs])
    return _join(batches)


def _same_first_batch(source, read, steps):
    """Whether ``source`` gives its first batch again as ``read`` began: a
    dataset that reshuffles each pass does not."""
    first = next(iter(_batches(source, steps)))[0]
    rows = len(tf.nest.flatten(first)[0])
    again = [np.asarray(leaf)[:rows] for leaf in tf.nest.flatten(read[0])]
    return all(map(np.array_equal, tf.nest.flatten(first), again))


def read_data(x, y=None, sample_weight=None, *, repeatable=False, steps=None,
              inputs=None):  # fmt: skip
    """``(x, y, sample_weight)`` as arrays, from arrays (a structure of them,
    given back as they are) or a ``tf.data.Dataset``, ``keras.utils.PyDataset``
    or generator of ``model.fit``'s batches, which carries its own ``y`` and
    ``sample_weight``. ``steps``: how many batches to read (None: to the end,
    where the end is known). ``inputs``: the model's declared inputs, which
    tell single samples from batches. With ``repeatable`` (the caller writes a
    resumable file) a dataset must give the same samples in the same order
    each time it is read. ValueError or TypeError for a source that cannot be
    read so, :class:`BatchesOfShapes` for batches that cannot be joined
    (module docstring). Introduced in ``04-chunked``.
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
    source = _batched(x, inputs)
    read = _read(source, steps)
    if repeatable and not _same_first_batch(source, read, steps):
        raise ValueError(
            "this dataset gives its samples in another order each time it is "
            "read (a shuffle without a seed, or reshuffle_each_iteration): a "
            "resumable out= file can only be continued on the same samples in "
            "the same order. Shuffle with a seed and "
            "reshuffle_each_iteration=False, leave the shuffle out, or pass "
            "arrays."
        )
    return read


def inputs_of(model):
    """A Keras model's declared inputs (what tells single samples from
    batches in :func:`read_data`), or None."""
    try:
        return getattr(model, "inputs", None)
    except (AttributeError, ValueError):  # a model never called
        return None


def stream_rows(x, compute, out, *, steps=None, inputs=None, progress=False):
    """An entry that gives one row per sample, on a data source ``x``, into
    ``out`` (an array or memmap with a row per sample): ``compute(x, y,
    sample_weight)`` on each batch as the source gives it, its rows written
    to ``out`` in order. Only one batch of inputs is in memory at a time, so
    the peak is the entry's budget however large the source (notebook
    04-chunked); batches of several shapes (``padded_batch``) are computed
    each apart. ``compute`` returns the rows, or ``(rows, extra)``: the last
    batch's ``extra`` comes back beside ``out``. ValueError when ``out`` does
    not have a row for each sample, or rows of another shape or dtype."""
    start, extra, had_extra = 0, None, False
    with tqdm(total=len(out), disable=not progress, unit="sample") as bar:
        for batch in _batches(_batched(x, inputs), steps):
            found = compute(*batch)
            if isinstance(found, tuple):
                (found, extra), had_extra = found, True
            rows = np.asarray(found)
            stop = start + len(rows)
            fits = rows.shape[1:] == out.shape[1:] and rows.dtype == out.dtype
            if stop > len(out) or not fits:
                raise ValueError(
                    f"out has shape {out.shape} and dtype {out.dtype}, but the "
                    f"source's rows so far need ({stop}, *{rows.shape[1:]}) and "
                    f"{rows.dtype}: make out with one row per sample of the "
                    "source (e.g. np.lib.format.open_memmap(path, mode='w+', "
                    "shape=..., dtype=...))."
                )
            out[start:stop] = rows
            start = stop
            bar.update(len(rows))
    if start != len(out):
        raise ValueError(
            f"out has {len(out)} rows, but the source gave {start} samples: "
            "make out with one row per sample of the source."
        )
    return (out, extra) if had_extra else out


def rows_by_shape(shapes, compute, out=None, resumable=False):
    """An entry that gives one row per sample, on batches of several shapes
    (:class:`BatchesOfShapes`): ``compute(x, y, sample_weight)`` on each
    group, in order, its rows joined (into ``out`` where given). ``compute``
    returns the rows, or ``(rows, extra)``; the last group's ``extra`` comes
    back beside them. A resumable file needs one shape: refused."""
    if resumable:
        raise ValueError(f"{shapes} A resumable out= file needs batches of one shape.")
    parts, extra, had_extra = [], None, False
    for group in shapes.groups:
        found = compute(*group)
        if isinstance(found, tuple):
            (found, extra), had_extra = found, True
        parts.append(np.asarray(found))
    if out is None:
        rows = np.concatenate(parts)
    else:
        start = 0
        for part in parts:
            out[start : start + len(part)] = part
            start += len(part)
        rows = out
    return (rows, extra) if had_extra else rows
