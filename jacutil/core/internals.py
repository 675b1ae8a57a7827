"""Every touch of TensorFlow's and Keras's private internals, behind one door.

jacutil reads a functional model's graph (which layer made each symbolic
tensor, and from what), finds every layer of a model, reads the logits Keras
keeps on a softmax or sigmoid output, runs grouped convolutions one group at
a time, and registers second-order gradients that TensorFlow lacks. None of
that has a public API in TensorFlow 2.21 / Keras 3.15, the versions tested
(``pyproject.toml``). Each function here checks that the internal is what it
expects and otherwise raises :class:`InternalsMoved`, naming the versions
installed - never a silent skip.
"""

from ._tf import keras, tf

TESTED = "TensorFlow 2.21 and Keras 3.15"


class InternalsMoved(RuntimeError):
    """A TensorFlow or Keras internal that jacutil reads is not where it was."""


def _moved(what):
    raise InternalsMoved(
        f"{what} is not where jacutil expects it in TensorFlow {tf.__version__} "
        f"with Keras {keras.__version__}; jacutil is tested with {TESTED} "
        "(pyproject.toml). Install those versions, or report this with the "
        "versions above."
    )


def made_by(tensor):
    """Which Keras operation made a functional model's symbolic ``tensor``,
    and how: ``(operation, node, index)``, the layer or op, the call (Keras
    node: ``input_tensors``, ``outputs``, ``arguments``) that made the
    tensor, and which of the call's outputs it is."""
    history = getattr(tensor, "_keras_history", None)
    if history is None or len(history) != 3:
        _moved("a Keras tensor's _keras_history (operation, node, index)")
    operation, node_index, index = history
    return operation, calls_of(operation)[node_index], index


def calls_of(operation):
    """Every call of a Keras layer or op in a functional graph (its nodes)."""
    nodes = getattr(operation, "_inbound_nodes", None)
    if nodes is None:
        _moved(f"the calls (_inbound_nodes) of {type(operation).__name__}")
    return nodes


def sublayers(layer):
    """A layer's own sublayers (not theirs), the layers its ``call`` may use."""
    if not hasattr(layer, "_flatten_layers"):
        _moved("a layer's _flatten_layers")
    return list(layer._flatten_layers(include_self=False, recursive=False))  # noqa: SLF001


def takes_training(operation):
    """Whether a layer's ``call`` takes ``training`` (False for plain ops)."""
    if not isinstance(operation, keras.layers.Layer):
        return False
    if not hasattr(operation, "_call_has_training_arg"):
        _moved("a layer's _call_has_training_arg")
    return bool(operation._call_has_training_arg)


def layers_within(model, include_self):
    """Every layer inside ``model``, however deeply nested (sublayers held as
    attributes too), or [] for a callable that is no Keras layer; with
    ``include_self``, ``model`` itself first."""
    if not isinstance(model, keras.layers.Layer):
        return []
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        _moved("a layer's _flatten_layers")
    return list(flatten(include_self=include_self, recursive=True))


def cached_logits(tensor):
    """The logits Keras keeps on the output of a softmax or sigmoid, or None.

    Keras marks only those outputs (for its cross-entropies), so None is the
    common answer, not a sign that the internal moved; the rules and the
    losses find a softmax or sigmoid in the graph as well.
    """
    return getattr(tensor, "_keras_logits", None)


def with_cached_logits(tensor, logits):
    """``tensor`` marked, as Keras marks a softmax's or sigmoid's output,
    with the ``logits`` it came from: what Keras's cross-entropies read
    instead of the probabilities (a one-sample slice of a batch's output
    loses the mark; :class:`jacutil.privacy.keras_loss.KerasLoss` puts the
    slice of the logits back)."""
    tensor._keras_logits = logits
    return tensor


def keras_backend_nn():
    """Keras's TensorFlow backend module whose ``conv`` ``keras.ops`` calls."""
    try:
        module = keras.src.backend.tensorflow.nn
    except AttributeError:
        module = None
    if module is None or not callable(getattr(module, "conv", None)):
        _moved("keras.src.backend.tensorflow.nn.conv")
    return module


def gradient_registry():
    """TensorFlow's gradient registry: op type -> {"type": the gradient
    function, or None for "not differentiable", ...}."""
    from tensorflow.python.framework import ops

    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    if not isinstance(registry, dict):
        _moved("TensorFlow's gradient registry (ops._gradient_registry)")
    return registry


def loss_tracker(model):
    """Keras's running mean of a compiled model's loss
    (``model._loss_tracker``), which ``model.fit`` shows as "loss":
    ``jacutil.privacy``'s train function updates it, as Keras's own
    ``train_step`` does: a ``keras.metrics.Mean``."""
    tracker = getattr(model, "_loss_tracker", None)
    if not isinstance(tracker, keras.metrics.Mean):
        _moved("Model._loss_tracker (Keras's running mean of the loss)")
    return tracker


def flat_caller(concrete):
    """``call(tensors)``: run a ``ConcreteFunction`` on its flat tensor
    inputs (``ConcreteFunction._call_flat``), without the public call's
    argument binding and signature check: on notebook 09's classifier those
    take 0.2 ms of a 0.5 ms private step. The caller guarantees that the
    tensors are the traced signature's, in order (:class:`jacutil.core.
    graph_calls.SignatureCalls` keys on their shapes and dtypes); the
    result is the function's structured output, as a public call returns."""
    call = getattr(concrete, "_call_flat", None)
    if call is None or not hasattr(concrete, "captured_inputs"):
        _moved("ConcreteFunction._call_flat(tensor_inputs, captured_inputs)")

    def run(tensors):
        return call(tensors, concrete.captured_inputs)

    return run


def compile_loss(model):
    """The loss ``model.compile`` built (``model._compile_loss``, Keras's
    ``CompileLoss``: every output's loss with its ``loss_weights``), or
    None when the model was compiled without a loss: what Keras's own
    ``compute_loss`` adds ``model.losses`` to."""
    if not hasattr(model, "_compile_loss"):
        _moved("Model._compile_loss (the loss model.compile built)")
    found = model._compile_loss
    if found is not None and not callable(found):
        _moved("Model._compile_loss as a callable CompileLoss")
    return found


def compute_loss(model, x, y, prediction, training):
    """Keras's own loss of a batch (``Model._compute_loss``: the user's
    ``compute_loss``, with or without its ``training`` argument): the
    compiled loss of every output plus ``model.losses``, or what a model's
    own ``compute_loss`` returns."""
    call = getattr(model, "_compute_loss", None)
    if call is None:
        _moved("Model._compute_loss (compute_loss, with or without training)")
    return call(x=x, y=y, y_pred=prediction, training=training)


def keras_train_step():
    """The ``train_step`` of Keras's TensorFlow trainer: a model whose class
    defines another runs code of its own in each step."""
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:
        _moved("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")
    return TensorFlowTrainer.train_step


def keras_saveable():
    """Keras's ``KerasSaveable``: an object that ``model.save`` walks to,
    from a model's attributes, and whose ``save_own_variables`` /
    ``load_own_variables`` write and read its entries of the weights file."""
    try:
        from keras.src.saving.keras_saveable import KerasSaveable
    except ImportError:
        _moved("keras.src.saving.keras_saveable.KerasSaveable")
    return KerasSaveable


def data_adapter(x, steps=None):
    """Keras's data adapter for ``x`` (``get_data_adapter``: what
    ``model.fit`` and ``model.predict`` read a ``tf.data.Dataset``, a
    ``PyDataset`` - its ``workers`` and ``use_multiprocessing`` too - or a
    generator through), ``steps`` batches an epoch where given."""
    try:
        from keras.src.trainers.data_adapters import get_data_adapter
    except ImportError:
        _moved("keras.src.trainers.data_adapters.get_data_adapter")
    adapter = get_data_adapter(x, steps_per_epoch=steps)
    for needed in ("get_numpy_iterator", "on_epoch_begin", "on_epoch_end"):
        if not hasattr(adapter, needed):
            _moved(f"a Keras data adapter's {needed}")
    return adapter
