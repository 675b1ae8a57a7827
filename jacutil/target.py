"""What every stage needs: the forward pass, the variables, and a checked batch.

Each stage starts with :func:`resolve_target` (what to differentiate) and
:func:`as_batch` (the input, checked and cast), and ends with
:func:`stack_columns` (one block of columns per variable, in ``flat_params``
order). The checks here are the reason a wrong call fails with a message that
says what to do, instead of returning a page of zeros.
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ._tf import keras, tf
from .guards import check_training_mode, require_connected


@dataclass
class Target:
    """A forward pass ``x -> (n_samples, n_outputs)`` and its variables."""

    forward: Callable
    variables: list
    dtype: np.dtype
    feature_shape: tuple | None  # shape of one sample, when the model knows it

    @property
    def n_params(self):
        return sum(_size(v) for v in self.variables)


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


def _keras_feature_shape(model):
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs or len(inputs) != 1:
        return None
    shape = tuple(inputs[0].shape[1:])
    return None if any(d is None for d in shape) else shape


def _built_variables(model, x):
    """Trainable variables of a Keras model, building it on one sample if needed."""
    if not model.built and x is not None:
        model(x[:1], training=False)
    return list(model.trainable_variables)


def resolve_target(model, variables=None, training=False, x=None):
    """Check ``model`` and ``variables`` and return a :class:`Target`.

    ``model`` is a Keras model (its trainable variables are used) or any
    callable ``f(x)``, which then needs ``variables=``. ``x`` (optional) builds
    a Keras model that has not run yet.
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
    else:
        variables = list(variables)
        if not variables:
            raise ValueError("variables= is empty: pass at least one variable.")
    for v in variables:
        if not _is_variable(v):
            raise TypeError(
                f"variables= must hold tf.Variable or keras.Variable objects; got "
                f"{type(v).__name__}. A tensor computed from the variables "
                "(such as tf.concat of them, flattened) is a copy that the model "
                "never reads: pass the variables themselves."
            )
    if is_keras:
        check_training_mode(model, training)
    dtypes = {_float_dtype(v) for v in variables}
    dtype = max(dtypes, key=lambda d: d.itemsize)

    if is_keras:

        def forward(x):
            y = model(x, training=training)
            return _as_rows(y, x)

        feature_shape = _keras_feature_shape(model)
    else:

        def forward(x):
            return _as_rows(model(x), x)

        feature_shape = None
    return Target(forward, variables, dtype, feature_shape)


def _as_rows(y, x):
    """Outputs as (n_samples, n_outputs): trailing output dims flattened."""
    y = tf.convert_to_tensor(y)
    if y.shape.rank == 0:
        raise ValueError(
            "the model returned a scalar; a per-sample Jacobian needs one output "
            "row per sample, shape (n_samples, ...). Return the per-sample "
            "outputs, not a loss summed over the batch."
        )
    return tf.reshape(y, [tf.shape(x)[0], -1])


def as_batch(x, target):
    """Check a batch of inputs and cast it to the model's float dtype."""
    if isinstance(x, (tf.Tensor, tf.Variable)):
        kind = np.dtype(x.dtype.as_numpy_dtype).kind if x.dtype != tf.string else "S"
        array = x
    else:
        array = np.asarray(x)
        kind = array.dtype.kind
    if kind not in "biuf":
        raise TypeError(
            f"x must hold numbers; its dtype is {array.dtype!s}. Convert it first, "
            "for example np.asarray(x, dtype='float32')."
        )
    shape = tuple(array.shape)
    if len(shape) == 0:
        raise ValueError(
            "x is a scalar; pass a batch with a leading sample axis, shape "
            "(n_samples, ...)."
        )
    expected = target.feature_shape
    if expected is not None and shape[1:] != expected:
        hint = ""
        if shape == expected:
            hint = " It looks like one sample without its batch axis: use x[None]."
        raise ValueError(
            f"x has shape {shape}, but the model takes samples of shape "
            f"{expected}, so x should have shape (n_samples, "
            f"{', '.join(map(str, expected))}).{hint}"
        )
    if shape[0] == 0:
        raise ValueError("x holds no samples (its first dimension is 0).")
    return tf.cast(tf.convert_to_tensor(array), target.dtype)


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
        blocks.append(tf.reshape(j, [n_rows, n_outputs, _size(v)]))
    return tf.concat(blocks, axis=2)
