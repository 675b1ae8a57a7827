"""The logits behind a softmax or sigmoid, and a model's heads, read from its
graph (notebook 11-curvature-and-uncertainty): a head's output is made by a
softmax or sigmoid (a layer, an activation, ``keras.ops.softmax``,
``tf.nn.softmax``, in a nested model or not) if the op that made it is one,
through identity, reshape, cast and transpose ops, or if Keras keeps logits
on it (``jacutil.core.internals.cached_logits``).
"""

from ..core._tf import keras, tf
from ..core.cache import kept
from ..core.internals import cached_logits

PROBABILITY_OPS = {"Softmax": "softmax", "Sigmoid": "sigmoid"}
PASS_THROUGH = {
    "Identity", "Reshape", "Squeeze", "ExpandDims", "Cast", "StopGradient",
    "Transpose", "EnsureShape", "PreventGradient", "CheckNumerics",
}  # fmt: skip


def _probability_made(tensor):
    """The softmax or sigmoid op that made a traced ``tensor``, or None."""
    t = tensor
    for _ in range(32):
        op = getattr(t, "op", None)
        if op is None or not hasattr(op, "type"):
            break
        if op.type in PROBABILITY_OPS:
            return op
        if op.type == "IdentityN":
            t = op.inputs[t.value_index]
        elif op.type in PASS_THROUGH and len(op.inputs):
            t = op.inputs[0]
        else:
            break
    return None


def probability_op(tensor):
    """``"softmax"`` or ``"sigmoid"`` if a traced ``tensor`` is made by one
    (as :func:`_probability_made` finds it), else None."""
    op = _probability_made(tensor)
    if op is not None:
        return PROBABILITY_OPS[op.type]
    return "softmax or sigmoid" if cached_logits(tensor) is not None else None


def logits_of(probabilities):
    """The logits a Keras cross-entropy reads instead of ``probabilities``, or
    None: Keras 3 keeps them on a softmax's or sigmoid's output
    (``cached_logits``); in a graph they are the input of the op that made it."""
    logits = cached_logits(probabilities)
    if logits is None and not tf.executing_eagerly():
        op = _probability_made(probabilities)
        logits = None if op is None else op.inputs[0]
    return logits


def model_heads(model, call, spec):
    """Each output head of ``call`` (``x -> output nest``) traced on ``spec``
    (a ``tf.TensorSpec`` nest): a list of ``(label, per-sample shape or None,
    probability)`` in ``tf.nest.flatten`` order, traced once per signature
    and kept for ``model`` (``jacutil.core.cache``'s kind ``"heads"``)."""
    key = tuple((tuple(s.shape[1:]), s.dtype.name) for s in tf.nest.flatten(spec))

    def trace():
        found = []

        def probe(x):
            out = call(x)
            paths = _labelled_leaves(out)
            for path, leaf in paths:
                leaf = tf.convert_to_tensor(leaf)
                shape = leaf.shape[1:]
                shape = tuple(shape) if shape.is_fully_defined() else None
                label = path if len(paths) > 1 else "output"
                found.append((label, shape, probability_op(leaf)))
            return tf.nest.flatten(out)

        tf.function(probe, autograph=False).get_concrete_function(spec)
        return found

    return kept("heads", model, key, trace)


def _labelled_leaves(out, prefix=""):
    """``(label, leaf)`` of an output nest in ``tf.nest.flatten`` order; a
    label is the dict key or list index (joined by ``/`` when nested)."""
    if isinstance(out, dict):
        items = [(str(k), out[k]) for k in sorted(out)]
    elif isinstance(out, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(out)]
    else:
        return [(prefix or "output", out)]
    return [
        pair
        for key, value in items
        for pair in _labelled_leaves(value, f"{prefix}/{key}" if prefix else key)
    ]


def declared_spec(model):
    """A Keras model's declared inputs as a ``tf.TensorSpec`` nest, or None."""
    inputs = getattr(model, "inputs", None) if isinstance(model, keras.Model) else None
    if not inputs:
        return None
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in inputs]
    return specs[0] if len(specs) == 1 else specs
