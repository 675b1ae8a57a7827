"""TensorFlow's and Keras's internals behind one door (jacutil.core.internals):
each touch finds what it expects on the tested versions, and says so
clearly, naming the versions, when an internal has moved (issue 35)."""

import subprocess
import sys
import types

import pytest

import jacutil as ju
from jacutil import keras, tf
from jacutil.core import internals
from jacutil.core.internals import InternalsMoved
from jacutil.core.second_order import ensure_second_order


class Plain(keras.layers.Layer):
    def call(self, x):
        return x


def functional():
    x = keras.Input((3,))
    h = keras.layers.Dense(4, name="hidden")(x)
    return keras.Model(x, {"out": keras.layers.Dense(2, name="head")(h)})


def test_each_touch_reads_the_tested_versions():
    model = functional()
    operation, node, index = internals.made_by(model.outputs[0])
    assert operation.name == "head" and index == 0
    assert node.input_tensors[0] is model.get_layer("hidden").output
    assert len(internals.calls_of(operation)) == 1
    assert internals.takes_training(keras.layers.Dropout(0.5))
    assert not internals.takes_training(Plain())
    assert not internals.takes_training(lambda t: t)  # a plain op or callable
    names = [layer.name for layer in internals.layers_within(model, False)]
    assert names[-2:] == ["hidden", "head"]
    assert internals.layers_within(lambda t: t, True) == []
    probabilities = keras.layers.Dense(3, activation="softmax")(tf.ones((1, 2)))
    assert internals.cached_logits(probabilities) is not None
    assert internals.cached_logits(tf.ones(2)) is None
    assert callable(internals.keras_backend_nn().conv)
    ensure_second_order()
    assert "SoftsignGrad" in internals.gradient_registry()


@pytest.mark.parametrize(
    "touch",
    [
        lambda: internals.made_by(types.SimpleNamespace()),
        lambda: internals.calls_of(types.SimpleNamespace()),
    ],
    ids=["made_by", "calls_of"],
)
def test_a_moved_internal_is_named_with_the_versions(touch):
    with pytest.raises(InternalsMoved) as caught:
        touch()
    message = str(caught.value)
    assert tf.__version__ in message and keras.__version__ in message
    assert internals.TESTED in message


def test_a_moved_layer_internal_is_an_error_not_a_skip(monkeypatch):
    layer = keras.layers.Dense(2)
    monkeypatch.delattr(keras.layers.Layer, "_flatten_layers")
    with pytest.raises(InternalsMoved, match="_flatten_layers"):
        internals.layers_within(layer, True)


def test_a_moved_gradient_registry_is_an_error(monkeypatch):
    from tensorflow.python.framework import ops

    monkeypatch.setattr(ops, "_gradient_registry", None)
    with pytest.raises(InternalsMoved, match="gradient registry"):
        internals.gradient_registry()


FIRST_USE = """
import sys
import jacutil as ju
assert "tensorflow" not in sys.modules, "import jacutil loaded TensorFlow"
ju.stages.vectorized, ju.rules, ju.curvature.hessian, ju.keras
from tensorflow.python.framework import ops
from jacutil.core.second_order import ensure_second_order
from jacutil.core.internals import InternalsMoved
assert "SoftsignGrad" not in ops._gradient_registry._registry, "patched on import"
moved, ops._gradient_registry = ops._gradient_registry, None
try:
    ensure_second_order()
    raise AssertionError("a moved registry was skipped")
except InternalsMoved as error:
    assert "gradient registry" in str(error), error
ops._gradient_registry = moved
ensure_second_order(); ensure_second_order()
assert "SoftsignGrad" in ops._gradient_registry._registry
"""


def test_second_order_gradients_are_registered_on_first_use_not_on_import():
    """Nothing is patched process-wide on import (not even by importing the
    modules that need the gradients); ensure_second_order registers them,
    once, and a moved registry is an error, not a skip. In a fresh process."""
    done = subprocess.run([sys.executable, "-c", FIRST_USE], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_moved_keras_conv_is_an_error_when_a_model_runs(monkeypatch):
    monkeypatch.delattr(internals.keras_backend_nn(), "conv")
    model = ju.question_mlp(n_inputs=3, hidden=(2,))
    with pytest.raises(InternalsMoved, match="conv"):
        ju.per_sample_jacobian(model, tf.ones((2, 3)))
