"""Check one layer's rule alone against autodiff, in random directions.

:func:`check_rule` builds the layer in float64 on a few seeded random
samples, runs its rule forward and backward as the engine does, and
compares, each sample on its own:

- ``forward``: the rule's output with the layer's own call;
- ``vjp``: the blocks contracted with a random weighting of the outputs,
  ``w_i @ J_i`` (m,), with the tape's gradient of ``sum(w_i * y_i)``;
- ``jvp``: the blocks times a random parameter direction, ``J_i @ u`` (l,),
  with forward mode (``tf.autodiff.ForwardAccumulator``);
- ``signal``: the signal below, contracted both ways, with the tape's input
  gradient and forward mode in a random input direction;
- ``columns``: the blocks asked for one variable at a time and in reverse
  order, placed by the engine, with the same columns of ``J``;
- ``norms``: ``backward_norms`` (the squared norms per sample and signal
  row, which a rule may compute without its blocks) with the squared norms
  of the rule's own blocks, and its signal below with ``backward``'s, for a
  random signal shared by every sample and one per sample, r = 3 rows, every
  variable, each alone and none; by the rule's choice of route and by each
  route forced (``jacutil.rules.blocks.norms_route``).

A wrong shape is caught before any number: the rule's final ``backward``
raises :class:`jacutil.rules.RuleContractError` (the report's ``problem``).
"""

from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from ..core._shared import size_of
from ..core._tf import keras, tf
from ..core.second_order import ensure_second_order
from ..core.target import watched
from ..rules.blocks import norms_route
from ..rules.registry import RULES, NoRule, Rule, RuleContractError, Wanted
from ..rules.verify import relative_error
from ..rules.walk import place_blocks, signal_for


@dataclass
class RuleReport:
    """What :func:`check_rule` measured.

    ``rule``: the rule's name (``describe()``); ``layer``: the layer, in
    words; ``tolerance``: the largest error that passes; ``errors``: by check
    name, each check's largest difference, relative to the largest reference
    value (or absolute below 1); ``problem``: a contract error or a refused
    layer, when the rule could not be run (else None).
    """

    rule: str
    layer: str
    tolerance: float
    errors: dict = field(default_factory=dict)
    problem: str | None = None

    @property
    def failures(self):
        """``[(check, error)]`` over the tolerance."""
        return [(k, e) for k, e in self.errors.items() if not e <= self.tolerance]

    @property
    def passed(self):
        """Whether no contract error and no check over the tolerance (``bool``)."""
        return self.problem is None and not self.failures

    def line(self):
        """One line (a ``str``): ok/FAIL, the layer, its rule and every
        check's error."""
        if self.problem is not None:
            found = self.problem
        else:
            found = "  ".join(f"{k} {e:.1e}" for k, e in self.errors.items())
        return f"{'ok  ' if self.passed else 'FAIL'} {self.layer}: {self.rule}  {found}"

    def why(self):
        """The failure in words, or "" when it passed (a ``str``)."""
        if self.problem is not None:
            return f"rule {self.rule} on {self.layer}: {self.problem}"
        return "; ".join(
            f"rule {self.rule} on {self.layer}: {check} off by {error:.3g} "
            f"(tolerance {self.tolerance:g})"
            for check, error in self.failures
        )


def check_rule(
    layer,
    rule=None,
    *,
    input_shape,
    input_dtype="float64",
    n_samples=3,
    seed=0,
    tolerance=1e-8,
    raise_on_failure=True,
):
    """Check ``layer``'s rule alone against autodiff (see the module's checks).

    Args:
        layer: a Keras layer. A float64 one that is not built is built here on
            ``input_shape`` and its weights moved at random (seeded); another
            dtype is copied in float64 from its config first.
        rule: the rule class to check; by default the one registered for
            ``type(layer)``.
        input_shape: one sample's input shape, without the samples axis.
        input_dtype: ``"float64"``, or an integer dtype for ids (then ids in
            ``range(layer.input_dim)``, and no signal below is checked).
        n_samples: n, the samples checked (each also alone by the tape).
        seed: seeds the weights' moves, the inputs and the directions.
        tolerance: the largest relative error that passes.
        raise_on_failure: raise AssertionError on a failure (else return the
            report).

    Returns:
        A :class:`RuleReport`: per check, the largest relative error of the
        rule's (n, l, m) blocks and ``(n, l, *input_shape)`` signal against
        autodiff (l = the layer's outputs per sample, m its parameters).

    Raises:
        AssertionError: a check failed, with which and by how much.
        LookupError: no rule is registered for the layer's type.
    """
    rule = rule or RULES.get(type(layer))
    if rule is None:
        raise LookupError(f"no rule registered for {type(layer).__name__}")
    ensure_second_order()  # its JVP check is forward mode
    rng = np.random.default_rng(seed)
    layer = _float64_layer(layer, input_shape, input_dtype, rng)
    label = f"{type(layer).__name__} on {tuple(input_shape)}"
    report = RuleReport(getattr(rule, "name", rule.__name__), label, tolerance)
    try:
        step = rule(layer)
        report.rule = step.describe()
        _run_checks(step, layer, _inputs(layer, input_shape, input_dtype, n_samples,
                                         rng), rng, report.errors)  # fmt: skip
    except (NoRule, RuleContractError) as error:
        report.problem = f"{type(error).__name__}: {error}"
    if raise_on_failure and not report.passed:
        raise AssertionError(report.why())
    return report


def _float64_layer(layer, input_shape, input_dtype, rng):
    """``layer`` (or its float64 copy), built on ``input_shape``."""
    if layer.compute_dtype != "float64":
        if layer.built:
            raise TypeError(
                f"layer {layer.name!r} is built in {layer.compute_dtype}: pass an "
                "unbuilt layer (it is copied in float64) or a float64 one"
            )
        try:
            layer = type(layer).from_config({**layer.get_config(), "dtype": "float64"})
        except Exception as error:  # a layer whose config does not rebuild it
            raise TypeError(
                f"layer {layer.name!r} computes in {layer.compute_dtype} and "
                f"cannot be copied in float64 ({error}): pass a float64 layer"
            ) from None
    if not layer.built:
        layer(keras.Input(shape=tuple(input_shape), dtype=input_dtype))
        for v in layer.weights:  # away from zeros and ones, variances positive
            if not tf.as_dtype(v.dtype).is_floating:
                continue
            moved = v.numpy() + 0.3 * rng.standard_normal(v.shape)
            if "variance" in v.path:
                moved = np.abs(moved) + 0.1
            v.assign(moved)
    return layer


def _inputs(layer, input_shape, input_dtype, n_samples, rng):
    shape = (n_samples, *input_shape)
    if tf.as_dtype(input_dtype).is_integer:
        ids = rng.integers(0, getattr(layer, "input_dim", 2), shape)
        return tf.constant(ids, input_dtype)
    return tf.constant(rng.standard_normal(shape), input_dtype)


def _run_checks(step, layer, x, rng, errors):
    n = int(x.shape[0])
    floating = x.dtype.is_floating
    variables = list(step.variables)
    y, saved = step.forward(x)
    expected = layer(x, training=False)
    errors["forward"] = relative_error(y, expected)
    n_outputs = int(np.prod(expected.shape[1:], dtype=np.int64))
    identity = tf.reshape(
        tf.eye(n_outputs, dtype=tf.float64), [1, n_outputs, *expected.shape[1:]]
    )

    def jacobian(order, wanted):
        wanted = Wanted(wanted)
        delta = signal_for(step, identity, wanted, n)
        blocks, below = step.backward(saved, delta, wanted, floating)
        J = place_blocks(blocks, order, n, n_outputs, tf.float64).numpy()
        if below is not None:
            below = np.broadcast_to(below.numpy(), (n, n_outputs, *x.shape[1:]))
        return J, below

    J, below = jacobian(variables, variables)  # (n, l, m), (n, l, *input_shape)
    _, alone = jacobian(variables, [])  # the signal as the layers above ask it

    # vjp: w_i @ J_i against the tape, each sample alone
    w = rng.standard_normal((n, n_outputs))
    tape_params, tape_input = [], []
    for i in range(n):
        x_i = x[i : i + 1]
        with tf.GradientTape() as tape:
            if floating:
                tape.watch(x_i)
            tape.watch([watched(v) for v in variables])
            score = tf.reduce_sum(w[i] * tf.reshape(layer(x_i, training=False), [-1]))
        sources = [watched(v) for v in variables] + ([x_i] if floating else [])
        grads = tape.gradient(score, sources)
        grads = [np.zeros(s.shape) if g is None else tf.convert_to_tensor(g).numpy()
                 for g, s in zip(grads, sources, strict=True)]  # fmt: skip
        tape_params.append(np.concatenate([[]] + [np.ravel(g) for g in grads[
            : len(variables)]]))  # fmt: skip
        if floating:
            tape_input.append(grads[-1][0])
    errors["vjp"] = relative_error(np.einsum("nlm,nl->nm", J, w), np.stack(tape_params))

    # jvp: J_i @ u against forward mode
    if variables:
        u = rng.standard_normal(J.shape[2])
        tangents = np.split(u, np.cumsum([size_of(v) for v in variables])[:-1])
        with tf.autodiff.ForwardAccumulator(
            [watched(v) for v in variables],
            [tf.constant(t.reshape(v.shape)) for t, v in zip(tangents, variables,
                                                             strict=True)],
        ) as accumulator:  # fmt: skip
            out = layer(x, training=False)
        forward = tf.reshape(accumulator.jvp(out), [n, n_outputs]).numpy()
        errors["jvp"] = relative_error(np.einsum("nlm,m->nl", J, u), forward)

    # the signal below: both contractions, both ways of asking
    if floating:
        t = tf.constant(rng.standard_normal(x.shape))
        with tf.autodiff.ForwardAccumulator(x, t) as accumulator:
            out = layer(x, training=False)
        forward = tf.reshape(accumulator.jvp(out), [n, n_outputs]).numpy()
        reference = np.stack(tape_input)
        errors["signal"] = max(
            relative_error(np.einsum("nl...,nl->n...", signal, w), reference)
            if signal is not None else np.inf
            for signal in (below, alone)
        )  # fmt: skip
        input_axes = "".join("abcdefg"[: len(x.shape) - 1])
        errors["signal"] = max(
            errors["signal"],
            relative_error(np.einsum(f"nl{input_axes},n{input_axes}->nl", below, t),
                      forward),
        )  # fmt: skip

    # columns: one variable at a time, and in reverse order
    if len(variables) > 1:
        where = np.cumsum([0] + [size_of(v) for v in variables])
        columns = {id(v): J[:, :, where[k] : where[k + 1]]
                   for k, v in enumerate(variables)}  # fmt: skip
        backwards = variables[::-1]
        placed, _ = jacobian(backwards, variables)
        expected = np.concatenate([columns[id(v)] for v in backwards], 2)
        worst = relative_error(placed, expected)
        for v in variables:
            placed, _ = jacobian([v], [v])
            worst = max(worst, relative_error(placed, columns[id(v)]))
        errors["columns"] = worst

    errors["norms"] = _norms_error(step, saved, n, y.shape[1:], floating, rng)


def _norms_error(step, saved, n, output_shape, floating, rng, n_rows=3):
    """The largest error of ``backward_norms`` against the blocks' squared norms
    and ``backward``'s signal below (the ``norms`` check)."""
    variables = list(step.variables)
    subsets = [variables, []] + ([[v] for v in variables] if len(variables) > 1 else [])
    overridden = type(step)._backward_norms is not Rule._backward_norms
    routes = [None, "ghost", "blocks"] if overridden else [None]
    worst = 0.0
    for rows in (1, n):  # one signal shared by every sample, then one per sample
        signal = tf.constant(rng.standard_normal((rows, n_rows, *output_shape)))
        for subset in subsets:
            wanted = Wanted(subset)
            delta = signal_for(step, signal, wanted, n)
            blocks, below = step.backward(saved, delta, wanted, floating)
            expected = np.zeros((n, n_rows))
            for _, block in blocks.items():
                expected += np.sum(np.square(block.numpy()), -1)
            for route in routes:
                with norms_route(route) if route else nullcontext():
                    squared, found = step.backward_norms(saved, delta, wanted, floating)
                squared = expected * 0 if squared is None else squared.numpy()
                worst = max(worst, relative_error(squared, expected))
                if floating:
                    shape = (n, *below.shape[1:])
                    worst = max(
                        worst,
                        relative_error(
                            np.broadcast_to(found.numpy(), shape),
                            np.broadcast_to(below.numpy(), shape),
                        ),
                    )
    return worst
