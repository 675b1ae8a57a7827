"""DP-SGD by ghost clipping (jacutil.privacy.dp_sgd), against a per-sample loop.

The reference takes one gradient per sample with its own tape, clips it and
averages: the textbook DP-SGD step that ghost clipping must equal without
ever forming those gradients.
"""

import math
import sys

import numpy as np
import pytest

from jacutil import keras, tf
from jacutil.privacy.clip_groups import clip_weights
from jacutil.privacy.dp_sgd import DPSGD

mse = keras.losses.mean_squared_error


def sparse_ce(y, prediction):
    return keras.losses.sparse_categorical_crossentropy(y, prediction)


def dense_model(seed=0, inputs=5, hidden=6, outputs=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((inputs,), dtype="float64"),
            keras.layers.Dense(hidden, activation="tanh", dtype="float64"),
            keras.layers.Dense(outputs, dtype="float64"),
        ]
    )


def conv_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2), dtype="float64"),
            keras.layers.Conv2D(3, 3, activation="tanh", dtype="float64"),
            keras.layers.Flatten(dtype="float64"),
            keras.layers.Dense(4, activation="softmax", dtype="float64"),
        ]
    )


def dense_data(n=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)), rng.normal(size=(n, 3))


def conv_data(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6, 6, 2)), rng.integers(0, 4, n)


def flat(model):
    return np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])


def restore(model, values):
    for variable, value in zip(model.trainable_variables, values, strict=True):
        variable.assign(value)


def loop_gradients(model, loss_fn, x, y):
    """(n, m): one tape per sample, in model.trainable_variables order."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            prediction = model(x[i : i + 1], training=False)
            loss = tf.reduce_sum(loss_fn(y[i : i + 1], prediction))
        grads = tape.gradient(loss, model.trainable_variables)
        rows.append(np.concatenate([np.ravel(g) for g in grads]))
    return np.array(rows)


def median_norm(G):
    """A clip C that clips about half the samples."""
    return float(np.median(np.linalg.norm(G, axis=1)))


def test_each_clipped_gradient_has_norm_at_most_C():
    model, (x, y) = dense_model(), dense_data()
    G = loop_gradients(model, mse, x, y)
    norms = np.linalg.norm(G, axis=1)
    C = median_norm(G)
    dp = DPSGD(
        model, mse, keras.optimizers.SGD(0.1), l2_norm_clip=C, noise_multiplier=0.0
    )
    weights = dp.clip_weights(x, y)  # from jacutil's norms, not the loop's
    clipped = np.linalg.norm(weights[:, None] * G, axis=1)
    assert (norms > C).any() and (norms < C).any()  # both cases are exercised
    assert (clipped <= C * (1 + 1e-12)).all()
    np.testing.assert_allclose(clipped[norms > C], C, rtol=1e-10)
    np.testing.assert_array_equal(weights[norms <= C], 1.0)
    np.testing.assert_array_equal(clip_weights([0.0, 2.0], 1.0), [1.0, 0.5])


@pytest.mark.parametrize(
    "build, data, loss_fn",
    [(dense_model, dense_data, mse), (conv_model, conv_data, sparse_ce)],
    ids=["dense", "conv"],
)
def test_noiseless_step_equals_the_per_sample_loop(build, data, loss_fn):
    model, (x, y) = build(), data()
    G = loop_gradients(model, loss_fn, x, y)
    C = median_norm(G)
    norms = np.linalg.norm(G, axis=1)
    reference = np.minimum(1.0, C / norms)[:, None] * G  # clipped in the loop
    assert (norms > C).any()
    lr, before = 0.25, flat(model)  # exact in the float32 Keras keeps it in
    dp = DPSGD(
        model, loss_fn, keras.optimizers.SGD(lr), l2_norm_clip=C, noise_multiplier=0.0
    )
    dp.step(x, y)
    expected = before - lr * reference.mean(axis=0)
    np.testing.assert_allclose(flat(model), expected, rtol=1e-10, atol=1e-13)
    # and the step is not the unclipped one (the test can tell them apart)
    assert not np.allclose(flat(model), before - lr * G.mean(axis=0), rtol=1e-6)


@pytest.mark.parametrize("denominator", [None, 20])
def test_noise_has_standard_deviation_sigma_C_over_the_batch_size(denominator):
    model = dense_model(inputs=5, hidden=40, outputs=20)  # m = 1060
    x, y = np.random.default_rng(1).normal(size=(8, 5)), np.zeros((8, 20))
    sigma, C, start = 1.3, 0.7, [v.numpy() for v in model.trainable_variables]
    clean = DPSGD(
        model, mse, keras.optimizers.SGD(1.0), l2_norm_clip=C, noise_multiplier=0.0
    )
    clean.step(x, y, denominator=denominator)
    without_noise = flat(model)
    noisy = DPSGD(
        model,
        mse,
        keras.optimizers.SGD(1.0),
        l2_norm_clip=C,
        noise_multiplier=sigma,
        seed=3,
    )
    draws = []
    for _ in range(10):
        restore(model, start)
        noisy.step(x, y, denominator=denominator)
        draws.append(without_noise - flat(model))  # = noise / denominator
    draws = np.concatenate(draws)
    expected = sigma * C / (denominator or len(x))
    N = draws.size
    assert abs(draws.mean()) < 4 * expected / math.sqrt(N)
    assert abs(draws.std() - expected) < 4 * expected / math.sqrt(2 * N)


def test_same_seed_same_step_and_one_trace_per_shape():
    x, y = dense_data()
    steps = []
    for seed in (7, 7, 8):
        model = dense_model()
        dp = DPSGD(
            model,
            mse,
            keras.optimizers.SGD(0.1),
            l2_norm_clip=0.5,
            noise_multiplier=1.0,
            seed=seed,
        )
        dp.step(x, y)
        steps.append(flat(model))
    np.testing.assert_array_equal(steps[0], steps[1])
    assert not np.allclose(steps[0], steps[2])
    assert dp.trace_count == 1
    dp.step(x + 1, y)  # the same shapes, other values
    assert dp.trace_count == 1
    dp.step(x[:4], y[:4])  # a new shape traces once more
    assert dp.trace_count == 2 and dp.steps == 3


def test_sampled_steps_are_seeded_poisson_sampling_with_their_accounting():
    """DPSGD keeps no loop of its own (model.fit is the loop, by
    make_private): ten sampled steps, twice from the same seed, repeat."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 5)), rng.normal(size=(60, 3))
    runs = []
    for _ in range(2):
        dp = DPSGD(
            dense_model(),
            mse,
            keras.optimizers.SGD(0.1),
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            seed=5,
        )
        losses = [dp.sampled_step(x, y, 12)[0].numpy() for _ in range(10)]
        runs.append((np.concatenate(losses), flat(dp.model)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert dp.steps == 2 * 5 and dp.steps_at == {12 / 60: 10}
    assert dp.trace_count <= 2  # padded to one shape (or, rarely, twice it)


def test_epsilon_falls_with_noise_and_grows_with_steps():
    import dp_accounting as dpa  # make setup installs it (see the Makefile)

    x, y = dense_data()
    models = {sigma: dense_model() for sigma in (0.8, 1.6)}
    dps = {
        sigma: DPSGD(
            model,
            mse,
            keras.optimizers.SGD(0.1),
            l2_norm_clip=1.0,
            noise_multiplier=sigma,
        )
        for sigma, model in models.items()
    }
    for dp in dps.values():
        assert dp.epsilon(1e-5) == 0.0
        for _ in range(5):
            dp.step(x, y, sampling_rate=0.01)
    low_noise, high_noise = dps[0.8].epsilon(1e-5), dps[1.6].epsilon(1e-5)
    assert 0 < high_noise < low_noise
    for _ in range(5):
        dps[1.6].step(x, y, sampling_rate=0.01)
    assert dps[1.6].epsilon(1e-5) > high_noise
    # what dp-accounting says of the same ten steps
    ledger = dpa.rdp.RdpAccountant()
    event = dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.6))
    ledger.compose(dpa.SelfComposedDpEvent(event, 10))
    assert dps[1.6].epsilon(1e-5) == pytest.approx(ledger.get_epsilon(1e-5))
    assert dps[1.6].epsilon(1e-5, accountant="pld") <= dps[1.6].epsilon(1e-5)
    silent = DPSGD(
        dense_model(),
        mse,
        keras.optimizers.SGD(0.1),
        l2_norm_clip=1.0,
        noise_multiplier=0.0,
    )
    silent.step(x, y)
    assert silent.epsilon(1e-5) == math.inf


def test_epsilon_without_dp_accounting_says_how_to_install(monkeypatch):
    dp = DPSGD(
        dense_model(),
        mse,
        keras.optimizers.SGD(0.1),
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
    )
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import fails
    with pytest.raises(ImportError, match="pip install --no-deps dp-accounting"):
        dp.epsilon(1e-5)
    assert dp.steps == 0


def test_errors_that_teach():
    model, (x, y) = dense_model(), dense_data()
    sgd = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="l2_norm_clip.*> 0"):
        DPSGD(model, mse, sgd, l2_norm_clip=0.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        DPSGD(model, mse, sgd, l2_norm_clip=float("nan"), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise_multiplier.*>= 0"):
        DPSGD(model, mse, sgd, l2_norm_clip=1.0, noise_multiplier=-0.5)
    dp = DPSGD(model, mse, sgd, l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="batch_size is 11 but the data has 10"):
        dp.sampled_step(x, y, 11)
    with pytest.raises(ValueError, match="sampling_rate"):
        dp.step(x, y, sampling_rate=0.0)
    reducing = DPSGD(
        model,
        keras.losses.MeanSquaredError(),
        sgd,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
    )
    with pytest.raises(ValueError, match=r"one loss per sample.*reduction=None"):
        reducing.step(x, y)
    assert reducing.steps == 0 and dp.steps == 0


# --- the fused sampled step (make_private's speed) ------------------------------


def test_the_fused_sampled_step_equals_the_step_through_numpy():
    """sampled_step runs gather, norms, clip weights and update in one graph
    where the norms are on the layer rules; the same seeds through
    padded_step (NumPy between the parts) give the same steps."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 5)), rng.normal(size=(60, 3))
    runs = []
    for fused in (True, False):
        dp = DPSGD(dense_model(), mse, keras.optimizers.SGD(0.1),
                   l2_norm_clip=0.5, noise_multiplier=0.7, seed=5)  # fmt: skip
        if not fused:
            as_tensors = dp._fused_step
            dp._fused_step = lambda x, y, f=as_tensors: (None, *f(x, y)[1:])
        weights = []
        for _ in range(6):
            dp.sampled_step(x, y, 12)
            weights.append((dp.last_index.copy(), dp.last_weights.copy()))
        runs.append((flat(dp.model), weights, dp.steps))
        if fused:
            assert dp._fused[2] is not None, "the fused step did not run"
            assert dp.trace_count <= 2  # one padded shape (rarely twice it)
    (theta, weights, steps), (theta_np, weights_np, steps_np) = runs
    assert steps == steps_np == 6
    for (i, w), (i_np, w_np) in zip(weights, weights_np, strict=True):
        np.testing.assert_array_equal(i, i_np)
        np.testing.assert_allclose(w, w_np, rtol=1e-12)
        assert (w < 1).any()  # clipping bound somewhere
    np.testing.assert_allclose(theta, theta_np, rtol=1e-12, atol=1e-14)


def test_the_fused_step_traces_per_pass_size_not_per_batch_or_array():
    """The compiled sampled step takes the data as an argument and a batch
    larger than the padded size in passes of that size: one trace serves
    every Poisson batch size (no new graph, and no stall, at the first large
    batch), and new arrays of the same shapes (another ``model.fit`` call)
    run the same trace - on their own values: the step equals a fresh
    DPSGD's from the same weights."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 5)), rng.normal(size=(60, 3))
    dp = DPSGD(dense_model(), mse, keras.optimizers.SGD(0.3),
               l2_norm_clip=0.5, noise_multiplier=0.0, seed=5)  # fmt: skip
    sizes = set()
    for _ in range(8):
        dp.sampled_step(x, y, 12, physical_batch_size=4)
        sizes.add(len(dp.last_index))
    assert len(sizes) > 1 and dp.trace_count == 1
    dp.sampled_step(x, y, 60)  # rate 1: every row, no noise
    traces = dp.trace_count
    x2, y2 = rng.normal(size=(60, 5)), rng.normal(size=(60, 3))
    theta = [v.numpy() for v in dp.model.trainable_variables]
    dp.sampled_step(x2, y2, 60)
    assert dp.trace_count == traces
    fresh = DPSGD(dense_model(seed=1), mse, keras.optimizers.SGD(0.3),
                  l2_norm_clip=0.5, noise_multiplier=0.0)  # fmt: skip
    restore(fresh.model, theta)
    fresh.sampled_step(x2, y2, 60)
    moved = flat(fresh.model)
    assert not np.allclose(moved, np.concatenate([t.ravel() for t in theta]))
    np.testing.assert_allclose(flat(dp.model), moved, rtol=1e-12, atol=1e-15)


def test_the_fused_step_skips_a_non_finite_gradient_and_refuses_all():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 5))

    def sqrt_loss(y, p):  # finite, but its gradient is NaN where y is 0
        return tf.reduce_sum(tf.sqrt(y * tf.square(p)), axis=-1)

    y = np.ones((8, 3))
    y[2] = 0.0
    dp = DPSGD(dense_model(), sqrt_loss, keras.optimizers.SGD(0.1),
               l2_norm_clip=1.0, noise_multiplier=0.0)  # fmt: skip
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        losses, _, _, valid = dp.sampled_step(x, y, 8)  # rate 1: every sample
    assert np.asarray(valid).tolist() == [1.0] * 8
    assert dp._fused[2] is not None
    assert dp.skipped == 1 and dp.last_weights[2] == 0
    assert np.isnan(losses[2]) and np.isfinite(np.delete(np.asarray(losses), 2)).all()
    assert np.isfinite(flat(dp.model)).all()
    before = flat(dp.model)
    with pytest.raises(FloatingPointError, match="every sample"):
        dp.sampled_step(x, np.zeros((8, 3)), 8)
    np.testing.assert_array_equal(flat(dp.model), before)
    assert dp.steps == 1
