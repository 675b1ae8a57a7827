"""make_private, then plain model.fit (issue 36): private training the Keras
way, checked against dp-accounting called directly, Keras's own fit and a tape
per sample."""

import math

import numpy as np
import pytest

from jacutil import keras, tf
from jacutil.privacy import make_private, noise_multiplier_for, per_sample_loss

dp_accounting = pytest.importorskip("dp_accounting")
pytestmark = pytest.mark.filterwarnings("ignore:seed=.*NOT private")

N, FEATURES, CLASSES, BATCH = 200, 6, 3, 20


def data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")
    return x, y


def compiled(learning_rate=0.5, hidden=None):
    keras.utils.set_random_seed(0)
    hidden = hidden or [keras.layers.Dense(8, activation="tanh")]
    model = keras.Sequential([keras.Input((FEATURES,)), *hidden,
                              keras.layers.Dense(CLASSES)])  # fmt: skip
    model.compile(
        keras.optimizers.SGD(learning_rate),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def private(model, **options):
    # seeded: these tests repeat their sampling (and say it is not private)
    settings = dict(epsilon=4.0, delta=1e-4, l2_norm_clip=1.0, batch_size=BATCH,
                    epochs=3, train_size=N, verbose=False, seed=0)  # fmt: skip
    made = make_private(model, **{**settings, **options})
    assert made is model  # the model back, as Keras users expect
    return model.privacy


def direct_epsilon(sigma, rate, steps, delta, accountant):
    """epsilon by dp-accounting itself, not through jacutil."""
    event = dp_accounting.PoissonSampledDpEvent(
        rate, dp_accounting.GaussianDpEvent(sigma)
    )
    if accountant == "pld":
        ledger = dp_accounting.pld.PLDAccountant()
    else:
        ledger = dp_accounting.rdp.RdpAccountant()
    return ledger.compose(dp_accounting.SelfComposedDpEvent(event, steps)).get_epsilon(
        delta
    )


def test_pld_epsilon_equals_the_accountant_with_each_step_built_once():
    """epsilon_of composes the PLD accountant's own distributions, each
    sampled step's built once per (sigma, q) and composed for every count:
    the same floats as the accountant given dp_event's events, for one rate
    and for two, asked again or for other counts."""
    from jacutil.privacy import accounting as dp_sgd

    dp_sgd.sampled_gaussian_pld.cache_clear()
    for sigma, steps_at in [(1.1, {0.05: 20}), (1.1, {0.05: 45}),
                            (1.1, {0.05: 20}), (0.8, {0.02: 7, 0.05: 12})]:  # fmt: skip
        ledger = dp_accounting.pld.PLDAccountant()
        ledger.compose(dp_sgd.dp_event(sigma, steps_at))
        assert dp_sgd.epsilon_of(sigma, steps_at, 1e-5, "pld") == ledger.get_epsilon(
            1e-5
        )
    built = dp_sgd.sampled_gaussian_pld.cache_info()
    # built: (1.1, .05) once for three calls, (.8, .02) and (.8, .05)
    assert (built.misses, built.hits) == (3, 2)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_sigma_is_the_smallest_that_keeps_epsilon_under_the_target(accountant):
    rate, steps, delta = 0.05, 60, 1e-5
    sigma = noise_multiplier_for(2.0, delta, rate, steps, accountant)
    assert direct_epsilon(sigma, rate, steps, delta, accountant) <= 2.0
    assert direct_epsilon(sigma * 0.99, rate, steps, delta, accountant) > 2.0


def test_a_coarse_search_the_accountant_refuses_is_searched_again(monkeypatch):
    """PLD's search runs on a coarser grid, then the accountant checks its
    sigma; where it would not keep epsilon under the target, the search runs
    again on the accountant's own grid, and the sigma is still the smallest."""
    from jacutil.privacy import accounting

    rate, steps, delta = 0.05, 60, 1e-5
    checks, epsilon_of = [], accounting.epsilon_of

    def refusing(sigma, steps_at, *args):  # the check of sigma says "over"
        # the planned steps come as {(sigma, rate): steps}
        (found, at), count = next(iter(steps_at.items()), ((None, None), 0))
        if sigma is not None or at != rate or count != steps:
            return epsilon_of(sigma, steps_at, *args)
        checks.append(found)
        return np.inf

    fine, new_accountant = [], accounting.new_accountant

    def counted(name):  # the accountant's own grid
        fine.append(name)
        return new_accountant(name)

    monkeypatch.setattr(accounting, "epsilon_of", refusing)
    monkeypatch.setattr(accounting, "new_accountant", counted)
    sigma = noise_multiplier_for(2.0, delta, rate, steps)
    assert len(checks) == 1 and fine  # searched again, on the fine grid
    assert direct_epsilon(sigma, rate, steps, delta, "pld") <= 2.0
    assert direct_epsilon(sigma * 0.99, rate, steps, delta, "pld") > 2.0


def test_fit_trains_privately_with_callbacks_and_validation_data(tmp_path):
    x, y = data()
    xv, yv = data(100, seed=1)
    model = compiled()
    training = private(model)
    seen = []

    class Seen(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(dict(logs))

    checkpoint = tmp_path / "best.keras"
    history = model.fit(
        x, y, epochs=3, validation_data=(xv, yv), verbose=0,
        callbacks=[Seen(), keras.callbacks.ModelCheckpoint(checkpoint)],
    )  # fmt: skip
    assert set(history.history) == {"loss", "accuracy", "epsilon", "val_loss",
                                    "val_accuracy"}  # fmt: skip
    assert len(seen) == 3 and all("val_accuracy" in logs for logs in seen)
    assert checkpoint.exists()
    steps = 3 * round(N / BATCH)
    assert training.steps == steps
    spent = history.history["epsilon"]
    assert spent == sorted(spent) and 0 < spent[0] < spent[-1]
    direct = direct_epsilon(training.noise_multiplier, BATCH / N, steps, 1e-4, "pld")
    assert spent[-1] == pytest.approx(direct, rel=1e-9) and direct <= 4.0
    # the compiled metrics are Keras's own, on the sampled rows
    assert 0 <= history.history["accuracy"][-1] <= 1
    assert history.history["val_loss"][-1] < history.history["val_loss"][0]


def test_validation_runs_in_batches_of_the_calibrated_size_or_the_one_given():
    """Keras evaluates validation_data at fit's batch size unless told; the
    private fit runs Keras's loop one token a step (batch size 1), so without
    this the 100 validation rows took 100 evaluation steps an epoch."""
    x, y = data()
    xv, yv = data(100, seed=1)
    class Counted(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_test_batch_end(self, batch, logs=None):
            self.seen.append(batch)

    for given, batches in [(None, math.ceil(100 / BATCH)), (50, 2)]:
        model = compiled()
        private(model, epochs=1, accountant="rdp")  # not what is tested here
        counted = Counted()
        model.fit(x, y, epochs=1, validation_data=(xv, yv), verbose=0,
                  validation_batch_size=given, callbacks=[counted])  # fmt: skip
        assert len(counted.seen) == batches, (given, counted.seen)


def test_epsilon_per_epoch_is_accounted_before_training_not_in_it(monkeypatch):
    """fit's logs show epsilon after each epoch without asking the accountant
    during the fit; each is what dp-accounting gives for that many steps;
    asked mid-epoch, the accountant answers (it is not in the table)."""
    from jacutil.privacy import keras_fit

    x, y = data()
    model = compiled()
    training = private(model, epochs=2)
    asked = []
    real = keras_fit.epsilon_of
    monkeypatch.setattr(keras_fit, "epsilon_of", lambda *a: asked.append(a) or real(*a))
    history = model.fit(x, y, epochs=2, verbose=0)
    assert asked == []
    per_epoch = round(N / BATCH)
    for epoch, spent in enumerate(history.history["epsilon"], 1):
        direct = direct_epsilon(
            training.noise_multiplier, BATCH / N, epoch * per_epoch, 1e-4, "pld"
        )
        assert spent == pytest.approx(direct, rel=1e-9)
    training.dpsgd.sampled_step(x, y, BATCH)  # one step past the table
    assert training.epsilon() > history.history["epsilon"][-1] and len(asked) == 1


def test_the_loss_in_the_logs_is_the_mean_of_the_sampled_rows():
    x, y = data()
    model = compiled(learning_rate=0.0)  # the model stays: every step sees it
    training = private(model, epochs=1)
    loss_fn = per_sample_loss(model.loss)
    history = model.fit(x, y, epochs=1, verbose=0)
    # at learning rate 0 each batch's losses come from the same model, so the
    # epoch's mean loss is the mean over all sampled rows of that model's losses
    losses = loss_fn(y, model(x)).numpy()
    assert training.steps == N // BATCH
    assert history.history["loss"][0] == pytest.approx(losses.mean(), rel=0.25)


def test_a_second_fit_on_new_arrays_takes_no_new_trace():
    """Each model.fit call converts x and y again, so the step sees new
    tensors: the compiled step takes them as arguments, and a Poisson batch
    larger than the padded size runs in passes of that size, so no later fit
    traces again (the first fit traces twice, as the compiled metrics build
    their variables), and the step trains on the new values."""
    x, y = data()
    model = compiled()
    training = private(model, epochs=3)
    dpsgd, sizes = training.dpsgd, []
    sampled_step = dpsgd.sampled_step

    def counted(*args, **options):
        found = sampled_step(*args, **options)
        sizes.append(len(dpsgd.last_index))
        return found

    dpsgd.sampled_step = counted
    model.fit(x, y, epochs=1, verbose=0)
    traces, seen = dpsgd.trace_count, set(sizes)
    model.fit(x.copy(), y.copy(), epochs=1, verbose=0)
    x_test, y_test = data(seed=1)
    before = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    x_new, y_new = data(seed=2)
    model.fit(x_new, y_new, epochs=1, verbose=0)
    assert dpsgd.trace_count == traces
    assert set(sizes) - seen  # a larger batch came, and traced nothing
    np.testing.assert_array_equal(dpsgd._fused[3], x_new)
    after = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    assert after["loss"] != before["loss"]


def test_the_clip_invariant_holds_inside_fit():
    """Each step's weights are min(1, C / |g_i|) of a tape per sample, so
    every sample's contribution has norm at most C."""
    x, y = data()
    model = compiled(learning_rate=0.0)
    training = private(model, l2_norm_clip=0.05, epochs=1)
    steps = []

    class Weights(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            dp = training.dpsgd
            steps.append((dp.last_index.copy(), dp.last_weights.copy()))

    model.fit(x, y, epochs=1, verbose=0, callbacks=[Weights()])
    assert len(steps) == training.steps == N // BATCH
    loss_fn = per_sample_loss(model.loss)
    clipped = 0
    for index, weights in steps:
        assert len(index) == len(weights)
        for i, w in zip(index, weights, strict=True):
            if w == 0:  # padding (a kept row's sample, weight 0)
                continue
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(y[i : i + 1], model(x[i : i + 1])))
            grads = tape.gradient(loss, model.trainable_variables)
            norm = float(tf.linalg.global_norm(grads))
            assert w == pytest.approx(min(1.0, 0.05 / norm), rel=1e-4)
            assert w * norm <= 0.05 * (1 + 1e-5)
            clipped += norm > 0.05
    assert clipped > 0  # the bound was tested where it binds


def test_per_layer_clipping_and_accumulation_inside_fit(capsys):
    """make_private with a clip norm per layer and passes of at most 8 rows:
    fit's steps equal those of one pass (the same seed); at learning rate 0,
    each group's weight is min(1, C_g / |g_ig|) of a tape per sample, so its
    clipped contribution is at most C_g; the printed line names the groups."""
    x, y = data()
    clips = {"hidden": 0.05, "head": 0.1}
    runs = []
    for rows, learning_rate in ((None, 0.5), (8, 0.5), (8, 0.0)):
        keras.utils.set_random_seed(0)  # the layer draws its seed when made
        hidden = [keras.layers.Dense(8, activation="tanh", name="hidden")]
        model = compiled(learning_rate, hidden=hidden)
        model.layers[-1].name = "head"
        training = private(model, l2_norm_clip=clips, epochs=1, verbose=True,
                           max_physical_batch_size=rows, seed=4)  # fmt: skip
        assert training.dpsgd.l2_norm_clip == pytest.approx((0.05**2 + 0.1**2) ** 0.5)
        model.fit(x, y, epochs=1, verbose=0)
        dp = training.dpsgd
        runs.append((model, dp.last_index, dp.last_weights))
    assert "per-layer clip norms hidden: 0.05, head: 0.1" in capsys.readouterr().out
    (model, index, weights), (model_acc, index_acc, weights_acc) = runs[:2]
    assert weights.shape[1] == 2 and len(index_acc) % 8 == 0 and len(index_acc) > 8
    valid = int((weights > 0).any(axis=1).sum())
    np.testing.assert_array_equal(index[:valid], index_acc[:valid])
    np.testing.assert_allclose(weights_acc[:valid], weights[:valid], rtol=1e-5)
    for a, b in zip(model_acc.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    model, index, weights = runs[2]  # learning rate 0: the model did not move
    loss_fn = per_sample_loss(model.loss)
    groups = [model.get_layer(name).trainable_variables for name in clips]
    clipped = 0
    for i, w in zip(index, weights, strict=True):
        if not w.any():  # padding
            continue
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(loss_fn(y[i : i + 1], model(x[i : i + 1])))
        for group, clip, w_g in zip(groups, clips.values(), w, strict=True):
            norm = float(tf.linalg.global_norm(tape.gradient(loss, group)))
            assert w_g == pytest.approx(min(1.0, clip / norm), rel=1e-4)
            assert w_g * norm <= clip * (1 + 1e-5)
            clipped += norm > clip
    assert clipped > 0  # the bound was tested where it binds


@pytest.mark.parametrize(
    "loss",
    [
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "sparse_categorical_crossentropy",
        keras.losses.sparse_categorical_crossentropy,
    ],
    ids=["object", "name", "function"],
)
def test_per_sample_loss_is_keras_unreduced(loss):
    y = np.array([0, 2, 1])
    p = np.array([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8], [0.6, 0.3, 0.1]], "float32")
    from_logits = isinstance(loss, keras.losses.Loss)
    expected = keras.losses.sparse_categorical_crossentropy(
        y, p, from_logits=from_logits
    )
    np.testing.assert_allclose(per_sample_loss(loss)(y, p), expected, rtol=1e-6)


def test_a_saved_private_model_loads_with_its_weights(tmp_path):
    x, y = data()
    model = compiled()
    private(model)
    model.fit(x, y, epochs=1, verbose=0)
    path = tmp_path / "private.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  model.predict(x, verbose=0))  # fmt: skip
    assert "fit" not in vars(loaded)  # a plain model: make_private again to go on


def test_early_stopping_ends_the_fit_and_the_budget_counts_what_ran():
    x, y = data()
    model = compiled(learning_rate=0.0)
    training = private(model)
    stop = keras.callbacks.EarlyStopping("loss", patience=0, min_delta=10.0)
    history = model.fit(x, y, epochs=3, verbose=0, callbacks=[stop])
    assert len(history.history["loss"]) == 2
    assert training.steps == 2 * round(N / BATCH)
    model.fit(x, y, epochs=1, verbose=0)  # the last budgeted epoch
    with pytest.raises(ValueError, match="at most 0 more epoch"):
        model.fit(x, y, epochs=1, verbose=0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, x, y: m.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(20)),
         "needs all train_size=200 samples as arrays"),
        (lambda m, x, y: m.fit(x[:100], y[:100]), "train_size=200"),
        (lambda m, x, y: m.fit(x, y, batch_size=50), "batch_size=20"),
        (lambda m, x, y: m.fit(x, y, epochs=4), "more than the 30 steps"),
        (lambda m, x, y: m.fit(x, y, sample_weight=np.ones(N)), "sample_weight"),
        (lambda m, x, y: m.fit(x, y, class_weight={0: 2.0}), "class_weight"),
        (lambda m, x, y: m.fit(x, y, validation_split=0.2), "validation_data"),
        (lambda m, x, y: m.fit(x, y, steps_per_epoch=3), "steps_per_epoch"),
        (lambda m, x, y: m.fit(x), "needs y"),
    ],
    ids=["dataset", "size", "batch_size", "epochs", "sample_weight",
         "class_weight", "validation_split", "steps_per_epoch", "no_y"],
)  # fmt: skip
def test_fit_refuses_what_breaks_the_accounting_before_a_step(call, message):
    x, y = data()
    model = compiled()
    training = private(model)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=message):
        call(model, x, y)
    assert training.steps == 0
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_train_on_batch_is_refused():
    x, y = data()
    model = compiled()
    training = private(model)
    with pytest.raises(TypeError, match="trains only through model.fit"):
        model.train_on_batch(x[:20], y[:20])
    assert training.steps == 0




def test_batch_norm_is_refused_with_what_to_use_instead():
    model = compiled(hidden=(keras.layers.Dense(8), keras.layers.BatchNormalization()))
    with pytest.raises(ValueError, match="LayerNormalization or GroupNormalization"):
        private(model)
    model.layers[1].trainable = False  # frozen: statistics from public data
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    private(model)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"delta": 0.01}, "1 / train_size"),
        ({"epsilon": 0.0}, "must be > 0"),
        ({"batch_size": 500}, "batch_size <= 200"),
        ({"epochs": 0}, "epochs is 0"),
        ({"accountant": "moments"}, "accountant is 'moments'"),
    ],
)
def test_make_private_refuses_a_bad_configuration(options, message):
    with pytest.raises(ValueError, match=message):
        private(compiled(), **options)


def test_an_uncompiled_model_is_refused():
    # an activity regularizer is no longer refused: it is clipped with each
    # sample's loss (tests/test_private_keras.py)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="not compiled"):
        private(model)


def test_calibration_is_printed_once(capsys):
    private(compiled(), verbose=True)
    printed = capsys.readouterr().out
    assert printed.count("make_private: noise multiplier") == 1
    assert "epsilon <= 4 at delta = 0.0001" in printed


def test_the_bench_rows_time_both_fits_and_the_accountant(monkeypatch, capsys):
    from jacutil.bench import privacy_rows

    name, build, make_data, _, rate = privacy_rows.MODELS["classifier"]
    monkeypatch.setitem(privacy_rows.MODELS, "classifier",
                        (name, build, make_data, 1024, rate))  # fmt: skip
    (row,) = privacy_rows.main(["--models", "classifier", "--epochs", "2"])
    assert row["plain_s"] > 0 and row["private_s"] > row["accounting_s"] > 0
    assert row["ratio"] == pytest.approx(row["private_s"] / row["plain_s"])
    assert 0 <= row["private_accuracy"] <= 1
    assert "| notebook 09's classifier | 1,024 |" in capsys.readouterr().out
