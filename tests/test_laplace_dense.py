"""Laplace's Dense form (issue 38): J = A (phi (x) I) from a Dense layer's
inputs, never formed, against the general J that the other tests check.
Notebook 11-curvature-and-uncertainty.

Each case fits the same posterior twice in float64, once with the Dense form
and once with it switched off (``dense_last_layer`` made to answer None), and
compares G, the predictive covariance, the log marginal likelihood and the
predictive; one case is checked against J from one tape per sample as well.
"""

import numpy as np
import pytest

import jacutil.curvature.laplace_base as laplace_module
from jacutil import keras, question_mlp, tf
from jacutil.curvature.laplace import Laplace

F64 = "float64"
N, N_TEST, D_IN = 12, 7, 4
RTOL = 1e-10


def _dense(width, **options):
    return keras.layers.Dense(width, dtype=F64, **options)


def model_of(kind, width, seed=0):
    """A float64 Sequential: two hidden Dense layers, then the last Dense of
    ``kind``: ``"linear"``, ``"no_bias"``, ``"softmax_inside"`` (the Dense's
    activation), ``"softmax_layer"`` (a Softmax layer after it) or
    ``"sigmoid_inside"``."""
    keras.utils.set_random_seed(seed)
    last = {
        "linear": _dense(width, name="head"),
        "no_bias": _dense(width, use_bias=False, name="head"),
        "softmax_inside": _dense(width, activation="softmax", name="head"),
        "softmax_layer": _dense(width, name="head"),
        "sigmoid_inside": _dense(width, activation="sigmoid", name="head"),
    }[kind]
    layers = [keras.Input((D_IN,), dtype=F64), _dense(6, activation="tanh"),
              _dense(5, activation="tanh"), last]  # fmt: skip
    if kind == "softmax_layer":
        layers.append(keras.layers.Softmax(dtype=F64))
    return keras.Sequential(layers)


def data(width, loss, n=N, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, D_IN))
    if loss == "softmax_cross_entropy":
        return x, rng.integers(0, width, n)
    if loss == "sigmoid_cross_entropy":
        return x, rng.integers(0, 2, (n, width)).astype(np.float64)
    return x, rng.standard_normal((n, width))


def both(monkeypatch, model, x, y, loss, structure, **options):
    """(Dense form, general form) of the same posterior."""
    dense = Laplace(model, x, y, loss, structure, **options)
    with monkeypatch.context() as patch:
        patch.setattr(laplace_module, "dense_last_layer", lambda *a, **k: None)
        general = Laplace(model, x, y, loss, structure, **options)
    return dense, general


def assert_same(dense, general, x_test):
    assert dense.jacobian_form == "dense" and dense.dense is not None
    assert general.jacobian_form == "general" and general.dense is None
    if dense.structure == "kfac":
        np.testing.assert_allclose(
            dense.ggn.to_dense(), general.ggn.to_dense(), rtol=RTOL, atol=1e-12
        )
    else:
        np.testing.assert_allclose(dense.ggn, general.ggn, rtol=RTOL, atol=1e-12)
    var = dense.predictive_variance(x_test)
    np.testing.assert_allclose(
        var, general.predictive_variance(x_test), rtol=RTOL, atol=1e-13
    )
    assert np.all(np.diagonal(var, 0, 1, 2) > 0)  # not trivially zero
    np.testing.assert_allclose(
        dense.log_marginal_likelihood(), general.log_marginal_likelihood(), rtol=RTOL
    )
    predicted, expected = dense.predict(x_test), general.predict(x_test)
    for a, b in zip(tf.nest.flatten(predicted), tf.nest.flatten(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-13)


def last_variables(model):
    return [model.get_layer("head").kernel] + (
        [model.get_layer("head").bias] if model.get_layer("head").use_bias else []
    )


CASES = [  # (last layer, loss, width)
    ("linear", "squared_error", 1),
    ("linear", "squared_error", 3),
    ("no_bias", "squared_error", 2),
    ("softmax_inside", "squared_error", 3),
    ("softmax_layer", "squared_error", 3),
    ("sigmoid_inside", "squared_error", 2),
    ("linear", "softmax_cross_entropy", 3),
    ("linear", "sigmoid_cross_entropy", 1),
    ("no_bias", "sigmoid_cross_entropy", 3),
]


@pytest.mark.parametrize("structure", ["last_layer", "diagonal", "kfac"])
@pytest.mark.parametrize(("kind", "loss", "width"), CASES)
def test_dense_form_equals_the_general_jacobian(
    monkeypatch, kind, loss, width, structure
):
    model = model_of(kind, width)
    x, y = data(width, loss)
    x_test = data(width, loss, N_TEST, seed=5)[0]
    options = {"prior_precision": 0.7}
    if loss == "squared_error":
        options["sigma_noise"] = 0.4
    if structure != "last_layer":  # these cover every weight by default
        options["variables"] = last_variables(model)
    dense, general = both(monkeypatch, model, x, y, loss, structure, **options)
    assert_same(dense, general, x_test)


@pytest.mark.parametrize("structure", ["last_layer", "diagonal", "kfac"])
def test_kernel_without_the_bias(monkeypatch, structure):
    """variables= the kernel alone of a Dense with a bias: phi without the 1."""
    model = model_of("softmax_inside", 3)
    x, y = data(3, "squared_error")
    variables = [model.get_layer("head").kernel]
    dense, general = both(
        monkeypatch, model, x, y, "squared_error", structure, variables=variables
    )
    if structure == "kfac":  # a kernel without its bias is not a Kronecker block
        assert dense.ggn.factors == [] and dense.jacobian_form == "general"
        return
    assert not dense.dense.with_bias
    assert_same(dense, general, data(3, "squared_error", N_TEST, seed=5)[0])


def per_sample_j(model, variables, x):
    """J (n, l, m) by one tape per sample, float64."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            out = tf.reshape(model(x[i : i + 1], training=False), [-1])
        jac = tape.jacobian(out, variables)
        rows.append(
            np.concatenate([np.reshape(j, (out.shape[0], -1)) for j in jac], axis=1)
        )
    return np.asarray(rows)


def test_against_one_tape_per_sample():
    """The Dense form against J formed sample by sample: G and J Sigma J.T."""
    model = model_of("softmax_layer", 3)
    x, y = data(3, "squared_error")
    x_test = data(3, "squared_error", N_TEST, seed=5)[0]
    la = Laplace(model, x, y, prior_precision=0.7, sigma_noise=0.4)
    assert la.jacobian_form == "dense"
    variables = last_variables(model)
    J = per_sample_j(model, variables, x)
    G = np.einsum("nkp,nkq->pq", J, J)
    np.testing.assert_allclose(la.ggn, G, rtol=1e-10, atol=1e-12)
    Sigma = np.linalg.inv(G / 0.4**2 + 0.7 * np.eye(len(G)))
    Js = per_sample_j(model, variables, x_test)
    np.testing.assert_allclose(
        la.predictive_variance(x_test),
        np.einsum("nkp,pq,njq->nkj", Js, Sigma, Js),
        rtol=1e-9,
        atol=1e-13,
    )


def test_new_prior_and_noise_are_used(monkeypatch):
    """Sigma is kept between calls: a new delta or sigma must replace it."""
    model = model_of("linear", 2)
    x, y = data(2, "squared_error")
    x_test = data(2, "squared_error", N_TEST, seed=5)[0]
    dense, general = both(monkeypatch, model, x, y, "squared_error", "last_layer")
    before = dense.predictive_variance(x_test)
    for la in (dense, general):
        la.prior_precision, la.sigma_noise = 3.0, 0.3
    after = dense.predictive_variance(x_test)
    assert not np.allclose(before, after)
    np.testing.assert_allclose(after, general.predictive_variance(x_test), rtol=RTOL)
    dense.optimize_prior_precision(prior_structure="layerwise")
    general.prior_precision = dense.prior_precision
    np.testing.assert_allclose(
        dense.predictive_variance(x_test),
        general.predictive_variance(x_test),
        rtol=RTOL,
    )


def test_chunks_and_a_float32_model(monkeypatch):
    """The question's float32 MLP, in many chunks: the two forms agree to
    float32's precision (both read the same float32 model)."""
    model = question_mlp(seed=3)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((40, 10)), rng.standard_normal((40, 2))
    x_test = rng.standard_normal((30, 10))
    dense, general = both(
        monkeypatch, model, x, y, "squared_error", "last_layer",
        sigma_noise=0.5, memory_budget=8 * 2 * 66 * 7,  # 7 samples a chunk
    )  # fmt: skip
    assert dense.jacobian_form == "dense"
    np.testing.assert_allclose(dense.ggn, general.ggn, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        dense.predictive_variance(x_test),
        general.predictive_variance(x_test),
        rtol=1e-5,
        atol=1e-7,
    )


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = _dense(5, activation="tanh")
        self.head = _dense(2)

    def call(self, x):
        return self.head(self.hidden(x))


def test_the_general_form_where_the_dense_form_does_not_apply():
    x, y = data(2, "squared_error")
    sub = Subclassed()
    sub(x[:1])
    mlp = model_of("linear", 2)
    time_distributed = keras.Sequential(
        [keras.Input((3, D_IN), dtype=F64), _dense(2, name="head"),
         keras.layers.Flatten(dtype=F64)]
    )  # fmt: skip
    x3 = np.random.default_rng(0).standard_normal((N, 3, D_IN))
    y3 = np.random.default_rng(1).standard_normal((N, 6))
    for la in (
        Laplace(sub, x, y),  # no functional graph to take the features from
        Laplace(mlp, x, y, structure="diagonal"),  # every layer's weights
        Laplace(time_distributed, x3, y3),  # a Dense on (n, t, d) inputs
        Laplace(mlp, x, y, variables=last_variables(mlp)[::-1]),  # bias first
    ):
        assert la.jacobian_form == "general" and la.dense is None
        assert "jacobian='general'" in repr(la)
    la = Laplace(mlp, x, y)
    assert la.jacobian_form == "dense" and "jacobian='dense'" in repr(la)


def test_the_features_run_by_xla_and_repeat_bit_for_bit():
    """XLA compiles once per batch shape: the same call, the same bits."""
    model = model_of("softmax_layer", 3)
    x, y = data(3, "squared_error")
    x_test = data(3, "squared_error", N_TEST, seed=5)[0]
    la = Laplace(model, x, y, prior_precision=0.7, sigma_noise=0.4)
    first = la.predictive_variance(x_test)
    assert la.dense.jit_compile
    np.testing.assert_array_equal(la.predictive_variance(x_test), first)
    other = Laplace(model, x, y, prior_precision=0.7, sigma_noise=0.4)
    np.testing.assert_array_equal(other.predictive_variance(x_test), first)


def test_the_kept_dense_form_does_not_keep_the_model():
    """The Dense form is kept per model (jacutil.core.cache), weakly."""
    import gc
    import weakref

    def fitted_once():
        model = model_of("softmax_layer", 2)
        x, y = data(2, "squared_error")
        la = Laplace(model, x, y)
        assert la.jacobian_form == "dense"
        again = Laplace(model, x, y, prior_precision=2.0)
        assert again.dense is la.dense  # built once per model and variables
        la.predictive_variance(x)
        return weakref.ref(model)

    model = fitted_once()
    gc.collect()
    assert model() is None


def test_without_xla_for_good_where_xla_fails(monkeypatch):
    from jacutil.curvature import dense_last_layer as module

    model = model_of("softmax_inside", 2)
    x, y = data(2, "squared_error")
    x_test = data(2, "squared_error", N_TEST, seed=5)[0]
    expected = Laplace(model, x, y).predictive_variance(x_test)
    compiled = module.DenseLastLayer._compiled

    def no_xla(self, batch, xla):
        if xla:
            raise tf.errors.UnimplementedError(None, None, "XLA cannot compile it")
        return compiled(self, batch, xla)

    monkeypatch.setattr(module.DenseLastLayer, "_compiled", no_xla)
    model = model_of("softmax_inside", 2)  # a new model: a new Dense form
    la = Laplace(model, x, y)
    assert la.jacobian_form == "dense" and not la.dense.jit_compile
    np.testing.assert_allclose(
        la.predictive_variance(x_test), expected, rtol=1e-12, atol=1e-15
    )


@pytest.mark.parametrize("n", [5, 100, 1001])
def test_products_by_rows_equal_one_product(n):
    """The Dense form multiplies in blocks of rows (BLAS on the calling
    thread): the same product, remainder block included."""
    from jacutil.curvature import dense_last_layer as module

    rng = np.random.default_rng(n)
    a, b = rng.standard_normal((n, 33)), rng.standard_normal((33, 99))
    rows = module.SERIAL_WORK // (33 * 99)
    assert module.FEWEST_ROWS <= rows < 1001  # n = 1001 takes several blocks
    np.testing.assert_allclose(module._by_rows(a, b), a @ b, rtol=1e-13, atol=1e-13)  # noqa: SLF001
