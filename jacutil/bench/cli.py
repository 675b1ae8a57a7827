"""``python -m jacutil.bench``: every path on each model, tables and plots.

    python -m jacutil.bench                    # mlp, cnn, lstm at their sizes
    python -m jacutil.bench --model mlp --sizes 100 1000 --memory inline

    python -m jacutil.bench --peer-rows        # and jacutil against the peers
                                               # on gradients, norms, more models

Writes results[-MODEL].json, .md (the tables) and scaling[-MODEL].png into
``--out`` (``build/bench``); with ``--peer-rows``, peers.json and peers.md
too (see ``peer_rows.py``). Introduced in ``07-benchmark``.
"""

import argparse
import json
import os
from pathlib import Path

from .fresh import measure_memory
from .paths import MODELS, PATHS
from .peer_rows import TASKS, peer_rows_markdown, run_peer_rows
from .plots import save
from .profile import profile_dense
from .report import markdown, summary_table
from .runner import run_bench


def parse(argv):
    """The command line's options, an ``argparse.Namespace`` (``argv`` None:
    ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(
        prog="python -m jacutil.bench",
        description="Time every per-sample Jacobian path, with JAX and PyTorch "
        "when installed, against the write floor.",
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        help="numbers of samples (default: each model's own; mlp 100 1,000 "
        "10,000, cnn and lstm 100 2,000)",
    )
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
        default=["mlp", "cnn", "lstm"],
        help="the models to time, one run each (default: mlp cnn lstm)",
    )
    parser.add_argument(
        "--peer-rows",
        nargs="*",
        choices=sorted(TASKS),
        metavar="TASK",
        help="also time jacutil against JAX and PyTorch on per-sample gradients, "
        "their norms and the Jacobian of more models (no TASK: all of "
        f"{', '.join(TASKS)}); --sizes and --quick set their n too",
    )
    parser.add_argument("--measure-memory", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.memory = [100, 1000], 3, "inline"
    return args


def run_one(model, args):
    """One model's run (a name in ``MODELS``), with the parsed command line:
    time, profile (the hand-derived path), save, print; the results dict."""
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
    n = max(results["sizes"])
    if args.profile and "dense" in results["labels"]:
        network = MODELS[model].build(args.seed)
        x = MODELS[model].inputs(n, args.seed)
        profile = profile_dense(network, x, args.repeats)
        results["profile"] = {"n": n, "seconds": profile}
    save(results, args.out)
    print()
    print(markdown(results))
    return results


def run_rows(args):
    """The peer rows (``--peer-rows``): time, save peers.json and .md, print;
    the dict ``run_peer_rows`` returns."""
    print("\njacutil against JAX and PyTorch: gradients, norms, more models")
    results = run_peer_rows(
        args.peer_rows or None, args.sizes, repeats=args.repeats, seed=args.seed
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(results, indent=1))
    text = peer_rows_markdown(results)
    (out / "peers.md").write_text(text)
    print()
    print(text)
    return results


def main(argv=None):
    """Run the benchmark on the command line ``argv`` (None: ``sys.argv[1:]``);
    the results dict, a list of them for several models, or None
    (``--measure-memory``)."""

    args = parse(argv)
    if args.measure_memory:  # one path's memory, in a fresh process (fresh.py)
        peaks = measure_memory(
            args.measure_memory, args.sizes, args.seed, args.model[0]
        )
        print(json.dumps(peaks))
        return None
    every = [run_one(model, args) for model in args.model]
    if len(every) > 1:
        for results in every:
            print(f"\n{results['model_label']}\n\n{summary_table(results)}")
    if args.peer_rows is not None:
        run_rows(args)
    print(f"\nwrote results, tables and plots into {args.out}/")
    return every[0] if len(every) == 1 else every
