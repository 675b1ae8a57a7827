"""What every stage needs: the forward pass, the variables, and their checks.

Each stage starts with :func:`resolve_target` (what to differentiate) and
:func:`jacutil.core.batch.as_batch` (the input, checked and cast), and ends with
:func:`stack_columns` (one block of columns per variable, in ``flat_params``
order). The checks here are the reason a wrong call fails with a message that
says what to do, instead of returning a page of zeros. How inputs and outputs
are laid out: ``jacutil.core.batch`` and ``jacutil.core.outputs``.
"""

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ._grouped import convolutions_by_group
from ._shared import count_params, size_of
from ._tf import keras, tf
from .batch import n_samples, take
from .guards import check_training_mode, require_connected
from .internals import layers_within
from .outputs import as_rows


@dataclass
class Target:
    """A forward pass ``x -> (n_samples, n_outputs)`` and its variables.

    ``call(x)`` returns the model's own output nest (holding the model
    weakly); ``forward(x)`` the rows. ``variables``: the m parameters'
    variables, in ``flat_params`` order, of one float ``dtype`` (a
    ``np.dtype``). ``declared`` is the model's declared input nest (Keras
    tensors), or None. ``layers`` holds every Keras layer of the model (none
    for a callable). ``layouts``: the :class:`jacutil.core.outputs.OutputLayout`
    per input signature, filled as batches come.
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
        """m, the number of parameters (an ``int``; counted once per list of
        variables: a call of a small model must not pay for it again)."""
        key = tuple(map(id, self.variables))
        counted = self.__dict__.get("_n_params")
        if counted is None or counted[0] != key:
            counted = (key, count_params(self.variables))
            self.__dict__["_n_params"] = counted
        return counted[1]

    def forward(self, x):
        """The outputs of batch ``x`` as rows: a tensor (n_samples, n_outputs)."""
        return as_rows(self.call(x), n_samples(x))

    def watch(self, tape):
        """Make ``tape`` record every variable, trainable or not."""
        for v in self.variables:
            tape.watch(watched(v))


def watched(variable):
    """What a tape or an accumulator watches: a ``keras.Variable``'s
    ``tf.Variable`` (``variable`` itself if it is one)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


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


def declared_inputs(model):
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
    every variable (``tf.Variable`` or ``keras.Variable``) in the list is
    differentiated, in the order given; TypeError or ValueError otherwise.
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
        with convolutions_by_group():  # see jacutil.core._grouped
            return reference()(x, training=training)

    return call


def _plain_call(model):
    """``x -> model(x)`` that does not keep ``model`` alive, where it can."""
    if hasattr(model, "__self__") and hasattr(model, "__func__"):
        method = weakref.WeakMethod(model)  # a bound method: keep only its object

        def call(x):
            return method()(x)

        return call
    try:
        reference = weakref.ref(model)
    except TypeError:  # a builtin: it lives as long as its module anyway
        return model

    def call(x):
        return reference()(x)

    return call


def resolve_target(model, variables=None, training=False, x=None):
    """Check ``model`` and ``variables`` and return a :class:`Target`.

    ``model`` is a Keras model (its trainable variables are used) or any
    callable ``f(x)``, which then needs ``variables=``. ``variables=`` (any
    iterable of variables, trainable or not) overrides a model's own. ``x``
    (optional) builds a Keras model that has not run yet.

    The target refers to the model weakly: whoever calls it holds the model.
    Introduced in notebook ``02-vectorized`` (a hand-written ``tf.map_fn``
    Jacobian uses the target's ``forward`` and ``variables``); ``03-compiled``
    uses it again. A check that fails raises TypeError or ValueError.
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
    layers = tuple(layers_within(model, include_self=False))  # the model not held
    _check_precision(layers, dtype)
    return Target(
        _keras_call(model, training),
        variables,
        dtype,
        declared=declared_inputs(model),
        layers=layers,
        training=training,
    )


def stack_columns(jacobians, variables, n_rows):
    """Join per-variable Jacobians into (n_rows, n_outputs, n_params).

    ``jacobians[j]`` has shape (n_rows, n_outputs, *variables[j].shape), or is
    ``None`` when the outputs do not use that variable: its true derivative is
    zero. When *every* one is ``None`` nothing is connected: an error
    (:func:`jacutil.core.guards.require_connected`), not a Jacobian of zeros.
    Introduced in notebook ``02-vectorized`` (it joins the blocks of a
    hand-written ``tf.map_fn`` Jacobian). ``variables`` are in
    ``flat_params`` order; ``n_rows`` is an ``int`` or a scalar tensor.
    """
    require_connected(jacobians, variables)
    template = next(j for j in jacobians if j is not None)
    n_outputs = tf.shape(template)[1]
    blocks = []
    for j, v in zip(jacobians, variables, strict=True):
        if j is None:
            j = tf.zeros([n_rows, n_outputs, size_of(v)], template.dtype)
        elif isinstance(j, tf.IndexedSlices):  # an Embedding's gradient
            j = tf.convert_to_tensor(j)
        blocks.append(tf.reshape(j, [n_rows, n_outputs, size_of(v)]))
    return tf.concat(blocks, axis=2)
