"""SignatureCalls: a tf.function run by the concrete function of each
signature gives the tf.function's own results, traces once per signature,
and keeps every other call on the public path."""

import numpy as np
import tensorflow as tf

from jacutil.core.graph_calls import SignatureCalls


def counted():
    traces = []

    def f(pair, scale):
        traces.append(1)
        a, b = pair
        return {"sum": tf.reduce_sum(a * scale, axis=0) + b, "n": tf.shape(a)[0]}

    return tf.function(f, autograph=False), traces


def test_each_signature_traces_once_and_returns_the_functions_results():
    function, traces = counted()
    calls = SignatureCalls(function)
    rng = np.random.default_rng(0)
    for rows in (3, 5, 3, 5, 3):
        a = tf.constant(rng.normal(size=(rows, 4)))
        b = tf.constant(rng.normal(size=(4,)))
        scale = tf.constant(rng.normal(), tf.float64)
        found = calls((a, b), scale)
        expected = tf.reduce_sum(a * scale, axis=0) + b
        np.testing.assert_array_equal(found["sum"].numpy(), expected.numpy())
        assert int(found["n"]) == rows
    assert len(traces) == 2  # one per number of rows
    # another dtype is another signature, not a float64 trace fed float32
    found = calls((tf.ones((3, 4), tf.float32), tf.ones(4, tf.float32)),
                  tf.constant(2.0, tf.float32))  # fmt: skip
    assert found["sum"].dtype == tf.float32 and len(traces) == 3
    np.testing.assert_array_equal(found["sum"].numpy(), np.full(4, 7.0))


def test_python_values_and_calls_inside_a_graph_take_the_public_path():
    function, traces = counted()
    calls = SignatureCalls(function)
    a, b = np.ones((2, 3)), np.zeros(3)
    np.testing.assert_array_equal(calls((a, b), 2.0)["sum"].numpy(), [4.0] * 3)
    np.testing.assert_array_equal(calls((a, b), 3.0)["sum"].numpy(), [6.0] * 3)
    assert len(traces) == 2  # a Python number is part of tf.function's key

    @tf.function(autograph=False)
    def outer(a, b):
        return calls((a, b), tf.constant(1.0, tf.float64))["sum"]

    np.testing.assert_array_equal(outer(tf.constant(a), tf.constant(b)).numpy(),
                                  [2.0] * 3)  # fmt: skip
