"""The one-run canary audit (issue 54): its bound is Steinke, Nasr and
Jagielski's, a correct run's stays at or below the claimed epsilon, and a
run whose noise or clipping is switched off (while the accountant still
claims the calibrated epsilon) exceeds it clearly."""

import math

import numpy as np
import pytest
from scipy import stats

from jacutil import keras, tf
from jacutil.privacy import make_private
from jacutil.privacy.audit import CanaryAudit, epsilon_lower_bound, p_value

pytest.importorskip("dp_accounting")

N, FEATURES = 512, 20
rng = np.random.default_rng(0)
X = rng.standard_normal((N, FEATURES)).astype("float32")
Y = (X[:, 0] + X[:, 1] > 0).astype("int32")


def test_p_value_is_the_binomial_tail_without_delta():
    for epsilon in (0.0, 0.5, 2.0):
        rate = math.exp(epsilon) / (1 + math.exp(epsilon))
        assert p_value(1000, 200, 150, epsilon, 0.0) == pytest.approx(
            stats.binom.sf(149, 200, rate)
        )
    assert p_value(1000, 200, 150, 1.0, 1e-5) > p_value(1000, 200, 150, 1.0, 0.0)


def test_all_guesses_right_give_the_bound_of_a_binomial_of_rate_one():
    """r right guesses of r rule out every eps whose rate p has p^r < 0.05:
    the bound is logit(0.05^(1/r))."""
    for guesses in (20, 200):
        expected = math.log(0.05 ** (1 / guesses) / (1 - 0.05 ** (1 / guesses)))
        got = epsilon_lower_bound(1000, guesses, guesses, 0.0, confidence=0.95)
        assert got == pytest.approx(expected, abs=1e-6)
    assert epsilon_lower_bound(1000, 200, 100, 0.0) == 0.0  # chance: nothing


def audited(switched_off=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(256, activation="tanh"),
                              keras.layers.Dense(2)])  # fmt: skip
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.5), loss)
    make_private(model, epsilon=1.0, delta=1e-5, l2_norm_clip=1.0, batch_size=64,
                 epochs=4, train_size=N, verbose=False, seed=2)  # fmt: skip
    dpsgd = model.privacy.dpsgd
    if switched_off == "noise":  # a bug: no noise added, sigma still claimed
        dpsgd.switch_noise_off_unaccounted()
    if switched_off == "clipping":  # a bug: every weight 1, noise sigma * C

        def unclipped(norms, valid):
            kept = tf.zeros(tf.shape(valid), bool)
            return tf.ones_like(norms) * valid[:, None], kept

        dpsgd.clip.weights = unclipped
    audit = CanaryAudit(model, X, Y, canaries=1000, seed=1)
    model.fit(X, Y, epochs=4, verbose=0, callbacks=[audit])
    return audit.result()


@pytest.mark.filterwarnings("ignore:seed=.*NOT private")
def test_a_correct_run_stays_at_or_below_its_claim():
    result = audited()
    assert result.claimed_epsilon <= 1.0 + 1e-9
    assert result.holds and result.epsilon_lower_bound < 0.5 * result.claimed_epsilon
    assert "at or below the claimed" in str(result)


@pytest.mark.filterwarnings("ignore:seed=.*NOT private")
@pytest.mark.parametrize("switched_off", ["noise", "clipping"])
def test_a_run_without_noise_or_clipping_exceeds_its_claim_clearly(switched_off):
    result = audited(switched_off)
    assert result.epsilon_lower_bound > 2 * result.claimed_epsilon, str(result)
    assert not result.holds and "ABOVE" in str(result)


def test_the_audit_needs_a_private_model_and_plain_sgd():
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(), "mse")
    with pytest.raises(ValueError, match="make_private"):
        CanaryAudit(model, X, Y)
    make_private(model, epsilon=1.0, delta=1e-5, l2_norm_clip=1.0, batch_size=64,
                 epochs=1, train_size=N, verbose=False)  # fmt: skip
    with pytest.raises(ValueError, match="plain SGD"):
        CanaryAudit(model, X, Y)
