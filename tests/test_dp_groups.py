"""Per-layer clipping and gradient accumulation in DP-SGD (issue 36), against
per-sample float64 tapes and against the unaccumulated step."""

import math

import numpy as np
import pytest

from jacutil import keras, tf
from jacutil.privacy.dp_sgd import DPSGD

mse = keras.losses.mean_squared_error


def model_of(seed=0, conv=False):
    keras.utils.set_random_seed(seed)
    if conv:
        layers = [
            keras.Input((6, 6, 2), dtype="float64"),
            keras.layers.Conv2D(3, 3, activation="tanh", name="conv", dtype="float64"),
            keras.layers.Flatten(dtype="float64"),
            keras.layers.Dense(3, name="head", dtype="float64"),
        ]
    else:
        layers = [
            keras.Input((5,), dtype="float64"),
            keras.layers.Dense(6, activation="tanh", name="hidden", dtype="float64"),
            keras.layers.Dense(4, activation="tanh", name="middle", dtype="float64"),
            keras.layers.Dense(3, name="head", dtype="float64"),
        ]
    return keras.Sequential(layers)


def data_of(n, conv=False, seed=0):
    rng = np.random.default_rng(seed)
    shape = (n, 6, 6, 2) if conv else (n, 5)
    return rng.normal(size=shape), rng.normal(size=(n, 3))


def flat(model):
    return np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])


def tape_gradients(model, x, y):
    """Each sample's gradient, variable by variable, by its own float64 tape."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(mse(y[i : i + 1], model(x[i : i + 1])))
        rows.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
    return rows


def per_layer_clipped_mean(model, x, y, groups):
    """sum_i sum_g clip_g(g_ig) / n, flattened, with groups {layer: C_g}."""
    variables = model.trainable_variables
    owner = {}
    for g, name in enumerate(groups):
        for v in model.get_layer(name).trainable_variables:
            owner[id(v)] = g
    clips = list(groups.values())
    total = [np.zeros(v.shape) for v in variables]
    largest = 0.0
    for grads in tape_gradients(model, x, y):
        for g, clip in enumerate(clips):
            parts = [j for j, v in enumerate(variables) if owner[id(v)] == g]
            norm = math.sqrt(sum(np.sum(grads[j] ** 2) for j in parts))
            scale = min(1.0, clip / norm) if norm > 0 else 1.0
            largest = max(largest, scale * norm / clip)
            for j in parts:
                total[j] += scale * grads[j]
    return np.concatenate([np.ravel(t) for t in total]) / len(x), largest


@pytest.mark.parametrize("conv", [False, True], ids=["dense", "conv"])
@pytest.mark.parametrize("path", ["step", "fused"])
def test_per_layer_clipping_equals_the_tapes(conv, path):
    n = 12
    x, y = data_of(n, conv)
    model = model_of(conv=conv)
    reference = model_of(conv=conv)
    names = ["conv", "head"] if conv else ["hidden", "middle", "head"]
    grads = tape_gradients(reference, x, y)
    # C_g: below each group's median norm, so that every group clips some samples
    clips = {}
    for name in names:
        parts = [
            j
            for j, v in enumerate(reference.trainable_variables)
            if any(v is w for w in reference.get_layer(name).trainable_variables)
        ]
        norms = [math.sqrt(sum(np.sum(g[j] ** 2) for j in parts)) for g in grads]
        clips[name] = 0.8 * float(np.median(norms))
    expected, _ = per_layer_clipped_mean(reference, x, y, clips)
    dp = DPSGD(model, mse, keras.optimizers.SGD(1.0), l2_norm_clip=clips,
               noise_multiplier=0.0)  # fmt: skip
    assert dp.l2_norm_clip == pytest.approx(
        math.sqrt(sum(c * c for c in clips.values()))
    )
    before = flat(model)
    if path == "step":
        dp.step(x, y)
    else:
        dp.sampled_step(x, y, n)  # rate 1: every sample, in the fused graph
        assert dp._fused[2] is not None
        np.testing.assert_array_equal(dp.last_index[:n], np.arange(n))
    weights = dp.last_weights
    assert weights.shape[1] == len(names) and (weights[:n] < 1).any(axis=0).all()
    np.testing.assert_allclose(before - flat(model), expected, rtol=1e-10, atol=1e-13)
    assert dp.largest_clipped_norm(x, y) <= 1 + 1e-12


def test_per_layer_noise_has_the_total_clip_norm_as_scale():
    """The noise's standard deviation is sigma * sqrt(sum C_g^2): weights 0,
    so the update is the noise alone; its spread over ~1,000 coordinates."""
    keras.utils.set_random_seed(0)
    dense = {"dtype": "float64"}
    model = keras.Sequential([keras.Input((40,), dtype="float64"),
                              keras.layers.Dense(25, name="a", **dense),
                              keras.layers.Dense(3, name="b", **dense)])  # fmt: skip
    dp = DPSGD(model, mse, keras.optimizers.SGD(1.0), l2_norm_clip={"a": 3.0, "b": 4.0},
               noise_multiplier=2.0, seed=1)  # fmt: skip
    x, y = np.zeros((4, 40)), np.zeros((4, 3))
    before = flat(model)
    dp.clipped_noisy_update(x, y, tf.zeros([4, 2], tf.float64), 1.0)
    noise = flat(model) - before
    assert noise.size > 1000
    assert np.std(noise) == pytest.approx(2.0 * 5.0, rel=0.06)


def test_per_layer_clipping_refuses_what_it_cannot_account():
    model = model_of()
    sgd = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match=r"layers \['middle'\] in no group"):
        DPSGD(model, mse, sgd, l2_norm_clip={"hidden": 1.0, "head": 1.0},
              noise_multiplier=1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"'nope'.*not a layer.*\['head', 'hidden'"):
        DPSGD(model, mse, sgd, l2_norm_clip={"nope": 1.0}, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="in two groups"):
        DPSGD(model, mse, sgd, l2_norm_clip={("hidden", "middle"): 1.0,
                                             "middle": 1.0, "head": 1.0},
              noise_multiplier=1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"l2_norm_clip\['head'\].*> 0"):
        DPSGD(model, mse, sgd, l2_norm_clip={("hidden", "middle"): 1.0, "head": 0.0},
              noise_multiplier=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="empty dict"):
        DPSGD(model, mse, sgd, l2_norm_clip={}, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        DPSGD(model, mse, sgd, l2_norm_clip=1.0, noise_multiplier=1.0,
              max_physical_batch_size=0)  # fmt: skip


@pytest.mark.parametrize("clip", ["flat", "per_layer"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "through_numpy"])
def test_gradient_accumulation_equals_the_whole_batch(clip, fused):
    """The same Poisson batches, noise and seeds, in passes of at most 7
    rows: the same steps as the whole batch in one pass, to 1e-12 in
    float64."""
    x, y = data_of(90)
    l2 = 0.3 if clip == "flat" else {("hidden", "middle"): 0.2, "head": 0.25}
    runs = []
    for rows in (None, 7):
        dp = DPSGD(model_of(), mse, keras.optimizers.SGD(0.3), l2_norm_clip=l2,
                   noise_multiplier=0.8, seed=3,
                   max_physical_batch_size=rows)  # fmt: skip
        if not fused:
            as_tensors = dp._fused_step
            dp._fused_step = lambda x, y, f=as_tensors: (None, *f(x, y)[1:])
        seen = []
        for _ in range(4):
            losses, _, _, valid = dp.sampled_step(x, y, 30)
            seen.append((dp.last_index.copy(), dp.last_weights.copy(),
                         np.asarray(losses)[np.asarray(valid) > 0]))  # fmt: skip
        runs.append((flat(dp.model), seen, dp.steps_at))
    (theta, seen, steps), (theta_acc, seen_acc, steps_acc) = runs
    assert steps == steps_acc
    for (i, w, loss), (i_acc, w_acc, loss_acc) in zip(seen, seen_acc, strict=True):
        valid = len(loss)
        np.testing.assert_array_equal(i[:valid], i_acc[:valid])
        assert len(i_acc) % 7 == 0 and len(i_acc) > 7  # several passes
        np.testing.assert_allclose(w_acc[:valid], w[:valid], rtol=1e-12)
        np.testing.assert_allclose(loss_acc, loss, rtol=1e-12)
    np.testing.assert_allclose(theta_acc, theta, rtol=1e-12, atol=1e-14)


def test_gradient_accumulation_in_step_and_a_skipped_sample():
    """DPSGD.step in passes of 3 rows equals one pass; a sample whose
    gradient is NaN is skipped in whichever pass it falls."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(10, 5))

    def sqrt_loss(y, p):  # finite, but its gradient is NaN where y is 0
        return tf.reduce_sum(tf.sqrt(y * tf.square(p)), axis=-1)

    y = np.ones((10, 3))
    y[4] = 0.0
    runs = []
    for rows in (None, 3):
        dp = DPSGD(model_of(), sqrt_loss, keras.optimizers.SGD(0.1),
                   l2_norm_clip=0.5, noise_multiplier=0.5, seed=2,
                   max_physical_batch_size=rows)  # fmt: skip
        with pytest.warns(RuntimeWarning, match="non-finite gradient"):
            losses = dp.step(x, y)
        assert dp.skipped == 1 and dp.last_weights[4] == 0 and np.isnan(losses[4])
        runs.append(flat(dp.model))
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-12, atol=1e-14)
