"""Guards against the traps of notebook 06-pitfalls, each with a message that teaches.

Three mistakes can be detected before they cost a learner a day:

* **Nothing connected** - every variable's Jacobian is ``None``: the outputs
  were differentiated with respect to a copy of the variables (tf.concat of
  them, flattened, built after the forward pass). :func:`require_connected`
  raises instead of returning a page of zeros.
* **Training mode** - ``training=True`` on a model with BatchNormalization
  (an error: samples are coupled) or active Dropout (a warning: the Jacobian
  of a random function). See :func:`check_training_mode`.
* **Retracing** - the same compiled Jacobian built and traced again and again
  (``ju.compiled_jacobian(model)`` inside a loop). :func:`note_trace` warns
  once when the traces exceed :data:`RETRACE_LIMIT`.

Introduced in ``06-pitfalls``.
"""

import warnings
import weakref

from ._shared import few_names
from ._tf import keras
from .internals import layers_within

DISCONNECTED = (
    "None of the {count} variables reaches the outputs, so every derivative "
    "would be zero. This is the classic mistake of differentiating with "
    "respect to a copy of the variables - for example tf.concat of the "
    "flattened variables, built after the forward pass - instead of the "
    "variables the model reads. Pass the model itself, or variables= the list "
    "that the forward pass uses; the Jacobian's columns already come in "
    "flat_params(model) order, so there is nothing to flatten first."
)


class JacobianError(ValueError):
    """A model or call that has no per-sample Jacobian; the message says why."""

    ag_pass_through = True  # raised inside a tf.function trace: reach the user as is


def require_connected(jacobians, variables):
    """Raise ``ValueError`` when every per-variable Jacobian is ``None``.

    A single ``None`` is fine - that variable is truly unused and its columns
    are zeros - but when *none* of the variables reaches the outputs the
    caller has differentiated with respect to the wrong thing.
    Introduced in ``06-pitfalls``.
    """
    if all(j is None for j in jacobians):
        raise JacobianError(DISCONNECTED.format(count=len(variables)))


_RNN_CELLS = (
    keras.layers.LSTMCell,
    keras.layers.GRUCell,
    keras.layers.SimpleRNNCell,
)
# Layers that draw random numbers in training mode, and the attribute that
# switches them off when it is 0.
_RANDOM_LAYERS = {
    keras.layers.Dropout: "rate",  # also SpatialDropout1D/2D/3D
    keras.layers.AlphaDropout: "rate",
    keras.layers.GaussianDropout: "rate",
    keras.layers.GaussianNoise: "stddev",
}


def random_layers(layers):
    """Names, ``"name (ClassName)"``, of the ``layers`` that draw random numbers
    in training mode: Dropout-like layers with a non-zero rate, recurrent
    layers and cells with a non-zero ``dropout`` or ``recurrent_dropout``."""
    names = []
    for layer in layers:
        random = any(
            isinstance(layer, kind) and getattr(layer, switch, 0) > 0
            for kind, switch in _RANDOM_LAYERS.items()
        )
        if isinstance(layer, (keras.layers.RNN, _RNN_CELLS)):
            rates = (getattr(layer, a, 0) for a in ("dropout", "recurrent_dropout"))
            random = any(isinstance(r, (int, float)) and r > 0 for r in rates)
        if random:
            names.append(f"{layer.name} ({type(layer).__name__})")
    return names


class TrainingModeWarning(UserWarning):
    """``training=True`` on a model with active Dropout: a random Jacobian."""


def check_training_mode(model, training):
    """Refuse BatchNormalization and warn about Dropout when ``training=True``.

    **BatchNormalization in training mode is an error.** It normalizes with
    the statistics of the batch, so sample i's outputs depend on every other
    sample: there is no per-sample Jacobian to compute. The stages disagree
    (one sample at a time, the layers before it get zero columns), the
    batch-wide Jacobian of sample 0 changes when sample 1 does, and every
    call overwrites the layer's moving mean and variance - the model you
    predict with. Nothing right can come out, so nothing does (Opacus, the
    per-sample-gradient library for PyTorch, refuses BatchNorm too).

    **Dropout in training mode is a warning.** Each call draws new masks, so
    the result is the exact Jacobian of one random draw of the network: two
    calls differ, and it is not the Jacobian of the network an optimizer or
    a prediction uses. It is what per-sample gradients of dropout training
    (or Monte Carlo dropout) want, so it is allowed, loudly; silence it with
    ``warnings.simplefilter("ignore", ju.core.guards.TrainingModeWarning)``.
    Every stage draws the masks as ``model(x, training=True)`` does: **each
    sample its own mask, shared by all of that sample's outputs** (the
    vectorized stages then run the samples in ``tf.map_fn``, since inside
    pfor every sample would share one mask; see ``jacutil.core.formulation``).

    Only Keras models are inspected, nested models and sublayers included;
    a layer that forces ``training=True`` inside its own ``call`` is not seen.
    Introduced in ``06-pitfalls``.
    """
    if not training or not isinstance(model, keras.Layer):
        return
    layers = layers_within(model, include_self=True) or [model]
    coupling = [  # a frozen one runs in inference mode even then
        layer.name
        for layer in layers
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
    ]
    if coupling:
        raise ValueError(
            f"training=True with BatchNormalization ({few_names(coupling)}): in "
            "training mode it normalizes with the statistics of the batch, so a "
            "sample's outputs depend on the other samples and there is no "
            "per-sample Jacobian (the stages would disagree), and every call "
            "would overwrite the layer's moving mean and variance. Use "
            "training=False, the default: the network that predicts. (A frozen "
            "layer, layer.trainable = False, keeps its moving statistics even "
            "in training mode, and is accepted.)"
        )
    random = random_layers(layers)
    if random:
        warnings.warn(
            f"training=True with {few_names(random)}: in training mode every "
            "call draws new random masks (one per sample, shared by its "
            "outputs), so this is the Jacobian of one random draw of the "
            "network, and two calls differ. For the network "
            "that predicts (and that an optimizer such as least_squares fits), "
            "use training=False, the default. If one random draw per call is "
            "what you want, silence this: warnings.simplefilter('ignore', "
            "ju.core.guards.TrainingModeWarning).",
            TrainingModeWarning,
            stacklevel=4,  # the caller of the stage
        )


RETRACE_LIMIT = 10  # traces of one compiled Jacobian before note_trace warns


class RetracingWarning(UserWarning):
    """The same compiled Jacobian was traced more than :data:`RETRACE_LIMIT` times."""


_trace_counts = {}  # (id of first variable, n variables, options) -> traces
_watched = set()  # ids of first variables with a finalizer that forgets them


def _forget(variable_id):
    _watched.discard(variable_id)
    for key in [k for k in _trace_counts if k[0] == variable_id]:
        del _trace_counts[key]


def note_trace(variables, options):
    """Count one trace of a compiled Jacobian; warn once past :data:`RETRACE_LIMIT`.

    Traces are counted per model (its variables) and ``options`` (the method
    and ``jit_compile``), across every compiled function built for them, so
    ``ju.compiled_jacobian(model)`` called inside a loop is caught although
    each new function traces only once. Returns the traces counted for this
    model and options so far. Introduced in ``06-pitfalls``.
    """
    first = variables[0]
    key = (id(first), len(variables), tuple(options))
    if id(first) not in _watched:
        _watched.add(id(first))
        weakref.finalize(first, _forget, id(first))
    count = _trace_counts.get(key, 0) + 1
    _trace_counts[key] = count
    if count == RETRACE_LIMIT + 1:
        warnings.warn(
            f"a compiled Jacobian of this model has been traced {count} times "
            f"(more than {RETRACE_LIMIT}). Each trace costs the time of a first "
            "call, usually far more than the Jacobian itself. Is "
            "ju.compiled_jacobian(model) inside a loop? Build it once, "
            "jac = ju.compiled_jacobian(model), and call jac(x) for every "
            "batch: a new number of samples does not retrace it.",
            RetracingWarning,
            stacklevel=2,
        )
    return count
