"""Checks of 12-private-fine-tuning's exercises."""

import numpy as np

from ...core._tf import keras, tf
from ..transformer import enable_attention_lora, tiny_transformer
from . import Hint, answered, as_array, checks, close_array, shape_of


def _tape_norms(model, x, y):
    """Each sample's gradient norm of the loss, one tape per sample (in one
    traced graph, called once per sample: eager tapes of a transformer
    cost seconds)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = [v.value for v in model.trainable_variables]

    @tf.function(reduce_retracing=True)
    def norm(x_i, y_i):
        with tf.GradientTape() as tape:
            value = loss(y_i, model(x_i, training=False))
        grads = tape.gradient(value, variables)
        return tf.sqrt(tf.add_n([tf.reduce_sum(g * g) for g in grads]))

    return np.asarray([float(norm(x[i : i + 1], y[i : i + 1])) for i in range(len(x))])


@checks("12-1")
def gradient_norms(answer, model, x, y):
    """The (n,) per-sample gradient norms, against a tape per sample."""
    what = "the gradient norm of each sample"
    answered(answer, f"{what}: an array of {len(x)} numbers")
    expected = _tape_norms(model, x, y)
    found = shape_of(answer)
    if found == (len(x), sum(int(np.prod(v.shape)) for v in model.trainable_variables)):
        raise Hint(
            f"an array of shape {found}: the gradients themselves. Each row's "
            "length is its norm: per_sample_gradient_norms gives them without "
            "forming the rows."
        )
    if found == ():
        raise Hint(
            "one number: the norm of the batch's gradient (or their mean). "
            "Clipping needs each sample's own norm, one per sample."
        )
    value = as_array(answer, what, expected.shape, "(n samples,)")
    if np.allclose(value, expected**2, rtol=1e-3):
        raise Hint("those are the squared norms: take their square roots.")
    close_array(value, expected, "your norms", 1e-3, 1e-6,
                "not the norms of each sample's gradient of the loss: pass the "
                "model, the loss object, then x and y.")  # fmt: skip


@checks("12-2")
def trainable_with_rank(answer, rank):
    """The trainable weights of a fresh tiny_transformer with LoRA of ``rank``."""
    answered(answer, "the number of trainable weights: one integer")
    try:
        value = float(np.asarray(answer).item())
    except (TypeError, ValueError):
        raise Hint("expected one integer: the count of trainable weights.") from None
    model = tiny_transformer()
    totals = {model.count_params()}  # every weight, before LoRA and after
    expected = sum(int(np.prod(v.shape)) for v in enable_attention_lora(model, rank))
    totals.add(model.count_params())
    if value in totals:
        raise Hint(
            "that counts every weight, frozen ones too: count only "
            "model.trainable_variables (what enable_attention_lora returns)."
        )
    if value == len(model.trainable_variables):
        raise Hint(
            "that is the number of trainable variables (arrays); the question "
            "asks for their entries: the product of each one's shape, summed."
        )
    if value != expected:
        raise Hint(
            f"not the count for rank {rank}: switch LoRA on with "
            f"enable_attention_lora(model, {rank}) on a fresh model, then sum "
            "the sizes of the trainable variables."
        )
