"""Embedding: each id's row of the table gets the signal at its position.

``y[t] = E[ids[t]]``, so ``d y[i, k] / d E[v, :] = sum_t [ids[i, t] == v]
delta[i, k, t, :]``: the outer-product rule with the one-hot ids as input.
The ids are integers, so no signal goes further down.
"""

from ..core._tf import keras, tf
from .blocks import outer_blocks
from .registry import NoRule, Rule, register


@register(keras.layers.Embedding)
class EmbeddingRule(Rule):
    name = "embedding"

    def __init__(self, layer):
        super().__init__(layer)
        if getattr(layer, "lora_enabled", False) or layer.quantization_mode:
            raise NoRule("a LoRA or quantized Embedding")
        self.variables = [layer.embeddings]

    def forward(self, a):
        return self.layer(a, training=False), a

    def backward(self, ids, delta, wanted, need_signal):
        at = wanted.get(id(self.layer.embeddings))
        if at is None:
            return {}, None
        one_hot = tf.one_hot(
            tf.cast(ids, tf.int32), self.layer.input_dim, dtype=delta.dtype
        )
        return {at: outer_blocks(one_hot, delta)}, None
