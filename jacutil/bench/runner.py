"""``run_bench``: time every path at every n, each checked against the reference.

Each path runs at each n: the first call (trace, compile) is timed apart,
then ``repeats`` more calls give the median. Every result is checked
against the compiled per-sample stage before it is timed. Beside the paths,
both write floors are timed at each n (see ``floor.py``). Introduced in
``07-benchmark``.
"""

from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np

from ..core import memory
from ..teaching.timing import first_call, repeat_times
from .floor import FLOOR, FLOOR_NEW, LABELS, fill_floor, preallocated, write_floor
from .fresh import measure_in_fresh_process
from .machine import machine_summary
from .paths import (
    MODELS,
    PATHS,
    REFERENCE,
    default_paths,
    jacobian_shape,
    not_installed,
)
from .skipping import format_seconds, memory_guard, quadratic_bytes, skip_reason


@dataclass
class Result:
    """One path at one n: seconds, peak bytes, or why it was skipped.

    Args:
        path: the path's name.
        n: the number of samples.
        first: seconds of the first call.
        times: seconds of each timed call.
        median: their median.
        peak: the first call's peak bytes.
        skipped: why it did not run, or None.
        predicted: seconds of one call, predicted where skipped.
        max_abs_diff: the largest absolute difference of its J from the
            reference's at this n (0 for the reference), or None.
        predicted_peak: for a quadratic path, the peak bytes predicted
            before it ran (or was skipped) at n; None otherwise.
        free: for a quadratic path, the machine's free bytes then; the
            path runs only where ``predicted_peak`` is below half of it.
    """

    path: str
    n: int
    first: float | None = None
    times: list = field(default_factory=list)
    median: float | None = None
    peak: int | None = None
    skipped: str | None = None
    predicted: float | None = None  # seconds of one call, where skipped
    max_abs_diff: float | None = None  # |J - the reference's J|, largest
    predicted_peak: int | None = None  # bytes, quadratic paths (skipping.py)
    free: int | None = None  # free bytes when predicted_peak was checked


def _timed(name, n, function, argument, repeats, watch_memory, check=None):
    """The :class:`Result` of ``function(argument)``: the first call (its peak
    bytes too when ``watch_memory``), then ``check(its value)``, which returns
    the largest absolute difference from the reference, then the timed calls."""
    if watch_memory:
        use = memory.peak_memory(function, argument)
        value, first, peak = use.result, use.seconds, use.peak
    else:
        (value, first), peak = first_call(function, argument), None
    difference = None if check is None else check(value)
    times = repeat_times(function, argument, repeats=repeats)
    return Result(
        name, n, first, times, float(np.median(times)), peak, max_abs_diff=difference
    )


def time_floors(shape, repeats, watch_memory):
    """Both floors at J's ``shape`` (n, l, m), a list of two :class:`Result`:
    filling a preallocated array, and np.full; ``repeats`` timed calls each, the
    first call's peak memory measured here when ``watch_memory``."""
    out = preallocated(shape)  # outside the timing
    floor = _timed(FLOOR, shape[0], fill_floor, out, repeats, watch_memory)
    new = _timed(FLOOR_NEW, shape[0], write_floor, shape, repeats, watch_memory)
    return [floor, new]


RTOL, ATOL = 1e-5, 1e-6  # every check: the paths, the peers, the peer rows


def tolerances():
    """The checks' tolerances in words: 'rtol 1e-5, atol 1e-6'."""

    def short(value):
        return f"{value:.0e}".replace("e-0", "e-")

    return f"rtol {short(RTOL)}, atol {short(ATOL)}"


def max_abs_diff(a, b):
    """The largest absolute difference of two arrays of one shape, a float
    (0.0 for empty arrays)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} and {b.shape}")
    return float(np.max(np.abs(a - b), initial=0.0))


def agree(value, expected, message):
    """Assert ``value`` equals ``expected`` at :data:`RTOL`, :data:`ATOL`
    (AssertionError with ``message`` otherwise); the largest absolute
    difference."""
    np.testing.assert_allclose(value, expected, rtol=RTOL, atol=ATOL, err_msg=message)
    return max_abs_diff(value, expected)


def _check(J, reference, name, n):
    """Every path's J equals the reference's (the first path run at this n);
    the largest absolute difference."""
    if not reference:
        reference.append(np.array(J))
    return agree(J, reference[0], f"{name} disagrees with {REFERENCE} at n = {n}")


def build_paths(model, names, log=print):
    """``{name: jac(x)}`` for the paths ``names`` that can run here on the Keras
    ``model`` (peers when installed); ``log`` says which cannot."""
    built = {}
    for name in names:
        jac = PATHS[name].build(model)
        if jac is None:
            log(not_installed(PATHS[name].label, name))
            continue
        built[name] = jac
    return built


def run_bench(
    sizes=None,
    *,
    repeats=5,
    max_seconds=30.0,
    memory_mode="fresh",
    paths=None,
    seed=0,
    log=print,
    model="mlp",
):
    """Time every path at every n; the results as a dict (``results.json``).

    ``model`` names one of :data:`MODELS` (the question's MLP, a CNN, an
    LSTM); ``sizes`` default to the model's own. ``paths`` default to every
    path that applies to the model. Peak memory is the first call's, measured
    in a fresh process per path (``memory_mode="fresh"``) or in this one
    (``"inline"``). ``repeats`` timed calls per path and n; a path is skipped
    at an n predicted to take longer than ``max_seconds``; ``seed`` is the
    model's and the inputs'; progress goes to ``log``.
    """

    bench_model = MODELS[model]
    sizes = sorted(sizes or bench_model.sizes)
    network = bench_model.build(seed)
    names = list(paths or default_paths(model, network))
    names = [REFERENCE] + [name for name in names if name != REFERENCE]
    built = build_paths(network, names, log)
    x_all = bench_model.inputs(max(sizes), seed)
    per_n2 = None
    if any(PATHS[name].exponent == 2 for name in built):
        per_n2 = quadratic_bytes(network, x_all)
    inline = memory_mode == "inline"
    done = []
    for n in sizes:
        x = x_all[:n]
        done += time_floors(jacobian_shape(network, x, n), repeats, inline)
        reference = []  # the reference's J at this n, once it has run
        for name, jac in built.items():
            guard = memory_guard(done, name, n, model, per_n2)
            predicted, reason = skip_reason(
                done, name, n, repeats, max_seconds, model, per_n2, guard
            )
            label = PATHS[name].label
            if reason:
                result = Result(name, n, skipped=reason, predicted=predicted)
                log(f"n = {n:>6,}  {label:<45} skipped: {reason}")
            else:
                # the quadratic paths watch memory even here: it guards larger n
                watch = inline or PATHS[name].exponent == 2
                check = partial(_check, reference=reference, name=name, n=n)
                result = _timed(name, n, jac, x, repeats, watch, check)
                log(
                    f"n = {n:>6,}  {label:<45} {format_seconds(result.median):>9}"
                    f"  (first {format_seconds(result.first)})"
                )
            result.predicted_peak, result.free = guard
            done.append(result)
    if memory_mode == "fresh":
        for name in built:
            ran = [r for r in done if r.path == name and r.median is not None]
            peaks = measure_in_fresh_process(name, [r.n for r in ran], seed, model)
            for r, peak in zip(ran, peaks, strict=True):
                r.peak = peak
    return {
        "model": model,
        "model_label": bench_model.label,
        "shape": list(jacobian_shape(network, x_all, 1)[1:]),
        "machine": machine_summary(),
        "sizes": sizes,
        "repeats": repeats,
        "memory": memory_mode,
        "labels": {name: PATHS[name].label for name in built} | LABELS,
        "results": [asdict(r) for r in done],
    }
