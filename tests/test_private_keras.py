"""make_private at the seams with Keras (issue 54): each sample's gradient
of Keras's own loss is clipped - every output, loss_weights, add_loss,
regularizers, a recompile, mixed precision's loss scale - the noise is
fresh by default, the privacy ledger lives with the model, and make_private
returns the model.

The reference throughout is Keras's own step: with no noise, a clip norm
no gradient reaches and every sample in the batch (rate 1), a private step
is ``sum_i g_i / B`` - what ``model.train_on_batch`` takes on a copy of the
model - so any term of Keras's loss that the private step dropped or
mis-weighted shows as a difference.
"""

import math

import numpy as np
import pytest

from jacutil import keras, tf
from jacutil.privacy import load_model, make_private
from jacutil.privacy.keras_loss import KerasLoss, LossCouplesSamples

dp_accounting = pytest.importorskip("dp_accounting")
pytestmark = pytest.mark.filterwarnings("ignore:seed=.*NOT private")

N, FEATURES = 24, 4
rng = np.random.default_rng(0)
X = rng.standard_normal((N, FEATURES)).astype("float32")
LABELS = (X[:, 0] > 0).astype("int32") + (X[:, 1] > 0.5).astype("int32")
VALUES = rng.standard_normal((N, 2)).astype("float32")


def flat(model):
    return np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])


class Activity(keras.layers.Layer):
    """A layer whose loss depends on each sample: what DP-SGD must clip."""

    def call(self, h):
        self.add_loss(0.3 * tf.reduce_mean(tf.square(h)))
        return h


def two_heads(outputs="list", loss_weights=None, extra=(), regularizer=None):
    """A trunk and two heads: classes (logits) and values."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(6, activation="tanh", kernel_regularizer=regularizer)(
        inputs
    )
    for layer in extra:
        h = layer(h)
    a = keras.layers.Dense(3, name="a")(h)
    b = keras.layers.Dense(2, name="b")(h)
    heads = {"a": a, "b": b} if outputs == "dict" else [a, b]
    if outputs == "tuple":
        heads = (a, b)
    return keras.Model(inputs, heads)


def targets(outputs):
    if outputs == "dict":
        return {"a": LABELS, "b": VALUES}
    return (LABELS, VALUES) if outputs == "tuple" else [LABELS, VALUES]


def losses(outputs):
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if outputs == "dict":
        return {"a": ce, "b": "mse"}
    return [ce, "mse"]


def keras_step_and_private_step(build, compile_options, y, x=X, general=False):
    """The weights' change by Keras's own step and by one private step with
    no noise, no clipping and every sample drawn, from the same weights."""
    own = build()
    own.compile(keras.optimizers.SGD(0.1), **compile_options)
    start = own.get_weights()
    own.train_on_batch(x, y)
    keras_move = flat(own)
    private = build()
    private.set_weights(start)
    private.compile(keras.optimizers.SGD(0.1), **compile_options)
    before = flat(private)
    make_private(private, epsilon=8.0, delta=1e-3, l2_norm_clip=1e6,
                 batch_size=len(x), epochs=1, train_size=len(x),
                 verbose=False)  # fmt: skip
    training = private.privacy
    training.dpsgd.noise_multiplier = 0.0  # before the first step traces
    if general:
        training.dpsgd.loss_fn.general = training.dpsgd.loss_fn.reads_forward = True
    private.fit(x, y, verbose=0)
    assert training.steps == 1 and len(training.dpsgd.last_index) >= len(x)
    return keras_move - start_flat(start), flat(private) - before, training


def start_flat(weights_list):
    return np.concatenate([np.ravel(w) for w in weights_list])


def close(got, expected, rtol=2e-4):
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=rtol * scale)


# -- 2 and 4: every output, loss_weights, one loss over the structure ----------


@pytest.mark.parametrize("outputs", ["list", "tuple", "dict"])
def test_several_outputs_train_on_kerass_own_loss(outputs):
    """Issue 54, point 2: the two-head model crashed ("non-rectangular
    Python sequence"); its step is now Keras's, for y as a list, a tuple
    or a dict, on the fast path and on the general one."""
    y = targets(outputs)
    options = {"loss": losses(outputs)}
    build = lambda: two_heads(outputs)  # noqa: E731
    expected, got, training = keras_step_and_private_step(build, options, y)
    close(got, expected)
    _, general, _ = keras_step_and_private_step(build, options, y, general=True)
    close(general, expected)


def test_one_loss_over_every_head():
    """The fix make_private's old error message advised: one loss for both
    heads (Keras applies it to each)."""
    y = [VALUES[:, :1].repeat(3, 1), VALUES]
    expected, got, _ = keras_step_and_private_step(two_heads, {"loss": "mse"}, y)
    close(got, expected)


def test_loss_weights_are_honoured():
    """Point 4: loss_weights made no difference; each weighting now gives
    Keras's own step, and the two steps differ."""
    steps = []
    for weights in ([1.0, 0.1], [1.0, 10.0]):
        options = {"loss": losses("list"), "loss_weights": weights}
        y = targets("list")
        expected, got, _ = keras_step_and_private_step(two_heads, options, y)
        close(got, expected)
        _, general, _ = keras_step_and_private_step(two_heads, options, y,
                                                    general=True)  # fmt: skip
        close(general, expected)
        steps.append(got)
    assert np.abs(steps[0] - steps[1]).max() > 1e-3 * np.abs(steps[0]).max()


def test_a_recompile_with_the_same_optimizer_trains_on_the_new_loss():
    """Point 4: compiling again with the same optimizer object and another
    loss kept training on the old loss; the next fit follows the compile."""
    model = two_heads()
    optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer, losses("list"))
    make_private(model, epsilon=8.0, delta=1e-3, l2_norm_clip=1e6, batch_size=N,
                 epochs=2, train_size=N, verbose=False)  # fmt: skip
    model.privacy.dpsgd.noise_multiplier = 0.0
    model.fit(X, targets("list"), epochs=1, verbose=0)
    model.compile(optimizer, losses("list"), loss_weights=[0.0, 1.0])  # same optimizer
    own = two_heads()
    own.set_weights(model.get_weights())
    own.compile(keras.optimizers.SGD(0.1), losses("list"), loss_weights=[0.0, 1.0])
    own.train_on_batch(X, targets("list"))
    before = flat(model)
    model.privacy.dpsgd.noise_multiplier = 0.0  # the rebuilt step: still none
    model.fit(X, targets("list"), epochs=1, verbose=0)
    close(flat(model) - before, flat(own) - before)
    assert model.privacy.steps == 2  # the ledger carried on


# -- 5: what the step runs, or a refusal ----------------------------------------


def test_add_loss_and_regularizers_are_in_the_step():
    """Point 5: a layer's add_loss was ignored. A loss that depends on each
    sample is clipped with its sample's (the general path); a weight
    regularizer is added once, outside the clipping: Keras's own step."""
    build = lambda: two_heads(extra=[Activity()], regularizer="l2")  # noqa: E731
    options = {"loss": losses("list")}
    y = targets("list")
    expected, got, training = keras_step_and_private_step(build, options, y)
    assert training.loss.reads_forward  # found by the check, not declared
    close(got, expected)


def test_an_activity_regularizer_is_clipped_per_sample_not_refused():
    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(5, activation="tanh", activity_regularizer="l2"),
            keras.layers.Dense(3),
        ])  # fmt: skip

    options = {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    expected, got, _ = keras_step_and_private_step(build, options, LABELS)
    close(got, expected)


def test_a_model_with_its_own_train_step_is_refused():
    """Point 5: a model's own train_step was bypassed without a word."""

    class Own(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = Own(inputs, keras.layers.Dense(3)(inputs))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(ValueError, match="defines its own train_step"):
        make_private(model, epsilon=4.0, delta=1e-3, l2_norm_clip=1.0, batch_size=8,
                     epochs=1, train_size=N, verbose=False)  # fmt: skip


def test_a_model_with_its_own_compute_loss_is_clipped_on_it():
    """A model's own compute_loss (Keras's documented hook) is the loss each
    sample's gradient comes from: the step is Keras's own."""

    class Scaled(keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         training=True):  # fmt: skip
            loss = super().compute_loss(x, y, y_pred, sample_weight, training)
            return 3.0 * loss

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        return Scaled(inputs, keras.layers.Dense(2)(inputs))

    options = {"loss": "mse"}
    expected, got, training = keras_step_and_private_step(build, options, VALUES)
    assert training.loss.own_compute_loss
    close(got, expected)


def test_a_loss_that_couples_samples_is_refused_before_a_step():
    def centred(y, p):  # each sample's loss depends on the batch's mean
        return tf.square(p - tf.reduce_mean(p, axis=0) - y)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), centred)
    make_private(model, epsilon=4.0, delta=1e-3, l2_norm_clip=1.0, batch_size=8,
                 epochs=1, train_size=N, verbose=False)  # fmt: skip
    before = flat(model)
    with pytest.raises(LossCouplesSamples, match="couples the samples"):
        model.fit(X, VALUES, verbose=0)
    np.testing.assert_array_equal(flat(model), before)
    assert model.privacy.steps == 0


# -- 3: mixed precision ---------------------------------------------------------


def test_mixed_precision_steps_are_kerass_own_not_32768_times_smaller():
    """Point 3: under mixed_float16 Keras wraps the optimizer in a
    LossScaleOptimizer, which divides the gradients it gets by the loss
    scale: the private update now comes in that scale, so the step is
    Keras's own (to float16's precision)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:

        def build():
            keras.utils.set_random_seed(0)
            return keras.Sequential([
                keras.Input((FEATURES,)),
                keras.layers.Dense(6, activation="tanh"),
                keras.layers.Dense(3, dtype="float32"),
            ])  # fmt: skip

        options = {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
        expected, got, training = keras_step_and_private_step(build, options, LABELS)
        _, general, _ = keras_step_and_private_step(build, options, LABELS,
                                                    general=True)  # fmt: skip
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert type(training.dpsgd.optimizer).__name__ == "LossScaleOptimizer"
    close(got, expected, rtol=5e-3)
    close(general, expected, rtol=5e-3)


# -- 1: the noise is secret by default --------------------------------------------


def fitted_move(seed=None, secure_mode=False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    before = flat(model)
    make_private(model, epsilon=1.0, delta=1e-3, l2_norm_clip=0.1, batch_size=8,
                 epochs=1, train_size=N, verbose=False, seed=seed,
                 secure_mode=secure_mode)  # fmt: skip
    model.fit(X, VALUES[:, :1].repeat(3, 1), verbose=0)
    return flat(model) - before, model.privacy.dpsgd.last_index


def test_the_default_noise_and_sampling_are_fresh_each_run():
    """Point 1: seed=None meant seed 0, so two runs added the same noise
    (correlation 1.000) and drew the same batches."""
    (a, batch_a), (b, batch_b) = fitted_move(), fitted_move()
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.9
    assert not np.array_equal(batch_a, batch_b)  # other batches drawn
    seeded = [fitted_move(seed=3) for _ in range(2)]
    np.testing.assert_array_equal(seeded[0][0], seeded[1][0])  # a seed repeats


def test_a_seeded_run_says_it_is_not_private(capsys):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    make_private(model, epsilon=1.0, delta=1e-3, l2_norm_clip=0.1, batch_size=8,
                 epochs=1, train_size=N, seed=3)  # fmt: skip
    assert "NOT private against them" in capsys.readouterr().out
    with pytest.warns(UserWarning, match="NOT private"):
        make_private(model, epsilon=8.0, delta=1e-3, l2_norm_clip=0.1, batch_size=8,
                     epochs=1, train_size=N, seed=3, verbose=False)  # fmt: skip


# -- 6: the ledger lives with the model ----------------------------------------


def direct_epsilon(events, delta):
    """epsilon of {(sigma, rate): steps} by dp-accounting itself."""
    ledger = dp_accounting.pld.PLDAccountant()
    for (sigma, rate), count in events.items():
        step = dp_accounting.PoissonSampledDpEvent(
            rate, dp_accounting.GaussianDpEvent(sigma)
        )
        ledger.compose(dp_accounting.SelfComposedDpEvent(step, count))
    return ledger.get_epsilon(delta)


def small_private(epsilon, epochs=1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(3)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.1), loss)
    return make_private(model, epsilon=epsilon, delta=1e-3, l2_norm_clip=1.0,
                        batch_size=3, epochs=epochs, train_size=N,
                        verbose=False)  # fmt: skip


def test_a_second_make_private_composes_what_the_first_spent(tmp_path):
    """Point 6: after 8 + 8 steps a second make_private reported only its
    own 8; epsilon now composes both, as dp-accounting does, and a second
    make_private calibrates what is left of its target."""
    model = small_private(1.0)  # 8 steps an epoch
    model.fit(X, LABELS, verbose=0)
    first = dict(model.privacy.ledger.events)
    spent = model.privacy.epsilon()
    assert spent == pytest.approx(direct_epsilon(first, 1e-3), rel=1e-3)
    make_private(model, epsilon=1.5, delta=1e-3, l2_norm_clip=1.0, batch_size=3,
                 epochs=1, train_size=N, verbose=False)  # fmt: skip
    model.fit(X, LABELS, verbose=0)
    events = model.privacy.ledger.events
    assert sum(events.values()) == 16
    both = direct_epsilon(events, 1e-3)
    assert model.privacy.epsilon() == pytest.approx(both, rel=1e-3)
    assert spent < both <= 1.5 + 1e-9
    # saved and loaded with jacutil.privacy.load_model: the ledger too
    path = tmp_path / "private.keras"
    model.save(path)
    plain = keras.models.load_model(path)  # Keras alone: a plain model
    np.testing.assert_array_equal(plain.predict(X, verbose=0),
                                  model.predict(X, verbose=0))  # fmt: skip
    loaded = load_model(path)
    assert loaded._privacy_ledger.events == events
    with pytest.raises(ValueError, match="leaves nothing for more steps"):
        make_private(loaded, epsilon=1.2, delta=1e-3, l2_norm_clip=1.0,
                     batch_size=3, epochs=1, train_size=N, verbose=False)  # fmt: skip
    make_private(loaded, epsilon=2.0, delta=1e-3, l2_norm_clip=1.0, batch_size=3,
                 epochs=1, train_size=N, verbose=False)  # fmt: skip
    loaded.fit(X, LABELS, verbose=0)
    assert loaded.privacy.ledger.steps == 24
    assert loaded.privacy.epsilon() == pytest.approx(
        direct_epsilon(loaded.privacy.ledger.events, 1e-3), rel=1e-3
    )


def test_the_over_budget_message_never_advises_starting_again():
    model = small_private(1.0)
    model.fit(X, LABELS, verbose=0)
    with pytest.raises(ValueError) as refused:
        model.fit(X, LABELS, verbose=0)
    message = str(refused.value)
    assert "at most 0 more epoch" in message
    assert "stays in the model's ledger" in message
    assert "with more epochs" not in message


def test_load_weights_into_a_private_model_reads_its_ledger(tmp_path):
    model = small_private(1.0)
    model.fit(X, LABELS, verbose=0)
    model.save_weights(tmp_path / "private.weights.h5")
    again = small_private(4.0)
    again.load_weights(tmp_path / "private.weights.h5")
    assert again.privacy.ledger.events == model.privacy.ledger.events


# -- 7: the model back ----------------------------------------------------------


def test_make_private_returns_the_model_with_its_handle(tmp_path):
    """Point 7: ``model = ju.make_private(model, ...)`` gave a
    PrivateTraining without save, predict or evaluate."""
    model = small_private(2.0)
    assert isinstance(model, keras.Model)
    model.fit(X, LABELS, verbose=0)
    assert model.privacy.steps == 8 and model.privacy.epsilon() > 0
    model.evaluate(X, LABELS, verbose=0)
    model.predict(X, verbose=0)
    model.save(tmp_path / "m.keras")


# -- what the logs say --------------------------------------------------------------


def test_no_skip_count_is_reported_and_the_logs_can_leave_training_out():
    """A sample whose gradient is not finite is a fact about that sample:
    the private fit reports no count; report_training=False keeps the logs
    to epsilon."""
    x = X.copy()
    x[3] = 1e30  # its loss overflows
    model = small_private(2.0)
    with warnings_as_errors():
        model.fit(x, LABELS, verbose=0)
    keras.utils.set_random_seed(0)
    quiet = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(3)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    quiet.compile(keras.optimizers.SGD(0.1), loss)
    make_private(quiet, epsilon=2.0, delta=1e-3, l2_norm_clip=1.0, batch_size=3,
                 epochs=1, train_size=N, verbose=False,
                 report_training=False)  # fmt: skip
    history = quiet.fit(X, LABELS, verbose=0)
    assert set(history.history) == {"epsilon"}


def warnings_as_errors():
    import warnings

    class Context:
        def __enter__(self):
            self.saved = warnings.catch_warnings()
            self.saved.__enter__()
            warnings.simplefilter("error", RuntimeWarning)

        def __exit__(self, *exc):
            self.saved.__exit__(*exc)

    return Context()


def test_keras_loss_per_sample_is_compute_loss_of_each_sample():
    """KerasLoss(model)(y, prediction) equals Keras's compute_loss on each
    sample alone, every head and weight included."""
    model = two_heads("dict")
    model.compile(keras.optimizers.SGD(0.1), losses("dict"),
                  loss_weights={"a": 2.0, "b": 0.5})  # fmt: skip
    loss = KerasLoss(model)
    y = targets("dict")
    loss.check(X, y)
    got = loss(y, model(X)).numpy()
    each = [
        float(model.compute_loss(X[i : i + 1], {k: v[i : i + 1] for k, v in y.items()},
                                 model(X[i : i + 1])))  # fmt: skip
        for i in range(N)
    ]
    np.testing.assert_allclose(got, each, rtol=1e-6)
    assert loss.aggregation == "mean" and not math.isnan(got.sum())


def test_each_outputs_loss_in_the_logs_is_the_sampled_rows_mean():
    """The logs' per-output losses are Keras's own trackers, updated on the
    sampled rows: at learning rate 0 their epoch means are each head's mean
    loss over the data (to sampling)."""
    model = two_heads()
    model.compile(keras.optimizers.SGD(0.0), losses("list"))
    make_private(model, epsilon=8.0, delta=1e-3, l2_norm_clip=1.0, batch_size=12,
                 epochs=4, train_size=N, verbose=False, seed=0)  # fmt: skip
    history = model.fit(X, targets("list"), epochs=4, verbose=0)
    a, b = model(X)
    ce = keras.losses.sparse_categorical_crossentropy(LABELS, a, from_logits=True)
    mse = keras.losses.mean_squared_error(VALUES, b)
    for name, values in (("a_loss", ce), ("b_loss", mse)):
        logged = np.mean(history.history[name])
        assert logged == pytest.approx(float(np.mean(values)), rel=0.25), name


def test_a_model_compiled_with_no_loss_but_its_own_add_loss_trains():
    """Keras lets a model's only loss be what its layers add (compile with
    no loss); make_private clips each sample's share of it."""

    class SquaredOutput(keras.layers.Layer):
        def call(self, h):
            self.add_loss(tf.reduce_mean(tf.square(h - 1.0)))
            return h

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        return keras.Model(inputs, SquaredOutput()(keras.layers.Dense(2)(inputs)))

    expected, got, training = keras_step_and_private_step(build, {}, VALUES)
    assert training.loss.compiled is None and training.loss.reads_forward
    close(got, expected)
