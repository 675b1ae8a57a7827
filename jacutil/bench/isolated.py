"""The peer rows with each library in its own process, beside one process.

In one process (:func:`in_one_process`) the libraries take turns, and
one library's thread pools, still spinning after its call, slow the next
library's (JAX's slow TensorFlow's). Here each library (jacutil, JAX,
PyTorch) builds the row's model, from the same seed, in a Python process of
its own; the processes wait side by side, and the parent asks each in turn
for one round of timed calls, round after round, starting each round with a
different library, so that a drift in the machine's load falls on all
alike; each round starts after a fifth of a second of quiet, so that the
threads the last library left spinning have gone to sleep. A row's time
is the median of its rounds' medians. Before any timing, each peer's result
is checked against jacutil's (saved by jacutil's process).

``python -m jacutil.bench.isolated`` times the rows of issue 38's table both
ways and prints them side by side with each ratio to the fastest peer and
whether the aim holds in both (``make bench-peers``). What each library
computes in each row is in :mod:`.fair_tasks`: the peer rows' gradients,
norms and Jacobian, the last-layer Laplace predictive against laplace-torch,
and the J of the CNN and the LSTM against the write floor. Introduced in
``07-benchmark``.
"""

import argparse
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..teaching.memory_sweeps import fresh_python
from ..teaching.timing import Timing, first_call, repeat_times
from .fair_tasks import NAMES, describe, libraries, model_name, prepare
from .machine import machine_summary
from .peer_rows import peer_ratio
from .skipping import format_seconds

# issue 38's rows: (task, n) -> the aim, jacutil's time over the fastest peer's
AIMS = {
    ("jacobian-mlp", 100): 1.0,
    ("gradients-mlp", 1000): 1.0,
    ("gradients-cnn", 1000): 1.0,
    ("norms-mlp", 1000): 0.5,
    ("norms-lstm", 1000): 0.5,
    ("norms-cnn", 1000): 0.5,
    ("floor-cnn", 2000): 4.0,
    ("floor-lstm", 2000): 4.0,
    ("laplace-mlp", 1000): 1.0,
}
# PyPI's torch loads triton, which crashes (SIGSEGV) when TensorFlow was
# loaded first: a process that may use PyTorch imports them first
TORCH_FIRST = "try:\n    import triton, torch\nexcept ImportError:\n    pass\n"
MAIN = "from jacutil.bench.isolated import main\nmain()"
SETTLE = 0.2  # seconds of quiet before each library's round
WAIT = 900  # seconds a child may take to answer (a first call compiles)


def thread_settings():
    """The thread counts of the libraries loaded in this process, a dict:
    TensorFlow's intra- and inter-op pools (0: its default, one per core),
    PyTorch's threads, and the environment's OpenMP and XLA settings."""
    from ..core._tf import tf

    settings = {
        "tf_intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
        "tf_inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
    }
    if "torch" in sys.modules:
        settings["torch"] = sys.modules["torch"].get_num_threads()
    for key in ("OMP_NUM_THREADS", "XLA_FLAGS", "TF_NUM_INTRAOP_THREADS"):
        if key in os.environ:
            settings[key] = os.environ[key]
    return settings


# -- the child: one library, one row ----------------------------------------------


def _say(message):
    print(json.dumps(message), flush=True)


def child(task_name, n, library, reference, *, repeats, seed, commands=None):
    """In its own process: build the row's function for ``library``, check
    it (the first process, jacutil's, saves its result to ``reference``;
    every later one is compared to it before it is timed), say it is ready,
    then time ``repeats`` calls for each ``go`` line of ``commands`` (stdin),
    until any other line or their end (the parent is gone)."""
    prepared = prepare(task_name, n, library, seed)
    value, first = first_call(prepared.function, *prepared.args)
    difference = 0.0
    if not Path(reference).exists():
        np.save(reference, np.asarray(value))
    else:
        difference = prepared.check(np.asarray(value), np.load(reference))
    _say({"first": first, "max_abs_diff": difference, "threads": thread_settings()})
    for line in sys.stdin if commands is None else commands:
        if line.strip() != "go":
            break
        times = repeat_times(prepared.function, *prepared.args, repeats=repeats)
        _say({"times": times})


# -- the parent ---------------------------------------------------------------------


class Child:
    """One library's process for one row; its stderr goes to a file whose
    end a failure quotes. Leaving the ``with`` block ends the process."""

    def __init__(self, task_name, n, library, reference, folder, repeats, seed):
        self.library = library
        self.log = Path(folder) / f"{library}.stderr"
        arguments = [task_name, str(n), library, str(reference)]
        arguments += ["--repeats", str(repeats), "--seed", str(seed)]
        code = (TORCH_FIRST if library in ("torch", "laplace") else "") + MAIN
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, "--child", *arguments],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.end()

    def answer(self):
        """The next JSON line the child prints; RuntimeError, with the end of
        its stderr, when it dies or stays silent for ``WAIT`` seconds."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            line = self.process.stdout.readline() if selector.select(WAIT) else ""
        if not line:
            self.end()
            tail = self.log.read_text()[-2000:]
            raise RuntimeError(
                f"the {self.library} process ended or stopped answering "
                f"(exit code {self.process.returncode}); its stderr ends:\n{tail}"
            )
        return json.loads(line)

    def round(self):
        """One round of timed calls: a list of seconds."""
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return self.answer()["times"]

    def end(self):
        """Close its stdin (it exits), then wait; kill it if it does not."""
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


def run_separately(task_name, n, *, rounds=7, repeats=3, seed=0, log=print):
    """Time one row with each installed library in its own process.

    Returns a row dict: ``task``, ``model``, ``n``, ``jacutil``, and
    ``peers`` with ``max_abs_diff``, each timing with ``first``, ``times``
    (the medians of its ``rounds`` rounds of ``repeats`` calls), ``median``
    and ``threads``; AssertionError when a peer's result differs."""
    names = libraries(task_name)
    with tempfile.TemporaryDirectory(prefix="jacutil-isolated-") as folder:
        reference = Path(folder) / "reference.npy"
        children, ready = {}, {}
        try:
            for library in names:  # jacutil first: the reference
                children[library] = Child(
                    task_name, n, library, reference, folder, repeats, seed
                )
                ready[library] = children[library].answer()
            rounds_of = {library: [] for library in names}
            for k in range(rounds):
                turn = names[k % len(names) :] + names[: k % len(names)]
                for library in turn:
                    time.sleep(SETTLE)  # the last library's spinning threads stop
                    rounds_of[library].append(
                        float(np.median(children[library].round()))
                    )
        finally:
            for process in children.values():
                process.end()
    timings = {
        library: {
            "first": ready[library]["first"],
            "times": rounds_of[library],
            "median": float(np.median(rounds_of[library])),
            "threads": ready[library]["threads"],
        }
        for library in names
    }
    row = {"task": task_name, "model": model_name(task_name), "n": n}
    row["jacutil"] = timings.pop("jacutil")
    row["peers"] = {
        peer: timing | {"max_abs_diff": ready[peer]["max_abs_diff"]}
        for peer, timing in timings.items()
    }
    log(f"separate processes: {task_name} n = {n:,}: " + ", ".join(
        f"{NAMES.get(library, library)} {format_seconds(t['median'])}"
        for library, t in [("jacutil", row["jacutil"]), *row["peers"].items()]
    ))  # fmt: skip
    return row


def in_one_process(task_name, n, *, repeats, seed):
    """The row with its libraries in turn in this process: each prepared,
    called once, checked against jacutil's result, then timed ``repeats``
    calls; a row dict as :func:`run_separately`'s."""
    row = {"task": task_name, "model": model_name(task_name), "n": n, "peers": {}}
    expected = None
    for library in libraries(task_name):
        prepared = prepare(task_name, n, library, seed)
        value, first = first_call(prepared.function, *prepared.args)
        difference = 0.0
        if expected is None:
            expected = np.asarray(value)
        else:
            difference = prepared.check(np.asarray(value), expected)
        times = repeat_times(prepared.function, *prepared.args, repeats=repeats)
        timing = Timing(first, times).as_dict()
        if library == "jacutil":
            row["jacutil"] = timing
        else:
            row["peers"][library] = timing | {"max_abs_diff": difference}
    return row


def one_process(task_name, n, repeats, seed):
    """:func:`in_one_process`'s row, run in a new Python process (which
    imports PyTorch first)."""
    return fresh_python(
        ["-c", TORCH_FIRST + MAIN, "--one-process", task_name, str(n),
         "--repeats", str(repeats), "--seed", str(seed)],
        f"the one-process run of {task_name} at n = {n} failed",
    )  # fmt: skip


def fair_rows(rows=None, *, rounds=7, repeats=3, seed=0, log=print):
    """Each of ``rows`` (``[(task, n)]``, default :data:`AIMS`'s) timed in
    one process (:func:`one_process`) and in separate processes
    (:func:`run_separately`); the results as a dict (``fair.json``)."""
    rows = list(rows or AIMS)
    both = []
    for task_name, n in rows:
        separate = run_separately(
            task_name, n, rounds=rounds, repeats=repeats, seed=seed, log=log
        )
        both.append({"one_process": one_process(task_name, n, rounds * repeats, seed),
                     "separate": separate})  # fmt: skip
    return {"machine": machine_summary(), "rounds": rounds, "repeats": repeats,
            "rows": both}  # fmt: skip


def _cell(row):
    ratio = peer_ratio(row)
    time = format_seconds(row["jacutil"]["median"])
    return f"{time} | {'-' if ratio is None else f'{ratio:.2f}'}"


def fair_table(results):
    """Markdown: each row's jacutil median and its ratio to the fastest peer,
    in one process and in separate processes, the aim, and whether it holds
    in both."""
    lines = [
        "| what | model | n | one process | x fastest | separate | x fastest "
        "| aim | met in both |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for pair in results["rows"]:
        one, separate = pair["one_process"], pair["separate"]
        aim = AIMS.get((one["task"], one["n"]))
        ratios = [peer_ratio(one), peer_ratio(separate)]
        if aim is None or None in ratios:
            met = "-"
        else:
            met = "yes" if max(ratios) <= aim else "no"
        lines.append(
            f"| {' | '.join(describe(one['task']))} | "
            f"{one['n']:,} | {_cell(one)} | {_cell(separate)} | "
            f"{'-' if aim is None else f'<= {aim:g}'} | {met} |"
        )
    return "\n".join(lines)


def _checked(timing):
    difference = timing["max_abs_diff"]
    if difference is None:
        return "(computes nothing: not compared)"
    return f"(max |peer - jacutil| {difference:.1e})"


def fair_markdown(results):
    """The section ``fair.md``: the table, the peers' medians, the threads."""
    m = results["machine"]
    head = (
        "# jacutil against the fastest peer, in one process and in separate "
        f"processes\n\n{m['date']}, {m['cpu_count']} CPUs, load average "
        f"{m['load_average']}. Separate: each library in its own process, "
        f"{results['rounds']} interleaved rounds of {results['repeats']} calls, "
        "the median of the rounds' medians. One process: the libraries in turn, "
        f"{results['rounds'] * results['repeats']} calls each. `x fastest`: "
        "jacutil's time over the fastest peer's (below 1: jacutil is faster); "
        "on a `x the write floor` row, over the time to fill a preallocated "
        "array of J's shape."
    )
    peers_lines = []
    for pair in results["rows"]:
        for way, row in pair.items():
            said = ", ".join(
                f"{NAMES[p]} {format_seconds(t['median'])} " + _checked(t)
                for p, t in row["peers"].items()
            )
            peers_lines.append(
                f"- {row['task']}, n = {row['n']:,}, {way.replace('_', ' ')}: "
                + (said or "no peer installed")
            )
    threads = {
        library: timing.get("threads")
        for pair in results["rows"][:1]
        for library, timing in [
            ("jacutil", pair["separate"]["jacutil"]),
            *pair["separate"]["peers"].items(),
        ]
    }
    return (
        "\n\n".join(
            [
                head,
                fair_table(results),
                "**The peers**:\n\n" + "\n".join(peers_lines),
                "**Threads in the separate processes**: " + json.dumps(threads),
            ]
        )  # fmt: skip
        + "\n"
    )


def main(argv=None):
    """``python -m jacutil.bench.isolated [--out DIR] [--rounds K]``; the
    hidden ``--child TASK N LIBRARY REFERENCE`` is one library's process."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m jacutil.bench.isolated")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--one-process", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="build/bench")
    args = parser.parse_args(argv)
    if args.child:
        task_name, n, library, reference = args.child
        child(task_name, int(n), library, reference, repeats=args.repeats,
              seed=args.seed)  # fmt: skip
        return
    if args.one_process:
        task_name, n = args.one_process
        row = in_one_process(task_name, int(n), repeats=args.repeats, seed=args.seed)
        print(json.dumps(row))
        return
    results = fair_rows(rounds=args.rounds, repeats=args.repeats, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fair.json").write_text(json.dumps(results, indent=1))
    text = fair_markdown(results)
    (out / "fair.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
