"""A batch of inputs: one array, or a list or dict of them (notebook 00-welcome).

Several inputs come as a list or tuple, or a dict by input name, of arrays that
share their first dimension: the samples. :func:`as_batch` checks a batch
against what the model declares and casts it; the helpers slice, pad and sign
batches of any such structure.
"""

import numpy as np

from ._tf import tf
from .arguments import refuse_non_finite


def n_samples(x):
    """Samples in a batch: the first dimension of its (first) input, an
    ``int`` (a scalar tensor when unknown while tracing)."""
    first = tf.nest.flatten(x)[0]
    return tf.shape(first)[0] if first.shape[0] is None else int(first.shape[0])


def take(x, start, stop):
    """Samples ``start:stop`` of every input of a batch."""
    return tf.nest.map_structure(lambda t: t[start:stop], x)


def pad_with_last(x, n_rows):
    """The batch padded to ``n_rows`` samples with copies of its last sample.

    A copy of a real sample keeps every padded row finite wherever the real
    rows are (a row of zeros may not be: ``log(0)``), so it cannot put NaN
    into a method that mixes rows, such as ``tape.jacobian`` over the batch.
    """

    def pad(t):
        rows = t.shape[0]
        if rows is not None and rows >= n_rows:
            return t
        # tf.tile, not tf.repeat: repeat is a dozen small ops, which cost
        # milliseconds when run eagerly before every padded call
        if rows is None:  # traced: the count is a tensor
            extra = n_rows - tf.shape(t)[0]
            multiples = tf.concat([[extra], tf.ones([t.shape.rank - 1], tf.int32)], 0)
        else:
            multiples = [n_rows - rows] + [1] * (t.shape.rank - 1)
        return tf.concat([t, tf.tile(t[-1:], multiples)], axis=0)

    return tf.nest.map_structure(pad, x)


def signature(x):
    """The ``tf.function`` input signature of a batch: any n, these features."""
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), x
    )


def signature_key(x):
    """A hashable key of :func:`signature`: equal keys share one trace."""
    leaves = tuple((tuple(t.shape[1:]), t.dtype.name) for t in tf.nest.flatten(x))
    return tf.nest.map_structure(lambda _: 0, x).__repr__(), leaves


def _input_names(declared):
    if isinstance(declared, dict):
        return list(declared)
    if isinstance(declared, (list, tuple)):
        return [getattr(t, "name", f"input {i}") for i, t in enumerate(declared)]
    return None


def _structured(x, declared):
    """``x`` arranged like the model's declared inputs (an error if it cannot be)."""
    several = isinstance(declared, (list, tuple)) and len(declared) > 1
    if isinstance(declared, dict):
        if not isinstance(x, dict) or set(x) != set(declared):
            given = sorted(x) if isinstance(x, dict) else type(x).__name__
            raise ValueError(
                f"the model takes a dict of inputs with keys {sorted(declared)}; "
                f"got {given}. Pass x={{name: array, ...}} with every key, each "
                "array with the samples first."
            )
        return {k: x[k] for k in declared}
    if several:
        names = _input_names(declared)
        if isinstance(x, dict):
            if set(x) == set(names):  # Keras takes inputs by name too
                return [x[name] for name in names]
            raise ValueError(
                f"the model takes {len(names)} inputs; got a dict with keys "
                f"{sorted(x)}. Pass a list [{', '.join(names)}], or a dict with "
                f"keys {sorted(names)}."
            )
        if not isinstance(x, (list, tuple)) or len(x) != len(declared):
            got = (
                f"{len(x)} arrays"
                if isinstance(x, (list, tuple))
                else f"one {type(x).__name__}"
            )
            raise ValueError(
                f"the model takes {len(declared)} inputs ({', '.join(names)}); got "
                f"{got}. Pass x=[{', '.join(names)}]: a list of arrays with the "
                "same number of samples first."
            )
        return list(x)
    if declared is not None:
        if isinstance(x, (list, tuple)) and len(x) == 1 and hasattr(x[0], "shape"):
            return x[0]  # [array] for a model of one input
        if isinstance(x, dict):
            raise ValueError(
                f"the model takes one input; got a dict with keys {sorted(x)}. "
                "Pass the array itself."
            )
        return x
    if isinstance(x, dict):
        return dict(x)
    if isinstance(x, (list, tuple)) and x and all(hasattr(e, "shape") for e in x):
        return list(x)  # several arrays for a callable
    return x


def _as_leaf(value, name, declared, dtype):
    """One input array, checked against its declaration and cast."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        array = value
        given = value.dtype
        kind = "S" if given == tf.string else np.dtype(given.as_numpy_dtype).kind
    else:
        try:
            array = np.asarray(value)
        except ValueError as error:
            raise ValueError(
                f"{name} could not be read as one array ({error}). Several inputs "
                "go in a list or dict of arrays, each with the samples first."
            ) from None
        kind = array.dtype.kind
    if kind not in "biuf":
        raise TypeError(
            f"{name} must hold numbers; its dtype is {array.dtype!s}. Convert it "
            "first, for example np.asarray(x, dtype='float32')."
        )
    shape = tuple(array.shape)
    if len(shape) == 0:
        raise ValueError(
            f"{name} is a scalar; pass a batch with a leading sample axis, shape "
            "(n_samples, ...)."
        )
    expected = None if declared is None else tuple(declared.shape[1:])
    if expected is not None and not _compatible(shape[1:], expected):
        hint = ""
        if _compatible(shape, expected):
            hint = (
                f" It looks like one sample without its batch axis: use {name}[None]."
            )
        wanted = ", ".join("any" if d is None else str(d) for d in expected)
        raise ValueError(
            f"{name} has shape {shape}, but the model takes samples of shape "
            f"({wanted}), so {name} should have shape (n_samples, {wanted}).{hint}"
        )
    if shape[0] == 0:
        raise ValueError(f"{name} holds no samples (its first dimension is 0).")
    refuse_non_finite(array, name)
    tensor = tf.convert_to_tensor(array)
    wanted = _leaf_dtype(tensor, declared, dtype)
    return tensor if tensor.dtype == wanted else tf.cast(tensor, wanted)


def _compatible(shape, expected):
    return len(shape) == len(expected) and all(
        e is None or s == e for s, e in zip(shape, expected, strict=True)
    )


def _leaf_dtype(tensor, declared, dtype):
    """Floats take the variables' dtype; integers (token ids) stay integers."""
    declared_dtype = None if declared is None else tf.as_dtype(declared.dtype)
    if declared_dtype is not None and declared_dtype.is_integer:
        return declared_dtype
    if declared_dtype is None and tensor.dtype.is_integer:
        return tensor.dtype
    return tf.as_dtype(dtype)


def _leaf_names(x):
    """How each input is named in messages: x, x[1] or x['ids']."""
    count = len(tf.nest.flatten(x))
    if isinstance(x, dict) and count == len(x):
        return [f"x[{key!r}]" for key in sorted(x)]
    if isinstance(x, (list, tuple)) and count == len(x):
        return [f"x[{i}]" for i in range(count)]
    if isinstance(x, (list, tuple, dict)):
        return [f"x (input {i})" for i in range(count)]
    return ["x"]


def as_batch(x, target):
    """Check a batch of inputs (one array, or a list or dict of them) and cast it.

    Floating-point inputs are cast to the variables' dtype; integer inputs
    (token ids for an ``Embedding``) stay integers. Every input must have the
    same number of samples first, and the per-sample shape that the model
    declares (a ``None`` there takes any size) in ``target``
    (:class:`jacutil.core.target.Target`). Returns the batch as tensors,
    arranged like the model's inputs; ValueError or TypeError, naming the
    input, when a check fails.
    """
    x = _structured(x, target.declared)
    leaves = tf.nest.flatten(x)
    declared = [None] * len(leaves)
    if target.declared is not None:
        declared = tf.nest.flatten(target.declared)
    names = _leaf_names(x)
    cast = [
        _as_leaf(v, name, d, target.dtype)
        for v, name, d in zip(leaves, names, declared, strict=True)
    ]
    counts = {name: int(t.shape[0]) for name, t in zip(names, cast, strict=True)}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in counts.items())
        raise ValueError(
            f"the inputs hold different numbers of samples ({listed}); every "
            "input needs one row per sample, the same samples in the same order."
        )
    return tf.nest.pack_sequence_as(x, cast)
