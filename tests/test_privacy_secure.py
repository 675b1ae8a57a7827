"""make_private(secure_mode=True): the sampling and the noise from os.urandom."""

import numpy as np
import pytest
from scipy import stats

from jacutil import keras, tf
from jacutil.privacy import make_private
from jacutil.privacy.noise import SecureRandom


def test_secure_noise_is_standard_normal_and_uniforms_are_uniform():
    draws = SecureRandom().standard_normal(200_000)
    assert abs(draws.mean()) < 5 / np.sqrt(draws.size)
    assert abs(draws.var() - 1.0) < 5 * np.sqrt(2 / draws.size)
    assert stats.kstest(draws, "norm").pvalue > 1e-4
    uniforms = SecureRandom().random(100_000)
    assert uniforms.min() >= 0.0 and uniforms.max() < 1.0
    assert stats.kstest(uniforms, "uniform").pvalue > 1e-4


def test_a_wrong_distribution_fails_the_ks_test():  # the check above can fail
    draws = SecureRandom().standard_normal(200_000) * 1.05
    assert stats.kstest(draws, "norm").pvalue < 1e-4


def test_secure_noise_in_a_graph_has_its_shape_and_does_not_repeat():
    source = SecureRandom()
    normal = tf.function(lambda: source.normal((3, 4), dtype=tf.float64))
    first, second = normal().numpy(), normal().numpy()
    assert first.shape == (3, 4) and first.dtype == np.float64
    assert not np.array_equal(first, second)


def secure_model(n=64):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = np.random.default_rng(0).normal(size=(n, 3)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    return model, x, y


def private_weights_after_fit(**options):
    model, x, y = secure_model()
    make_private(
        model, epsilon=2.0, delta=1e-5, l2_norm_clip=1.0, batch_size=16,
        epochs=1, train_size=len(x), verbose=False, **options,
    )  # fmt: skip
    model.fit(x, y, epochs=1, verbose=0)
    return [w.numpy() for w in model.trainable_variables]


def test_secure_fit_runs_and_two_runs_differ_where_seeded_runs_repeat():
    first = private_weights_after_fit(secure_mode=True)
    second = private_weights_after_fit(secure_mode=True)
    assert all(np.all(np.isfinite(w)) for w in first)
    assert not np.array_equal(first[0], second[0])
    seeded = [private_weights_after_fit(seed=3) for _ in range(2)]
    np.testing.assert_array_equal(seeded[0][0], seeded[1][0])


def test_a_seed_is_refused_with_secure_mode():
    model, x, _ = secure_model()
    with pytest.raises(ValueError, match="leave seed out"):
        make_private(
            model, epsilon=2.0, delta=1e-5, l2_norm_clip=1.0, batch_size=16,
            epochs=1, train_size=len(x), verbose=False, secure_mode=True, seed=0,
        )  # fmt: skip
