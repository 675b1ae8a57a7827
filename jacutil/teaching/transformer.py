"""A small transformer classifier and seeded token data (notebook 12).

The shape of a KerasHub text classifier, built from a config with Keras's
own layers and random weights (nothing is downloaded): token and position
embeddings, ``n_layers`` blocks of ``MultiHeadAttention`` and a feed-forward
``Dense`` pair, each with a residual and a ``LayerNormalization``, a mean
over the real (unpadded) tokens and a ``Dense`` head. Token 0 is padding:
attention never reads it and the mean leaves it out.

The data are sequences of random tokens, padded at the end, labelled by
which of two sets of "marker" tokens occurs more often; a second seed draws
another pair of sets, a related task to fine-tune on.
"""

import numpy as np

from ..core._tf import keras


@keras.saving.register_keras_serializable(package="jacutil")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position: ``y[t] = x[t] + P[t]``."""

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=tuple(input_shape[-2:]),
            initializer=keras.initializers.RandomNormal(stddev=0.02, seed=7),
            name="positions",
        )

    def call(self, x):
        return x + keras.ops.cast(self.positions, x.dtype)


def tiny_transformer(
    vocabulary=64, length=16, width=32, heads=2, n_layers=2, n_classes=2, *, seed=0
):
    """A transformer classifier on token ids (n, length), 0 the padding.

    Returns a functional ``keras.Model`` named ``tiny_transformer``: ids ->
    logits (n, n_classes). Each block: ``h = LayerNorm(h + MHA(h, h,
    attention_mask))`` then ``h = LayerNorm(h + Dense(Dense_gelu(h)))``,
    the feed-forward ``2 * width`` wide. ``seed`` seeds every initializer.
    Introduced in ``12-private-fine-tuning``.
    """
    layers = keras.layers
    ops = keras.ops
    init = iter(range(seed, seed + 100))

    def glorot():
        return keras.initializers.GlorotUniform(seed=next(init))

    ids = keras.Input((length,), dtype="int32", name="token_ids")
    real = ops.cast(ops.not_equal(ids, 0), "float32")  # (n, T): 1 for a token
    attention_mask = ops.logical_and(
        ops.expand_dims(ops.not_equal(ids, 0), 1),
        ops.expand_dims(ops.not_equal(ids, 0), 2),
    )  # (n, T, T): pairs of real tokens
    h = layers.Embedding(
        vocabulary,
        width,
        embeddings_initializer=keras.initializers.RandomNormal(
            stddev=0.1, seed=next(init)
        ),
        name="token_embedding",
    )(ids)
    h = PositionEmbedding(name="position_embedding")(h)
    for i in range(n_layers):
        attention = layers.MultiHeadAttention(
            heads,
            width // heads,
            kernel_initializer=glorot(),
            name=f"attention_{i}",
        )(h, h, attention_mask=attention_mask)
        h = layers.LayerNormalization(name=f"attention_norm_{i}")(h + attention)
        f = layers.Dense(
            2 * width, activation="gelu", kernel_initializer=glorot(), name=f"ff_in_{i}"
        )(h)
        f = layers.Dense(width, kernel_initializer=glorot(), name=f"ff_out_{i}")(f)
        h = layers.LayerNormalization(name=f"ff_norm_{i}")(h + f)
    summed = ops.sum(h * ops.expand_dims(real, -1), axis=1)
    pooled = summed / ops.maximum(ops.sum(real, axis=1, keepdims=True), 1.0)
    logits = layers.Dense(n_classes, kernel_initializer=glorot(), name="head")(pooled)
    return keras.Model(ids, logits, name="tiny_transformer")


def enable_attention_lora(model, rank):
    """LoRA of ``rank`` on every attention layer's query and value
    projections (as KerasHub's ``backbone.enable_lora``): each kernel frozen,
    its two low-rank factors the only trainable weights there. Every other
    layer but the head is frozen too. Returns the trainable variables."""
    for layer in model.layers:
        if isinstance(layer, keras.layers.MultiHeadAttention):
            layer.query_dense.enable_lora(rank)
            layer.value_dense.enable_lora(rank)
            for dense in (layer.key_dense, layer.output_dense):
                dense.trainable = False
        elif layer.name != "head":
            layer.trainable = False
    return model.trainable_variables


def token_data(n_samples, vocabulary=64, length=16, *, seed=0, task=0):
    """Seeded token sequences ``(ids, labels)``: ids (n, length) int32 with
    random lengths from ``length // 2`` to ``length`` (0 pads the end), and
    labels (n,) int32: 1 where the task's first marker set occurs more often
    than its second (ties broken by the first token). ``task`` draws the
    marker sets (4 tokens each): another task, a related problem."""
    rng = np.random.default_rng(seed)
    markers = np.random.default_rng(1000 + task).permutation(np.arange(1, vocabulary))
    first, second = markers[:4], markers[4:8]
    ids = rng.integers(1, vocabulary, (n_samples, length))
    lengths = rng.integers(length // 2, length + 1, n_samples)
    ids[np.arange(length)[None, :] >= lengths[:, None]] = 0
    score = np.isin(ids, first).sum(1) - np.isin(ids, second).sum(1)
    labels = np.where(score == 0, ids[:, 0] % 2, score > 0)
    return ids.astype("int32"), labels.astype("int32")


@keras.saving.register_keras_serializable(package="jacutil")
class ReversibleEmbedding(keras.layers.Embedding):
    """An ``Embedding`` that also reads its matrix transposed, as KerasHub's
    ``ReversibleEmbedding``: ``layer(ids)`` embeds the tokens and
    ``layer(h, reverse=True)`` gives the logits ``h @ E.T`` (the output head
    tied to the input embedding, one layer used twice)."""

    def call(self, inputs, reverse=False):
        if reverse:
            kernel = keras.ops.transpose(keras.ops.convert_to_tensor(self.embeddings))
            return keras.ops.matmul(inputs, keras.ops.cast(kernel, inputs.dtype))
        return super().call(inputs)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            shape = (*inputs.shape[:-1], self.input_dim)
            return keras.KerasTensor(shape, dtype=self.compute_dtype)
        return super().compute_output_spec(inputs)


def tiny_gpt2(vocabulary=96, length=16, width=32, heads=2, n_layers=2, *, seed=0):
    """A decoder-only language model of KerasHub's GPT-2 shape, from Keras's
    own layers and random weights (nothing downloaded): token ids (n, length)
    -> next-token logits (n, length, vocabulary).

    Token and position embeddings, then ``n_layers`` pre-norm blocks ``h = h
    + MHA(LN(h), causal)`` and ``h = h + Dense(Dense_gelu(LN(h)))`` (the MLP
    ``4 * width`` wide), a final LayerNorm and the logits from the token
    embedding's own matrix (:class:`ReversibleEmbedding`, tied as GPT-2's
    are). ``seed`` seeds every initializer.
    """
    layers = keras.layers
    init = iter(range(seed, seed + 100))

    def glorot():
        return keras.initializers.GlorotUniform(seed=next(init))

    ids = keras.Input((length,), dtype="int32", name="token_ids")
    embedding = ReversibleEmbedding(
        vocabulary,
        width,
        embeddings_initializer=keras.initializers.RandomNormal(
            stddev=0.1, seed=next(init)
        ),
        name="token_embedding",
    )
    h = PositionEmbedding(name="position_embedding")(embedding(ids))
    for i in range(n_layers):
        x = layers.LayerNormalization(epsilon=1e-5, name=f"attention_norm_{i}")(h)
        x = layers.MultiHeadAttention(
            heads, width // heads, kernel_initializer=glorot(), name=f"attention_{i}"
        )(x, x, use_causal_mask=True)
        h = layers.Add(name=f"attention_residual_{i}")([h, x])
        x = layers.LayerNormalization(epsilon=1e-5, name=f"mlp_norm_{i}")(h)
        x = layers.Dense(
            4 * width,
            activation="gelu",
            kernel_initializer=glorot(),
            name=f"mlp_in_{i}",
        )(x)
        x = layers.Dense(width, kernel_initializer=glorot(), name=f"mlp_out_{i}")(x)
        h = layers.Add(name=f"mlp_residual_{i}")([h, x])
    h = layers.LayerNormalization(epsilon=1e-5, name="final_norm")(h)
    logits = embedding(h, reverse=True)
    return keras.Model(ids, logits, name="tiny_gpt2")


def enable_gpt2_lora(model, rank):
    """LoRA of ``rank`` on each attention's query and value projections, as
    KerasHub's ``backbone.enable_lora(rank)``: every layer frozen but those
    two, whose kernels are frozen too; their low-rank factors and biases
    train. Returns the trainable variables."""
    for layer in model.layers:
        layer.trainable = False
    for layer in model.layers:
        if isinstance(layer, keras.layers.MultiHeadAttention):
            layer.trainable = True
            for dense in (layer.key_dense, layer.output_dense):
                dense.trainable = False
            layer.query_dense.enable_lora(rank)
            layer.value_dense.enable_lora(rank)
    return model.trainable_variables


def next_token_data(n_samples, vocabulary=96, length=16, *, seed=0):
    """Seeded next-token data ``(ids, targets)``, both (n, length) int32:
    sequences of a fixed random Markov chain (each token followed by one of
    three likely successors, else by any token), ``targets`` the ids shifted
    by one. ``seed`` draws the sequences; the chain is the same for every
    seed (a task one can learn)."""
    chain = np.random.default_rng(4242)
    successors = chain.integers(1, vocabulary, (vocabulary, 3))
    rng = np.random.default_rng(seed)
    tokens = np.empty((n_samples, length + 1), np.int64)
    tokens[:, 0] = rng.integers(1, vocabulary, n_samples)
    for t in range(1, length + 1):
        likely = successors[tokens[:, t - 1], rng.integers(0, 3, n_samples)]
        anyone = rng.integers(1, vocabulary, n_samples)
        tokens[:, t] = np.where(rng.random(n_samples) < 0.8, likely, anyone)
    return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
