"""What every stage needs: the forward pass, the variables, and a checked batch.

Each stage starts with :func:`resolve_target` (what to differentiate) and
:func:`as_batch` (the input, checked and cast), and ends with
:func:`stack_columns` (one block of columns per variable, in ``flat_params``
order). The checks here are the reason a wrong call fails with a message that
says what to do, instead of returning a page of zeros.

**The layout** (notebook ``00-welcome``). Inputs: one array, or a list, tuple
or dict of arrays (a model's several inputs) that share their first dimension,
the samples. Outputs: whatever nest the model returns; one sample's row is
every output leaf flattened and joined in ``tf.nest.flatten`` order (dict keys
sorted), so ``n_outputs`` counts them all. :func:`jacutil.split_outputs` splits
a Jacobian's rows back into the model's output structure.
"""

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ._tf import keras, tf
from .guards import JacobianError, check_training_mode, require_connected


@dataclass
class Target:
    """A forward pass ``x -> (n_samples, n_outputs)`` and its variables.

    ``call(x)`` returns the model's own output nest; ``forward(x)`` the rows.
    ``declared`` is the model's declared input nest (Keras tensors), or None.
    ``layers`` holds every Keras layer of the model (none for a callable).
    """

    call: Callable
    variables: list
    dtype: np.dtype
    declared: object = None
    layers: tuple = ()
    training: bool = False
    layouts: dict = field(default_factory=dict)  # input signature -> OutputLayout

    @property
    def n_params(self):
        return sum(_size(v) for v in self.variables)

    def forward(self, x):
        """The outputs of batch ``x`` as rows: (n_samples, n_outputs)."""
        return as_rows(self.call(x), n_samples(x))

    def watch(self, tape):
        """Make ``tape`` record every variable, trainable or not."""
        for v in self.variables:
            tape.watch(v.value if isinstance(v, keras.Variable) else v)


@dataclass(frozen=True)
class OutputLayout:
    """Where each output leaf sits in a sample's row (see :func:`output_layout`)."""

    structure: object  # the model's output nest, each leaf its index in flatten order
    shapes: tuple  # per-sample shape of each leaf, in tf.nest.flatten order
    n_outputs: int

    def slices(self):
        """One ``slice`` of a sample's row per output leaf, in flatten order."""
        sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        ends = np.cumsum(sizes)
        return [slice(int(e - s), int(e)) for s, e in zip(sizes, ends, strict=True)]


def _size(variable):
    return int(np.prod(variable.shape, dtype=np.int64))


def _is_variable(value):
    return isinstance(value, (tf.Variable, keras.Variable))


def _float_dtype(variable):
    dtype = tf.as_dtype(variable.dtype)
    if not dtype.is_floating:
        raise TypeError(
            f"variable {variable.name!r} has dtype {dtype.name}; a Jacobian "
            "needs floating-point variables (float32 or float64)."
        )
    return np.dtype(dtype.as_numpy_dtype)


def _declared_inputs(model):
    """The model's declared input nest (Keras tensors), or None if unknown."""
    for attribute in ("input", "inputs"):  # a Sequential not yet called: inputs
        try:
            declared = getattr(model, attribute)
        except (AttributeError, ValueError):
            continue
        if isinstance(declared, (list, tuple)) and len(declared) == 1:
            return declared[0]
        if declared is not None and len(tf.nest.flatten(declared)) > 0:
            return declared
    return None


def _built_variables(model, x):
    """Trainable variables of a Keras model, building it on one sample if needed."""
    if not model.built and x is not None:
        model(take(x, 0, 1), training=False)
    return list(model.trainable_variables)


def variable_list(variables):
    """``variables=`` as a checked list: variables only, each once, one dtype.

    Any iterable is taken (a generator is read once, here). Trainable or not,
    every variable in the list is differentiated.
    """
    if _is_variable(variables):
        raise TypeError(
            "variables= must be a list of variables, not one variable: "
            "pass variables=[v]."
        )
    try:
        variables = list(variables)
    except TypeError:
        raise TypeError(
            f"variables= must be a list of variables; got {type(variables).__name__}."
        ) from None
    if not variables:
        raise ValueError("variables= is empty: pass at least one variable.")
    seen = {}
    for v in variables:
        if not _is_variable(v):
            raise TypeError(
                f"variables= must hold tf.Variable or keras.Variable objects; got "
                f"{type(v).__name__}. A tensor computed from the variables "
                "(such as tf.concat of them, flattened) is a copy that the model "
                "never reads: pass the variables themselves."
            )
        if id(v) in seen:
            raise ValueError(
                f"variable {v.name!r} appears twice in variables=. Each variable "
                "is one block of columns, and theta (flat_params) would hold it "
                "twice; list every variable once."
            )
        seen[id(v)] = v
    return variables


def _one_dtype(variables):
    """The variables' one float dtype; two dtypes are an error that names them."""
    by_dtype = {}
    for v in variables:
        by_dtype.setdefault(_float_dtype(v), []).append(v.name)
    if len(by_dtype) > 1:
        listed = "; ".join(
            f"{d.name}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
            for d, names in by_dtype.items()
        )
        raise TypeError(
            f"the variables have {len(by_dtype)} dtypes ({listed}), but one "
            "Jacobian has one dtype. Build every layer with the same dtype "
            "(dtype= on each layer, or keras.config.set_floatx before building), "
            "or pass variables= of one dtype."
        )
    return next(iter(by_dtype))


class PrecisionWarning(UserWarning):
    """The model computes in float16 or bfloat16 (a mixed-precision policy)."""


def _check_precision(layers, dtype):
    half = sorted(
        {
            layer.compute_dtype
            for layer in layers
            if layer.compute_dtype in ("float16", "bfloat16")
        }
    )
    if half:
        warnings.warn(
            f"the model computes in {' and '.join(half)} (a mixed-precision "
            f"policy), so this {dtype.name} Jacobian is only as accurate as "
            f"{half[0]}: about 3 significant digits, and derivatives that small "
            "round to zero. For an optimizer, build the model with "
            "keras.mixed_precision.set_global_policy('float32') and copy the "
            "weights into it (model.get_weights / set_weights).",
            PrecisionWarning,
            stacklevel=4,
        )


def _keras_call(model, training):
    """``x -> model(x, training=training)`` that does not keep the model alive."""
    reference = weakref.ref(model)

    def call(x):
        return reference()(x, training=training)

    return call


def _plain_call(model):
    if hasattr(model, "__self__") and hasattr(model, "__func__"):
        method = weakref.WeakMethod(model)  # a bound method: keep only its object

        def call(x):
            return method()(x)

        return call
    return model


def resolve_target(model, variables=None, training=False, x=None):
    """Check ``model`` and ``variables`` and return a :class:`Target`.

    ``model`` is a Keras model (its trainable variables are used) or any
    callable ``f(x)``, which then needs ``variables=``. ``variables=`` (any
    iterable of variables, trainable or not) overrides a model's own. ``x``
    (optional) builds a Keras model that has not run yet.

    The target refers to the model weakly: whoever calls it holds the model.
    """
    is_keras = isinstance(model, keras.Layer)
    if not callable(model):
        raise TypeError(
            f"model must be a Keras model or a callable f(x); got "
            f"{type(model).__name__}."
        )
    if variables is None:
        if not is_keras:
            raise TypeError(
                "a plain callable has no variables of its own: pass "
                "variables=[...], the tf.Variables that it reads."
            )
        variables = _built_variables(model, x)
        if not variables:
            raise ValueError(
                f"model {model.name!r} has no trainable variables, so its "
                "Jacobian has no columns. Build it (call it once, or give it an "
                "Input) and check that its layers are not all frozen "
                "(layer.trainable = False)."
            )
    variables = variable_list(variables)
    dtype = _one_dtype(variables)
    if not is_keras:
        return Target(_plain_call(model), variables, dtype, training=training)
    check_training_mode(model, training)
    layers = tuple(_all_layers(model))
    _check_precision(layers, dtype)
    return Target(
        _keras_call(model, training),
        variables,
        dtype,
        declared=_declared_inputs(model),
        layers=layers,
        training=training,
    )


def _all_layers(model):
    """Every layer inside the model (not the model: the target must not hold it)."""
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        return []
    return list(flatten(include_self=False, recursive=True))


# --- inputs -------------------------------------------------------------------


def n_samples(x):
    """Samples in a batch: the first dimension of its (first) input."""
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
        extra = n_rows - tf.shape(t)[0]
        return tf.concat([t, tf.repeat(t[-1:], extra, axis=0)], axis=0)

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
        kind = "S" if value.dtype == tf.string else value.dtype.as_numpy_dtype
        kind = kind if kind == "S" else np.dtype(kind).kind
        array = value
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
    declares (a ``None`` there takes any size).
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


# --- outputs ------------------------------------------------------------------


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
    sample.
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
        n_outputs = int(sum(np.prod(s, dtype=np.int64) for s in shapes))
        target.layouts[key] = OutputLayout(structure, shapes, n_outputs)
    return target.layouts[key]


def stack_columns(jacobians, variables, n_rows):
    """Join per-variable Jacobians into (n_rows, n_outputs, n_params).

    ``jacobians[j]`` has shape (n_rows, n_outputs, *variables[j].shape), or is
    ``None`` when the outputs do not use that variable: its true derivative is
    zero. When *every* one is ``None`` nothing is connected, and that is an
    error, not a Jacobian of zeros.
    """
    require_connected(jacobians, variables)
    template = next(j for j in jacobians if j is not None)
    n_outputs = tf.shape(template)[1]
    blocks = []
    for j, v in zip(jacobians, variables, strict=True):
        if j is None:
            j = tf.zeros([n_rows, n_outputs, _size(v)], template.dtype)
        elif isinstance(j, tf.IndexedSlices):  # an Embedding's gradient
            j = tf.convert_to_tensor(j)
        blocks.append(tf.reshape(j, [n_rows, n_outputs, _size(v)]))
    return tf.concat(blocks, axis=2)
