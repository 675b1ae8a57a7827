"""Proofs of jacutil.curvature.laplace against brute force in NumPy.

The reference forms the float64 J of every parameter with
``jacutil.jacobian``, cuts the structure's columns out of it, builds
``P = G / sigma^2 + delta I`` and inverts it explicitly (it is small), and
writes the log marginal likelihood with ``slogdet``. Where laplace-torch is
installed (a bench peer) it is run on the same weights. Notebook
11-curvature-and-uncertainty.
"""

import functools
import importlib.util
import math

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from jacutil.curvature.laplace import Laplace, laplace, last_layer_variables
from tests.architectures import build

N = 6
DELTA, SIGMA = 0.7, 0.6  # neither is 1, so a missing factor shows


def rows(out, n):
    return np.concatenate(
        [np.reshape(np.asarray(t), (n, -1)) for t in tf.nest.flatten(out)], axis=1
    )


def outputs(case, x):
    return rows(case.model64(x), len(tf.nest.flatten(x)[0]))


def formed_j(case, x, variables=None):
    """J (n, l, m) of ``variables`` (default: all), cut from the full formed J."""
    everything = case.variables64 or case.model64.trainable_variables
    J = np.asarray(ju.jacobian(case.model64, x, variables=case.variables64))
    if variables is None:
        return J
    ids = [id(v) for v in variables]
    pieces, start = [], 0
    for v in everything:
        size = int(np.prod(v.shape))
        if id(v) in ids:
            pieces.append(J[:, :, start : start + size])
        start += size
    return np.concatenate(pieces, axis=2)


def moved(x, seed=7):
    """Other test points with the training batch's shapes (no new tracing)."""
    rng = np.random.default_rng(seed)
    return tf.nest.map_structure(lambda a: a + 0.5 * rng.standard_normal(a.shape), x)


def softmax(f):
    e = np.exp(f - f.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def brute_hessian(loss, f):
    """H_i per sample, written out (not from OutputLoss)."""
    n, width = f.shape
    if loss == "squared_error":
        return np.stack([np.eye(width)] * n)
    if loss == "sigmoid_cross_entropy":
        s = 1 / (1 + np.exp(-f))
        return np.stack([np.diag(si * (1 - si)) for si in s])
    p = softmax(f)
    return np.stack([np.diag(pi) - np.outer(pi, pi) for pi in p])


def brute_log_likelihood(loss, f, y, sigma):
    if loss == "squared_error":
        return float(
            np.sum(-0.5 * (y - f) ** 2 / sigma**2 - 0.5 * np.log(2 * np.pi * sigma**2))
        )
    if loss == "sigmoid_cross_entropy":
        return float(np.sum(y * f - np.logaddexp(0, f)))
    log_p = np.log(softmax(f))
    return float(np.sum(log_p[np.arange(len(y)), y]))


def targets(loss, n, width, seed=1):
    rng = np.random.default_rng(seed)
    if loss == "squared_error":
        return rng.standard_normal((n, width))
    if loss == "sigmoid_cross_entropy":
        return rng.integers(0, 2, (n, width)).astype(float)
    return rng.integers(0, width, n)


# (zoo name, loss, variables of the last layer for a plain callable)
CASES = [
    ("mlp", "squared_error"),
    ("mlp", "softmax_cross_entropy"),
    ("convolution", "sigmoid_cross_entropy"),
    ("two_heads_list", "squared_error"),  # two heads: both named by last_layer=
    ("lstm", "softmax_cross_entropy"),
    ("frozen_layer", "squared_error"),  # BatchNorm, a frozen layer
    ("explicit_nontrainable", "squared_error"),  # a plain callable
]


@functools.cache
def zoo(name):
    """The zoo's case, built once per module: its traced Jacobians are reused."""
    return build(name, seed=3)


def fitted(name, loss, structure="last_layer", **options):
    case = zoo(name)
    x = case.batch(N)
    if case.variables64 is not None:
        last = case.variables64[-1:]
    elif name == "two_heads_list":  # no single last layer: name both heads
        heads = case.model64.layers[-2:]
        options["last_layer"] = heads
        last = [v for head in heads for v in head.trainable_variables]
    elif structure == "last_layer":
        last = last_layer_variables(case.model64, x)
    else:
        last = case.model64.trainable_variables
    y = targets(loss, N, case.n_outputs)
    sigma = SIGMA if loss == "squared_error" else 1.0
    variables = last if case.variables64 is not None else None
    la = laplace(
        case.model64,
        x,
        y,
        loss,
        structure,
        prior_precision=DELTA,
        sigma_noise=sigma,
        variables=variables,
        **options,
    )
    return case, x, y, la, last, sigma


def brute_precision(la, case, x, last, loss, sigma, structure="last_layer"):
    J = formed_j(case, x, last)
    H = brute_hessian(loss, outputs(case, x))
    G = sum(J[i].T @ H[i] @ J[i] for i in range(len(J)))
    if structure == "diagonal":
        G = np.diag(np.diag(G))
    return G, G / sigma**2 + DELTA * np.eye(G.shape[0])


@pytest.mark.parametrize(("name", "loss"), CASES)
def test_last_layer_against_brute_force(name, loss):
    case, x, y, la, last, sigma = fitted(name, loss)
    G, P = brute_precision(la, case, x, last, loss, sigma)
    every = case.variables64 or case.model64.trainable_variables
    assert la.n_params == G.shape[0] < sum(int(np.prod(v.shape)) for v in every)
    np.testing.assert_allclose(la.ggn, G, rtol=1e-9, atol=1e-12)
    assert np.abs(G).max() > 0
    np.testing.assert_allclose(la.posterior_precision(), P, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        la.posterior_covariance(), np.linalg.inv(P), rtol=1e-8, atol=1e-12
    )

    # predictive variance: J* P^-1 J*.T, with an explicit inverse
    x_test = moved(x)
    Js = formed_j(case, x_test, last)
    expected = np.einsum("nkp,pq,njq->nkj", Js, np.linalg.inv(P), Js)
    np.testing.assert_allclose(
        la.predictive_variance(x_test), expected, rtol=1e-8, atol=1e-12
    )

    # the log marginal likelihood, slogdet
    theta = np.concatenate([np.ravel(v.numpy()) for v in last])
    lml = (
        brute_log_likelihood(loss, outputs(case, x), y, sigma)
        - 0.5 * (np.linalg.slogdet(P)[1] - P.shape[0] * math.log(DELTA))
        - 0.5 * DELTA * theta @ theta
    )
    np.testing.assert_allclose(la.log_marginal_likelihood(), lml, rtol=1e-10)


def test_marginal_likelihood_at_other_values_stores_nothing():
    case, x, y, la, last, sigma = fitted("mlp", "squared_error")
    before = la.log_marginal_likelihood()
    other = la.log_marginal_likelihood(prior_precision=3.0, sigma_noise=0.9)
    assert other != before
    assert (la.prior_precision, la.sigma_noise) == (DELTA, SIGMA)
    # the same values given at construction give the same number
    again = laplace(case.model64, x, y, prior_precision=3.0, sigma_noise=0.9)
    assert again.log_marginal_likelihood() == pytest.approx(other, rel=1e-12)


def test_chunks_equal_one_piece():
    case, x, y, la, last, sigma = fitted("mlp", "squared_error")
    x_test = case.batch(7)
    whole = la.predictive_variance(x_test)
    chunked = laplace(
        case.model64, x, y, prior_precision=DELTA, sigma_noise=sigma, memory_budget=1
    )  # one sample per chunk
    assert len(chunked._chunks(x)) == N
    np.testing.assert_allclose(chunked.ggn, la.ggn, rtol=1e-12, atol=1e-14)
    la.memory_budget = 1
    assert len(la._chunks(x_test)) == 7
    np.testing.assert_allclose(la.predictive_variance(x_test), whole, rtol=1e-12)


def test_regression_predict_adds_the_noise_on_request():
    case, x, y, la, last, sigma = fitted("mlp", "squared_error")
    x_test = case.batch(3)
    mean, var = la.predict(x_test)
    mean_f, var_f = la.predict(x_test, observation_noise=False)
    np.testing.assert_allclose(mean, outputs(case, x_test), rtol=1e-12)
    np.testing.assert_allclose(mean_f, mean)
    np.testing.assert_allclose(
        var - var_f, np.broadcast_to(SIGMA**2 * np.eye(3), var.shape)
    )
    np.testing.assert_allclose(var_f, la.predictive_variance(x_test))


@pytest.mark.parametrize("fit_sigma", [False, True])
def test_optimizer_finds_a_maximum(fit_sigma):
    case, x, y, la, last, sigma = fitted("mlp", "squared_error")
    delta, sigma = la.optimize_prior_precision(sigma_noise="fit" if fit_sigma else None)
    assert (la.prior_precision, la.sigma_noise) == (delta, sigma)
    assert 1e-4 * 1.1 < delta < 1e4 / 1.1  # inside the bounds: a true maximum
    assert sigma == (SIGMA if not fit_sigma else sigma)
    best = la.log_marginal_likelihood()
    for factor in (1.1, 1 / 1.1):
        assert la.log_marginal_likelihood(delta * factor) < best
        if fit_sigma:
            assert la.log_marginal_likelihood(delta, sigma * factor) < best
    if fit_sigma:
        assert sigma != SIGMA


def test_optimizer_for_a_classification():
    case, x, y, la, last, sigma = fitted("mlp", "softmax_cross_entropy")
    delta, sigma = la.optimize_prior_precision()
    assert sigma == 1.0
    best = la.log_marginal_likelihood()
    assert la.log_marginal_likelihood(delta * 1.1) < best
    assert la.log_marginal_likelihood(delta / 1.1) < best


def _trained_1d():
    """A small ReLU MLP fitted to sin on [-1, 1] (float64): random hidden
    units with kinks spread over the data, the last layer by least squares
    (its MAP under a weak prior)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (40, 1))
    y = np.sin(3 * x) + 0.05 * rng.standard_normal(x.shape)
    model = keras.Sequential(
        [
            keras.Input((1,), dtype="float64"),
            keras.layers.Dense(16, activation="relu", dtype="float64"),
            keras.layers.Dense(1, dtype="float64"),
        ]
    )
    hidden, head = model.layers
    w = rng.choice([-1.0, 1.0], 16) * rng.uniform(0.5, 2.0, 16)
    hidden.set_weights([w[None, :], -w * rng.uniform(-1, 1, 16)])
    features = np.hstack([np.asarray(hidden(x)), np.ones((len(x), 1))])
    ridge = features.T @ features + 1e-6 * np.eye(17)
    solution = np.linalg.solve(ridge, features.T @ y)
    head.set_weights([solution[:16], solution[16]])
    assert np.sqrt(np.mean((np.asarray(model(x)) - y) ** 2)) < 0.1  # it fits
    return model, x, y


@pytest.fixture(scope="module")
def trained_1d():
    return _trained_1d()


def test_regression_uncertainty_grows_away_from_the_data(trained_1d):
    model, x, y = trained_1d
    la = laplace(model, x, y, sigma_noise=0.1)
    la.optimize_prior_precision(sigma_noise="fit")
    inside = np.linspace(-0.9, 0.9, 19)[:, None]
    outside = np.array([[-4.0], [-3.0], [3.0], [4.0]])
    std_in = np.sqrt(la.predict(inside, observation_noise=False)[1][:, 0, 0])
    std_out = np.sqrt(la.predict(outside, observation_noise=False)[1][:, 0, 0])
    assert std_out.min() > 2 * std_in.max()
    # and the fit is a fit: the noise found is near the 0.05 put in
    assert 0.02 < la.sigma_noise < 0.2


def _classifier():
    case = zoo("mlp")
    x = case.batch(20)
    y = np.argmax(
        outputs(case, x) + 0.5 * np.random.default_rng(0).standard_normal((20, 3)), 1
    )
    return case, x, y


def test_probit_probabilities_sum_to_one_and_are_less_confident():
    case, x, y = _classifier()
    la = laplace(case.model64, x, y, "softmax_cross_entropy", prior_precision=0.5)
    x_test = case.batch(9)
    p = la.predict(x_test)
    f = outputs(case, x_test)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-12)
    map_p = softmax(f)
    assert np.all(p.max(axis=1) < map_p.max(axis=1))
    kappa = 1 / np.sqrt(
        1 + np.pi / 8 * np.diagonal(la.predictive_variance(x_test), 0, 1, 2)
    )
    np.testing.assert_allclose(p, softmax(f * kappa), rtol=1e-12)


def test_monte_carlo_probabilities():
    case, x, y = _classifier()
    la = laplace(case.model64, x, y, "softmax_cross_entropy", prior_precision=0.5)
    x_test = case.batch(4)
    a = la.predict(x_test, samples=2000, seed=5)
    b = la.predict(x_test, samples=2000, seed=5)
    c = la.predict(x_test, samples=2000, seed=6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.testing.assert_allclose(a.sum(axis=1), 1.0, rtol=1e-12)
    # a brute-force Monte Carlo with the same seed: draws through NumPy's Cholesky
    var = la.predictive_variance(x_test)
    f = outputs(case, x_test)
    draws = np.random.default_rng(5).standard_normal((2000, *f.shape))
    values, vectors = np.linalg.eigh(var)
    root = vectors * np.sqrt(np.clip(values, 0, None))[:, None, :]
    fs = f + np.einsum("nkj,snj->snk", root, draws)
    expected = np.mean([softmax(one) for one in fs], axis=0)
    np.testing.assert_allclose(a, expected, rtol=1e-10)
    # near the probit approximation
    np.testing.assert_allclose(a, la.predict(x_test), atol=0.05)


def test_sigmoid_probit():
    case = zoo("convolution")
    x = case.batch(N)
    y = targets("sigmoid_cross_entropy", N, 2)
    la = laplace(case.model64, x, y, "sigmoid_cross_entropy")
    p = la.predict(x)
    f = outputs(case, x)
    kappa = 1 / np.sqrt(1 + np.pi / 8 * np.diagonal(la.predictive_variance(x), 0, 1, 2))
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-kappa * f)), rtol=1e-12)
    assert np.all(np.abs(p - 0.5) < np.abs(1 / (1 + np.exp(-f)) - 0.5))


# -- every parameter: diagonal and KFAC -------------------------------------------


FULL_CASES = [
    ("mlp", "squared_error", "diagonal"),
    ("convolution", "softmax_cross_entropy", "diagonal"),
    ("attention", "squared_error", "diagonal"),  # residual; attention, LayerNorm
    ("mlp", "squared_error", "kfac"),
    ("convolution", "softmax_cross_entropy", "kfac"),  # Conv2D factors
    ("frozen_layer", "squared_error", "kfac"),  # BatchNorm: G's diagonal
]


def _full_g(case, x, loss):
    J = formed_j(case, x)
    H = brute_hessian(loss, outputs(case, x))
    return sum(J[i].T @ H[i] @ J[i] for i in range(len(J)))


def kfac_formed(la, case, x, loss):
    """K from the factors: kron(A, B) on each factored layer's columns
    ([kernel; bias] row-major), G's exact diagonal elsewhere."""
    m = la.n_params
    K = np.diag(np.diag(_full_g(case, x, loss)))
    covered = np.zeros(m, bool)
    for f in la.ggn.factors:
        columns = np.r_[f.kernel, f.bias] if f.bias is not None else np.r_[f.kernel]
        K[columns, :] = 0
        K[:, columns] = 0
        K[np.ix_(columns, columns)] = np.kron(f.A, f.B)
        covered[columns] = True
    return K, covered


@pytest.mark.parametrize(("name", "loss", "structure"), FULL_CASES)
def test_every_parameter_against_brute_force(name, loss, structure):
    case, x, y, la, every, sigma = fitted(name, loss, structure)
    m = sum(int(np.prod(v.shape)) for v in every)
    assert la.n_params == m
    if structure == "diagonal":
        G = np.diag(np.diag(_full_g(case, x, loss)))
        np.testing.assert_allclose(la.ggn, np.diag(G), rtol=1e-9, atol=1e-12)
        P = np.diag(G) / sigma**2 + DELTA
        np.testing.assert_allclose(la.posterior_covariance(), 1 / P, rtol=1e-12)
    else:
        G, covered = kfac_formed(la, case, x, loss)
        assert covered.any() and (name != "frozen_layer" or not covered.all())
        assert not np.allclose(G, _full_g(case, x, loss))  # an approximation
    P = G / sigma**2 + DELTA * np.eye(m)

    x_test = moved(x)
    Js = formed_j(case, x_test)
    expected = np.einsum("nkp,pq,njq->nkj", Js, np.linalg.inv(P), Js)
    np.testing.assert_allclose(
        la.predictive_variance(x_test), expected, rtol=1e-8, atol=1e-12
    )
    theta = ju.flat_params(case.model64)
    lml = (
        brute_log_likelihood(loss, outputs(case, x), y, sigma)
        - 0.5 * (np.linalg.slogdet(P)[1] - m * math.log(DELTA))
        - 0.5 * DELTA * theta @ theta
    )
    np.testing.assert_allclose(la.log_marginal_likelihood(), lml, rtol=1e-10)
    delta, _ = la.optimize_prior_precision()
    best = la.log_marginal_likelihood()
    assert la.log_marginal_likelihood(delta * 1.1) < best
    assert la.log_marginal_likelihood(delta / 1.1) < best


# -- errors that teach ---------------------------------------------------------


def test_errors():
    case = zoo("mlp")
    x = case.batch(N)
    y = targets("squared_error", N, 3)
    with pytest.raises(ValueError, match="structure must be one of"):
        laplace(case.model64, x, y, structure="full")
    with pytest.raises(ValueError, match="y has shape"):
        laplace(case.model64, x, y[:, :2])
    with pytest.raises(ValueError, match="is for a regression"):
        laplace(
            case.model64, x, np.zeros(N, int), "softmax_cross_entropy", sigma_noise=2
        )
    with pytest.raises(ValueError, match="prior_precision must be a positive"):
        laplace(case.model64, x, y, prior_precision=0)
    la = laplace(case.model64, x, y)
    with pytest.raises(ValueError, match="per-sample shape"):
        la.predictive_variance(np.zeros((2, 5)))
    with pytest.raises(ValueError, match="Gaussian already"):
        la.predict(x, samples=10)
    with pytest.raises(ValueError, match="method must be 'marglik'"):
        la.optimize_prior_precision("gridsearch")
    softmax_model = build("causal_conv1d", seed=0)
    with pytest.raises(ValueError, match=r"(applies|made by) a softmax"):
        laplace(
            softmax_model.model64,
            softmax_model.batch(N),
            np.zeros(N, int),
            "softmax_cross_entropy",
        )
    callable_case = build("explicit_nontrainable", seed=0)
    with pytest.raises(TypeError, match="variables="):
        laplace(callable_case.model64, callable_case.batch(N), np.zeros((N, 2)))


# -- laplace-torch, when it is installed -----------------------------------------


def torch_copy(model):
    """A torch.nn.Sequential with the same weights as a stack of Dense layers
    (ReLU or no activation)."""
    import torch

    modules = []
    for dense in (layer for layer in model.layers if layer.trainable_variables):
        linear = torch.nn.Linear(*dense.kernel.shape).double()
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(dense.kernel.numpy().T))
            linear.bias.copy_(torch.from_numpy(dense.bias.numpy()))
        modules.append(linear)
        if dense.activation is keras.activations.relu:
            modules.append(torch.nn.ReLU())
        else:
            assert dense.activation is keras.activations.linear
    return torch.nn.Sequential(*modules)


@pytest.mark.skipif(
    importlib.util.find_spec("laplace") is None
    or importlib.util.find_spec("torch") is None,
    reason="laplace-torch is not installed (a bench peer, jacutil/peers)",
)
@pytest.mark.parametrize(
    ("likelihood", "structure"),
    [
        ("regression", "last_layer"),
        ("regression", "diagonal"),
        ("regression", "kfac"),
        ("classification", "last_layer"),
        ("classification", "kfac"),
    ],
)
def test_against_laplace_torch(trained_1d, likelihood, structure):
    import torch
    from laplace import Laplace as TorchLaplace

    if likelihood == "regression":
        model, x, y = trained_1d
        x_test = np.linspace(-3, 3, 7)[:, None]
        sigma, loss, y_torch = 0.2, "squared_error", torch.from_numpy(y)
    else:
        case, x, y = _classifier()
        model, x_test = case.model64, case.batch(9)
        sigma, loss, y_torch = 1.0, "softmax_cross_entropy", torch.from_numpy(y)
    data = torch.utils.data.TensorDataset(torch.from_numpy(x), y_torch)
    peer = TorchLaplace(
        torch_copy(model),
        likelihood,
        subset_of_weights="last_layer" if structure == "last_layer" else "all",
        hessian_structure={"last_layer": "full", "diagonal": "diag", "kfac": "kron"}[
            structure
        ],
        sigma_noise=sigma,
        prior_precision=0.8,
    )
    peer.fit(torch.utils.data.DataLoader(data, batch_size=len(x)))
    ours = laplace(model, x, y, loss, structure, sigma_noise=sigma, prior_precision=0.8)
    if structure == "kfac":
        # laplace-torch's KFAC keeps a weight block kron(A_w, B) and a bias
        # block B apart (no cross terms); ours factors [kernel; bias] whole.
        # From our factors with that cut, its marginal likelihood follows.
        K = ours.ggn.to_dense()
        for f in ours.ggn.factors:
            d = len(f.A) - 1
            K[np.ix_(np.r_[f.kernel], np.r_[f.bias])] = 0
            K[np.ix_(np.r_[f.bias], np.r_[f.kernel])] = 0
            K[np.ix_(np.r_[f.kernel], np.r_[f.kernel])] = np.kron(f.A[:d, :d], f.B)
            K[np.ix_(np.r_[f.bias], np.r_[f.bias])] = f.A[d, d] * f.B
        P = K / sigma**2 + 0.8 * np.eye(len(K))
        expected = ours.log_likelihood() - 0.5 * (
            np.linalg.slogdet(P)[1]
            - len(K) * math.log(0.8)
            + 0.8 * ours.mean @ ours.mean
        )
        assert not np.isclose(ours.log_marginal_likelihood(), expected, rtol=1e-4)
        np.testing.assert_allclose(
            expected, float(peer.log_marginal_likelihood()), rtol=1e-4
        )
        return
    np.testing.assert_allclose(
        ours.log_marginal_likelihood(),
        float(peer.log_marginal_likelihood()),
        rtol=1e-4,
    )
    if likelihood == "regression":
        _, f_var = peer(torch.from_numpy(x_test), pred_type="glm")
        np.testing.assert_allclose(
            ours.predictive_variance(x_test),
            f_var.detach().numpy(),
            rtol=1e-4,
            atol=1e-8,
        )
    else:
        p = peer(torch.from_numpy(x_test), pred_type="glm", link_approx="probit")
        np.testing.assert_allclose(
            ours.predict(x_test), p.detach().numpy(), rtol=1e-4, atol=1e-8
        )


def test_laplace_is_the_class():
    case = zoo("mlp")
    x = case.batch(N)
    la = laplace(case.model64, x, targets("squared_error", N, 3))
    assert isinstance(la, Laplace)
    assert la.structure == "last_layer"
    assert [v.name for v in la.variables] == [
        v.name for v in case.model64.layers[-1].trainable_variables
    ]
