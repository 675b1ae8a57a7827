"""Every number private training reports is the one that ran (issue 63):
adaptive clipping's count as its accounting assumes, sigma that the step
reads and the ledger counts, History's epsilon from the ledger, a loaded
model's steps never forgotten, fit's checks paid once. Each test failed on
the code before the issue's fix."""

import math

import numpy as np
import pytest

from jacutil import keras
from jacutil.privacy import load_model, make_private
from jacutil.privacy.accounting import dp_accounting_module
from jacutil.privacy.adaptive_clip import AdaptiveClip
from jacutil.privacy.dp_sgd import DPSGD

dpa = dp_accounting_module()
N, FEATURES, DELTA = 256, 6, 1e-4
rng = np.random.default_rng(0)
X = rng.standard_normal((N, FEATURES)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def classifier(width=8):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(width, activation="tanh"),
                             keras.layers.Dense(2)])  # fmt: skip


def zero_loss(y, prediction):
    """No gradient: an update is the noise alone."""
    return 0.0 * keras.ops.sum(prediction, axis=-1)


def dp_accounting_epsilon(events, delta=DELTA):
    """dp-accounting's own PLD epsilon of ``{(sigma, rate): steps}``."""
    accountant = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    for (sigma, rate), steps in sorted(events.items()):
        step = dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(sigma))
        accountant.compose(dpa.SelfComposedDpEvent(step, steps))
    return accountant.get_epsilon(delta)


def flat(model):
    return np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])


# -- 1. adaptive clipping releases the centred count --------------------------


def test_the_released_count_is_centred_with_the_noise_the_accountant_assumes():
    """At B = 20 (count noise B / 20 = 1), the count recovered from the clip
    norms C moved to is sum_i (b_i - 1/2) plus N(0, sigma_b^2): sensitivity
    1/2, noise multiplier 2 sigma_b, what z_grad's formula pays for. The raw
    count of before (sensitivity 1) read as centred carries the batch
    size's Poisson spread besides: its noise came out about 2.3, not 1."""
    batch, quantile, eta = 20, 0.5, 0.2
    clip = AdaptiveClip(quantile, eta, count_noise=batch / 20)
    dp = DPSGD(classifier(), LOSS, keras.optimizers.SGD(0.0), l2_norm_clip=0.3,
               noise_multiplier=1.0, seed=0, adaptive_clip=clip)  # fmt: skip
    noise = []
    for _ in range(400):
        before = float(dp.clip.current())
        _, _, _, valid = dp.sampled_step(X, Y, batch)
        after = float(dp.clip.current())
        sampled = float(np.sum(valid))
        unclipped = float(np.sum(dp.last_weights[np.asarray(valid) > 0] == 1.0))
        fraction = quantile - math.log(after / before) / eta
        released = (fraction - 0.5) * batch  # what the step released
        noise.append(released - (unclipped - sampled / 2))
    noise = np.array(noise)
    assert abs(noise.mean()) < 4 / math.sqrt(len(noise))
    assert np.std(noise) == pytest.approx(clip.count_noise, rel=0.12)


def test_adaptive_epsilon_is_dp_accountings_for_the_noise_added():
    """make_private at B = 20 with adaptive clipping: the gradient's noise
    multiplier z_grad and the count's (2 sigma_b, sensitivity 1/2) compose,
    by Andrew et al.'s Theorem 1, to one Gaussian mechanism of multiplier
    z_eff; dp-accounting's epsilon for z_eff over the steps taken is the
    epsilon the model reports, within its target."""
    model = classifier()
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(True))  # fmt: skip
    make_private(model, epsilon=3.0, delta=DELTA, l2_norm_clip=1.0, batch_size=20,
                 epochs=1, train_size=N, target_quantile=0.5, seed=0,
                 verbose=False)  # fmt: skip
    model.fit(X, Y, epochs=1, verbose=0)
    training = model.privacy
    z_grad = training.dpsgd.gradient_noise_multiplier
    count_multiplier = 2 * training.dpsgd.adaptive_clip.count_noise
    z_eff = (z_grad**-2 + count_multiplier**-2) ** -0.5
    steps = training.ledger.steps
    assert steps == round(N / 20)
    found = dp_accounting_epsilon({(z_eff, 20 / N): steps})
    assert training.epsilon() == pytest.approx(found, rel=1e-3)
    assert training.epsilon() <= 3.0


# -- 2. sigma: read by the step, counted by the ledger -------------------------


def measured_noise(dp, steps, batch):
    """The standard deviation of each coordinate's update over ``steps``
    sampled steps of a zero loss with SGD(1.0): sigma C / B."""
    moves = []
    for _ in range(steps):
        before = flat(dp.model)
        dp.sampled_step(X, Y, batch)
        moves.append(flat(dp.model) - before)
    return float(np.std(np.concatenate(moves)))


def test_a_new_sigma_is_the_next_steps_and_the_ledger_counts_each():
    """Before: the compiled step kept the sigma of its first trace (0.5)
    while epsilon() composed every step at the new one (2.0): 0.99
    reported for 13.66 spent."""
    batch, rate = 32, 32 / N
    dp = DPSGD(classifier(width=64), zero_loss, keras.optimizers.SGD(1.0),
               l2_norm_clip=1.0, noise_multiplier=0.5, seed=0)  # fmt: skip
    low = measured_noise(dp, 10, batch)
    dp.noise_multiplier = 2.0
    high = measured_noise(dp, 10, batch)
    assert low == pytest.approx(0.5 / batch, rel=0.05)
    assert high == pytest.approx(2.0 / batch, rel=0.05)
    assert dp.ledger.events == {(0.5, rate): 10, (2.0, rate): 10}
    assert dp.steps == 20
    found = dp_accounting_epsilon({(0.5, rate): 10, (2.0, rate): 10}, 1e-5)
    assert dp.epsilon(1e-5, accountant="pld") == pytest.approx(found, rel=1e-9)


def test_a_noise_schedule_mid_fit_is_what_runs_and_what_is_accounted():
    """A callback raises sigma at the second epoch of make_private's fit:
    the updates' noise follows and epsilon (History's and the model's) is
    dp-accounting's over the two sigmas' steps."""
    model = classifier(width=64)
    model.compile(keras.optimizers.SGD(1.0), zero_loss)
    make_private(model, epsilon=3.0, delta=DELTA, l2_norm_clip=1.0, batch_size=32,
                 epochs=2, train_size=N, seed=0, verbose=False)  # fmt: skip
    training = model.privacy
    first = training.noise_multiplier
    moves = {0: [], 1: []}

    class Schedule(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            if epoch == 1:
                training.noise_multiplier = 3 * first

        def on_train_batch_begin(self, batch, logs=None):
            self.before = flat(model)

        def on_train_batch_end(self, batch, logs=None):
            moves[self.epoch].append(flat(model) - self.before)

    schedule = Schedule()
    history = model.fit(X, Y, epochs=2, verbose=0, callbacks=[schedule])
    steps = round(N / 32)
    for epoch, sigma in ((0, first), (1, 3 * first)):
        noise = float(np.std(np.concatenate(moves[epoch])))
        assert noise == pytest.approx(sigma / 32, rel=0.08)
    rate = 32 / N
    events = {(first, rate): steps, (3 * first, rate): steps}
    assert training.ledger.events == events
    found = dp_accounting_epsilon(events)
    assert training.epsilon() == pytest.approx(found, rel=1e-3)
    assert history.history["epsilon"][-1] == training.epsilon()


def test_the_configuration_is_frozen_but_for_sigma():
    dp = DPSGD(classifier(), LOSS, keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
               noise_multiplier=1.0, seed=0)  # fmt: skip
    for name in ("l2_norm_clip", "clip", "adaptive_clip", "max_physical_batch_size"):
        with pytest.raises(AttributeError, match="fixed when the DPSGD is built"):
            setattr(dp, name, 2.0)
    with pytest.raises(AttributeError, match="follows noise_multiplier"):
        dp.gradient_noise_multiplier = 0.0
    with pytest.raises(ValueError, match="finite number >= 0"):
        dp.noise_multiplier = -1.0
    assert dp.config.noise_multiplier == 1.0 and dp.l2_norm_clip == 1.0


# -- 3. report_training=False with metrics and validation ----------------------


def test_report_training_false_fits_with_metrics_and_validation_data():
    """Before: 'Cannot get result() since the metric has not yet been
    built', after the epoch's private steps were spent."""
    model = classifier()
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])  # fmt: skip
    make_private(model, epsilon=2.0, delta=DELTA, l2_norm_clip=1.0, batch_size=32,
                 epochs=2, train_size=N, seed=0, report_training=False,
                 verbose=False)  # fmt: skip
    history = model.fit(X, Y, epochs=2, validation_data=(X[:64], Y[:64]), verbose=0)
    assert set(history.history) == {"epsilon", "val_loss", "val_accuracy"}
    assert history.history["epsilon"][-1] == model.privacy.epsilon() > 0


# -- 4. History's epsilon when a callback stops training -----------------------


class StopAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.steps:
            self.model.stop_training = True


@pytest.mark.parametrize("stop_after", [3, 11])
def test_historys_epsilon_is_the_ledgers_when_training_stops_mid_epoch(stop_after):
    """Before: 0.0 after 3 steps (true 1.73), 2.479 after 11 (true 2.824)."""
    model = classifier()
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(True))  # fmt: skip
    make_private(model, epsilon=2.0, delta=DELTA, l2_norm_clip=1.0, batch_size=32,
                 epochs=2, train_size=N, seed=0, verbose=False)  # fmt: skip
    history = model.fit(X, Y, epochs=2, verbose=0, callbacks=[StopAfter(stop_after)])
    training = model.privacy
    assert training.ledger.steps == stop_after
    true = dp_accounting_epsilon({(training.noise_multiplier, 32 / N): stop_after})
    assert history.history["epsilon"][-1] == training.epsilon()
    assert training.epsilon() == pytest.approx(true, rel=1e-3)


# -- 5. a loaded model's steps are never forgotten -----------------------------


def test_make_private_refuses_a_model_whose_steps_no_ledger_records(tmp_path):
    """Before: keras.models.load_model then make_private started a new count
    though the optimizer had taken 16 steps."""

    def private_model():
        model = classifier()
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(True))  # fmt: skip
        return model

    model = private_model()
    options = dict(epsilon=2.0, delta=DELTA, l2_norm_clip=1.0, batch_size=32,
                   epochs=2, train_size=N, seed=0, verbose=False)  # fmt: skip
    make_private(model, **options)
    model.fit(X, Y, epochs=2, verbose=0)
    path = str(tmp_path / "private.keras")
    model.save(path)
    plain = keras.models.load_model(path)
    with pytest.raises(ValueError, match=r"jacutil\.privacy\.load_model"):
        make_private(plain, **options)
    make_private(plain, new_count=True, **options)  # said: a new count
    assert plain.privacy.ledger.steps == 0
    loaded = load_model(path)  # with its ledger: the count goes on
    make_private(loaded, **{**options, "epsilon": 4.0})
    assert loaded.privacy.ledger.steps == 16
    assert loaded.privacy.epsilon() == pytest.approx(model.privacy.epsilon())


# -- 7. fit's early checks once per data signature -----------------------------


def test_fits_early_checks_run_once_per_data_signature(monkeypatch):
    """Before: each fit call traced the norms on three samples again (0.24
    s a call: a fit per epoch paid it every epoch)."""
    model = classifier()
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(True))  # fmt: skip
    make_private(model, epsilon=2.0, delta=DELTA, l2_norm_clip=1.0, batch_size=32,
                 epochs=3, train_size=N, seed=0, verbose=False)  # fmt: skip
    dpsgd = model.privacy.dpsgd
    calls = []
    checked = dpsgd.clip_weights
    monkeypatch.setattr(dpsgd, "clip_weights",
                        lambda *a: calls.append(1) or checked(*a))  # fmt: skip
    for _ in range(3):
        model.fit(X, Y, epochs=1, verbose=0)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="rows"):  # the other checks still run
        model.fit(X[:10], Y[:10], epochs=1, verbose=0)
