"""Each peer (JAX, PyTorch) returns jacutil's Jacobian on an MLP, a CNN, an LSTM."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import peers
from jacutil.peers.network import describe

MODELS = {
    "mlp": (ju.question_mlp, lambda n: ju.regression_data(n)[0]),
    "cnn": (ju.small_cnn, ju.image_data),
    "lstm": (ju.sequence_lstm, ju.sequence_data),
}


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("peer", ["jax", "torch"])
def test_peer_equals_jacutil(peer, model_name):
    pytest.importorskip(peer)
    build, inputs = MODELS[model_name]
    model, x = build(seed=3), inputs(5)
    J = getattr(peers, f"{peer}_jacobian")(model)(x)
    expected = ju.compiled_jacobian(model)(x)
    assert J.shape == expected.shape and J.dtype == np.float32
    np.testing.assert_allclose(J, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("peer", ["jax", "torch"])
def test_peer_leaves_frozen_weights_out(peer):
    pytest.importorskip(peer)
    model = ju.small_cnn(seed=1)
    model.layers[0].trainable = False  # the first convolution: constants
    x = ju.image_data(3)
    J = getattr(peers, f"{peer}_jacobian")(model)(x)
    np.testing.assert_allclose(J, ju.compiled_jacobian(model)(x), rtol=1e-5, atol=1e-6)
    assert J.shape[2] == ju.flat_params(model).size


def test_describe_reads_keras_layouts():
    layers, theta = describe(ju.sequence_lstm())
    assert [layer.kind for layer in layers] == ["lstm", "dense"]
    assert [p.shape for p in theta] == [(4, 64), (16, 64), (64,), (16, 2), (2,)]
    assert layers[0].weights == {"kernel": 0, "recurrent_kernel": 1, "bias": 2}
    assert (layers[0].activation, layers[0].recurrent_activation) == (
        "tanh",
        "sigmoid",
    )


def test_describe_names_a_layer_it_does_not_rebuild():
    model = ju.keras.Sequential(
        [ju.keras.Input((4,)), ju.keras.layers.BatchNormalization()]
    )
    with pytest.raises(ValueError, match="BatchNormalization"):
        describe(model)


def test_peers_are_none_when_not_installed(monkeypatch):
    monkeypatch.setattr(peers, "available", lambda name: False)
    model = ju.question_mlp()
    assert peers.jax_jacobian(model) is None and peers.torch_jacobian(model) is None
