"""The rules' forward and backward passes over a plan's steps.

One forward pass through the steps keeps what each rule needs; then, from
the outputs down, each step's rule turns the per-sample signal into its
blocks of columns and the signal of the step below, and stops below the
lowest step that holds a wanted variable. No tape over the whole model and
no pfor, except inside a layer that has no rule and holds wanted variables.
The forward pass fills a map tensor -> value (the plan's
``jacutil.rules.graph.Wiring``); the backward pass starts each output with
its rows of the identity, sums the signals of a tensor read by several steps,
and skips the branches that hold no wanted variable.
"""

from dataclasses import dataclass

import numpy as np

from ..core._shared import size_of
from ..core._tf import tf
from .registry import Blocks, LogitsSignal


def rules_tensor(plan, x, signal=None):
    """(n, l, m) Jacobian of batch ``x`` by the plan's rules (use
    :meth:`Plan.tensor`, which refuses inputs the plan was not checked on).

    ``signal(y)``, when given, returns the signal to start from instead of
    the identity: ``(n, r, *output_shape)``, giving (n, r, m) - with r = 1 and
    the derivative of a per-sample loss, the per-sample gradients. It may be
    a :class:`LogitsSignal` (the derivative at the top layer's logits). A
    model of several outputs takes :class:`OutputRows` (a signal on the l
    rows), not a function. ``x``: a batch of n samples, a tensor, or a list
    or dict of them as ``jacutil.core.batch.as_batch`` arranges several inputs.

    Raises:
        LogitsNotOnRules: a :class:`LogitsSignal` and a top rule that cannot
            start from it; or (:class:`SignalOnSeveralOutputs`) a signal
            function on a model of several outputs.
    """
    blocks, n_samples, n_outputs, dtype = _gather_blocks(plan, x, signal, "backward")
    return place_blocks(blocks, plan.variables, n_samples, n_outputs, dtype)


def rules_squared_norms(plan, x, signal):
    """(n, r): the squared norm of each sample's ``J_i.T s_i`` for each of
    the r rows of its signal - per-sample gradient norms, squared, without
    the gradients where the rules know how (:meth:`Rule.backward_norms`).
    Use :meth:`Plan.squared_norms`, which refuses unchecked inputs.
    Arguments as :func:`rules_tensor` (``signal`` not None).
    """
    total, summed = [], Blocks()

    def add(step, saved, delta, wanted, need_signal):
        if _holds_shared(plan, wanted):  # each call's blocks, summed first
            found, below = step.backward(saved, delta, wanted, need_signal)
            summed.add(found)
            return below
        squared, below = step.backward_norms(saved, delta, wanted, need_signal)
        if squared is not None:
            total.append(squared)
        return below

    n_samples, n_outputs, dtype = _walk_backward(plan, x, signal, add)
    total += [tf.reduce_sum(tf.square(block), axis=-1) for _, block in summed.items()]
    if not total:
        return tf.zeros([n_samples, n_outputs], dtype)
    return tf.add_n(total)


@dataclass(frozen=True)
class Weighing:
    """The signal of :func:`rules_weighted_sums`: ``signal(prediction)`` as
    :func:`rules_tensor` takes it (one row), and ``weigh(squared)``, the
    weights (n,) from the squared norms (n,)."""

    signal: object
    weigh: object


def rules_weighted_sums(plan, x, weighing):
    """``sum_i w_i g_i`` per variable (a list in ``plan.variables`` order,
    None where no rule wrote one), with ``w = weighing.weigh(|g_i|^2)``: the
    norms' forward and backward pass, then each step's
    :meth:`Rule.weighted_sums` from the signals that pass kept - DP-SGD's
    clipped sum without a second pass. Every step holding a wanted variable
    must have ``weighs_sums`` (:meth:`Plan.weighs_sums`). Use
    :meth:`Plan.weighted_sums`, which refuses unchecked inputs."""
    total, kept = [], []

    def add(step, saved, delta, wanted, need_signal):
        squared, below = step.backward_norms(saved, delta, wanted, need_signal)
        if squared is not None:
            total.append(squared)
            kept.append((step, saved, delta, wanted))
        return below

    n_samples, _, dtype = _walk_backward(plan, x, weighing.signal, add)
    squared = tf.add_n(total)[:, 0] if total else tf.zeros([n_samples], dtype)
    weights = weighing.weigh(squared)
    sums = Blocks()
    for step, saved, delta, wanted in kept:
        sums.update(step.weighted_sums(saved, delta, wanted, weights))
    found = {id(key[0]): block for key, block in sums.items()}
    return [
        None if id(v) not in found else tf.reshape(found[id(v)], v.shape)
        for v in plan.variables
    ]


def rules_squared_columns(plan, x, signal):
    """(m,): the squares of ``J_i.T s_ir`` summed over samples i and signal
    rows r - G's exact diagonal when the rows are the columns of a square
    root of each ``H_i`` (notebook 11) - without the blocks where the rules
    know how (:meth:`Rule.backward_squares`). Use :meth:`Plan.squared_columns`,
    which refuses unchecked inputs. Arguments as :func:`rules_tensor`.
    """
    squares, _, _, dtype = _gather_blocks(plan, x, signal, "backward_squares")
    shaped = Blocks((key, column[None, None]) for key, column in squares.items())
    return tf.reshape(place_blocks(shaped, plan.variables, 1, 1, dtype), [-1])


def _gather_blocks(plan, x, signal, method):
    """The blocks each step's ``method`` (``"backward"`` or
    ``"backward_squares"``) writes, and ``(n, l or r, dtype)``."""
    blocks, summed = Blocks(), Blocks()

    def write(step, saved, delta, wanted, need_signal):
        if method == "backward_squares" and _holds_shared(plan, wanted):
            found, below = step.backward(saved, delta, wanted, need_signal)
            summed.add(found)  # squared once summed over the layer's calls
            return below
        found, below = getattr(step, method)(saved, delta, wanted, need_signal)
        blocks.add(found)  # a layer called twice: its calls' blocks summed
        return below

    walked = _walk_backward(plan, x, signal, write)
    for key, block in summed.items():
        blocks.add([(key, tf.reduce_sum(tf.square(block), axis=[0, 1]))])
    return blocks, *walked


def _holds_shared(plan, wanted):
    """Whether a step's wanted variables include one that another step (the
    same layer, called again) holds too."""
    return any(id(v) in plan.shared for v in wanted)


def forward_values(plan, x):
    """The rules' forward pass over the plan's steps: ``(values, saved)``,
    ``values`` the tensor of each key of the plan's wiring (the model's
    inputs, every step's output) and ``saved`` what each step's rule keeps
    for its backward step, in step order."""
    wiring = plan.wiring
    leaves = tf.nest.flatten(x)
    if len(leaves) != len(wiring.model_inputs):
        raise ValueError(
            f"the plan takes {len(wiring.model_inputs)} inputs; got {len(leaves)}"
        )
    values = dict(zip(wiring.model_inputs, leaves, strict=True))
    saved = []
    for step, keys, key in zip(plan.steps, wiring.inputs, wiring.outputs, strict=True):
        inputs = [values[k] for k in keys]
        values[key], kept = step.forward(inputs if step.several_inputs else inputs[0])
        saved.append(kept)
    return values, saved


def _walk_backward(plan, x, signal, visit):
    """The forward pass, then the steps from the outputs down, in reverse
    topological order: ``visit(step, saved, delta, wanted, need_signal)`` for
    each step above a wanted variable, returning the signal below (a list for
    a step of several inputs). Where a tensor feeds several steps, their
    signals are summed. Returns ``(n, l or r, dtype)``.
    """
    wiring = plan.wiring
    values, saved = forward_values(plan, x)
    outputs = [values[key] for key in wiring.model_outputs]
    n_samples = tf.shape(tf.nest.flatten(x)[0])[0]
    signals, n_outputs, at_logits = _starting_signals(plan, outputs, signal)
    depends = plan.needs_signal()
    for j in reversed(range(len(plan.steps))):
        step, key = plan.steps[j], wiring.outputs[j]
        delta = signals.pop(key, None)
        if not depends[key] or delta is None:
            continue  # nothing wanted at or below it, or no output reads it
        delta = signal_for(step, delta, plan.wanted[j], n_samples)
        if at_logits and j == plan.top:
            delta = LogitsSignal(delta)
        need = [depends[k] for k in wiring.inputs[j]]
        if step.several_inputs:
            below = visit(step, saved[j], delta, plan.wanted[j], need)
        else:
            below = [visit(step, saved[j], delta, plan.wanted[j], need[0])]
        for k, part, needed in zip(wiring.inputs[j], below, need, strict=True):
            if needed and part is not None:
                signals[k] = part if k not in signals else signals[k] + part
    return n_samples, n_outputs, outputs[0].dtype


@dataclass(frozen=True)
class OutputRows:
    """A signal on the l output rows of every sample, in the order of
    ``jacutil.core.outputs`` (each output flattened, in ``tf.nest.flatten``
    order): ``rows`` of shape (1 or n, r, l).
    """

    rows: object


def _starting_signals(plan, outputs, signal):
    """``({key: signal}, r, at_logits)``: each model output's starting signal."""
    at_logits = False
    if signal is None or isinstance(signal, OutputRows):
        sizes = [int(np.prod(y.shape[1:], dtype=np.int64)) for y in outputs]
        if signal is None:  # one identity for every sample, broadcast where needed
            rows = tf.eye(sum(sizes), dtype=outputs[0].dtype)[None]
            n_outputs = sum(sizes)
        else:
            rows = signal.rows
            n_outputs = tf.shape(rows)[1]
        parts = tf.split(rows, sizes, axis=2) if len(sizes) > 1 else [rows]
        deltas = [
            tf.reshape(part, tf.concat([tf.shape(part)[:2], y.shape[1:]], 0))
            for part, y in zip(parts, outputs, strict=True)
        ]
    else:
        if len(outputs) != 1:
            raise SignalOnSeveralOutputs(
                f"a signal function on a model of {len(outputs)} outputs"
            )
        delta = signal(outputs[0])
        at_logits = isinstance(delta, LogitsSignal)
        if at_logits:
            delta = delta.delta
            top = plan.top
            only_reader = plan.wiring.readers().get(plan.wiring.model_outputs[0]) == 1
            if top is None or not only_reader:
                raise LogitsNotOnRules("the output is not written by one layer")
            if not plan.steps[top].takes_logits_signal:
                raise LogitsNotOnRules(plan.steps[top].describe())
        deltas, n_outputs = [delta], tf.shape(delta)[1]
    signals = {}
    for key, delta in zip(plan.wiring.model_outputs, deltas, strict=True):
        signals[key] = delta if key not in signals else signals[key] + delta
    return signals, n_outputs, at_logits


def signal_for(step, delta, wanted, n_samples):
    """The signal a step takes: ``delta`` ``(1 or n, l, *output_shape)`` with one
    row per sample (broadcast to n = ``n_samples``), unless the step's rule
    takes a shared signal and writes no blocks (no ``wanted`` variable)."""
    if wanted or not step.shared_signal:
        return tf.broadcast_to(delta, tf.concat([[n_samples], tf.shape(delta)[1:]], 0))
    return delta


def place_blocks(blocks, variables, n_samples, n_outputs, dtype):
    """(n, l, m) Jacobian of ``dtype``, with n = ``n_samples`` and
    l = ``n_outputs``: the :class:`~jacutil.rules.registry.Blocks` (each
    (n, l, size)) in the columns of ``variables``, in that order.

    A joint block (kernel, bias) lies whole where its variables are adjacent
    in ``variables`` (in its order) and is split otherwise; a variable
    without a block (the outputs do not use it) gets zeros.
    """
    position = {id(v): i for i, v in enumerate(variables)}
    at = {}  # position of the first variable -> (how many variables, block)
    for key, block in blocks.items():
        places = [position[id(v)] for v in key]
        if places == list(range(places[0], places[0] + len(places))):
            at[places[0]] = (len(key), block)
            continue
        parts = tf.split(block, [size_of(v) for v in key], axis=2)
        for place, part in zip(places, parts, strict=True):
            at[place] = (1, part)
    parts, i = [], 0
    while i < len(variables):
        if i in at:
            count, block = at[i]
            parts.append(block)
            i += count
        else:  # a variable the outputs do not use: zeros
            size = size_of(variables[i])
            parts.append(tf.zeros([n_samples, n_outputs, size], dtype))
            i += 1
    if not parts:
        return tf.zeros([n_samples, n_outputs, 0], dtype)
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=2)


class LogitsNotOnRules(Exception):
    """The loss reads logits that the top rule cannot start from."""


class SignalOnSeveralOutputs(LogitsNotOnRules):
    """A signal function on a model of several outputs: the rules start a
    function's signal at one output only (:class:`OutputRows` start anywhere).
    Like :class:`LogitsNotOnRules`, it sends the caller to autodiff."""
