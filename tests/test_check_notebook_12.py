"""12-private-fine-tuning's exercise check: typical wrong answers get their
hint; and the notebook's model and data (jacutil.teaching.transformer)."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras
from jacutil.teaching import check
from jacutil.teaching.transformer import (
    enable_attention_lora,
    tiny_transformer,
    token_data,
)
from tests.check_hints import hint
from tests.generated import tape_jacobian


@pytest.fixture(scope="module")
def lora_model():
    model = tiny_transformer(vocabulary=20, length=6, width=8, heads=2, seed=1)
    enable_attention_lora(model, 2)
    x, y = token_data(10, vocabulary=20, length=6, seed=2)
    return model, x, y


def test_12_1_gradient_norms(lora_model):
    model, x, y = lora_model
    context = {"model": model, "x": x, "y": y}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    norms = ju.per_sample_gradient_norms(model, loss, x, y)
    assert check.verdict("12-1", norms, **context).correct
    assert not check.verdict("12-1", None, **context).answered
    assert "squared norms" in hint("12-1", norms**2, **context)
    assert "one number" in hint("12-1", float(np.linalg.norm(norms)), **context)
    G = ju.per_sample_gradients(model, loss, x, y)
    assert "the gradients themselves" in hint("12-1", G, **context)
    assert "not the norms" in hint("12-1", 2 * norms, **context)


def test_12_2_trainable_weights_with_rank_8():
    model = tiny_transformer()
    count = sum(int(np.prod(v.shape)) for v in enable_attention_lora(model, 8))
    assert check.verdict("12-2", count, rank=8).correct
    assert "every weight" in hint("12-2", model.count_params(), rank=8)
    assert "trainable variables (arrays)" in hint(
        "12-2", len(model.trainable_variables), rank=8
    )
    four = enable_attention_lora(tiny_transformer(), 4)
    four = sum(int(np.prod(v.shape)) for v in four)
    assert "not the count for rank 8" in hint("12-2", four, rank=8)


def test_token_data_pads_the_end_and_labels_by_markers():
    ids, labels = token_data(200, vocabulary=30, length=10, seed=0, task=3)
    assert ids.shape == (200, 10) and ids.dtype == np.int32
    real = ids != 0
    # padding only at the end: once a 0, always a 0
    assert np.all(real[:, :-1] >= real[:, 1:])
    assert real.sum(1).min() >= 5 and set(np.unique(labels)) == {0, 1}
    again, _ = token_data(200, vocabulary=30, length=10, seed=0, task=3)
    np.testing.assert_array_equal(ids, again)  # seeded
    _, other = token_data(200, vocabulary=30, length=10, seed=0, task=4)
    assert np.mean(other != labels) > 0.2  # another task: other markers


def test_the_padding_never_reaches_the_logits():
    """The padding token's embedding can be anything: the attention mask and
    the mean over real tokens leave it out (a real token's cannot)."""
    model = tiny_transformer(vocabulary=20, length=6, width=8, heads=2, seed=1)
    ids = np.array([[3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 0]], "int32")
    before = np.asarray(model(ids))
    table = model.get_layer("token_embedding").embeddings
    moved = table.numpy()
    moved[0] += 5.0  # the padding's row
    table.assign(moved)
    np.testing.assert_allclose(np.asarray(model(ids)), before, rtol=1e-5, atol=1e-6)
    moved[3] += 5.0  # a real token's row
    table.assign(moved)
    assert not np.allclose(np.asarray(model(ids))[0], before[0], atol=1e-3)


def test_lora_leaves_only_factors_biases_and_head_trainable(lora_model):
    model, x, _ = lora_model
    names = sorted(v.path.split("/")[-1] for v in model.trainable_variables)
    assert set(names) == {"bias", "kernel", "lora_kernel_a", "lora_kernel_b"}
    kernels = [v.path for v in model.trainable_variables if v.path.endswith("/kernel")]
    assert kernels == ["head/kernel"]
    factors = [v for v in model.trainable_variables if "lora" in v.path]
    J = ju.jacobian(model, x, variables=factors)
    np.testing.assert_allclose(J, tape_jacobian(model, x, factors), rtol=1e-4,
                               atol=1e-6)  # fmt: skip
