"""Per-sample gradients of a loss and their norms, against one tape per sample."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from tests.architectures import ARCHITECTURES, build

LOSS = keras.losses.mean_squared_error  # one loss per sample


def one_at_a_time(model, x, y, variables):
    """The reference: a fresh tape for each sample's own loss."""
    variables = variables or model.trainable_variables
    rows = []
    for i in range(len(y)):
        x_i = tf.nest.map_structure(lambda t, i=i: t[i : i + 1], x)
        with tf.GradientTape() as tape:
            tape.watch(
                [v.value if isinstance(v, keras.Variable) else v for v in variables]
            )
            loss = tf.reduce_mean(LOSS(y[i : i + 1], model(x_i)))  # one sample
        grads = tape.gradient(loss, variables)
        rows.append(
            np.concatenate(
                [
                    np.zeros(int(np.prod(v.shape)))
                    if g is None
                    else np.ravel(tf.convert_to_tensor(g))
                    for g, v in zip(grads, variables, strict=True)
                ]
            )
        )
    return np.array(rows)


SINGLE_OUTPUT = [
    name
    for name in sorted(ARCHITECTURES)
    if name not in ("two_heads_list", "dict_heads", "two_inputs_two_heads")
]


@pytest.mark.parametrize("name", SINGLE_OUTPUT)
def test_per_sample_gradients_equal_one_tape_per_sample(name):
    case = build(name)
    x = case.batch(4)
    model, variables = case.model64, case.variables64
    shape = np.shape(model(x) if variables is None else model(x))
    y = np.random.default_rng(0).standard_normal(shape)
    G = ju.per_sample_gradients(model, LOSS, x, y, variables=variables)
    expected = one_at_a_time(model, x, y, variables)
    np.testing.assert_allclose(G, expected, rtol=1e-9, atol=1e-11)
    norms = ju.per_sample_gradient_norms(model, LOSS, x, y, variables=variables)
    np.testing.assert_allclose(norms, np.linalg.norm(expected, axis=1), rtol=1e-9)


def test_dense_norms_need_no_gradients_and_match():
    model = ju.question_mlp(seed=1, dtype="float64")
    x, y = ju.regression_data(6, seed=1)
    norms = ju.per_sample_gradient_norms(model, LOSS, x, y)
    G = ju.per_sample_gradients(model, LOSS, x, y)
    np.testing.assert_allclose(norms, np.linalg.norm(G, axis=1), rtol=1e-10)


def test_a_reduced_loss_is_an_error_that_says_what_to_use():
    model = ju.question_mlp(hidden=(4,))
    x, y = ju.regression_data(5)
    with pytest.raises(ValueError, match="one loss per sample"):
        ju.per_sample_gradients(model, keras.losses.MeanSquaredError(), x, y)
    with pytest.raises(ValueError, match="one target per sample"):
        ju.per_sample_gradients(model, LOSS, x, y[:3])


@pytest.mark.parametrize("entry", ["per_sample_gradients", "per_sample_gradient_norms"])
def test_the_second_call_traces_nothing(entry):
    """A training step calls these once per batch: one trace per input shape,
    whatever n, and the same numbers as a fresh computation."""
    function = getattr(ju, entry)
    model = ju.question_mlp(seed=2, dtype="float64")
    x, y = ju.regression_data(40, seed=2)
    first, choice = function(model, LOSS, x, y, explain=True)
    # the first call on a shape runs eagerly (no trace), the second traces
    assert not choice.traced and choice.path == "layer rules"
    traced = []
    for n in (40, 17, 1, 40):
        again, choice = function(model, LOSS, x[:n], y[:n], explain=True)
        traced.append(choice.traced)
        np.testing.assert_allclose(again, first[:n], rtol=1e-12)
    assert traced == [True, False, False, False]
    job = ju.fitting.loss_gradients.gradients_for(model, LOSS, None, False)
    assert job.trace_count == 1


def test_chunks_within_a_memory_budget_give_the_same_rows():
    model = ju.question_mlp(seed=3, dtype="float64")
    x, y = ju.regression_data(50, seed=3)
    whole = ju.per_sample_gradients(model, LOSS, x, y)
    norms = ju.per_sample_gradient_norms(model, LOSS, x, y)
    # the first calls ran eagerly: the second ones trace the graph of the whole
    whole = ju.per_sample_gradients(model, LOSS, x, y)
    norms = ju.per_sample_gradient_norms(model, LOSS, x, y)
    np.testing.assert_allclose(norms, np.linalg.norm(whole, axis=1), rtol=1e-10)
    for entry, expected in [
        (ju.per_sample_gradients, whole),
        (ju.per_sample_gradient_norms, norms),
    ]:
        chunked, choice = entry(model, LOSS, x, y, memory_budget=2**20, explain=True)
        assert choice.chunks > 1 and choice.chunk_size < 50
        assert not choice.traced  # the chunks share the graph of the whole
        np.testing.assert_allclose(chunked, expected, rtol=1e-10)
    expected = one_at_a_time(model, x, y, None)
    np.testing.assert_allclose(whole, expected, rtol=1e-9, atol=1e-11)


def test_the_cache_does_not_keep_a_loss_closure_alive():
    import gc
    import weakref

    model = ju.question_mlp(hidden=(4,), seed=4)
    x, y = ju.regression_data(6, seed=4)
    captured = np.ones(10**6)  # what a closure might capture

    def loss(y_true, y_pred, captured=captured):
        return LOSS(y_true, y_pred)

    gone = weakref.ref(captured)
    ju.per_sample_gradients(model, loss, x, y)
    del loss, captured
    gc.collect()
    assert gone() is None, "the cached gradients kept the loss function alive"


def test_a_new_loss_function_is_a_new_graph_with_its_own_numbers():
    model = ju.question_mlp(hidden=(4,), seed=5, dtype="float64")
    x, y = ju.regression_data(6, seed=5)
    mse = ju.per_sample_gradients(model, LOSS, x, y, copy=True)
    mae = ju.per_sample_gradients(model, keras.losses.mean_absolute_error, x, y)
    assert not np.allclose(mse, mae)
    np.testing.assert_allclose(mse, one_at_a_time(model, x, y, None), rtol=1e-9)


def test_norms_on_the_rules_run_under_xla_up_to_a_size_and_agree():
    from jacutil.fitting.loss_gradients import XLA_NORMS_ROWS

    model = ju.question_mlp(hidden=(8,), seed=6, dtype="float64")
    x, y = ju.regression_data(XLA_NORMS_ROWS + 3, seed=6)
    for n, under_xla in [(5, True), (XLA_NORMS_ROWS + 3, False)]:
        for _ in range(2):  # the first call runs eagerly; the second compiles
            norms, choice = ju.per_sample_gradient_norms(
                model, LOSS, x[:n], y[:n], explain=True
            )
        assert choice.formulation.endswith("under XLA") == under_xla
        G = ju.per_sample_gradients(model, LOSS, x[:n], y[:n])
        np.testing.assert_allclose(norms, np.linalg.norm(G, axis=1), rtol=1e-10)
    expected = np.linalg.norm(one_at_a_time(model, x[:5], y[:5], None), axis=1)
    np.testing.assert_allclose(norms[:5], expected, rtol=1e-9)
