"""Embedding: each id's row of the table gets the signal at its position.

``y[t] = E[ids[t]]``, so ``d y[i, k] / d E[v, :] = sum_t [ids[i, t] == v]
delta[i, k, t, :]``: the outer-product rule with the one-hot ids as input.
The ids are integers, so no signal goes further down.

The squared norm of that (vocabulary, dim) block per sample is
``sum_{t, s} [ids[t] == ids[s]] (delta[t] . delta[s])``: each position's
signal dotted with the sum of the signals at the positions of the same id,
(T, T) equalities per sample instead of the block - the norm sampler of
Opacus's ghost clipping (``opacus/grad_sample/embedding_norm_sample.py``,
``compute_embedding_norm_sample``, which sums the signal per unique
(sample, id) pair) and BackPACK's ``BatchL2Grad`` for ``Embedding``.
"""

from ..core._tf import keras, tf
from .blocks import ghost_is_cheaper, outer_blocks, positions_of
from .dense import refuse_adapted
from .registry import Blocks, Rule, register


@register(keras.layers.Embedding)
class EmbeddingRule(Rule):
    """``y = table[ids]``: each id's row of the table; ids get no signal. A LoRA
    or quantized Embedding raises :class:`NoRule`."""

    name = "embedding"

    def __init__(self, layer):
        super().__init__(layer)
        refuse_adapted(layer, "Embedding")
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

    def _backward_norms(self, ids, delta, wanted, need_signal):
        """Ghost norms where the T positions are at most the vocabulary V: per
        sample and row, the (T, T) equalities times the signal take T * T * dim
        multiply-adds, the one-hot product T * V * dim; the block otherwise."""
        table = self.layer.embeddings
        positions = positions_of([*ids.shape, 1])  # ids: (n, *positions)
        dim, vocabulary = self.layer.output_dim, self.layer.input_dim
        known = positions is not None
        ghost_work = positions * positions * dim if known else None
        block_work = positions * vocabulary * dim if known else 0
        if table not in wanted or not ghost_is_cheaper(ghost_work, block_work):
            return super()._backward_norms(ids, delta, wanted, need_signal)
        n_samples, n_rows = tf.shape(delta)[0], tf.shape(delta)[1]
        ids = tf.reshape(tf.cast(ids, tf.int32), [n_samples, -1])  # (n, T)
        delta = tf.reshape(delta, [n_samples, n_rows, -1, delta.shape[-1]])
        same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), delta.dtype)
        by_id = tf.einsum("nts,nrsd->nrtd", same, delta)  # the sum per id
        return tf.reduce_sum(delta * by_id, [2, 3]), None
