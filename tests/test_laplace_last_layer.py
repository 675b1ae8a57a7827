"""Laplace's last layer from the forward pass, per-layer priors, and the
refusals of issue 34 (items 4, 6, 9, 10). Notebook 11-curvature-and-uncertainty.

Every reference is formed here in float64: J from one tape per sample, G
summed from it (squared error: H = I), ``P = G / sigma^2 + diag(delta)``
inverted explicitly, the log marginal likelihood with ``slogdet``.
"""

import math

import numpy as np
import pytest

from jacutil import keras, tf
from jacutil.curvature.laplace import laplace, last_layer_variables

N, SIGMA = 6, 0.6
F64 = "float64"


def dense(width, activation=None, name=None):
    return keras.layers.Dense(width, activation=activation, dtype=F64, name=name)


def data(width_in, width_out, n=N, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, width_in)), rng.standard_normal((n, width_out))


def per_sample_j(model, variables, x):
    """J (n, l, m) of ``variables``, one tape per sample."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape(persistent=True) as tape:
            out = model(x[i : i + 1], training=False)
            row = tf.concat([tf.reshape(o, [-1]) for o in tf.nest.flatten(out)], 0)
            entries = [row[k] for k in range(int(row.shape[0]))]
        grads = [tape.gradient(e, variables) for e in entries]
        rows.append(
            [
                np.concatenate(
                    [np.ravel(np.zeros(v.shape) if g is None else g)
                     for v, g in zip(variables, gs, strict=True)]
                )
                for gs in grads
            ]
        )  # fmt: skip
    return np.asarray(rows)


def explicit(model, variables, x, x_test, delta, sigma=SIGMA, diagonal=False):
    """(P, predictive variance at x_test) for the squared error, by hand."""
    J = per_sample_j(model, variables, x)
    G = np.einsum("nkp,nkq->pq", J, J)
    if diagonal:
        G = np.diag(np.diag(G))
    P = G / sigma**2 + np.diag(np.broadcast_to(delta, (len(G),)))
    Js = per_sample_j(model, variables, x_test)
    return P, np.einsum("nkp,pq,njq->nkj", Js, np.linalg.inv(P), Js)


def explicit_lml(la, P, delta, y, sigma=SIGMA):
    f = la.f_train
    theta = la.mean
    delta = np.broadcast_to(delta, theta.shape)
    log_lik = np.sum(
        -0.5 * (y - f) ** 2 / sigma**2 - 0.5 * np.log(2 * np.pi * sigma**2)
    )
    return (
        log_lik
        - 0.5 * (np.linalg.slogdet(P)[1] - np.sum(np.log(delta)))
        - 0.5 * np.sum(delta * theta**2)
    )


# -- several heads -------------------------------------------------------------


def two_heads(seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((3,), dtype=F64)
    h = dense(4, "tanh", name="body")(x)
    model = keras.Model(x, [dense(2, name="head_a")(h), dense(1, name="head_b")(h)])
    return model


def test_two_heads_are_refused_without_last_layer():
    model = two_heads()
    x, y = data(3, 3)
    with pytest.raises(ValueError, match=r"last_layer=\['head_a', 'head_b'\]"):
        laplace(model, x, y, sigma_noise=SIGMA)
    with pytest.raises(ValueError, match="no single last layer"):
        last_layer_variables(model, x)


@pytest.mark.parametrize("by", ["names", "layers"])
def test_two_heads_with_last_layer(by):
    model = two_heads()
    x, y = data(3, 3)
    x_test = data(3, 3, n=4, seed=1)[0]
    heads = [model.get_layer("head_a"), model.get_layer("head_b")]
    named = [h.name for h in heads] if by == "names" else heads
    la = laplace(model, x, y, sigma_noise=SIGMA, prior_precision=0.7, last_layer=named)
    variables = [v for h in heads for v in h.trainable_variables]
    assert [id(v) for v in la.variables] == [id(v) for v in variables]
    assert la.layer_names == ["head_a", "head_b"]
    P, expected = explicit(model, variables, x, x_test, 0.7)
    var = la.predictive_variance(x_test)
    np.testing.assert_allclose(var, expected, rtol=1e-9, atol=1e-13)
    head_a, head_b = var[:, 0, 0], var[:, 2, 2]
    assert head_a.min() > 1e-3 and head_b.min() > 1e-3  # neither head is certain


def test_last_layer_refuses_variables_too_and_other_structures():
    model = two_heads()
    x, y = data(3, 3)
    with pytest.raises(ValueError, match="not both"):
        laplace(model, x, y, last_layer="head_a", variables=model.trainable_variables)
    with pytest.raises(ValueError, match="pass variables="):
        laplace(model, x, y, "squared_error", "diagonal", last_layer="head_a")
    with pytest.raises(ValueError, match="no layer.*have that name.*'head_a'"):
        laplace(model, x, y, last_layer="head_c")


# -- the order of model.layers is not the order of the forward pass -----------


class HeadFirst(keras.Model):
    """The head is created (and so listed in model.layers) before the body."""

    def __init__(self, nested):
        super().__init__(dtype=F64)
        self.head = dense(2, name="head")
        if nested:
            self.body = keras.Sequential(
                [dense(5, "tanh", name="inner_a"), dense(4, "tanh", name="inner_b")],
                name="body",
            )
        else:
            self.body = dense(4, "tanh", name="body")

    def call(self, x):
        return self.head(self.body(x))


def nested_functional():
    """A functional model whose body and head are models themselves."""
    body = keras.Sequential(
        [keras.Input((3,), dtype=F64), dense(4, "tanh", name="inner")], name="body"
    )
    last = dense(2, name="head")
    head = keras.Sequential([keras.Input((4,), dtype=F64), last])
    x = keras.Input((3,), dtype=F64)
    return keras.Model(x, head(body(x))), last


@pytest.mark.parametrize("kind", ["subclassed", "subclassed_nested", "functional"])
def test_the_posterior_is_over_the_head(kind):
    keras.utils.set_random_seed(1)
    x, y = data(3, 2)
    x_test = data(3, 2, n=4, seed=2)[0]
    if kind == "functional":
        model, head = nested_functional()
    else:
        model = HeadFirst(nested=kind == "subclassed_nested")
        model(x[:1])  # build
        assert model.layers[0].name == "head"  # listed first, called last
        head = model.head
    variables = list(head.trainable_variables)
    la = laplace(model, x, y, sigma_noise=SIGMA, prior_precision=0.7)
    assert [id(v) for v in la.variables] == [id(v) for v in variables]
    P, expected = explicit(model, variables, x, x_test, 0.7)
    np.testing.assert_allclose(la.posterior_precision(), P, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(
        la.predictive_variance(x_test), expected, rtol=1e-9, atol=1e-13
    )


# -- per-layer prior precisions ---------------------------------------------------


def mlp(seed=2):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((3,), dtype=F64),
            dense(4, "tanh", name="hidden"),
            dense(2, name="out"),
        ]
    )


def kfac_dense(la):
    """KFAC as a matrix from its factors (kron(A, B) on [kernel; bias])."""
    K = np.zeros((la.n_params, la.n_params))
    rest = la.ggn.rest
    K[rest, rest] = la.ggn.rest_diagonal
    for f in la.ggn.factors:
        columns = np.r_[f.kernel, f.bias] if f.bias is not None else np.r_[f.kernel]
        K[np.ix_(columns, columns)] = np.kron(f.A, f.B)
    return K


@pytest.mark.parametrize("structure", ["last_layer", "diagonal", "kfac"])
def test_per_layer_priors_against_the_explicit_inverse(structure):
    if structure == "last_layer":
        model, (x, y) = two_heads(), data(3, 3)
        options = {"last_layer": ["head_a", "head_b"]}
        names = ["head_a", "head_b"]
    else:
        model, (x, y) = mlp(), data(3, 2)
        options, names = {}, ["hidden", "out"]
    prior = dict(zip(names, [0.3, 2.5], strict=True))
    x_test = data(3, 1, n=4, seed=3)[0]
    la = laplace(
        model, x, y, "squared_error", structure, prior_precision=prior,
        sigma_noise=SIGMA, **options,
    )  # fmt: skip
    assert la.layer_names == names
    np.testing.assert_array_equal(la.prior_precision, [0.3, 2.5])
    assert la.prior_precision_by_layer == prior
    variables = la.variables or model.trainable_variables
    sizes = [
        sum(int(np.prod(v.shape)) for v in model.get_layer(n).weights) for n in names
    ]
    delta = np.repeat([0.3, 2.5], sizes)
    if structure == "kfac":
        P = kfac_dense(la) / SIGMA**2 + np.diag(delta)
        Js = per_sample_j(model, variables, x_test)
        expected = np.einsum("nkp,pq,njq->nkj", Js, np.linalg.inv(P), Js)
    else:
        P, expected = explicit(
            model, variables, x, x_test, delta, diagonal=structure == "diagonal"
        )
        formed = la.posterior_precision()
        np.testing.assert_allclose(
            np.diag(formed) if structure == "diagonal" else formed,
            P, rtol=1e-10, atol=1e-12,
        )  # fmt: skip
    np.testing.assert_allclose(
        la.predictive_variance(x_test), expected, rtol=1e-9, atol=1e-13
    )
    np.testing.assert_allclose(
        la.log_marginal_likelihood(), explicit_lml(la, P, delta, y), rtol=1e-10
    )
    # a sequence in layer order is the same prior; equal values are the scalar
    again = la.log_marginal_likelihood([0.3, 2.5])
    assert again == pytest.approx(la.log_marginal_likelihood(), rel=1e-14)
    assert la.log_marginal_likelihood([0.9, 0.9]) == pytest.approx(
        la.log_marginal_likelihood(0.9), rel=1e-10
    )


def test_per_layer_prior_errors():
    model, (x, y) = mlp(), data(3, 2)
    with pytest.raises(ValueError, match=r"missing: \['out'\]"):
        laplace(model, x, y, "squared_error", "diagonal", prior_precision={"hidden": 1})
    with pytest.raises(ValueError, match=r"unknown: \['nope'\]"):
        laplace(
            model, x, y, "squared_error", "diagonal",
            prior_precision={"hidden": 1, "out": 1, "nope": 2},
        )  # fmt: skip
    with pytest.raises(ValueError, match="one value for each of the 2 layers"):
        laplace(model, x, y, "squared_error", "diagonal", prior_precision=[1, 2, 3])
    with pytest.raises(ValueError, match="must be positive"):
        laplace(model, x, y, "squared_error", "diagonal", prior_precision=[1, -2])


@pytest.mark.parametrize("structure", ["last_layer", "diagonal", "kfac"])
def test_layerwise_optimum_beats_its_perturbations(structure):
    if structure == "last_layer":
        model, (x, y), options = (
            two_heads(),
            data(3, 3),
            {"last_layer": ["head_a", "head_b"]},
        )
    else:
        model, (x, y), options = mlp(), data(3, 2), {}
    la = laplace(model, x, y, "squared_error", structure, sigma_noise=SIGMA, **options)
    scalar, _ = la.optimize_prior_precision()
    assert np.ndim(scalar) == 0
    at_scalar = la.log_marginal_likelihood()
    delta, sigma = la.optimize_prior_precision(prior_structure="layerwise")
    assert delta.shape == (2,) and sigma == SIGMA
    np.testing.assert_array_equal(la.prior_precision, delta)
    assert np.all((1e-4 * 1.1 < delta) & (delta < 1e4 / 1.1))  # an inner optimum
    best = la.log_marginal_likelihood()
    assert best >= at_scalar - 1e-9
    for g in range(2):
        for factor in (1.05, 1 / 1.05):
            moved = delta.copy()
            moved[g] *= factor
            assert la.log_marginal_likelihood(moved) < best
    # the stored shape is kept, and sigma can be fitted with it
    delta, sigma = la.optimize_prior_precision(sigma_noise="fit")
    assert delta.shape == (2,) and sigma != SIGMA
    best = la.log_marginal_likelihood()
    for factor in (1.05, 1 / 1.05):
        assert la.log_marginal_likelihood(delta, sigma * factor) < best
        assert la.log_marginal_likelihood(delta * [factor, 1]) < best


# -- refusals ------------------------------------------------------------------


@pytest.mark.parametrize("where", ["x", "y"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_data_is_refused(where, value):
    model, (x, y) = mlp(), data(3, 2)
    (x if where == "x" else y)[4, 1] = value
    with pytest.raises(
        ValueError, match=rf"^{where} holds NaN or infinity .*indices 4\)"
    ):
        laplace(model, x, y)


@pytest.mark.parametrize("budget", [-1, 0, math.nan, "1GB"])
def test_memory_budget_is_checked(budget):
    model, (x, y) = mlp(), data(3, 2)
    with pytest.raises((ValueError, TypeError), match="memory_budget must be"):
        laplace(model, x, y, memory_budget=budget)


@pytest.mark.parametrize("structure", ["last_layer", "diagonal"])
def test_variables_as_a_generator_are_read_once(structure):
    model, (x, y) = mlp(), data(3, 2)
    chosen = model.trainable_variables[-2:]
    from_list = laplace(model, x, y, "squared_error", structure, variables=chosen)
    la = laplace(model, x, y, "squared_error", structure, variables=(v for v in chosen))
    assert [id(v) for v in la.variables] == [id(v) for v in chosen]
    assert la.n_params == from_list.n_params == 10
    np.testing.assert_allclose(la.ggn, from_list.ggn, rtol=1e-14)
