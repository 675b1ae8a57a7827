"""The rule contract: every registered rule, alone, against autodiff.

``jacutil.testing.check_rule`` runs each rule on every setting of
``jacutil.testing.SETTINGS`` (VJP, JVP, the signal below, the columns); a
newly registered layer type without a setting fails here; a rule that lies
is caught by the check, and one that returns a block of the wrong shape by
the rule's final ``backward``.
"""

import numpy as np
import pytest

from jacutil import keras, rules, testing, tf
from jacutil.rules.dense import DenseRule

layers = keras.layers


@pytest.mark.parametrize("setting", testing.SETTINGS, ids=lambda s: s.label)
def test_check_rule(setting):
    report = testing.check_rule(
        setting.make(), input_shape=setting.input_shape,
        input_dtype=setting.input_dtype,
    )  # fmt: skip
    assert report.passed and report.errors["forward"] <= report.tolerance


def test_every_registered_rule_has_a_setting():
    """Every rule of one input: check_rule takes one. MultiHeadAttention's
    (a call of several tensors) is checked in tests/test_rules_transformer.py."""
    covered = {setting.layer_type for setting in testing.SETTINGS}
    several = {layers.MultiHeadAttention}
    unchecked = [t.__name__ for t in rules.RULES if t not in covered | several]
    assert not unchecked, f"registered without a check_rule setting: {unchecked}"


class DropsTheBias(DenseRule):
    """Writes the kernel's block only: the bias's columns stay zeros."""

    def _backward(self, saved, delta, wanted, need_signal):
        wanted = rules.Wanted(v for v in wanted if v is not self.bias)
        return DenseRule._backward(self, saved, delta, wanted, need_signal)


class TransposesTheKernel(DenseRule):
    """The kernel's block in (q, p) order instead of (p, q): right shape, wrong
    columns."""

    def _backward(self, saved, delta, wanted, need_signal):
        kernel, only = self.layer.kernel, rules.Wanted
        blocks, below = DenseRule._backward(self, saved, delta, only(), need_signal)
        if kernel not in wanted:
            return blocks, below
        blocks = DenseRule._backward(self, saved, delta, only([kernel]), False)[0]
        n, n_out = tf.shape(delta)[0], tf.shape(delta)[1]
        p, q = kernel.shape
        block = tf.reshape(blocks[kernel], [n, n_out, p, q])
        swapped = tf.transpose(block, [0, 1, 3, 2])
        blocks[kernel] = tf.reshape(swapped, [n, n_out, p * q])
        if self.bias in wanted:
            blocks.update(
                DenseRule._backward(self, saved, delta, only([self.bias]), False)[0]
            )
        return blocks, below


class ForgetsTheSlope(DenseRule):
    """Passes the signal below without the activation's slope."""

    def _backward(self, saved, delta, wanted, need_signal):
        blocks, _ = DenseRule._backward(self, saved, delta, wanted, False)
        below = None
        if need_signal:
            below = tf.einsum("nlq,pq->nlp", delta, self.layer.kernel)
        return blocks, below


@pytest.mark.parametrize(
    "rule, check",
    [(DropsTheBias, "vjp"), (TransposesTheKernel, "vjp"), (ForgetsTheSlope, "signal")],
)
def test_check_rule_catches_a_wrong_rule(rule, check):
    layer = layers.Dense(3, activation="tanh", dtype="float64")
    report = testing.check_rule(layer, rule, input_shape=(4,), raise_on_failure=False)
    assert not report.passed and check in dict(report.failures)
    assert report.errors[check] > 1e-3
    with pytest.raises(AssertionError, match=f"{check} off by"):
        testing.check_rule(
            layers.Dense(3, activation="tanh", dtype="float64"), rule, input_shape=(4,)
        )


class ShortBlock(DenseRule):
    """The kernel's block missing its last column."""

    def _backward(self, saved, delta, wanted, need_signal):
        blocks, below = DenseRule._backward(self, saved, delta, wanted, need_signal)
        key = blocks.keys()[0]
        blocks[key] = blocks[key][:, :, :-1]
        return blocks, below


def test_a_wrongly_shaped_block_is_caught_by_backward():
    layer = layers.Dense(3, dtype="float64")
    layer.build((None, 4))
    rule = ShortBlock(layer)
    x = tf.constant(np.ones((2, 4)))
    _, saved = rule.forward(x)
    delta = tf.ones([2, 3, 3], tf.float64)
    with pytest.raises(rules.RuleContractError, match=r"ShortBlock.*\(2, 3, 14\)"):
        rule.backward(saved, delta, [layer.kernel, layer.bias], False)
    report = testing.check_rule(
        layers.Dense(3, dtype="float64"), ShortBlock, input_shape=(4,),
        raise_on_failure=False,
    )  # fmt: skip
    assert "RuleContractError" in report.problem and "expected" in report.problem


def test_a_wrongly_shaped_signal_is_caught_by_backward():
    class FlatSignal(DenseRule):
        def _backward(self, saved, delta, wanted, need_signal):
            blocks, below = DenseRule._backward(self, saved, delta, wanted, True)
            return blocks, tf.reshape(below, [tf.shape(below)[0], -1])

    layer = layers.Dense(3, dtype="float64")
    layer.build((None, 4))
    rule = FlatSignal(layer)
    _, saved = rule.forward(tf.constant(np.ones((2, 4))))
    with pytest.raises(rules.RuleContractError, match="signal below"):
        rule.backward(saved, tf.ones([2, 3, 3], tf.float64), [], True)


def test_positions_instead_of_variables_are_refused():
    layer = layers.Dense(3, dtype="float64")
    layer.build((None, 4))
    rule = DenseRule(layer)
    _, saved = rule.forward(tf.constant(np.ones((2, 4))))
    with pytest.raises(TypeError, match="not column positions"):
        rule.backward(saved, tf.ones([2, 3, 3], tf.float64), {id(layer.kernel): 0},
                      False)  # fmt: skip
