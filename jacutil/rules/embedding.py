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

With LoRA (``enable_lora``: the table is ``E + s A @ B``, E frozen) A's
block is that of a table read with the signal ``s delta @ B.T``, B's the
outer product of ``s A[ids]`` and delta (``jacutil.rules.dense``'s LoRA).
"""

from ..core._tf import keras, tf
from .blocks import ghost_is_cheaper, outer_blocks, positions_of
from .dense import as_dtype_of, lora_factors, outer_norms, refuse_adapted
from .registry import Blocks, Rule, register


@register(keras.layers.Embedding)
class EmbeddingRule(Rule):
    """``y = table[ids]``: each id's row of the table; ids get no signal. With
    LoRA, the blocks of the frozen table, A and B; a quantized Embedding
    raises :class:`NoRule`."""

    name = "embedding"

    def __init__(self, layer):
        super().__init__(layer)
        refuse_adapted(layer, "Embedding", lora=True)
        names = ("_embeddings", "lora_embeddings_a", "lora_embeddings_b")
        self.lora = lora_factors(layer, names)
        if self.lora is not None:
            self.table = self.lora[0]
            self.variables = [self.table, self.lora[1], self.lora[2]]
        else:
            self.table = layer.embeddings
            self.variables = [self.table]

    def describe(self):
        """``"embedding"``, or ``"embedding+lora"`` (a ``str``)."""
        return self.name + ("+lora" if self.lora is not None else "")

    def _forward(self, a):
        return self.layer(a, training=False), a

    def _terms(self, ids, delta, wanted):
        """``([(variable, signal)], [(variable, rows, signal)])``: the tables
        read at ``ids`` (the table, A) and B's outer product."""
        tables, outer = [], []
        if self.table in wanted:
            tables.append((self.table, delta))
        if self.lora is not None:
            _, factor_a, factor_b, scale = self.lora
            if factor_a in wanted:
                low = tf.tensordot(delta, as_dtype_of(factor_b, delta), [[-1], [1]])
                tables.append((factor_a, scale * low))
            if factor_b in wanted:
                rows = tf.gather(as_dtype_of(factor_a, delta), tf.cast(ids, tf.int32))
                outer.append((factor_b, scale * rows, delta))
        return tables, outer

    def _backward(self, ids, delta, wanted, need_signal):
        tables, outer = self._terms(ids, delta, wanted)
        blocks = Blocks()
        if tables:
            one_hot = tf.one_hot(
                tf.cast(ids, tf.int32), self.layer.input_dim, dtype=delta.dtype
            )
            for variable, signal in tables:
                blocks[variable] = outer_blocks(one_hot, signal)
        for variable, rows, signal in outer:
            blocks[variable] = outer_blocks(rows, signal)
        return blocks, None

    def _backward_norms(self, ids, delta, wanted, need_signal):
        """Ghost norms where the T positions are at most the vocabulary V: per
        sample and row, the (T, T) equalities times the signal take T * T * dim
        multiply-adds, the one-hot product T * V * dim; the block otherwise.
        B's (LoRA) is an outer product's (:func:`outer_norms`)."""
        positions = positions_of([*ids.shape, 1])  # ids: (n, *positions)
        dim, vocabulary = self.layer.output_dim, self.layer.input_dim
        known = positions is not None
        ghost_work = positions * positions * dim if known else None
        block_work = positions * vocabulary * dim if known else 0
        if not ghost_is_cheaper(ghost_work, block_work):
            return super()._backward_norms(ids, delta, wanted, need_signal)
        tables, outer = self._terms(ids, delta, wanted)
        parts = [_table_norms(ids, signal) for _, signal in tables]
        parts += [outer_norms(rows, signal) for _, rows, signal in outer]
        return (tf.add_n(parts) if parts else None), None


def _table_norms(ids, delta):
    """(n, r): the squared norm of a table's block read at ``ids`` (n,
    *positions) with the signal ``delta`` (n, r, *positions, d), by the
    equalities of the ids: ``sum_{t,s} [ids_t == ids_s] delta_t . delta_s``."""
    n_samples, n_rows = tf.shape(delta)[0], tf.shape(delta)[1]
    ids = tf.reshape(tf.cast(ids, tf.int32), [n_samples, -1])  # (n, T)
    delta = tf.reshape(delta, [n_samples, n_rows, -1, delta.shape[-1]])
    same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), delta.dtype)
    by_id = tf.einsum("nts,nrsd->nrtd", same, delta)  # the sum per id
    return tf.reduce_sum(delta * by_id, [2, 3])
