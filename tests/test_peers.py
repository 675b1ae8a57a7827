"""Each peer (JAX, PyTorch) returns jacutil's Jacobian on an MLP, a CNN, an LSTM,
a residual MLP and a two-head model, and jacutil's per-sample gradients and
their norms. The translation itself (``describe`` and ``forward``) is
checked in NumPy, which needs neither peer."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import peers
from jacutil.bench import models as bench_models
from jacutil.peers.layers import Ops, forward
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
    assert peers.jax_gradients(model) is None and peers.torch_gradients(model) is None
    assert peers.jax_gradient_norms(model) is None
    assert peers.torch_gradient_norms(model) is None


GRAPHS = {
    "residual": (bench_models.residual_mlp, lambda n: bench_models.flat_data(n, 32)),
    "two_head": (bench_models.two_head, lambda n: bench_models.flat_data(n, 10)),
}


@pytest.mark.parametrize("model_name", sorted(GRAPHS))
@pytest.mark.parametrize("peer", ["jax", "torch"])
def test_peer_jacobian_of_a_graph_equals_jacutil(peer, model_name):
    pytest.importorskip(peer)
    build, inputs = GRAPHS[model_name]
    model, x = build(seed=4), inputs(5)
    J = getattr(peers, f"{peer}_jacobian")(model)(x)
    expected = ju.jacobian(model, x)
    assert J.shape == expected.shape
    np.testing.assert_allclose(J, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("peer", ["jax", "torch"])
def test_peer_rows_follow_the_output_order_of_a_dict(peer):
    pytest.importorskip(peer)
    model, x = _dict_heads(), bench_models.flat_data(4, 6)
    J = getattr(peers, f"{peer}_jacobian")(model)(x)
    np.testing.assert_allclose(J, ju.jacobian(model, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("peer", ["jax", "torch"])
def test_peer_gradients_and_norms_equal_jacutil(peer, model_name):
    pytest.importorskip(peer)
    build, inputs = MODELS[model_name]
    model, x = build(seed=5), inputs(5)
    y = bench_models.targets(model, 5)
    mse = ju.keras.losses.mean_squared_error
    G = getattr(peers, f"{peer}_gradients")(model)(x, y)
    expected = ju.per_sample_gradients(model, mse, x, y)
    assert G.shape == expected.shape == (5, ju.flat_params(model).size)
    np.testing.assert_allclose(G, expected, rtol=1e-5, atol=1e-6)
    norms = getattr(peers, f"{peer}_gradient_norms")(model)(x, y)
    np.testing.assert_allclose(
        norms, ju.per_sample_gradient_norms(model, mse, x, y), rtol=1e-5, atol=1e-6
    )


def _dict_heads():
    """Two heads returned as a dict whose keys sort against the call order."""
    keras = ju.keras
    inputs = keras.Input((6,))
    trunk = keras.layers.Dense(8, activation="tanh", name="trunk")(inputs)
    wide = keras.layers.Dense(3, name="wide")(trunk)
    narrow = keras.layers.Dense(1, name="narrow")(trunk)
    return keras.Model(inputs, {"b": wide, "a": narrow})


NUMPY = Ops(
    act={
        "linear": lambda z: z,
        "relu": lambda z: np.maximum(z, 0),
        "tanh": np.tanh,
        "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
    },
    conv2d=None,
    concat=np.concatenate,
)


def _numpy_forward(model, x):
    """The records run in NumPy, sample by sample: (n, n_outputs)."""
    layers, theta = describe(model)
    return np.stack([forward(layers, theta, sample, NUMPY) for sample in x])


@pytest.mark.parametrize("model_name", sorted(GRAPHS))
def test_a_graph_forward_equals_keras(model_name):
    build, inputs = GRAPHS[model_name]
    model, x = build(seed=2), inputs(4)
    rows = np.concatenate(
        [np.reshape(y, (4, -1)) for y in ju.tf.nest.flatten(model(x))], axis=1
    )
    np.testing.assert_allclose(_numpy_forward(model, x), rows, rtol=1e-5, atol=1e-6)


def test_describe_reads_a_residual_graph_in_topological_order():
    layers, theta = describe(bench_models.residual_mlp())
    kinds = [layer.kind for layer in layers]
    assert kinds == ["dense"] + ["dense", "add"] * 3 + ["dense", "outputs"]
    assert layers[1].inputs == (1,) and layers[2].inputs == (1, 2)  # a + block(a)
    assert layers[-1].inputs == (len(layers) - 1,)
    assert sum(p.size for p in theta) == 11_481


def test_describe_joins_the_outputs_in_jacutils_row_order():
    model, x = _dict_heads(), bench_models.flat_data(3, 6)
    layers, _ = describe(model)
    variables = model.trainable_variables
    layer_of = {i: v.path.split("/")[0] for i, v in enumerate(variables)}
    heads = [layer_of[layers[k - 1].weights["kernel"]] for k in layers[-1].inputs]
    assert heads == ["narrow", "wide"]  # keys "a", "b": tf.nest.flatten order
    rows = ju.split_outputs(_numpy_forward(model, x)[:, :, None], model, x)
    for key in ("a", "b"):
        np.testing.assert_allclose(
            rows[key][..., 0], model(x)[key], rtol=1e-5, atol=1e-6
        )


def test_describe_names_a_layer_of_a_graph_it_does_not_rebuild():
    keras = ju.keras
    inputs = keras.Input((4,))
    a = keras.layers.Dense(3)(inputs)
    joined = keras.layers.Concatenate()([a, inputs])
    with pytest.raises(ValueError, match="Concatenate"):
        describe(keras.Model(inputs, keras.layers.Dense(1)(joined)))
