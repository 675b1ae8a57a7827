"""The user's loss, as ``model.compile`` takes it, as one loss per head of the
model (notebook 11-curvature-and-uncertainty): one loss for every head, or a
list (in the heads' order) or a dict (by output name) of losses, one per head,
each built as a class of ``jacutil.curvature.output_losses``. Each loss may be

* one of the plain names ``NAMES``, which mean the **sum** over samples
  (``reduction="sum"``, ``G = sum_i J_i.T H_i J_i``): :class:`SquaredError`,
  :class:`SoftmaxCrossEntropy` (logits over the head's last axis, ``y_i``
  integer labels or one-hot rows) and :class:`SigmoidCrossEntropy` (logits of
  independent yes/no outputs, ``y_i`` in {0, 1}), each with its ``H_i``;
* a Keras loss object or name, with its own ``reduction`` (Keras' default,
  ``"sum_over_batch_size"``, divides G by the number of loss values, n for
  one value per sample; ``"sum"`` does not). In closed form:
  ``MeanSquaredError`` / ``"mse"`` (Keras averages over the last axis of k
  values, so ``H_i = (2/k) I``), ``SparseCategoricalCrossentropy`` and
  ``CategoricalCrossentropy`` with ``from_logits=True`` (softmax Hessian;
  label smoothing changes the targets, not H) and ``BinaryCrossentropy``
  with ``from_logits=True`` (sigmoid Hessian over k, averaged like MSE);
* any other Keras loss, or a callable ``loss(y_true, y_pred)`` returning one
  value per sample (or per position): ``H_i`` by automatic differentiation
  (:class:`AutodiffLoss`) at the head's outputs, in the graph. It may depend
  on the targets, so such a loss needs ``y=``.

A cross-entropy is taken at the *logits*: the model's graph is traced once
(``jacutil.rules.logits``) and a cross-entropy head whose output is made by
a softmax or sigmoid is refused, whatever describes the loss; so is a Keras
cross-entropy with ``from_logits=False``.
"""

import functools

from ..core._tf import keras, tf
from ..core.batch import signature
from ..rules.logits import declared_spec, model_heads
from .output_losses import (
    NAMES,
    AutodiffLoss,
    HeadLosses,
    OutputLoss,
    SigmoidCrossEntropy,
    SoftmaxCrossEntropy,
    SquaredError,
    checked_reduction,
    for_output,
    unknown_loss,
)

KERAS_KINDS = {  # the Keras loss functions with a closed form
    keras.losses.mean_squared_error: "mse",
    keras.losses.sparse_categorical_crossentropy: "sparse",
    keras.losses.categorical_crossentropy: "categorical",
    keras.losses.binary_crossentropy: "binary",
}


def _closed_form(kind, options, reduction, shape):
    """The closed form of a Keras loss on a head, or None."""
    if kind == "mse":
        k = shape[-1] if shape else None
        return None if k is None else SquaredError(scale=2.0 / k, reduction=reduction)
    if options.get("axis", -1) not in (-1, None) or options.get("ignore_class"):
        return None
    if not options.get("from_logits", False):
        return "probabilities"
    smoothing = float(options.get("label_smoothing", 0.0) or 0.0)
    if kind in ("sparse", "categorical"):
        return SoftmaxCrossEntropy(label_smoothing=smoothing, reduction=reduction)
    k = shape[-1] if shape else 1
    return SigmoidCrossEntropy(
        scale=1.0 / k, label_smoothing=smoothing, reduction=reduction
    )


def head_loss(spec, shape=None, label="output", probability=None):
    """One head's :class:`OutputLoss`, bound to the head, from ``spec`` (one
    head's loss as :func:`output_loss` takes it); ``shape`` (None: unknown),
    ``label`` and ``probability`` as :meth:`OutputLoss.bind` takes them.

    Raises:
        ValueError: an unknown loss, a reduction that is not one number, or a
            cross-entropy on probabilities (or with ``from_logits=False``).
    """
    if isinstance(spec, HeadLosses):
        raise ValueError("a HeadLosses describes a whole model, not one head.")
    if isinstance(spec, OutputLoss):
        loss = spec
    elif isinstance(spec, str) and spec in NAMES:
        loss = OutputLoss(spec)
    else:
        loss = _from_keras(spec, shape, label, probability)
    if shape is None:
        loss._check_head(probability)
        return loss
    return loss.bind(shape, label, probability)


def _about(spec):
    """How a loss is named in messages."""
    if isinstance(spec, keras.losses.Loss):
        return f"keras.losses.{type(spec).__name__}"
    if isinstance(spec, functools.partial):
        return f"partial({_about(spec.func)})"
    if isinstance(spec, str):
        return repr(spec)
    return getattr(spec, "__name__", repr(spec))


def _from_keras(spec, shape, label, probability):
    about = _about(spec)
    if isinstance(spec, str):
        try:
            spec = keras.losses.get(spec)
        except ValueError:
            raise unknown_loss(about) from None
    reduction, options, fn = "sum_over_batch_size", {}, spec
    if isinstance(spec, keras.losses.Loss):
        config = spec.get_config()
        reduction = config.get("reduction", reduction)
        options = {k: v for k, v in config.items() if k not in ("name", "reduction")}
        fn = getattr(spec, "fn", None)
    elif isinstance(spec, functools.partial):
        fn, options = spec.func, dict(spec.keywords)
    elif not callable(spec):
        raise unknown_loss(about)
    reduction = checked_reduction(reduction)
    kind = KERAS_KINDS.get(fn) if fn is not None else None
    loss = _closed_form(kind, options, reduction, shape) if kind else None
    if loss == "probabilities":
        example = "SparseCategoricalCrossentropy"
        if isinstance(spec, keras.losses.Loss):
            example = type(spec).__name__
        where = (
            "its output holds probabilities (made by a "
            f"{probability}): remove that activation so that it outputs logits, and"
            if probability
            else "curvature is taken at the logits:"
        )
        raise ValueError(
            f"the loss {about}{for_output(label)} reads probabilities "
            f"(from_logits=False); {where} pass the loss with from_logits=True, "
            f"e.g. keras.losses.{example}(from_logits=True)."
        )
    if loss is None:
        call = spec.call if isinstance(spec, keras.losses.Loss) else spec
        loss = AutodiffLoss(call, reduction=reduction, about=about)
    return loss


def describe(loss, heads):
    """The model's :class:`HeadLosses` from the user's ``loss`` (as
    :func:`output_loss` takes it, or a :class:`HeadLosses`) and its ``heads``
    as :func:`model_heads` gives them (or ``[("output", None, None)]``)."""
    labels = [label for label, _, _ in heads]
    if isinstance(loss, HeadLosses):
        specs = loss.heads
        if len(specs) != len(heads):
            raise ValueError(
                f"the loss describes {len(specs)} output(s); the model has "
                f"{len(heads)}."
            )
    elif isinstance(loss, dict):
        missing = sorted(set(labels) - set(loss))
        extra = sorted(set(loss) - set(labels))
        if missing or extra or len(heads) == 1:
            raise ValueError(
                f"a dict of losses needs one per output, by name: the outputs are "
                f"{labels}; the dict has {sorted(loss)}."
            )
        specs = [loss[label] for label in labels]
    elif isinstance(loss, (list, tuple)):
        if len(loss) != len(heads):
            raise ValueError(
                f"{len(loss)} loss(es) for {len(heads)} output(s) {labels}: give "
                "one loss per output, in the order of tf.nest.flatten (dict keys "
                "sorted), or one loss for all."
            )
        specs = list(loss)
    else:
        specs = [loss] * len(heads)
    pairs = zip(specs, heads, strict=True)
    return HeadLosses([head_loss(s, shape, label, p) for s, (label, shape, p) in pairs])


def losses_for(loss, model, call=None, spec=None):
    """The :class:`HeadLosses` of ``loss`` on ``model``, the model's graph
    traced once (``call``, default: the model in inference mode) on ``spec``
    (default: its declared inputs) to find its heads."""
    if call is None:
        keras_model = isinstance(model, keras.Model)
        call = (lambda x: model(x, training=False)) if keras_model else model
    spec = spec if spec is not None else declared_spec(model)
    heads = [("output", None, None)]
    if spec is not None:
        heads = model_heads(model, call, spec)
        if any(shape is None for _, shape, _ in heads) and len(heads) > 1:
            raise ValueError(
                "an output of this model has a per-sample shape that is unknown "
                "until it runs; pass x (the entries do) so that it can be traced."
            )
        if len(heads) == 1 and heads[0][1] is None:
            heads = [("output", None, heads[0][2])]
    return describe(loss, heads)


def output_loss(loss, model=None, x=None):
    """``loss`` as an :class:`OutputLoss`, one per head of the model.

    Introduced in ``11-curvature-and-uncertainty``. The model's graph is
    traced (on ``x``, or on its declared inputs) to find its heads, their
    class counts, and any softmax or sigmoid that makes a cross-entropy
    head's output - refused, whatever describes the loss.

    Args:
        loss: a name from ``NAMES`` (summed over samples), a Keras loss
            object, name or function (its reduction), a callable
            ``loss(y_true, y_pred)``, an :class:`OutputLoss`; or a list or
            dict of them, one per head, as ``model.compile`` takes them.
        model: the Keras model or callable, or None.
        x: a batch to trace the model on (optional for a built Keras model).

    Returns:
        One head's :class:`OutputLoss`, or a :class:`HeadLosses` for several.
    """
    spec = None
    if x is not None:
        spec = signature(tf.nest.map_structure(tf.convert_to_tensor, x))
    if model is None:
        described = describe(loss, [("output", None, None)])
    else:
        described = losses_for(loss, model, spec=spec)
    return described.heads[0] if len(described.heads) == 1 else described
