"""Regressions of issue 34 (per-sample gradients, DP-SGD and argument checks),
each against a reference formed independently in float64: one tape per
sample, Keras's own gradient, a hand-written check.

Every test here failed on the main it was written against: the defect it
names is in its docstring.
"""

import warnings

import numpy as np
import pytest

from jacutil import (
    chunked_jacobian,
    jacobian_operator,
    jvp,
    keras,
    per_sample_gradient_norms,
    per_sample_gradients,
    tf,
)
from jacutil.matrix_free.products import products
from jacutil.privacy.clip_groups import clip_weights
from jacutil.privacy.dp_sgd import DPSGD

F64 = "float64"


def mlp(head, outputs, seed=0, **dense):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((3,), dtype=F64),
            keras.layers.Dense(4, activation="tanh", dtype=F64, **dense),
            keras.layers.Dense(outputs, activation=head, dtype=F64),
        ]
    )


def tape_per_sample(model, loss_fn, x, y):
    """(n, m): one tape per sample, the textbook reference."""
    rows = []
    for i in range(len(x)):
        yi = tf.nest.map_structure(lambda t, i=i: t[i : i + 1], y)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(yi, model(x[i : i + 1], training=False)))
        grads = tape.gradient(loss, model.trainable_variables)
        rows.append(np.concatenate([np.ravel(g) for g in grads]))
    return np.array(rows)


def confidence_penalty(y, p):
    """Cross-entropy (Keras reads the logits) plus an entropy term (reads p)."""
    entropy = tf.reduce_sum(p * tf.math.log(p + 1e-12), axis=-1)
    return keras.losses.sparse_categorical_crossentropy(y, p) + 0.3 * entropy


IDS = ["focal", "penalty"]
X = np.random.default_rng(0).normal(size=(6, 3))
BOTH_PATHS = [
    ("sigmoid", 2, keras.losses.binary_focal_crossentropy,
     np.random.default_rng(1).integers(0, 2, (6, 2)).astype(F64)),
    ("softmax", 3, confidence_penalty, np.array([0, 1, 2, 0, 1, 2])),
]  # fmt: skip


@pytest.mark.parametrize("head, outputs, loss_fn, y", BOTH_PATHS, ids=IDS)
def test_loss_reading_probabilities_and_logits(head, outputs, loss_fn, y):
    """Item 1: the layer rules kept dL/dp and dropped the path through the
    logits that Keras's cross-entropy reads: 56 % and 96 % off."""
    model = mlp(head, outputs)
    reference = tape_per_sample(model, loss_fn, X, y)
    G, choice = per_sample_gradients(model, loss_fn, X, y, explain=True)
    assert choice.path == "layer rules"
    np.testing.assert_allclose(G, reference, rtol=1e-10, atol=1e-12)
    norms = per_sample_gradient_norms(model, loss_fn, X, y)
    np.testing.assert_allclose(norms, np.linalg.norm(reference, axis=1), rtol=1e-10)


@pytest.mark.parametrize("head, outputs, loss_fn, y", BOTH_PATHS, ids=IDS)
def test_dp_sgd_clip_bound_with_both_paths(head, outputs, loss_fn, y):
    """Item 1: DPSGD let one sample's update reach 2.1 C and 8.3 C."""
    model = mlp(head, outputs)
    reference = tape_per_sample(model, loss_fn, X, y)
    clip = 0.5 * float(np.median(np.linalg.norm(reference, axis=1)))
    dp = DPSGD(model, loss_fn, keras.optimizers.SGD(0.1), l2_norm_clip=clip,
               noise_multiplier=0.0)  # fmt: skip
    assert dp.largest_clipped_norm(X, y) <= 1 + 1e-9
    w = dp.clip_weights(X, y)
    contributions = np.linalg.norm(w[:, None] * reference, axis=1)
    assert contributions.max() <= clip * (1 + 1e-9)


@pytest.mark.parametrize("tail", ["dropout", "linear"])
def test_norms_of_softmax_followed_by_a_passthrough(tail):
    """Item 7: LogitsNotOnRules escaped the XLA norms path on a softmax
    followed by Dropout or Activation("linear")."""
    keras.utils.set_random_seed(0)
    layer = (
        keras.layers.Dropout(0.5, dtype=F64)
        if tail == "dropout"
        else keras.layers.Activation("linear", dtype=F64)
    )
    model = keras.Sequential(
        [keras.Input((3,), dtype=F64),
         keras.layers.Dense(3, activation="softmax", dtype=F64), layer]
    )  # fmt: skip
    loss_fn = keras.losses.sparse_categorical_crossentropy
    y = np.array([0, 1, 2, 0, 1, 2])
    reference = tape_per_sample(model, loss_fn, X, y)
    norms = per_sample_gradient_norms(model, loss_fn, X, y)
    np.testing.assert_allclose(norms, np.linalg.norm(reference, axis=1), rtol=1e-10)


def test_dp_sgd_step_equals_keras_gradient_with_regularizers():
    """Item 5: the regularizers' gradient was left out of DPSGD's update
    (65-98 % off Keras's); with no noise and a large C a step is Keras's."""
    model = mlp(None, 2, kernel_regularizer=keras.regularizers.L2(0.3),
                bias_regularizer=keras.regularizers.L1(0.2))  # fmt: skip
    loss_fn = keras.losses.mean_squared_error
    y = np.random.default_rng(2).normal(size=(6, 2))
    with tf.GradientTape() as tape:
        mean_loss = tf.reduce_mean(loss_fn(y, model(X, training=False)))
        total = mean_loss + tf.add_n(model.losses)
    keras_gradient = tape.gradient(total, model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]
    dp = DPSGD(model, loss_fn, keras.optimizers.SGD(1.0), l2_norm_clip=1e6,
               noise_multiplier=0.0)  # fmt: skip
    dp.step(X, y)
    for b, v, g in zip(before, model.trainable_variables, keras_gradient, strict=True):
        np.testing.assert_allclose(b - v.numpy(), g.numpy(), rtol=1e-10, atol=1e-14)


def test_activity_regularizer_refused():
    """Item 5: an activity regularizer depends on the samples; its gradient
    would escape the clipping."""
    model = mlp(None, 2, activity_regularizer=keras.regularizers.L1(0.1))
    with pytest.raises(ValueError, match="activity_regularizer"):
        DPSGD(model, keras.losses.mean_squared_error, keras.optimizers.SGD(0.1),
              l2_norm_clip=1.0, noise_multiplier=1.0)  # fmt: skip


def test_regularizers_left_out_of_per_sample_gradients_is_documented():
    """Item 5: per_sample_gradients leaves the regularizers out (as Opacus
    does); it was written nowhere."""
    assert "regulariz" in per_sample_gradients.__doc__


def test_nan_input_refused_with_its_indices():
    """Item 6: a NaN sample made every per-sample gradient NaN, and a DP-SGD
    step turned every weight into NaN."""
    model = mlp(None, 2)
    x = X.copy()
    x[[1, 4], 0] = np.nan
    y = np.zeros((6, 2))
    for entry in (per_sample_gradients, per_sample_gradient_norms):
        with pytest.raises(ValueError, match=r"x holds NaN .*\(indices 1, 4\)"):
            entry(model, keras.losses.mean_squared_error, x, y)
    y[3, 1] = np.inf
    with pytest.raises(ValueError, match=r"y holds NaN .*indices 3\)"):
        per_sample_gradients(model, keras.losses.mean_squared_error, X, y)
    dp = DPSGD(model, keras.losses.mean_squared_error, keras.optimizers.SGD(0.1),
               l2_norm_clip=1.0, noise_multiplier=1.0)  # fmt: skip
    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match="NaN"):
        dp.step(x, np.zeros((6, 2)))
    for b, v in zip(before, model.trainable_variables, strict=True):
        np.testing.assert_array_equal(b, v.numpy())


def test_non_finite_gradient_contributes_nothing():
    """Item 6: a NaN norm got clip weight 1 and spread NaN into every weight;
    now the sample is skipped, counted and reported."""
    assert clip_weights([np.nan, np.inf, 2.0], 1.0).tolist() == [0.0, 0.0, 0.5]
    model = mlp(None, 2)

    def log_loss(y, p):  # finite, but its gradient is NaN where y is 0: sqrt'(0)
        return tf.reduce_sum(tf.sqrt(y * tf.square(p)), axis=-1)

    y = np.ones((6, 2))
    y[2] = 0.0
    dp = DPSGD(model, log_loss, keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
               noise_multiplier=0.0)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = dp.step(X, y)
    assert dp.skipped == 1
    assert any("non-finite gradient" in str(w.message) for w in caught)
    assert np.isnan(losses[2]) and np.isfinite(np.delete(losses, 2)).all()
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


def test_targets_as_a_list_for_two_heads():
    """Item 8: y=[y_a, y_b] for a two-head model gave NumPy's
    'inhomogeneous shape' message."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,), dtype=F64)
    hidden = keras.layers.Dense(4, activation="tanh", dtype=F64)(inputs)
    heads = [keras.layers.Dense(2, dtype=F64)(hidden),
             keras.layers.Dense(1, dtype=F64)(hidden)]  # fmt: skip
    model = keras.Model(inputs, heads)

    def two_losses(y, p):
        return (keras.losses.mean_squared_error(y[0], p[0])
                + keras.losses.mean_squared_error(y[1], p[1]))  # fmt: skip

    rng = np.random.default_rng(3)
    y = [rng.normal(size=(6, 2)), rng.normal(size=(6, 1))]
    G = per_sample_gradients(model, two_losses, X, y)
    np.testing.assert_allclose(G, tape_per_sample(model, two_losses, X, y), rtol=1e-10)
    with pytest.raises(ValueError, match=r"y\[1\] has shape \(5, 1\)"):
        per_sample_gradients(model, two_losses, X, [y[0], y[1][:5]])


BAD_SIZES = [(-2, ValueError), (0, ValueError), (2.5, TypeError), ("100", TypeError)]


@pytest.mark.parametrize("bad, error", BAD_SIZES)
def test_chunk_size_checked_once_for_every_entry(bad, error):
    """Item 10: ggn_operator's products with chunk_size=-2 gave exactly zero,
    0 gave 'range() arg 3 must not be zero', jvp and jacobian_operator said
    'need at least one array to concatenate'."""
    model = mlp(None, 2)
    v = np.ones(model.count_params())
    calls = [
        lambda: chunked_jacobian(model, X, chunk_size=bad, progress=False),
        lambda: jvp(model, X, v, chunk_size=bad),
        lambda: jacobian_operator(model, X, chunk_size=bad) @ v,
        lambda: products(model, chunk_size=bad),
    ]
    for call in calls:
        with pytest.raises(error, match="chunk_size must be"):
            call()


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), "1GB"])
def test_memory_budget_checked(bad):
    """Item 10: a non-positive or non-numeric budget was taken, or failed in int()."""
    model = mlp(None, 2)
    with pytest.raises((ValueError, TypeError), match="memory_budget must be"):
        per_sample_gradients(model, keras.losses.mean_squared_error, X,
                             np.zeros((6, 2)), memory_budget=bad)  # fmt: skip


def test_products_with_other_options_refused():
    """Item 10: jacobian_operator(..., products=p, variables=vs) dropped
    variables=, chunk_size, mode and training without a word."""
    model = mlp(None, 2)
    p = products(model)
    with pytest.raises(TypeError, match="products= and variables"):
        jacobian_operator(model, X, products=p, variables=model.trainable_variables[:1])


def test_empty_batch_refused():
    """Item 10: an empty x gave ZeroDivisionError."""
    model = mlp(None, 2)
    with pytest.raises(ValueError, match="holds no samples"):
        per_sample_gradients(model, keras.losses.mean_squared_error,
                             np.zeros((0, 3)), np.zeros((0, 2)))  # fmt: skip
