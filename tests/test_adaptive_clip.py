"""Adaptive clipping (issue 54; Andrew et al., 2021): C follows a quantile
of the per-sample norms, and the gradient's noise pays for the count."""

import math

import numpy as np
import pytest

from jacutil import keras, per_sample_gradient_norms
from jacutil.privacy import make_private
from jacutil.privacy.accounting import epsilon_of
from jacutil.privacy.adaptive_clip import AdaptiveClip
from jacutil.privacy.dp_sgd import DPSGD

N = 512
rng = np.random.default_rng(0)
X = rng.standard_normal((N, 6)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def classifier():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)),
                             keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])  # fmt: skip


@pytest.mark.parametrize("quantile", [0.5, 0.9])
def test_the_clip_norm_follows_the_quantile_of_the_norms(quantile):
    """With the model still (learning rate 0) and no noise anywhere, C
    settles at the quantile of the per-sample norms."""
    model = classifier()
    dp = DPSGD(model, LOSS, keras.optimizers.SGD(0.0), l2_norm_clip=10.0,
               noise_multiplier=0.0, seed=0,
               adaptive_clip=AdaptiveClip(quantile, 0.2, count_noise=0.0))  # fmt: skip
    for _ in range(300):
        dp.sampled_step(X, Y, 64)
    norms = per_sample_gradient_norms(model, LOSS, X, Y)
    target = np.quantile(norms, quantile)
    assert float(dp.clip.current()) == pytest.approx(target, rel=0.1)


def test_the_gradient_noise_pays_for_the_count():
    """Theorem 1 of Andrew et al.: z_grad = (z^-2 - (2 sigma_b)^-2)^-1/2, and
    the noise added has that standard deviation times C (zero gradients:
    the update is the noise alone)."""
    clip = AdaptiveClip(0.5, 0.2, count_noise=2.0)
    z = 1.1
    expected = (z**-2 - 4.0**-2) ** -0.5
    assert clip.gradient_noise_multiplier(z) == pytest.approx(expected)
    assert expected > z
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((40,)), keras.layers.Dense(50)])
    zero = lambda y, p: 0.0 * keras.ops.sum(p, axis=-1)  # noqa: E731
    dp = DPSGD(model, zero, keras.optimizers.SGD(1.0), l2_norm_clip=0.5,
               noise_multiplier=z, seed=0, adaptive_clip=clip)  # fmt: skip
    x = rng.standard_normal((32, 40)).astype("float32")
    before = model.layers[0].kernel.numpy().copy()
    start = float(dp.clip.current())
    dp.step(x, np.zeros((32, 50), "float32"))
    moved = (before - model.layers[0].kernel.numpy()).ravel()
    noise = expected * start / 32  # z_grad C / B: SGD(1.0), no gradient
    assert np.std(moved) == pytest.approx(noise, rel=0.05)


def test_make_private_adapts_and_the_accountant_sees_sigma(capsys):
    model = classifier()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.5), loss)
    make_private(model, epsilon=2.0, delta=1e-4, l2_norm_clip=5.0, batch_size=64,
                 epochs=2, train_size=N, target_quantile=0.5)  # fmt: skip
    printed = capsys.readouterr().out
    assert "Adaptive clipping: C starts at 5" in printed
    history = model.fit(X, Y, epochs=2, verbose=0)
    training = model.privacy
    assert history.history["l2_norm_clip"][-1] < 5.0  # moved towards the median
    sigma = training.noise_multiplier
    assert training.dpsgd.gradient_noise_multiplier > sigma
    assert set(training.ledger.events) == {(sigma, 64 / N)}
    assert training.epsilon() == pytest.approx(
        epsilon_of(sigma, {64 / N: 16}, 1e-4, "pld"), rel=1e-12
    )
    assert training.epsilon() <= 2.0


def test_adaptive_clipping_refusals():
    with pytest.raises(ValueError, match="target_quantile"):
        AdaptiveClip(1.5)
    with pytest.raises(ValueError, match="too small for the noise multiplier"):
        AdaptiveClip(0.5, 0.2, count_noise=0.4).gradient_noise_multiplier(1.0)
    model = classifier()
    per_layer = {layer.name: 1.0 for layer in model.layers}
    with pytest.raises(ValueError, match="one number"):
        DPSGD(model, LOSS, keras.optimizers.SGD(0.1), l2_norm_clip=per_layer,
              noise_multiplier=1.0, adaptive_clip=AdaptiveClip())  # fmt: skip
    assert math.isfinite(AdaptiveClip().gradient_noise_multiplier(1.0))
