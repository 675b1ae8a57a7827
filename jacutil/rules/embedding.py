"""Embedding: each id's row of the table gets the signal at its position.

``y[t] = E[ids[t]]``, so ``d y[i, k] / d E[v, :] = sum_t [ids[i, t] == v]
delta[i, k, t, :]``: the outer-product rule with the one-hot ids as input.
The ids are integers, so no signal goes further down.
"""

from ..core._tf import keras, tf
from .blocks import outer_blocks
from .registry import Blocks, NoRule, Rule, register


@register(keras.layers.Embedding)
class EmbeddingRule(Rule):
    """``y = table[ids]``: each id's row of the table; ids get no signal.

    Args:
        layer: the Keras layer.

    Raises:
        NoRule: a LoRA or quantized Embedding.
    """

    name = "embedding"

    def __init__(self, layer):
        super().__init__(layer)
        if getattr(layer, "lora_enabled", False) or layer.quantization_mode:
            raise NoRule("a LoRA or quantized Embedding")
        self.variables = [layer.embeddings]

    def _forward(self, a):
        return self.layer(a, training=False), a

    def _backward(self, ids, delta, wanted, need_signal):
        table = self.layer.embeddings
        if table not in wanted:
            return {}, None
        one_hot = tf.one_hot(
            tf.cast(ids, tf.int32), self.layer.input_dim, dtype=delta.dtype
        )
        return Blocks([(table, outer_blocks(one_hot, delta))]), None
