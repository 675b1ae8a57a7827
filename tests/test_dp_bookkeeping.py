"""DP-SGD's book-keeping (issue 36): the fused step's clipped sum from the
norms' own pass (Dense's ``a.T @ (w * delta)``, a convolution's filter
gradient of ``w * delta``) equals the step with a second,
weighted backward pass, to 1e-12 in float64, and the per-sample tapes."""

import numpy as np
import pytest

from jacutil import keras, tf
from jacutil.privacy.dp_sgd import DPSGD

F64 = {"dtype": "float64"}


def mlp(seed=0, softmax=False, sequence=False, conv=False, norm=False, image=False):
    keras.utils.set_random_seed(seed)
    shape = (6, 6, 2) if image else (4, 5) if sequence else (5,)
    x = keras.Input(shape, dtype="float64")
    h = x
    if image:
        h = keras.layers.Conv2D(4, 3, strides=2, padding="same", groups=2,
                                activation="relu", **F64)(h)  # fmt: skip
        h = keras.layers.Conv2D(3, 2, dilation_rate=2, **F64)(h)
        h = keras.layers.Flatten(**F64)(h)
    h = keras.layers.Dense(7, activation="tanh", **F64)(h)
    if conv:
        h = keras.layers.Conv1D(2, 2, padding="causal", activation="tanh", **F64)(h)
    if norm:  # a layer without weighted sums: the second pass
        h = keras.layers.LayerNormalization(**F64)(h)
    if sequence:
        h = keras.layers.Flatten(**F64)(h)
    h = keras.layers.Dense(6, activation="relu", use_bias=False, **F64)(h)
    outputs = keras.layers.Dense(3, activation="softmax" if softmax else None, **F64)(h)
    return keras.Model(x, outputs)


def flat(model):
    return np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])


def tapes_clipped_mean(model, loss, x, y):
    """The float64 reference: one tape per sample, C the median of the finite
    norms, and the sum of the finite samples' gradients clipped to C over n;
    ``(expected update of SGD(1.0), kept, C)``."""
    grads = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(loss(y[i : i + 1], model(x[i : i + 1])))
        g = tape.gradient(value, model.trainable_variables)
        grads.append(np.concatenate([np.ravel(t.numpy()) for t in g]))
    grads = np.array(grads)
    norms = np.linalg.norm(grads, axis=1)
    kept = np.isfinite(norms)
    clip = float(np.median(norms[kept]))
    scale = np.minimum(1.0, clip / norms[kept])
    return (scale[:, None] * grads[kept]).sum(axis=0) / len(x), kept, clip


def cross_entropy(y, p):
    return keras.losses.sparse_categorical_crossentropy(y, p)


CASES = {
    "mse": (dict(), keras.losses.mean_squared_error),
    "softmax_logits": (dict(softmax=True), cross_entropy),
    "sequence": (dict(sequence=True), keras.losses.mean_squared_error),
    "conv1d": (dict(sequence=True, conv=True), keras.losses.mean_squared_error),
    "conv2d": (dict(image=True, softmax=True), cross_entropy),
    "layer_norm": (dict(norm=True), keras.losses.mean_squared_error),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [None, 9])
def test_bookkeeping_equals_the_second_pass(case, rows):
    options, loss = CASES[case]
    rng = np.random.default_rng(2)
    shape = (
        (6, 6, 2)
        if options.get("image")
        else (4, 5)
        if options.get("sequence")
        else (5,)
    )
    x = rng.normal(size=(80, *shape))
    y = rng.integers(0, 3, 80) if options.get("softmax") else rng.normal(size=(80, 3))
    runs = []
    for bookkeeping in (True, False):
        dp = DPSGD(mlp(**options), loss, keras.optimizers.SGD(0.2),
                   l2_norm_clip=0.3, noise_multiplier=0.6, seed=7,
                   max_physical_batch_size=rows)  # fmt: skip
        dp.bookkeeping = bookkeeping
        seen = []
        for _ in range(4):
            losses, _, _, valid = dp.sampled_step(x, y, 25)
            kept = np.asarray(valid) > 0
            seen.append((dp.last_index[kept], dp.last_weights[kept],
                         np.asarray(losses)[kept]))  # fmt: skip
        assert dp._fused[2] is not None  # the fused step ran
        assert dp.bookkept is (bookkeeping and not options.get("norm"))
        runs.append((flat(dp.model), seen))
    (theta, seen), (theta_two, seen_two) = runs
    for (i, w, loss_i), (i2, w2, loss2) in zip(seen, seen_two, strict=True):
        np.testing.assert_array_equal(i, i2)
        np.testing.assert_allclose(w, w2, rtol=1e-12)
        assert (w < 1).any()
        np.testing.assert_allclose(loss_i, loss2, rtol=1e-12)
    np.testing.assert_allclose(theta, theta_two, rtol=1e-11, atol=1e-13)


def test_bookkeeping_equals_the_tapes_and_skips_a_nan():
    """No noise, SGD(1.0), rate 1: the update is the mean of the clipped
    per-sample gradients of float64 tapes; a sample whose gradient is NaN
    weighs 0 and its NaN stays out of the sums."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(10, 5)), np.ones((10, 3))
    y[6] = 0.0

    def sqrt_loss(y, p):  # finite, but its gradient is NaN where y is 0
        return tf.reduce_sum(tf.sqrt(y * tf.square(p)), axis=-1)

    model = mlp()
    expected, kept, clip = tapes_clipped_mean(model, sqrt_loss, x, y)
    dp = DPSGD(model, sqrt_loss, keras.optimizers.SGD(1.0), l2_norm_clip=clip,
               noise_multiplier=0.0)  # fmt: skip
    before = flat(model)
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        dp.sampled_step(x, y, 10)
    # sample 6, and those whose output is exactly 0 (every ReLU unit off)
    assert dp.bookkept and not kept[6] and dp.skipped == (~kept).sum()
    np.testing.assert_array_equal(dp.last_weights[:10] == 0, ~kept)
    np.testing.assert_allclose(before - flat(model), expected, rtol=1e-10, atol=1e-13)


def test_bookkeeping_keeps_an_overflowing_sample_out():
    """A sample whose activations overflow (a NaN input is refused; inputs of
    +-1e308 are not): under a first kernel scaled by 100 its second
    convolution's input is inf, and its output, norm and gradient NaN. It
    weighs 0, and its activations and signal - zeroed by ``multiply_no_nan``,
    not multiplied by 0, which would give NaN - leave the book-kept sums
    equal to the float64 tapes' clipped mean of the other samples."""
    options, loss = CASES["conv2d"]
    rng = np.random.default_rng(5)
    x = rng.normal(size=(10, 6, 6, 2))
    x[4] = rng.choice([-1.0, 1.0], size=(6, 6, 2)) * 1e308
    y = rng.integers(0, 3, 10)
    model = mlp(seed=1, **options)
    kernel = model.layers[1].kernel
    kernel.assign(kernel * 100)
    expected, kept, clip = tapes_clipped_mean(model, loss, x, y)
    assert not kept[4] and kept.sum() == 9
    dp = DPSGD(model, loss, keras.optimizers.SGD(1.0), l2_norm_clip=clip,
               noise_multiplier=0.0)  # fmt: skip
    before = flat(model)
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        dp.sampled_step(x, y, 10)
    assert dp.bookkept and dp.skipped == 1
    np.testing.assert_array_equal(dp.last_weights[:10] == 0, ~kept)
    after = flat(model)
    assert np.isfinite(after).all()
    np.testing.assert_allclose(before - after, expected, rtol=1e-10, atol=1e-13)
