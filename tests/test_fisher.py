"""jacutil.curvature.fisher against references formed in float64 in the test.

The empirical Fisher against ``sum_i g_i g_i.T`` with each ``g_i`` from one
GradientTape per sample on the Keras loss objects themselves (each sample's
share of every head's reduced, weighted loss); the Monte Carlo Fisher
against G (``ggn_diagonal``, ``ggn_operator``) within its standard errors,
and reproducible by seed; the Hessian's diagonal against a nested-tape
Hessian of the summed Keras loss, and Hutchinson's within its standard
errors of it. Notebook 11-curvature-and-uncertainty.
"""

import numpy as np
import pytest

from jacutil import keras, tf
from jacutil.curvature.diagonal import ggn_diagonal
from jacutil.curvature.fisher import (
    empirical_fisher_diagonal,
    empirical_fisher_operator,
    hessian_diagonal,
    mc_fisher_diagonal,
    mc_fisher_operator,
)
from jacutil.curvature.ggn import ggn_operator
from jacutil.curvature.output_losses import SquaredError

N = 6
D64 = "float64"


def three_heads():
    """A float64 model with a regression, a softmax and a sigmoid head."""
    keras.utils.set_random_seed(3)
    x = keras.Input((3,), dtype=D64)
    h = keras.layers.Dense(4, activation="tanh", dtype=D64)(x)
    outputs = [
        keras.layers.Dense(2, dtype=D64)(h),  # MSE
        keras.layers.Dense(3, dtype=D64)(h),  # softmax logits
        keras.layers.Dense(2, dtype=D64)(h),  # sigmoid logits
    ]
    return keras.Model(x, outputs)


def two_heads():
    keras.utils.set_random_seed(4)
    x = keras.Input((3,), dtype=D64)
    h = keras.layers.Dense(4, activation="tanh", dtype=D64)(x)
    outputs = [keras.layers.Dense(2, dtype=D64)(h), keras.layers.Dense(3, dtype=D64)(h)]
    return keras.Model(x, outputs)


def one_head(units=3):
    keras.utils.set_random_seed(5)
    return keras.Sequential(
        [
            keras.Input((3,), dtype=D64),
            keras.layers.Dense(4, activation="tanh", dtype=D64),
            keras.layers.Dense(units, dtype=D64),
        ]
    )


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 3))
    y_reg = rng.normal(size=(N, 2))
    labels = rng.integers(0, 3, N)
    bits = rng.integers(0, 2, (N, 2)).astype(float)
    weights = rng.uniform(0.5, 2.0, N)
    return x, y_reg, labels, bits, weights


def flat(grads):
    return np.concatenate([np.ravel(g.numpy()) for g in grads])


def reference_empirical_fisher(model, x, ys, losses, sample_weight):
    """``sum_i g_i g_i.T``, ``g_i = sum_h grad(share_ih) / sqrt(c_ih)``:
    ``share_ih`` sample i's share of head h's Keras loss (its sample weight
    masked to sample i), ``c_ih`` its coefficient on the unreduced loss
    (``share = c L``), both from Keras; one tape per sample."""
    variables = model.trainable_variables
    w = np.ones(N) if sample_weight is None else sample_weight
    outs = model(x)
    outs = [outs] if not isinstance(outs, list) else outs
    G = []
    for i in range(N):
        mask = np.where(np.arange(N) == i, w, 0.0)
        with tf.GradientTape() as tape:
            preds = model(x)
            preds = [preds] if not isinstance(preds, list) else preds
            total = 0.0
            for loss, y, f, f0 in zip(losses, ys, preds, outs, strict=True):
                share = loss(y, f, sample_weight=mask)
                plain = float(
                    np.sum(np.asarray(loss.call(y[i : i + 1], f0[i : i + 1])))
                )
                c = float(share) / plain
                total = total + share / np.sqrt(c)
        G.append(flat(tape.gradient(total, variables)))
    G = np.array(G)
    return G.T @ G


def keras_losses(case):
    mse_sum = keras.losses.MeanSquaredError(reduction="sum", dtype=D64)
    scce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype=D64)
    if case == "mse sum, weighted":
        return one_head(2), [mse_sum], "weights"
    if case == "softmax, mean over the batch":
        return one_head(3), [scce], None
    return two_heads(), [mse_sum, scce], "weights"


CASES = ["mse sum, weighted", "softmax, mean over the batch", "two heads, weighted"]


@pytest.mark.parametrize("case", CASES)
def test_empirical_fisher_is_the_sum_of_gradient_outer_products(case):
    model, losses, weighted = keras_losses(case)
    x, y_reg, labels, _, weights = data()
    ys = [
        y_reg if isinstance(lo, keras.losses.MeanSquaredError) else labels
        for lo in losses
    ]
    sample_weight = weights if weighted else None
    expected = reference_empirical_fisher(model, x, ys, losses, sample_weight)
    loss = losses if len(losses) > 1 else losses[0]
    y = ys if len(ys) > 1 else ys[0]
    F = empirical_fisher_operator(model, x, y, loss, sample_weight=sample_weight)
    m = F.shape[0]
    np.testing.assert_allclose(F @ np.eye(m), expected, rtol=1e-9, atol=1e-12)
    diagonal = empirical_fisher_diagonal(model, x, y, loss, sample_weight=sample_weight)
    np.testing.assert_allclose(diagonal, np.diag(expected), rtol=1e-9, atol=1e-12)


def test_empirical_fisher_recomputes_chunks_outside_the_budget():
    model, losses, _ = keras_losses("two heads, weighted")
    x, y_reg, labels, _, weights = data()
    y = [y_reg, labels]
    held = empirical_fisher_operator(model, x, y, losses, sample_weight=weights)
    small = empirical_fisher_operator(
        model, x, y, losses, sample_weight=weights, memory_budget=1
    )
    V = np.random.default_rng(1).normal(size=(held.shape[0], 2))
    np.testing.assert_allclose(small @ V, held @ V, rtol=1e-12, atol=1e-14)
    d, how = empirical_fisher_diagonal(
        model, x, y, losses, sample_weight=weights, memory_budget=1, explain=True
    )
    assert f"{N} chunk(s) of 1 samples" in how
    np.testing.assert_allclose(d, np.diag(held @ np.eye(held.shape[0])), rtol=1e-12)


def test_empirical_fisher_needs_y():
    with pytest.raises(ValueError, match="true targets: pass y="):
        empirical_fisher_operator(one_head(), data()[0], None, "squared_error")


MC_LOSSES = [
    keras.losses.MeanSquaredError(dtype=D64),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype=D64),
    keras.losses.BinaryCrossentropy(from_logits=True, reduction="sum", dtype=D64),
]


def test_monte_carlo_fisher_diagonal_converges_to_the_ggn_diagonal():
    model = three_heads()
    x, *_, weights = data()
    exact = ggn_diagonal(model, x, MC_LOSSES, sample_weight=weights)
    estimate = mc_fisher_diagonal(
        model, x, MC_LOSSES, sample_weight=weights, mc_samples=3000, seed=0
    )
    assert estimate.n_probes == 3000
    z = np.abs(estimate.value - exact) / estimate.standard_error
    assert np.all(estimate.standard_error > 0)
    assert z.max() < 5, z.max()
    relative = np.abs(estimate.value - exact).max() / np.abs(exact).max()
    assert relative < 0.05, relative


def test_monte_carlo_fisher_operator_converges_to_g():
    model = three_heads()
    x, *_, weights = data()
    m = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    G = ggn_operator(model, x, MC_LOSSES, sample_weight=weights) @ np.eye(m)
    F = mc_fisher_operator(
        model, x, MC_LOSSES, sample_weight=weights, mc_samples=3000, seed=1
    ) @ np.eye(m)
    np.testing.assert_allclose(F, F.T, atol=1e-14)
    assert np.linalg.norm(F - G) / np.linalg.norm(G) < 0.05


def test_monte_carlo_fisher_is_reproducible_by_seed():
    model = three_heads()
    x = data()[0]
    a = mc_fisher_diagonal(model, x, MC_LOSSES, mc_samples=3, seed=7)
    b = mc_fisher_diagonal(model, x, MC_LOSSES, mc_samples=3, seed=7)
    c = mc_fisher_diagonal(model, x, MC_LOSSES, mc_samples=3, seed=8)
    np.testing.assert_array_equal(a.value, b.value)
    np.testing.assert_array_equal(a.standard_error, b.standard_error)
    assert not np.allclose(a.value, c.value)
    F = mc_fisher_operator(model, x, MC_LOSSES, mc_samples=3, seed=7)
    np.testing.assert_allclose(np.diag(F @ np.eye(F.shape[0])), a.value, rtol=1e-12)


def test_squared_error_draws_have_h_as_their_second_moment():
    """Keras' MSE over k = 4 values: scale 2/k, y ~ N(f, I / scale)."""
    loss = SquaredError(scale=0.5)
    f = np.random.default_rng(0).normal(size=(2, 4))
    s = loss.sample_signals(f, 200_000, np.random.default_rng(1))
    second = np.einsum("ndk,ndj->nkj", s, s) / s.shape[1]
    np.testing.assert_allclose(second, 0.5 * np.stack([np.eye(4)] * 2), atol=0.01)


def test_monte_carlo_fisher_refuses_a_loss_with_no_likelihood():
    def absolute(y_true, y_pred):
        return keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)

    with pytest.raises(ValueError, match="no Monte Carlo Fisher"):
        mc_fisher_diagonal(one_head(), data()[0], absolute, mc_samples=2)
    with pytest.raises(ValueError, match="mc_samples must be at least 1"):
        mc_fisher_operator(one_head(), data()[0], "squared_error", mc_samples=0)


def reference_hessian(model, x, ys, losses, sample_weight):
    """The Hessian of the summed, weighted Keras loss, by nested tapes."""
    variables = model.trainable_variables
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            preds = model(x)
            value = tf.add_n(
                [
                    loss(y, f, sample_weight=sample_weight)
                    for loss, y, f in zip(losses, ys, preds, strict=True)
                ]
            )
        g = tf.concat(
            [tf.reshape(t, [-1]) for t in inner.gradient(value, variables)], 0
        )
    blocks = outer.jacobian(g, variables)
    return np.concatenate([np.reshape(b.numpy(), (g.shape[0], -1)) for b in blocks], 1)


def test_hessian_diagonal_exact_and_hutchinson():
    model = three_heads()
    x, y_reg, labels, bits, weights = data()
    ys = [y_reg, labels, bits]
    expected = np.diag(reference_hessian(model, x, ys, MC_LOSSES, weights))
    exact = hessian_diagonal(model, x, ys, MC_LOSSES, sample_weight=weights)
    assert exact.n_probes == 0 and not np.any(exact.standard_error)
    np.testing.assert_allclose(exact.value, expected, rtol=1e-9, atol=1e-12)
    estimate = hessian_diagonal(
        model, x, ys, MC_LOSSES, sample_weight=weights, method="auto",
        exact_up_to=10, n_probes=200, seed=3,
    )  # fmt: skip
    assert estimate.n_probes == 200
    assert np.all(
        np.abs(estimate.value - expected) <= 5 * estimate.standard_error + 1e-12
    )
    with pytest.raises(ValueError, match="method must be one of"):
        hessian_diagonal(model, x, ys, MC_LOSSES, method="lanczos")
