# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 12 · Private fine-tuning of a transformer with LoRA
#
# **Questions**
# - How do I fine-tune a pretrained transformer on private data, the Keras
#   way, with a privacy guarantee?
# - Why train only LoRA's low-rank factors, and what does each sample's
#   gradient of them cost?
#
# **Objectives**
# - Build a small transformer classifier from a config (random weights, no
#   download), pretrain it on public data, then switch on LoRA so that only
#   the attention's low-rank factors (with their projections' biases) and
#   the head train.
# - Prove each sample's gradient of those weights, from the layer rules,
#   equal to a tape of its own.
# - Fine-tune it on private token data, padded, with `make_private` and
#   plain `model.fit`, and read ε from the logs.
# - Measure a private step against a plain one at batch 32.
#
# This notebook comes after `09-matrix-free`, which teaches DP-SGD and
# `make_private` on small models: here the same call meets a transformer.
#
# *Teaching: 21 min · Exercises: 15 min*

# %% [markdown]
# ## Setup

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

import jacutil as ju
from jacutil import keras, tf
from jacutil.teaching import check
from jacutil.teaching.claims import claim
from jacutil.teaching.transformer import (
    enable_attention_lora,
    tiny_transformer,
    token_data,
)

# %% tags=["nbval-ignore-output"]
print(ju.teaching.notebook.device_summary())

# %% tags=["parameters"]
n_public = 3000  # token sequences of the public (pretraining) task
n_private = 4000  # sequences of the private task
pretrain_epochs = 3  # plain Adam epochs on the public task
private_epochs = 4  # DP-SGD epochs on the private task
target_epsilon = 8.0  # the privacy budget of the fine-tuning
rank = 4  # LoRA's rank
batch_size = 64  # the expected batch of the private fit (Poisson-sampled)
n_timed = 5  # epochs timed for the step comparison (each 4 steps)
seed = 0

# %% [markdown]
# ## A transformer from a config
#
# KerasHub builds its models from a config: `BertBackbone(vocabulary_size=...,
# num_layers=..., hidden_dim=...)`, random weights unless you load a preset.
# `tiny_transformer` is the same shape built from Keras's own layers: token
# and position embeddings, two blocks of `MultiHeadAttention` and a
# feed-forward pair, each with a residual and a `LayerNormalization`, a mean
# over the real tokens and a `Dense` head. Token 0 is padding: the attention
# mask keeps every real token from reading it.
#
# The data: sequences of random tokens, padded at the end, labelled by which
# of two small sets of "marker" tokens occurs more often. Task 0 is public
# and plentiful; task 1 (other markers) is the private one.

# %%
keras.utils.set_random_seed(seed)
model = tiny_transformer(seed=seed)
x_public, y_public = token_data(n_public, seed=seed + 1, task=0)
x_private, y_private = token_data(n_private, seed=seed + 2, task=1)
x_test, y_test = token_data(1000, seed=seed + 3, task=1)
print(f"{model.count_params():,} weights; a batch of ids {x_private.shape}, "
      f"padding: {np.mean(x_private == 0):.0%} of the positions")
print("one sequence:", x_private[0])


def compiled(model, learning_rate):
    model.compile(keras.optimizers.Adam(learning_rate),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


compiled(model, 3e-3).fit(x_public, y_public, batch_size=64,
                          epochs=pretrain_epochs, verbose=0)
public_accuracy = model.evaluate(*token_data(1000, seed=seed + 4, task=0),
                                 verbose=0)[1]
before = model.evaluate(x_test, y_test, verbose=0)[1]
print(f"pretrained: accuracy {public_accuracy:.1%} on the public task, "
      f"{before:.1%} on the private one (chance: about 50%)")
pretrained = model.get_weights()

# %% [markdown]
# ## LoRA: a few trainable weights
#
# LoRA (Hu et al., 2021) freezes a kernel `W` and learns a low-rank change:
# `W + (α / r) A B` with `A` (d, r) and `B` (r, k). Keras has it built in:
# `layer.enable_lora(rank)` on `Dense`, `EinsumDense` and `Embedding`.
# `enable_attention_lora` turns it on for every attention layer's query
# and value projections, as KerasHub's `backbone.enable_lora(rank)` does
# (Keras keeps those projections' biases trainable), and freezes everything
# else but the head: for each attention layer `layer.query_dense.enable_lora(rank)`
# and `layer.value_dense.enable_lora(rank)`, for every other layer
# `layer.trainable = False` (`jacutil/teaching/transformer.py`).

# %%
trainable = enable_attention_lora(model, rank)
n_trainable = sum(int(np.prod(v.shape)) for v in trainable)
print(f"{n_trainable:,} trainable weights of {model.count_params():,} "
      f"({n_trainable / model.count_params():.1%}):")
for v in trainable:
    print(f"  {v.path:34} {tuple(v.shape)}")
claim("lora-few-percent", n_trainable < 0.1 * model.count_params(),
      f"LoRA leaves {n_trainable / model.count_params():.1%} of the weights "
      "trainable")

# %% [markdown]
# For DP-SGD that is a gift twice over. The noise is added to every trainable
# weight, so fewer weights means less noise in total; and each sample's
# gradient is only of the factors. The layer rules write it from each
# layer's input and signal: for the factor `A` of a projection with input
# `x` and signal `δ`, the outer product of `x` and `(α / r) δ Bᵀ`; for `B`,
# of `(α / r) x A` and `δ` (`jacutil/rules/dense.py`). The attention core
# between the projections passes its signal by autodiff.
#
# Proof: each sample's gradient from `ju.per_sample_gradients` against a
# `tf.GradientTape` per sample.

# %%
# one loss per sample (reduction=None), as per-sample gradients need
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
x_few, y_few = x_private[:8], y_private[:8]
G, choice = ju.per_sample_gradients(model, loss, x_few, y_few, explain=True)
print(str(choice).splitlines()[0])
rows = []
for i in range(len(x_few)):
    with tf.GradientTape() as tape:
        value = loss(y_few[i:i + 1], model(x_few[i:i + 1], training=False))
    grads = tape.gradient(value, [v.value for v in trainable])
    rows.append(np.concatenate([np.ravel(g) for g in grads]))
error = np.abs(G - np.stack(rows)).max() / np.abs(np.stack(rows)).max()
assert error < 1e-4, error
print(f"per-sample gradients {G.shape} == a tape per sample: relative "
      f"difference {error:.1e}")

# %% [markdown]
# ## Private fine-tuning with `model.fit`
#
# `make_private` (notebook 09) calibrates the noise so that `private_epochs`
# epochs of Poisson-sampled batches spend at most ε, then `model.fit` takes
# DP-SGD steps: each sample's gradient of Keras's own loss clipped to norm
# 1, summed, noised. The padding needs nothing more: the mask is part of
# the model.

# %%
model = tiny_transformer(seed=seed)
model.set_weights(pretrained)
enable_attention_lora(model, rank)
compiled(model, 3e-2)
ju.make_private(model, epsilon=target_epsilon, delta=1e-5, l2_norm_clip=1.0,
                batch_size=batch_size, epochs=private_epochs,
                train_size=n_private, seed=seed)
history = model.fit(x_private, y_private, epochs=private_epochs, verbose=0)
after = model.evaluate(x_test, y_test, verbose=0)[1]
spent = history.history["epsilon"]
print(f"epsilon after each epoch: {', '.join(f'{e:.2f}' for e in spent)}")
print(f"accuracy on the private task: {before:.1%} before, {after:.1%} after "
      f"private LoRA fine-tuning (epsilon {spent[-1]:.2f})")
claim("private-fit-epsilon", len(spent) == private_epochs
      and all(np.diff(spent) > 0) and spent[-1] <= target_epsilon + 1e-6,
      f"model.fit logged epsilon after each of its {len(spent)} epochs, "
      f"growing to {spent[-1]:.2f} <= {target_epsilon}")

# %% [markdown]
# The same fine-tuning without privacy, for comparison (same weights, same
# learning rate, same epochs):

# %%
plain = tiny_transformer(seed=seed)
plain.set_weights(pretrained)
enable_attention_lora(plain, rank)
compiled(plain, 3e-2).fit(x_private, y_private, batch_size=batch_size,
                          epochs=private_epochs, verbose=0)
plain_after = plain.evaluate(x_test, y_test, verbose=0)[1]
fig, ax = plt.subplots(figsize=(5, 3))
ax.bar(["pretrained", f"private LoRA\n(ε = {spent[-1]:.1f})", "plain LoRA"],
       [before, after, plain_after], color=["0.6", "C0", "C1"])
ax.axhline(0.5, color="k", lw=0.8, ls=":")
ax.set_ylabel("accuracy on the private task")
ax.set_ylim(0, 1)
plt.tight_layout()
plt.show()
gap = plain_after - after
print(f"private {after:.1%}, plain {plain_after:.1%}: the private fit is "
      + (f"{gap * 100:.1f} points behind the plain one here" if gap > 0 else
         "not behind the plain one on this run"))

# %% [markdown]
# ## What a private step costs
#
# The call users repeat is an epoch of `model.fit`. Both models below start
# from the same weights and fit the same 128 sequences at batch 32, an epoch
# each in turn; the first epoch of each (tracing) is left out.

# %% tags=["nbval-ignore-output"]
x_small, y_small = x_private[:128], y_private[:128]


def timed_model(private):
    m = tiny_transformer(seed=seed)
    m.set_weights(pretrained)
    enable_attention_lora(m, rank)
    compiled(m, 1e-3)
    if private:
        ju.make_private(m, epsilon=target_epsilon, delta=1e-5, l2_norm_clip=1.0,
                        batch_size=32, epochs=n_timed + 1, train_size=128,
                        verbose=False)
    return m


models = {"plain": timed_model(False), "private": timed_model(True)}
seconds = {name: [] for name in models}
for _ in range(n_timed + 1):
    for name, m in models.items():
        start = time.perf_counter()
        m.fit(x_small, y_small, batch_size=32, epochs=1, verbose=0)
        seconds[name].append(time.perf_counter() - start)
plain_s, private_s = (np.median(s[1:]) for s in seconds.values())
print(f"an epoch of 4 steps: plain {plain_s * 1e3:.0f} ms, private "
      f"{private_s * 1e3:.0f} ms: {private_s / plain_s:.2f}x")

# %% [markdown]
# On this machine the ratio is printed above. `make bench` measures it on
# the same model with a larger run (`python -m jacutil.bench.privacy_rows`).

# %% [markdown]
# ## Exercises
#
# Each exercise ends with a check: put your answer in `answer` and run the
# check's cell. It says "correct", or gives a hint (never the answer).
#
# **1.** Clipping at norm 1 scales down every sample whose gradient is
# longer. With `ju.per_sample_gradient_norms`, compute the norm of each of
# the first 64 private samples' gradient of the loss (`loss` above), for
# the trainable weights of `plain` (an array of 64 norms), and print the
# share above 1.

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: the norms come from the layer rules without forming the
# gradients (ghost norms); the share clipped is the share above 1.
answer = ju.per_sample_gradient_norms(plain, loss, x_private[:64], y_private[:64])
print(f"{np.mean(answer > 1):.0%} of the 64 gradients would be clipped")

# %%
check.exercise("12-1", answer, model=plain, x=x_private[:64], y=y_private[:64])

# %% [markdown]
# **2.** A higher rank trains more weights. Build a fresh
# `tiny_transformer(seed=seed)`, switch on LoRA of rank 8 with
# `enable_attention_lora`, and count its trainable weights (one integer).

# %% tags=["solution", "nbval-ignore-output"] jupyter={"source_hidden": true}
# Solution: count the entries of the trainable variables only; each factor
# pair grows with the rank, the biases and the head do not.
wider = tiny_transformer(seed=seed)
answer = sum(int(np.prod(v.shape)) for v in enable_attention_lora(wider, 8))
print(f"rank 8: {answer:,} trainable weights (rank {rank}: {n_trainable:,})")

# %%
check.exercise("12-2", answer, rank=8)

# %% [markdown]
# ## Keypoints
#
# - `layer.enable_lora(rank)` freezes a kernel and trains two low-rank
#   factors; on attention's query and value projections that leaves a few
#   percent of the weights trainable. <!-- claim: lora-few-percent -->
# - The layer rules write each sample's gradient of the factors from the
#   layer's input and signal; `MultiHeadAttention` passes its signal through
#   the attention core by autodiff. Proved against a tape per sample.
# - `make_private` then `model.fit` fine-tunes privately with the padding
#   mask inside the model; the logs carry ε after each epoch. <!-- claim: private-fit-epsilon -->
# - A private epoch's cost is printed beside a plain one's from the same
#   run: measure it on your machine, not from a table.
