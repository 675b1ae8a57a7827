"""How the per-sample Jacobian is vectorized for a given model (notebook
08-your-own-model).

``per_sample_tape_jacobian`` maps a one-sample Jacobian over the batch with
pfor (``tf.vectorized_map``). Three kinds of model need more:

* **Recurrent layers** (``LSTM``, ``GRU``, ``SimpleRNN``, ``Bidirectional``):
  a Keras RNN runs a ``tf.while_loop``, and pfor cannot vectorize the gradient
  of a ``while_loop`` inside another pfor. While the Jacobian is traced, each
  RNN layer is *unrolled* (its ``unroll`` flag set, the same layer and
  weights): the loop becomes one step per time step, which pfor vectorizes.
  Tracing then takes longer for long sequences.
* **Random layers in training mode** (``Dropout`` with ``training=True``):
  inside pfor every sample would share one random mask. ``tf.map_fn`` runs
  the samples one after another, so each draws its own mask - the same
  semantics as ``model(x, training=True)`` and the other stages.
* **Anything else pfor cannot convert**: ``tf.map_fn`` too, with a
  :class:`SlowPathWarning`.
"""

import contextlib
import logging
import warnings

from ._tf import keras, tf
from .guards import JacobianError, random_layers
from .target import n_samples, pad_with_last, stack_columns
from .vectorized import per_sample_tape_jacobian

# Errors with which pfor refuses a graph it cannot vectorize.
PFOR_ERRORS = (ValueError, TypeError, NotImplementedError, tf.errors.OpError)


class SlowPathWarning(UserWarning):
    """pfor could not vectorize the model, so samples run one at a time."""


def recurrent_layers(target):
    """The model's Keras RNN layers (nested ones and Bidirectional's included)."""
    return [layer for layer in target.layers if isinstance(layer, keras.layers.RNN)]


@contextlib.contextmanager
def unrolled(layers):
    """Trace ``layers`` (Keras RNNs) unrolled: the same layers and weights."""
    saved = [layer.unroll for layer in layers]
    for layer in layers:
        layer.unroll = True
    try:
        yield
    finally:
        for layer, unroll in zip(layers, saved, strict=True):
            layer.unroll = unroll


class _DropPforErrors(logging.Filter):
    """pfor logs every op it fails to convert at ERROR level; we handle it."""

    def filter(self, record):
        return not (
            record.levelno >= logging.ERROR
            and record.pathname.replace("\\", "/").endswith("parallel_for/pfor.py")
        )


@contextlib.contextmanager
def _pfor_errors_handled():
    """Silence pfor's own error log while we try it: a failure is caught here."""
    logger, quiet = tf.get_logger(), _DropPforErrors()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def map_fn_jacobian(target, x):
    """(n, l, m) tensor: the one-sample Jacobian in a ``tf.map_fn`` loop."""

    def one_sample(xi):
        xi = tf.nest.map_structure(lambda t: t[None], xi)
        with tf.GradientTape() as tape:
            target.watch(tape)
            y = target.forward(xi)
        jacobians = tape.jacobian(y, target.variables)
        return stack_columns(jacobians, target.variables, 1)[0]

    signature = tf.TensorSpec(None, target.dtype)
    return tf.map_fn(one_sample, x, fn_output_signature=signature)


def _map_fn(target, x):
    if tf.executing_eagerly():  # a graph runs the loop far faster than Python
        return tf.function(lambda x: map_fn_jacobian(target, x))(x)
    return map_fn_jacobian(target, x)


def _first_line(error):
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    message = next((line for line in lines if "Error" in line), lines[-1:] or [""])
    return str(message)[:200]


def per_sample_tensor(target, x):
    """The per-sample Jacobian of ``x`` and the formulation that computed it.

    Returns ``(tensor, formulation)``: ``tf.vectorized_map`` (recurrent
    layers unrolled) when pfor can vectorize the model, ``tf.map_fn``
    otherwise. Introduced in ``08-your-own-model``.
    """
    random = random_layers(target.layers) if target.training else []
    if random:
        return _map_fn(target, x), (
            "tf.map_fn over samples: random layers in training mode "
            f"({', '.join(random)}) draw one mask per sample"
        )
    rnns = recurrent_layers(target)
    formulation = "tf.vectorized_map over samples"
    if rnns:
        names = ", ".join(layer.name for layer in rnns)
        formulation += f", recurrent layers unrolled while traced ({names})"
    try:
        with unrolled(rnns), _pfor_errors_handled():
            if not rnns:
                return per_sample_tape_jacobian(target, x), formulation
            # pfor's unrolled recurrent gradient fails at run time on a batch
            # of one sample (TF 2.21): run one copy of the last sample more.
            rows = n_samples(x)
            J = per_sample_tape_jacobian(target, pad_with_last(x, rows + 1))
            return J[:rows], formulation
    except PFOR_ERRORS as error:
        if isinstance(error, JacobianError):
            raise
        reason = _first_line(error)
    warnings.warn(
        f"tf.vectorized_map could not vectorize this model ({reason}), so its "
        "samples run one at a time in tf.map_fn: correct, and much slower. "
        "Please report the model if it is a standard Keras one.",
        SlowPathWarning,
        stacklevel=3,
    )
    return _map_fn(target, x), f"tf.map_fn over samples: pfor failed ({reason})"

