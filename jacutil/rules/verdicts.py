"""The cheap check: each layer's rule proved once per configuration, the verdict kept.

A plan is used only where its rules are proved (:meth:`jacutil.rules.Plan.check`).
The proof is made of pieces that do not depend on the model around a layer:

- the rules' forward pass gives the model's outputs on the checked samples
  (so every replayed call and every wire between layers is right), and
- each layer's rule agrees with autodiff of that layer's own call, alone, on
  two of those samples: its blocks, its squared norms and the signal it
  passes below, for a random signal at its output (:func:`step_disagreement`).

The chain rule, which the walk (:mod:`jacutil.rules.walk`) applies, does the
rest. A layer's verdict depends only on its rule, its class and configuration,
its dtype, the shapes of its inputs and which of its variables are columns:
:func:`verdict_key` names it. A verdict that passed is kept in the process
and, for jacutil's own rules on Keras's own layers, in a folder under the
user's cache directory, one per TensorFlow, Keras and jacutil version (and
the source of the rules): ``JACUTIL_CHECK_CACHE`` names another folder, or
``0`` switches the folder off. A layer not yet proved is checked on first
use; where a check fails the whole model is checked against autodiff as
before (which also names float32's rounding). Introduced in ``08-your-own-model``.
"""

import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

from ..core._shared import joined_gradients, sizes_of
from ..core._tf import keras, tf
from ..core.target import watched
from .autodiff import AutodiffRule

CACHE_ENV = "JACUTIL_CHECK_CACHE"  # a folder, or "0" for none
OFF = ("0", "off", "false", "no", "none")
IGNORED = ("_initializer", "_regularizer", "_constraint")  # config keys
SIGNAL_ROWS = 1  # random signal rows per checked sample

_PASSED = set()  # verdict keys proved in this process


@dataclass
class CheckReport:
    """What a plan's check did: ``layers`` proved now, ``known`` taken from
    a kept verdict, ``whole_model`` whether autodiff of the whole model ran
    (a layer's check failed, or no cheap check applied), and ``seconds``."""

    layers: int = 0
    known: int = 0
    whole_model: bool = False
    seconds: float = 0.0
    failed: list = field(default_factory=list)  # why a layer's check failed

    def __str__(self):
        how = "autodiff of the whole model" if self.whole_model else "layer by layer"
        return (
            f"checked {how} in {self.seconds:.2f} s: {self.layers} layer rules "
            f"proved now, {self.known} known from an earlier check"
        )


@functools.cache
def versions():
    """The versions a verdict holds for: TensorFlow's, Keras's, jacutil's
    and a digest of the rules' source files (a ``str``)."""
    try:
        ours = metadata.version("jacutil")
    except metadata.PackageNotFoundError:  # run from a checkout, not installed
        ours = "unknown"
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return (
        f"tf-{tf.__version__}_keras-{keras.__version__}_jacutil-{ours}_"
        + (digest.hexdigest()[:12])
    )


def cache_folder():
    """The folder of kept verdicts for these :func:`versions`, or None when
    ``JACUTIL_CHECK_CACHE`` is ``0`` (a ``Path``)."""
    setting = os.environ.get(CACHE_ENV, "")
    if setting.lower() in OFF:
        return None
    if setting:
        base = Path(setting)
    else:
        home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        base = Path(home) / "jacutil" / "rule-checks"
    return base / versions()


def _config(layer):
    try:
        config = layer.get_config()  # a lambda activation: OSError (no source)
    except Exception:  # noqa: BLE001 (a config that cannot be read: not kept)
        return None
    # what the layer computes: not its name, nor how its weights were drawn
    config = {
        key: value for key, value in config.items()
        if key != "name" and not key.endswith(IGNORED)
    }  # fmt: skip
    return json.dumps(config, sort_keys=True, default=repr)


def verdict_key(step, node, inputs, wanted, need_signal):
    """``(key, keep_on_disk)``: the name of a layer's verdict (a hex ``str``),
    or ``(None, False)`` where no verdict may be kept (an instance whose
    ``call`` was replaced, a config that cannot be read)."""
    layer = step.layer
    config = _config(layer)
    if config is None or "call" in vars(layer):
        return None, False
    parts = [
        f"{type(step).__module__}.{type(step).__qualname__}", step.describe(),
        f"{type(layer).__module__}.{type(layer).__qualname__}", config,
        str(layer.compute_dtype), node.extra_arguments(),
        [(tuple(a.shape[1:]), str(a.dtype.name)) for a in inputs],
        [i for i, v in enumerate(step.variables) if v in wanted],
        list(need_signal),
    ]  # fmt: skip
    key = hashlib.sha256(json.dumps(parts, default=repr).encode()).hexdigest()
    ours = type(step).__module__.startswith("jacutil.rules.")
    keras_layer = type(layer).__module__.startswith("keras.")
    # a rule class defined elsewhere may be redefined with the same name
    return f"{key}-{id(type(step))}" if not ours else key, ours and keras_layer


def is_known(key, on_disk):
    """Whether the verdict ``key`` passed in this process or is kept on disk."""
    if key in _PASSED:
        return True
    folder = cache_folder() if on_disk else None
    if folder is not None and (folder / key).exists():
        _PASSED.add(key)
        return True
    return False


def remember(key, on_disk):
    """Keep a passed verdict: in the process, and on disk when ``on_disk``.
    The file appears whole or not at all (written, then renamed); a folder
    that cannot be written keeps it in the process only."""
    _PASSED.add(key)
    folder = cache_folder() if on_disk else None
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{key}.{os.getpid()}.partial"
        partial.write_text("passed\n")
        os.replace(partial, folder / key)
    except OSError:
        pass


def forget_in_process():
    """Drop the verdicts kept in this process (the folder keeps its own)."""
    _PASSED.clear()


def _relative(hand, reference):
    hand, reference = np.asarray(hand), np.asarray(reference)
    if hand.shape != reference.shape:
        return np.inf
    if hand.size == 0:
        return 0.0
    scale = max(1.0, float(np.abs(reference).max()))
    return float(np.abs(hand - reference).max()) / scale


def step_disagreement(step, node, a, wanted, need_signal, keys=None, seed=0):
    """None if ``step``'s rule agrees with autodiff of ``node`` (the layer's
    call in the model) on the samples of ``a``, else why (a ``str``).

    Checked: the rule's output, and for a random signal at the output its
    blocks of the ``wanted`` variables, their squared norms and the signal
    below (where ``need_signal``), each sample against a tape of its own.
    ``keys`` names the tensor of each input (default: all different): one
    tensor read twice (attention's query and value) gets the sum of both
    signals, as the walk sums them.
    """
    inputs = list(a) if step.several_inputs else [a]
    needed = list(need_signal) if step.several_inputs else [need_signal]
    keys = list(range(len(inputs))) if keys is None else list(keys)
    y, saved = step.forward(a)
    dtype = y.dtype
    tolerance = (1e-4 if dtype == tf.float32 else 1e-9) * np.sqrt(SIGNAL_ROWS)
    if _relative(y, node(*inputs)) > tolerance:
        return "its output differs from the layer's"
    n = int(y.shape[0])
    delta = tf.random.stateless_normal(
        [n, SIGNAL_ROWS, *y.shape[1:]], [seed, 3], dtype=dtype
    )
    blocks, below = step.backward(saved, delta, wanted, need_signal)
    squared, _ = step.backward_norms(saved, delta, wanted, need_signal)
    below = list(below) if step.several_inputs else [below]
    ours = [v for v in step.variables if v in wanted]
    if step.shared_signal and not ours:  # the walk may give one shared signal
        _, shared = step.backward(saved, delta[:1], wanted, need_signal)
        shared = list(shared) if step.several_inputs else [shared]
        for mine, one in zip(below, shared, strict=True):
            if mine is not None and _relative(one[0], mine[0]) > tolerance:
                return "its signal below differs when the signal is shared"
    from .walk import place_blocks  # the walk imports this module's caller

    hand = place_blocks(blocks, ours, n, SIGNAL_ROWS, dtype).numpy()
    first = {}  # each tensor's first position
    for p, key in enumerate(keys):
        first.setdefault(key, p)
    watch = [
        key for key, p in first.items()
        if needed[p] and inputs[p].dtype.is_floating
    ]  # fmt: skip
    tracked = [watched(v) for v in ours]
    for i in range(n):
        one = {key: inputs[p][i : i + 1] for key, p in first.items()}
        for k in range(SIGNAL_ROWS):
            with tf.GradientTape() as tape:
                tape.watch([one[key] for key in watch] + tracked)
                out = node(*[one[key] for key in keys])
            grads = tape.gradient(
                out, [one[key] for key in watch] + tracked,
                output_gradients=tf.cast(delta[i : i + 1, k], out.dtype),
            )  # fmt: skip
            auto = np.zeros(0)
            if ours:
                auto = joined_gradients(grads[len(watch) :], sizes_of(ours), dtype)
                auto = auto.numpy()
            errors = {
                "blocks": _relative(hand[i, k], auto),
                "squared norms": _relative(
                    np.asarray(squared)[i, k] if squared is not None else 0.0,
                    auto @ auto,
                ),
            }
            for key, grad in zip(watch, grads[: len(watch)], strict=True):
                reference = np.zeros(one[key].shape[1:]) if grad is None else grad[0]
                parts = [
                    np.asarray(below[p][i, k])
                    for p, same in enumerate(keys)
                    if same == key and below[p] is not None
                ]  # fmt: skip
                ours_below = sum(parts) if parts else np.zeros_like(reference)
                errors[f"signal below (input {first[key]})"] = _relative(
                    ours_below, reference
                )
            for what, error in errors.items():
                if not error <= tolerance:
                    return f"its {what} differ from autodiff by {error:.3g} (relative)"
    return None


def _rows(outputs):
    """(n, l): every output of a nest, each flattened per sample, side by side."""
    leaves = tf.nest.flatten(outputs)
    return tf.concat([tf.reshape(t, [tf.shape(t)[0], -1]) for t in leaves], 1)


def prove_layers(plan, x, target, report):
    """Whether every rule of ``plan`` on the samples of ``x`` is proved
    layer by layer (kept verdicts, or checked now and kept), its forward
    pass giving the model's outputs; ``report`` (a :class:`CheckReport`)
    counts what it did. False: the whole model must be checked."""
    from .walk import forward_values

    start = time.perf_counter()
    try:
        values, _ = forward_values(plan, x)
        ours = _rows([values[key] for key in plan.wiring.model_outputs])
        theirs = _rows(target.forward(x))  # the outputs' rows, in one order
        tolerance = 1e-4 if ours.dtype == tf.float32 else 1e-9
        if _relative(ours, theirs) > tolerance:
            report.failed.append("the rules' forward pass differs from the model's")
            return False
        rows = int(tf.shape(tf.nest.flatten(x)[0])[0])
        two = sorted({0, rows - 1})
        depends = plan.needs_signal()
        wiring = plan.wiring
        for j, step in enumerate(plan.steps):
            if isinstance(step, AutodiffRule) or not depends[wiring.outputs[j]]:
                continue  # autodiff itself, or never on the backward walk
            keys = wiring.inputs[j]
            inputs = [tf.gather(values[k], two) for k in keys]
            need = [depends[k] for k in keys]
            wanted = plan.wanted[j]
            a = inputs if step.several_inputs else inputs[0]
            need_signal = need if step.several_inputs else need[0]
            key, on_disk = verdict_key(step, plan.nodes[j], inputs, wanted, need)
            if key is not None and is_known(key, on_disk):
                report.known += 1
                continue
            why = step_disagreement(
                step, plan.nodes[j], a, wanted, need_signal, keys=keys
            )
            report.layers += 1
            if why is not None:
                report.failed.append(f"layer {step.layer.name!r}: {why}")
                return False
            if key is not None:
                remember(key, on_disk)
        return True
    finally:
        report.seconds += time.perf_counter() - start
