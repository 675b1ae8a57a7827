"""Proofs of jacutil.curvature against brute force from the formed float64 J.

G, its exact diagonal and KFAC (exact for one sample through one Dense
layer) against ``sum_i J_i.T H_i J_i`` built in NumPy from ``jacutil.jacobian``
on the zoo's float64 models; Hessian-vector products against central
finite differences of the loss's gradient; the spectra against NumPy's
eigenvalues of the formed matrices. Notebook 11-curvature-and-uncertainty.
"""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from jacutil.core.guards import JacobianError
from jacutil.core.target import watched
from jacutil.curvature.diagonal import ggn_diagonal
from jacutil.curvature.ggn import ggn_operator
from jacutil.curvature.hessian import hessian_operator
from jacutil.curvature.kfac import kfac
from jacutil.curvature.losses import output_loss
from jacutil.curvature.output_losses import OutputLoss
from jacutil.curvature.spectra import (
    hutchinson_diagonal,
    hutchinson_trace,
    top_eigenvalues,
    top_singular_values,
)
from tests.architectures import ARCHITECTURES, build

N = 5


def formed(case, x):
    """J (n, l, m) in float64 and the outputs (n, l)."""
    J = np.asarray(ju.jacobian(case.model64, x, variables=case.variables64))
    f = case.model64(x) if case.variables64 is not None else case.model64(x)
    f = np.concatenate(
        [np.reshape(np.asarray(t), (J.shape[0], -1)) for t in tf.nest.flatten(f)], 1
    )
    return J, f


def brute_ggn(J, H):
    return np.einsum("ikp,ikj,ijq->pq", J, H, J)


def classifier(classes=3, final=None, dtype="float64"):
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(5, activation="tanh", dtype=dtype),
            keras.layers.Dense(classes, activation=final, dtype=dtype),
        ]
    )


def conv_classifier(dtype="float64"):
    keras.utils.set_random_seed(2)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2), dtype=dtype),
            keras.layers.Conv2D(3, 3, activation="relu", dtype=dtype),
            keras.layers.Conv2D(2, 2, strides=2, padding="same", dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(4, dtype=dtype),
        ]
    )


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_ggn_operator_is_jt_j_on_the_zoo(name):
    case = build(name)
    x = case.batch(N)
    J, _ = formed(case, x)
    G = ggn_operator(case.model64, x, variables=case.variables64)
    m = J.shape[2]
    V = np.random.default_rng(0).standard_normal((m, 2))
    expected = np.einsum("ikp,ikq->pq", J, J) @ V
    np.testing.assert_allclose(G @ V, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("loss", ["softmax_cross_entropy", "sigmoid_cross_entropy"])
@pytest.mark.parametrize("make", [classifier, conv_classifier])
def test_ggn_operator_of_cross_entropies(loss, make):
    model = make()
    shape = (N, *model.inputs[0].shape[1:])
    x = np.random.default_rng(3).standard_normal(shape)
    J = np.asarray(ju.jacobian(model, x))
    f = np.asarray(model(x)).reshape(N, -1)
    H = output_loss(loss, model).hessian(f)
    v = np.random.default_rng(4).standard_normal(J.shape[2])
    G = ggn_operator(model, x, loss, chunk_size=2)  # three chunks, summed
    np.testing.assert_allclose(G @ v, brute_ggn(J, H) @ v, rtol=1e-9, atol=1e-12)


def test_a_softmax_output_is_refused_with_advice():
    with pytest.raises(ValueError, match="outputs logits"):
        ggn_operator(
            classifier(final="softmax"), np.zeros((2, 4)), "softmax_cross_entropy"
        )


def test_an_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="loss must be one of"):
        OutputLoss("hinge")


def test_no_variable_reaching_the_outputs_is_an_error():
    model = classifier()
    copy = [tf.Variable(tf.concat([tf.reshape(v, [-1]) for v in model.weights], 0))]
    with pytest.raises(JacobianError, match="reaches the outputs"):
        ggn_operator(model, np.zeros((2, 4)), variables=copy) @ np.ones(
            copy[0].shape[0]
        )


def test_the_second_operator_traces_nothing():
    model = classifier()
    x = np.random.default_rng(0).standard_normal((N, 4))
    m = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    ggn_operator(model, x) @ np.ones(m)
    from jacutil.curvature.compiled import curvature_products

    traces = curvature_products(model).trace_count
    ggn_operator(model, x) @ np.ones(m)
    after = curvature_products(model).trace_count
    assert after == traces


def gradient(model, variables, x, t, loss):
    variables = [watched(v) for v in variables or model.trainable_variables]
    with tf.GradientTape() as tape:
        tape.watch(variables)  # a callable's variables may be non-trainable
        f = model(x)
        f = tf.reshape(f, [tf.shape(f)[0], -1])
        value = loss.value_tf(f, t)
    return np.concatenate([np.ravel(g) for g in tape.gradient(value, variables)])


@pytest.mark.parametrize(
    "name", ["mlp", "convolution", "activation_layers", "lstm", "explicit_nontrainable"]
)
def test_hessian_products_are_finite_differences_of_gradients(name):
    case = build(name)
    model, variables = case.model64, case.variables64
    variables = variables or model.trainable_variables
    x = case.batch(N)
    loss = OutputLoss("squared_error")
    f = np.asarray(model(x)).reshape(N, -1)
    y = f + np.random.default_rng(5).standard_normal(f.shape)  # residuals matter
    v = np.random.default_rng(6).standard_normal(
        sum(int(np.prod(w.shape)) for w in variables)
    )
    Hv = hessian_operator(model, x, y, loss, variables=case.variables64) @ v
    start = [w.numpy() for w in variables]
    eps = 1e-5
    sides = []
    for sign in (1, -1):
        offset = 0
        for w, w0 in zip(variables, start, strict=True):
            size = w0.size
            w.assign(w0 + sign * eps * v[offset : offset + size].reshape(w0.shape))
            offset += size
        sides.append(gradient(model, variables, x, tf.constant(y), loss))
    for w, w0 in zip(variables, start, strict=True):
        w.assign(w0)
    expected = (sides[0] - sides[1]) / (2 * eps)
    np.testing.assert_allclose(Hv, expected, rtol=1e-6, atol=1e-6)


def test_the_hessian_is_g_where_the_residuals_vanish_and_the_net_is_linear():
    model = classifier(classes=2)
    model.layers[0].activation = keras.activations.linear
    x = np.random.default_rng(7).standard_normal((N, 4))
    f = np.asarray(model(x))
    v = np.random.default_rng(8).standard_normal(model.count_params())
    H = hessian_operator(model, x, f)  # zero residuals
    G = ggn_operator(model, x)
    np.testing.assert_allclose(H @ v, G @ v, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_ggn_diagonal_is_the_diagonal_of_jt_j_on_the_zoo(name):
    case = build(name)
    x = case.batch(N)
    J, _ = formed(case, x)
    found = ggn_diagonal(case.model64, x, variables=case.variables64, memory_budget=1)
    np.testing.assert_allclose(
        found, np.einsum("ikp,ikp->p", J, J), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("loss", ["softmax_cross_entropy", "sigmoid_cross_entropy"])
@pytest.mark.parametrize("make", [classifier, conv_classifier])
def test_ggn_diagonal_of_cross_entropies(loss, make):
    model = make()
    x = np.random.default_rng(3).standard_normal((N, *model.inputs[0].shape[1:]))
    J = np.asarray(ju.jacobian(model, x))
    H = output_loss(loss, model).hessian(np.asarray(model(x)).reshape(N, -1))
    found, how = ggn_diagonal(model, x, loss, explain=True)
    assert how.startswith("layer rules")
    np.testing.assert_allclose(found, np.diag(brute_ggn(J, H)), rtol=1e-10, atol=1e-12)


def block(G, f):
    """G's block of one layer's [kernel; bias] parameters."""
    idx = np.r_[f.kernel, f.bias] if f.bias is not None else np.r_[f.kernel]
    return G[np.ix_(idx, idx)]


@pytest.mark.parametrize("loss", ["squared_error", "softmax_cross_entropy"])
@pytest.mark.parametrize(
    "layer",
    [
        lambda: keras.layers.Dense(3, dtype="float64"),
        lambda: keras.layers.Conv2D(3, 3, dtype="float64"),  # one position
    ],
)
def test_kfac_is_exact_for_one_sample_through_one_layer(loss, layer):
    keras.utils.set_random_seed(4)
    shape = (5,) if not isinstance(layer(), keras.layers.Conv2D) else (3, 3, 2)
    model = keras.Sequential(
        [
            keras.Input(shape, dtype="float64"),
            layer(),
            keras.layers.Flatten(dtype="float64"),
        ]
    )
    x = np.random.default_rng(9).standard_normal((1, *shape))
    J = np.asarray(ju.jacobian(model, x))
    H = output_loss(loss, model).hessian(np.asarray(model(x)).reshape(1, -1))
    K = kfac(model, x, loss)
    np.testing.assert_allclose(K.to_dense(), brute_ggn(J, H), rtol=1e-10, atol=1e-12)


def test_kfac_factors_are_the_covariances_of_inputs_and_signals():
    model = classifier(classes=3)  # Dense(5, tanh), Dense(3): logits
    x = np.random.default_rng(10).standard_normal((N, 4))
    loss = output_loss("softmax_cross_entropy", model)
    K = kfac(model, x, loss, chunk_size=2)  # three chunks, summed
    J = np.asarray(ju.jacobian(model, x))
    S = loss.sqrt_hessian(np.asarray(model(x)))
    signal_grads = np.einsum("ikc,ikm->icm", S, J)  # per sample and signal
    hidden = np.tanh(x @ model.layers[0].kernel.numpy() + model.layers[0].bias.numpy())
    for f, a in zip(K.factors, [x, hidden], strict=True):
        a_bar = np.concatenate([a, np.ones((N, 1))], axis=1)
        np.testing.assert_allclose(f.A, a_bar.T @ a_bar / N, rtol=1e-10)
        delta = signal_grads[:, :, f.bias].reshape(-1, f.B.shape[0])  # bias = delta
        np.testing.assert_allclose(f.B, delta.T @ delta, rtol=1e-9, atol=1e-14)


def test_kfac_inverse_and_logdet_are_those_of_the_dense_matrix():
    model = conv_classifier()
    x = np.random.default_rng(11).standard_normal((N, 6, 6, 2))
    K = kfac(model, x, "softmax_cross_entropy")
    dense = K.to_dense()
    assert len(K.factors) == 3 and len(K.rest) == 0
    np.testing.assert_allclose(dense, dense.T, atol=1e-12)
    v = np.random.default_rng(12).standard_normal(K.n_params)
    damped = dense + 0.1 * np.eye(K.n_params)
    np.testing.assert_allclose(
        K.inverse_matvec(v, 0.1), np.linalg.solve(damped, v), rtol=1e-8, atol=1e-10
    )
    np.testing.assert_allclose(K.logdet(0.1), np.linalg.slogdet(damped)[1], rtol=1e-10)


def test_kfac_gives_the_exact_diagonal_to_other_layers():
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
            keras.layers.LayerNormalization(dtype="float64"),
            keras.layers.Dense(2, dtype="float64"),
        ]
    )
    x = np.random.default_rng(13).standard_normal((N, 4))
    K = kfac(model, x)
    J = np.asarray(ju.jacobian(model, x))
    assert len(K.rest) == 6  # LayerNorm's gamma and beta
    np.testing.assert_allclose(
        np.diag(K.to_dense())[K.rest], np.einsum("ikp,ikp->p", J, J)[K.rest], rtol=1e-10
    )


def test_kfac_refuses_what_it_cannot_replay():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    with pytest.raises(ValueError, match="keras.Sequential"):
        kfac(model, np.zeros((2, 4)))


def test_spectra_from_products_are_numpys_of_the_formed_matrices():
    model = conv_classifier()
    x = np.random.default_rng(14).standard_normal((8, 6, 6, 2))
    J = np.asarray(ju.jacobian(model, x)).reshape(8 * 4, -1)
    G = J.T @ J
    np.testing.assert_allclose(
        top_eigenvalues(ggn_operator(model, x), k=3),
        np.linalg.eigvalsh(G)[::-1][:3],
        rtol=1e-8,
    )
    np.testing.assert_allclose(
        top_singular_values(model, x, k=3),
        np.linalg.svd(J, compute_uv=False)[:3],
        rtol=1e-8,
    )
    y = np.random.default_rng(15).standard_normal((8, 4))
    H = hessian_operator(model, x, y)
    formed_H = H @ np.eye(H.shape[0])
    np.testing.assert_allclose(
        top_eigenvalues(H, k=2), np.linalg.eigvalsh(formed_H)[::-1][:2], rtol=1e-8
    )


def test_hutchinson_estimates_are_within_their_errors():
    A = np.random.default_rng(16).standard_normal((30, 30))
    A = A @ A.T
    trace = hutchinson_trace(A, n_probes=400, seed=1)
    assert abs(trace.value - np.trace(A)) < 4 * trace.standard_error
    diagonal = hutchinson_diagonal(A, n_probes=400, seed=1)
    assert np.all(np.abs(diagonal.value - np.diag(A)) < 5 * diagonal.standard_error)
    assert trace.standard_error > 0  # random signs: an estimate, not the trace
    with pytest.raises(ValueError, match="eigsh finds"):
        top_eigenvalues(A, k=30)


def test_softmax_without_classes_is_refused_not_degenerate():
    f = lambda x: x  # noqa: E731 (a callable: no output shape to read)
    with pytest.raises(ValueError, match="number of classes"):
        output_loss("softmax_cross_entropy", f)
    assert output_loss(OutputLoss("softmax_cross_entropy", 3), f).classes == 3


def test_kfac_and_the_diagonal_trace_once_per_model():
    from jacutil.core import cache

    model = classifier()
    x = np.random.default_rng(17).standard_normal((N, 4))
    kfac(model, x)
    ggn_diagonal(model, x)
    replays = [
        entry
        for entry in cache.entries("curvature", model).values()
        if hasattr(entry, "trace_count")
    ]
    before = sum(r.trace_count for r in replays)
    np.testing.assert_allclose(kfac(model, x).to_dense(), kfac(model, x).to_dense())
    ggn_diagonal(model, x)
    assert sum(r.trace_count for r in replays) == before > 0
