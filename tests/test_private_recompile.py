"""A private fine-tune compiles once per shape of batch, never per batch
(issue 63, point 6).

A GPT-2-shaped model whose output head is its token embedding read
transposed (KerasHub's ``ReversibleEmbedding``: one layer used twice) is off
the layer rules, so each private step takes its norms from the per-sample
gradients, vectorized over samples under XLA (attention's batch matmuls).
Keras's loss of each sample (``KerasLoss``) vectorized over its one sample
inside that ``vectorized_map`` made XLA take the batch's values as
compile-time constants: the same graph, compiled again for every new
Poisson batch (a private epoch 137-252x a plain one). Here: after a warm-up
epoch, the steps of another epoch trace nothing, and the program XLA
compiles for each of their batches is one program that takes the batch as
its parameters.
"""

import re

import numpy as np
import pytest

from jacutil import keras, tf
from jacutil.core.formulation import Ladder
from jacutil.fitting.loss_gradients import gradients_for, per_sample_gradient_norms
from jacutil.privacy import make_private
from jacutil.privacy.dp_sgd import DPSGD
from jacutil.teaching.transformer import enable_gpt2_lora, next_token_data, tiny_gpt2

pytest.importorskip("dp_accounting")
pytestmark = pytest.mark.filterwarnings("ignore:seed=.*NOT private")

N, BATCH, VOCABULARY, LENGTH = 48, 8, 24, 8


def _private_gpt2(train_embedding=False):
    keras.utils.set_random_seed(0)
    model = tiny_gpt2(VOCABULARY, LENGTH, width=16, heads=2, n_layers=1, seed=0)
    enable_gpt2_lora(model, 4)
    # trained, the tied embedding is a layer whose variables train used twice:
    # on the layer rules, its two calls' blocks summed (frozen, as KerasHub's
    # LoRA leaves it, it is two functions of no trained variable)
    model.get_layer("token_embedding").trainable = train_embedding
    model.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    make_private(model, epsilon=3.0, delta=1e-3, l2_norm_clip=1.0,
                 batch_size=BATCH, epochs=3, train_size=N, seed=0,
                 verbose=False)  # fmt: skip
    return model


def _entry(hlo):
    """The parameters of the HLO module's entry computation, as written."""
    return re.search(r"^ENTRY [^(]*\((.*)\) ->", hlo, re.MULTILINE).group(1)


def test_tied_gpt2_with_lora_takes_the_fused_step_tracing_once():
    """KerasHub's LoRA freezes the tied embedding: used twice, it is two
    functions of no trained variable, and the fused, book-kept step runs."""
    model = _private_gpt2()
    x, y = next_token_data(N, VOCABULARY, LENGTH, seed=0)
    model.fit(x, y, epochs=1, verbose=0)  # warm-up: traces and compiles
    dpsgd = model.privacy.dpsgd
    assert dpsgd._fused[2] is not None and dpsgd.bookkept
    traces, steps = dpsgd.trace_count, dpsgd.steps
    model.fit(x, y, epochs=1, verbose=0)  # new Poisson batches, same shape
    assert dpsgd.steps == steps + N // BATCH
    assert dpsgd.trace_count == traces


def test_off_the_rules_the_norms_compile_once_not_per_batch(monkeypatch):
    """With the tied embedding trained the norms are the per-sample
    gradients', vectorized under XLA: one program for every batch."""
    # a trained tied embedding is on the rules now (issue 64): this test
    # takes the model off them, as a model the rules cannot read would be
    import jacutil.engine.compiled as compiled

    monkeypatch.setattr(
        compiled, "plan_for", lambda *args: (None, "off the rules, for this test")
    )
    model = _private_gpt2(train_embedding=True)
    x, y = next_token_data(N, VOCABULARY, LENGTH, seed=0)
    calls = []
    ladder_call = Ladder.__call__

    def recorded(self, key, args, xla=()):
        found = ladder_call(self, key, args, xla)
        calls.append((self, key, args, found[1], found[2]))
        return found

    monkeypatch.setattr(Ladder, "__call__", recorded)
    model.fit(x, y, epochs=1, verbose=0)  # warm-up: traces and compiles
    dpsgd = model.privacy.dpsgd
    assert dpsgd._fused[2] is None  # off the rules: a trained layer used twice
    job = gradients_for(model, dpsgd.loss_fn, None, False)
    traces = (dpsgd.trace_count, job.trace_count)
    calls.clear()

    model.fit(x, y, epochs=1, verbose=0)  # new Poisson batches, same shape
    assert (dpsgd.trace_count, job.trace_count) == traces
    norms = [call for call in calls if call[1][0] == "norms"]
    assert len(norms) >= N // BATCH  # one call a step (more: a large draw)
    assert all(under_xla for *_, under_xla in norms)  # what this test is about
    programs = set()
    for ladder, key, args, mode, under_xla in norms:
        function = ladder.functions[key, mode, under_xla].function
        hlo = function.experimental_get_compiler_ir(*args)(stage="hlo")
        rows = int(args[0].shape[0])
        # the token ids are a parameter of the program, not its constants
        assert f"s32[{rows},{LENGTH}]" in _entry(hlo), _entry(hlo)
        programs.add(hlo)
    assert len(programs) == 1  # the same program for every batch


@pytest.mark.parametrize("train_embedding", [False, True])
def test_norms_are_each_samples_own_gradient_norm(train_embedding):
    """The norms of the rules (the frozen tied embedding: two functions) and
    of the vectorized path (Keras's loss of each sample taken as it is) are
    those of each sample's gradient, one tape per sample."""
    model = _private_gpt2(train_embedding)
    x, y = next_token_data(4, VOCABULARY, LENGTH, seed=1)
    norms = per_sample_gradient_norms(model, model.privacy.dpsgd.loss_fn, x, y)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = []
    for i in range(4):
        with tf.GradientTape() as tape:
            value = loss(y[i : i + 1], model(x[i : i + 1], training=False))
        grads = tape.gradient(value, model.trainable_variables)
        expected.append(np.sqrt(sum(float(tf.reduce_sum(g**2)) for g in grads)))
    np.testing.assert_allclose(norms, expected, rtol=1e-4)


def test_a_fused_step_of_the_tied_gpt2_is_the_clipped_sum():
    """With no noise, the fused book-kept step on the frozen tied embedding
    moves the LoRA factors by the sum of each sampled row's gradient clipped
    to C (one tape per sample), over the expected batch size."""
    keras.utils.set_random_seed(0)
    model = tiny_gpt2(VOCABULARY, LENGTH, width=16, heads=2, n_layers=1, seed=0)
    enable_gpt2_lora(model, 4)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    clip = 0.05
    dpsgd = DPSGD(model, loss.call, keras.optimizers.SGD(1.0), l2_norm_clip=clip,
                  noise_multiplier=0.0, seed=0)  # fmt: skip
    x, y = next_token_data(N, VOCABULARY, LENGTH, seed=2)
    before = [v.numpy() for v in dpsgd.variables]
    _, _, _, valid = dpsgd.sampled_step(x, y, BATCH)
    assert dpsgd._fused[2] is not None and dpsgd.bookkept
    after = [v.numpy() for v in dpsgd.variables]
    for v, value in zip(dpsgd.variables, before, strict=True):
        v.assign(value)
    total, clipped = [np.zeros_like(b) for b in before], 0
    for i in dpsgd.last_index[np.asarray(valid) > 0]:
        with tf.GradientTape() as tape:
            value = loss(y[i : i + 1], model(x[i : i + 1], training=False))
        grads = [g.numpy() for g in tape.gradient(value, dpsgd.variables)]
        norm = np.sqrt(sum(float(np.sum(g**2)) for g in grads))
        clipped += norm > clip
        for t, g in zip(total, grads, strict=True):
            t += g * min(1.0, clip / norm)
    assert clipped > 0  # the clipping is at work
    for b, a, t in zip(before, after, total, strict=True):
        np.testing.assert_allclose(a, b - t / BATCH, rtol=1e-4, atol=1e-6)
