"""The benchmark: every path on the question's network, in one run (``make bench``).

    python -m jacutil.bench                        # n = 100, 1,000, 10,000
    python -m jacutil.bench --sizes 100 1000 --repeats 5 --memory inline

Each path runs at each n: the first call (trace, compile) is timed apart, then
``repeats`` more calls give the median. A path is skipped where its predicted
time for all those calls exceeds ``--max-seconds``, or, for the quadratic
``tape.jacobian`` paths, where its predicted memory does not fit. Every result
is checked against the compiled per-sample stage before it is timed. Peak
memory is the resident memory a path's first call at each n needs above the
level before, measured in a fresh process per path (``--memory fresh``), or in
this one (``inline``: quicker, but memory that an earlier path left pooled is
not counted again).

The *floor* is the time to write an array of the Jacobian's size:
``np.full((n, l, m), 1.0, float32)`` allocates a fresh array and writes every
element once, which any function that returns a new Jacobian must do too.

Writes ``results.json``, ``results.md`` (the tables) and ``scaling.png`` (a
log-log plot) into ``--out`` (``build/bench``). Introduced in ``07-benchmark``.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import memory, peers
from ._tf import tf
from .chunked import chunked_jacobian
from .compiled import compiled_jacobian
from .dense_jacobian import compiled_dense_jacobian
from .loop import loop_jacobian
from .models import question_mlp, regression_data, sequence_data, sequence_lstm
from .vectorized import per_sample_jacobian, vectorized_jacobian

SIZES = (100, 1000, 10_000)
REFERENCE = "compiled"  # every path is checked against this one, at every n
FLOOR = "floor"


@dataclass
class Path_:
    """One way to compute the Jacobian: ``build(model)`` returns ``jac(x)``."""

    label: str
    build: object
    exponent: int = 1  # time and memory grow like n**exponent


PATHS = {
    "loop": Path_("loop_jacobian (nested loop)", lambda m: _bind(loop_jacobian, m)),
    "vectorized": Path_(
        "vectorized_jacobian (tape.jacobian, eager)",
        lambda m: _bind(vectorized_jacobian, m),
        exponent=2,
    ),
    "compiled_batch": Path_(
        "tape.jacobian, tf.function",
        lambda m: compiled_jacobian(m, method="batch"),
        exponent=2,
    ),
    "per_sample": Path_(
        "per_sample_jacobian (vectorized_map, eager)",
        lambda m: _bind(per_sample_jacobian, m),
    ),
    "compiled": Path_("vectorized_map, tf.function", compiled_jacobian),
    "compiled_xla": Path_(
        "vectorized_map, XLA", lambda m: compiled_jacobian(m, jit_compile=True)
    ),
    "chunked": Path_(
        "chunked_jacobian (256 MiB chunks)",
        lambda m: _bind(chunked_jacobian, m, progress=False),
    ),
    "dense": Path_("hand-derived, tf.function", compiled_dense_jacobian),
    "dense_xla": Path_(
        "hand-derived, XLA",
        lambda m: compiled_dense_jacobian(m, jit_compile=True),
    ),
    "jax": Path_("JAX jit(vmap(jacrev))", peers.jax_jacobian),
    "torch": Path_("torch.func vmap(jacrev)", peers.torch_jacobian),
}
PEERS = ("jax", "torch")


@dataclass
class BenchModel:
    """A model to time: ``build(seed)`` and ``inputs(n, seed)``."""

    label: str
    build: object
    inputs: object
    paths: tuple = ()  # default paths (empty: all)


MODELS = {
    "mlp": BenchModel(
        "the question's network (10-64-32-2, float32)",
        lambda seed: question_mlp(seed=seed),
        lambda n, seed: regression_data(n, seed=seed)[0],
    ),
    "lstm": BenchModel(
        "LSTM(16) -> Dense(2) on 16 steps x 4 (float32)",
        lambda seed: sequence_lstm(seed=seed),
        lambda n, seed: sequence_data(n, seed=seed),
        paths=(
            "loop",
            "vectorized",
            "compiled_batch",
            "per_sample",
            "compiled",
            "compiled_xla",
            "chunked",
        ),
    ),
}


def jacobian_shape(model, x, n):
    """(n, l, m) of the model's per-sample Jacobian, from one sample of x."""
    n_outputs = int(np.prod(model(x[:1]).shape[1:]))
    n_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return (n, n_outputs, n_params)


def _bind(function, model, **options):
    return lambda x: function(model, x, **options)


def write_floor(shape, dtype=np.float32):
    """The floor: a fresh array of the Jacobian's shape, every element written once."""
    return np.full(shape, 1.0, dtype)


@dataclass
class Result:
    """One path at one n: seconds, peak bytes, or why it was skipped."""

    path: str
    n: int
    first: float | None = None
    times: list = field(default_factory=list)
    median: float | None = None
    peak: int | None = None
    skipped: str | None = None
    predicted: float | None = None  # seconds of one call, where skipped


def _first_call(jac, x, memory_mode):
    """(result, seconds, peak bytes or None) of the first call at this n."""
    if memory_mode == "inline":
        use = memory.peak_memory(jac, x)
        return use.result, use.seconds, use.peak
    start = time.perf_counter()
    J = jac(x)
    return J, time.perf_counter() - start, None


def _times(jac, x, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jac(x)
        times.append(time.perf_counter() - start)
    return times


def _predict(done, path, n):
    """Seconds of one call at n, extrapolated from the sizes this path ran at.

    From one size: linear in n (small n is mostly overhead, so a quadratic
    path would be overestimated); from two: the fitted slope, between 1 and
    the path's exponent. Memory, not time, guards the quadratic paths.
    """
    ran = [r for r in done if r.path == path and r.median is not None]
    if not ran:
        return None
    slope = 1.0
    if len(ran) >= 2:
        a, b = ran[-2], ran[-1]
        slope = np.log(b.median / a.median) / np.log(b.n / a.n)
        slope = float(np.clip(slope, 1.0, PATHS[path].exponent))
    return ran[-1].median * (n / ran[-1].n) ** slope


def _predicted_peak(done, path, n, model="mlp"):
    """Bytes at n of a quadratic path: a*n**2 fitted to the peaks measured so far."""
    peaks = [(r.n, r.peak) for r in done if r.path == path and r.peak]
    guesses = [max(p / m**2 for m, p in peaks) * n**2] if peaks else []
    if model == "mlp":  # the measured model of notebook 02
        guesses.append(memory.predicted_bytes(n, "batch"))
    return max(guesses, default=None)


def _skip_reason(done, path, n, repeats, max_seconds, model="mlp"):
    predicted = _predict(done, path, n)
    if PATHS[path].exponent == 2:  # memory first: it is the real limit
        peak = _predicted_peak(done, path, n, model)
        free = _available()
        if peak is not None and peak > free:
            return predicted, (
                f"out of memory: needs about {peak / 2**30:.0f} GiB, "
                f"{free / 2**30:.0f} GiB free"
            )
    if predicted is not None and predicted * (repeats + 1) > max_seconds:
        return predicted, f"predicted {repeats + 1} x {_seconds(predicted)}"
    return predicted, None


def _available():
    """Half of the memory that is free now, in bytes."""
    import psutil

    return int(0.5 * psutil.virtual_memory().available)


def build_paths(model, names, log=print):
    """``{name: jac}`` for the paths that can run here (peers when installed)."""
    built = {}
    for name in names:
        jac = PATHS[name].build(model)
        if jac is None:
            log(
                f"note: {PATHS[name].label} skipped: {name} is not installed "
                "(make bench-peers installs it)."
            )
            continue
        built[name] = jac
    return built


def run_bench(
    sizes=SIZES,
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

    ``model`` names one of :data:`MODELS`: the question's MLP (every path)
    or an LSTM (the autodiff paths).
    """
    bench_model = MODELS[model]
    network = bench_model.build(seed)
    names = list(paths or bench_model.paths or PATHS)
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    built = build_paths(network, names, log)
    x_all = bench_model.inputs(max(sizes), seed)
    done = []
    for n in sorted(sizes):
        x = x_all[:n]
        shape = jacobian_shape(network, x, n)
        _, first, peak = _first_call(write_floor, shape, memory_mode)
        times = _times(write_floor, shape, repeats)
        done.append(Result(FLOOR, n, first, times, float(np.median(times)), peak))
        reference = None
        for name, jac in built.items():
            predicted, reason = _skip_reason(done, name, n, repeats, max_seconds, model)
            if reason:
                done.append(Result(name, n, skipped=reason, predicted=predicted))
                log(f"n = {n:>6,}  {PATHS[name].label:<45} skipped: {reason}")
                continue
            J, first, peak = _first_call(jac, x, memory_mode)
            times = _times(jac, x, repeats)
            if reference is None:
                reference = np.array(J)
            np.testing.assert_allclose(
                J,
                reference,
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{name} disagrees with {REFERENCE} at n = {n}",
            )
            result = Result(name, n, first, times, float(np.median(times)), peak)
            done.append(result)
            log(
                f"n = {n:>6,}  {PATHS[name].label:<45} "
                f"{_seconds(result.median):>9}  (first {_seconds(first)})"
            )
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
        "sizes": sorted(sizes),
        "repeats": repeats,
        "memory": memory_mode,
        "labels": {name: PATHS[name].label for name in built} | {FLOOR: "write floor"},
        "results": [asdict(r) for r in done],
    }


def _seconds(s):
    if s is None:
        return "-"
    return (
        f"{s:.2f} s"
        if s >= 1
        else f"{1e3 * s:.1f} ms"
        if s >= 1e-3
        else (f"{1e6 * s:.0f} us")
    )


def machine_summary():
    """Where the numbers come from: CPU, load, versions."""
    versions = {"tensorflow": tf.__version__, "numpy": np.__version__}
    for name in PEERS:
        if peers.available(name):
            versions[name] = __import__(name).__version__
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "python": platform.python_version(),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def _measure_memory(name, sizes, seed, model="mlp"):
    """Peak bytes of each size's first call, sizes increasing (in this process)."""
    network = MODELS[model].build(seed)
    jac = PATHS[name].build(network) if name != FLOOR else None
    x = MODELS[model].inputs(max(sizes), seed)
    start = memory.anonymous_rss()
    peaks = []
    for n in sorted(sizes):
        if jac is None:
            shape = jacobian_shape(network, x, n)
            use = memory.peak_memory(write_floor, shape, baseline=start)
        else:
            use = memory.peak_memory(jac, x[:n], baseline=start)
        peaks.append(use.peak)
    return peaks


def measure_in_fresh_process(name, sizes, seed=0, model="mlp"):
    """Peak bytes of path ``name`` at each size, in a new Python process."""
    if not sizes:
        return []
    command = [
        sys.executable,
        "-m",
        "jacutil.bench",
        "--measure-memory",
        name,
        "--seed",
        str(seed),
        "--model",
        model,
        "--sizes",
        *map(str, sizes),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def profile_dense(model, x, repeats=5):
    """Where the hand-derived path's time goes at one n: ``{piece: seconds}``.

    Each piece includes the ones before it: the forward pass alone, the
    column blocks (not joined), the joined tensor, ``jac(x)`` (a NumPy view
    of it), ``jac(x, copy=True)``; and the floor.
    """
    from .dense_jacobian import dense_blocks

    jac = compiled_dense_jacobian(model)
    if jac.fallback:
        raise ValueError(f"the hand-derived path does not apply: {jac.fallback}.")
    x_tensor = tf.constant(x)
    spec = [tf.TensorSpec([None, x.shape[1]], x_tensor.dtype)]
    forward = tf.function(lambda x: model(x, training=False), input_signature=spec)
    blocks = tf.function(
        lambda x: dense_blocks(jac.chain, jac.target.variables, x),
        input_signature=spec,
    )
    shape = (len(x), int(model.outputs[0].shape[-1]), jac.target.n_params)
    pieces = {
        "forward pass only": lambda: forward(x_tensor),
        "column blocks, not joined": lambda: blocks(x_tensor),
        "joined: the (n, l, m) tensor": lambda: jac.tensor(x_tensor),
        "jac(x): a read-only NumPy view": lambda: jac(x),
        "jac(x, copy=True): writable": lambda: jac(x, copy=True),
        "floor: write a new array": lambda: write_floor(shape),
    }
    timings = {}
    for name, piece in pieces.items():
        piece()
        timings[name] = float(np.median(_times(lambda _, p=piece: p(), None, repeats)))
    return timings


def _results_at(results, n):
    return {r["path"]: r for r in results["results"] if r["n"] == n}


def ratios(results, n):
    """``{path: (x loop, x fastest, x floor)}`` at n; the loop predicted if skipped."""
    at = _results_at(results, n)
    ran = {p: r["median"] for p, r in at.items() if r["median"] is not None}
    floor = ran.pop(FLOOR)
    if not ran:
        return {}
    fastest = min(ran.values())
    loop = at.get("loop", {})
    loop = loop.get("median") or loop.get("predicted")
    return {
        p: (loop / t if loop else None, t / fastest, t / floor) for p, t in ran.items()
    }


def table_at(results, n):
    """A Markdown table of every path at n, fastest first."""
    at = _results_at(results, n)
    labels = results["labels"]
    share = ratios(results, n)
    floor = at[FLOOR]
    n_outputs, n_params = results.get("shape", (2, 2850))
    mbytes = n * n_outputs * n_params * 4 / 1e6
    lines = [
        f"**n = {n:,}** - the floor writes a new {n:,} x {n_outputs} x "
        f"{n_params:,} float32 array ({mbytes:,.1f} MB) in "
        f"{_seconds(floor['median'])}",
        "",
        "| path | median | first call | peak memory | loop / path | "
        "x fastest | x floor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def order(item):
        r = item[1]
        return (r["median"] is None, r["median"] or r["predicted"] or np.inf)

    for path, r in sorted(at.items(), key=order):
        if path == FLOOR:
            continue
        label = labels.get(path, path)
        if r["median"] is None:
            guess = f"~{_seconds(r['predicted'])}" if r["predicted"] else "-"
            lines.append(f"| {label} | {guess} | skipped: {r['skipped']} | | | | |")
            continue
        peak = f"{r['peak'] / 2**20:,.0f} MiB" if r["peak"] is not None else "-"
        vs_loop, vs_fastest, vs_floor = share[path]
        vs_loop = f"{vs_loop:,.0f}" if vs_loop else "-"
        lines.append(
            f"| {label} | {_seconds(r['median'])} | {_seconds(r['first'])} | {peak} "
            f"| {vs_loop} | {vs_fastest:.2f} | {vs_floor:.1f} |"
        )
    return "\n".join(lines)


def markdown(results):
    """All the tables, and where they were measured."""
    m = results["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    label = results.get("model_label", "the question's network (10-64-32-2, float32)")
    head = [
        f"# Per-sample Jacobian of {label}",
        "",
        f"{m['date']}, {m['cpu_count']} CPUs ({m['processor']}), load average "
        f"{m['load_average']}; {versions}. Medians of {results['repeats']} runs "
        f"after the first call; peak memory measured {results['memory']}. "
        "`loop / path`: how many times faster than the nested loop (~: the loop "
        "was predicted, not run).",
    ]
    tables = [table_at(results, n) for n in results["sizes"]]
    if "profile" in results:
        tables.append(profile_table(results["profile"]))
    return "\n\n".join(["\n".join(head), *tables]) + "\n"


def profile_table(profile):
    """Markdown: where the hand-derived path's time goes (see ``profile_dense``)."""
    lines = [
        f"**Where the hand-derived path's time goes, n = {profile['n']:,}** "
        "(each piece includes the ones above it)",
        "",
        "| piece | median |",
        "|---|---:|",
    ]
    for name, seconds in profile["seconds"].items():
        lines.append(f"| {name} | {_seconds(seconds)} |")
    return "\n".join(lines)


def series(results):
    """``{label: [median or None per size]}`` for the plot, the floor included."""
    out = {}
    for path, label in results["labels"].items():
        values = []
        for n in results["sizes"]:
            r = _results_at(results, n).get(path)
            values.append(r["median"] if r else None)
        if sum(v is not None for v in values):
            out[label] = values
    return out


def slopes(results):
    """``{label: fitted slope of log(median) against log(n)}``, two sizes or more."""
    from .plots import fitted_slope

    out = {}
    for label, values in series(results).items():
        ran = [(n, v) for n, v in zip(results["sizes"], values, strict=True) if v]
        if len(ran) >= 2:
            out[label] = fitted_slope([n for n, _ in ran], [v for _, v in ran])
    return out


def plot(results, ax=None):
    """Log-log plot of every path's median against n, with fitted slopes."""
    import matplotlib.pyplot as plt

    from .plots import loglog_scaling

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4.5))
    colors = plt.cm.tab20.colors
    ax.set_prop_cycle(color=colors[::2] + colors[1::2])  # 20 distinct colours
    ax = loglog_scaling(results["sizes"], series(results), ax=ax)
    for line in ax.get_lines():
        if line.get_label().startswith("write floor"):
            line.set(color="black", linestyle="--")
    label = results.get("model_label", "the question's network")
    ax.set_title(f"Per-sample Jacobian of {label.split(' (')[0]}: median time")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.figure.tight_layout()
    return ax


def save(results, out):
    """Write results.json, results.md and scaling.png into ``out``.

    A model other than the question's MLP gets its name in the file names:
    results-lstm.json, results-lstm.md, scaling-lstm.png.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = results.get("model", "mlp")
    suffix = "" if model == "mlp" else f"-{model}"
    (out / f"results{suffix}.json").write_text(json.dumps(results, indent=1))
    (out / f"results{suffix}.md").write_text(markdown(results))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    plot(results, ax=ax)
    fig.savefig(out / f"scaling{suffix}.png", dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m jacutil.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=30.0,
        help="skip a path at a size when all its calls there "
        "are predicted to take longer (default 30)",
    )
    parser.add_argument("--memory", choices=["fresh", "inline"], default="fresh")
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS))
    parser.add_argument(
        "--quick", action="store_true", help="sizes 100 1,000, 3 repeats, memory inline"
    )
    parser.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        help="skip timing the pieces of the hand-derived path",
    )
    parser.add_argument("--out", default="build/bench")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model",
        nargs="+",
        choices=sorted(MODELS),
        default=["mlp", "lstm"],
        help="the models to time, one run each (default: mlp lstm)",
    )
    parser.add_argument("--measure-memory", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_memory:
        peaks = _measure_memory(
            args.measure_memory, args.sizes, args.seed, args.model[0]
        )
        print(json.dumps(peaks))
        return None
    if args.quick:
        args.sizes, args.repeats, args.memory = [100, 1000], 3, "inline"
    every = []
    for model in args.model:
        print(f"\n{MODELS[model].label}")
        results = run_bench(
            args.sizes,
            repeats=args.repeats,
            max_seconds=args.max_seconds,
            memory_mode=args.memory,
            paths=args.paths,
            seed=args.seed,
            model=model,
        )
        after = [round(v, 2) for v in os.getloadavg()]
        results["machine"]["load_average_after"] = after
        n = max(args.sizes)
        if args.profile and "dense" in results["labels"]:
            x = regression_data(n, seed=args.seed)[0]
            profile = profile_dense(question_mlp(seed=args.seed), x, args.repeats)
            results["profile"] = {"n": n, "seconds": profile}
        out = save(results, args.out)
        print()
        print(markdown(results))
        every.append(results)
    print(f"wrote results, tables and plots into {out}/")
    return every[0] if len(every) == 1 else every


if __name__ == "__main__":
    main()
