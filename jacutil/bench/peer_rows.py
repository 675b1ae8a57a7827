"""jacutil against JAX and PyTorch beyond the Jacobian: the peer rows.

``make bench-peers`` adds these rows (``--peer-rows``) to the Jacobian
tables: each is one of :data:`TASKS`, a kind of :data:`KINDS` on one model
at one n, timed for jacutil and each peer on the same weights
(``jacutil.peers`` rebuilds the Keras model). The ``jacobian`` rows time
models the Jacobian tables do not: a residual MLP (``Add`` skips) and a
two-head model (its two outputs' rows joined in jacutil's order).

Every call is timed the way a user repeats it: one warm-up call (trace,
compile; timed apart as ``first``), then the median of ``repeats`` calls.
Before the timed calls, each peer's result is checked against jacutil's
(``rtol`` 1e-5, ``atol`` 1e-6, as every Jacobian path is) and the largest
absolute difference is kept: each row's proof line prints it. The models
come from :data:`~.paths.MODELS`, so notebook ``07-benchmark`` can time
the same rows. Introduced in ``07-benchmark``.
"""

from dataclasses import dataclass

from .. import peers
from ..auto import jacobian
from ..core._tf import keras
from ..fitting.loss_gradients import per_sample_gradient_norms, per_sample_gradients
from ..teaching.timing import Timing, first_call, repeat_times
from .machine import machine_summary
from .models import targets
from .paths import MODELS, PEER_NAMES, PEERS, not_installed
from .runner import agree, tolerances
from .skipping import format_seconds

SQUARED_ERROR = keras.losses.mean_squared_error  # one loss a sample: the mean over l


@dataclass
class Kind:
    """What a row computes (``label``, in words): jacutil's way, ``ours(model)``
    returning ``f(x, y)``, and each peer's, ``{peer: (label, build)}`` where
    ``build(model)`` returns ``f(x, y)``, or None when the peer is not
    installed."""

    label: str
    ours: object
    peers: dict


def _gradients(model):
    return lambda x, y: per_sample_gradients(model, SQUARED_ERROR, x, y)


def _norms(model):
    return lambda x, y: per_sample_gradient_norms(model, SQUARED_ERROR, x, y)


def _jacobian(model):
    return lambda x, y: jacobian(model, x)


def _x_only(build):
    """A peer's ``jac(x)`` as ``f(x, y)``, or None."""

    def built(model):
        jac = build(model)
        return None if jac is None else (lambda x, y: jac(x))

    return built


KINDS = {
    "gradients": Kind(
        "per-sample gradients (squared error)",
        _gradients,
        {
            "jax": ("jit(vmap(grad))", peers.jax_gradients),
            "torch": ("vmap(grad)", peers.torch_gradients),
        },
    ),
    "norms": Kind(
        "per-sample gradient norms (squared error)",
        _norms,
        {
            "jax": ("jit(norm(vmap(grad)))", peers.jax_gradient_norms),
            "torch": ("norm(vmap(grad))", peers.torch_gradient_norms),
        },
    ),
    "jacobian": Kind(
        "per-sample Jacobian",
        _jacobian,
        {
            "jax": ("jit(vmap(jacrev))", _x_only(peers.jax_jacobian)),
            "torch": ("vmap(jacrev)", _x_only(peers.torch_jacobian)),
        },
    ),
}


@dataclass
class Task:
    """One kind of row (a name in :data:`KINDS`) on one model (a name in
    :data:`~.paths.MODELS`), at its default sizes n."""

    kind: str
    model: str
    sizes: tuple


TASKS = {
    **{
        f"{kind}-{model}": Task(kind, model, (1000, 10_000))
        for kind in ("gradients", "norms")
        for model in ("mlp", "cnn", "lstm")
    },
    "jacobian-mlp": Task("jacobian", "mlp", (100,)),
    "jacobian-residual": Task("jacobian", "residual", (2000,)),
    "jacobian-two_head": Task("jacobian", "two_head", (2000,)),
}


def inputs_for(task, network, n, seed):
    """(x, y) of n samples: the model's inputs and targets for its loss."""
    bench_model = MODELS[task.model]
    x = bench_model.inputs(n, seed)
    if task.kind == "jacobian":
        return x, None
    if bench_model.targets is not None:
        return x, bench_model.targets(n, seed)
    return x, targets(network, n, seed=seed)


def run_task(name, sizes=None, *, repeats=5, seed=0, log=print):
    """Time one task's rows: jacutil and each installed peer, each checked.

    ``name`` is a name in :data:`TASKS`; ``sizes`` default to the task's own;
    ``repeats`` timed calls after the warm-up call; ``seed`` the model's,
    inputs' and targets'; progress goes to ``log``. Returns a list of row
    dicts, one per n: ``task``, ``kind``, ``model``, ``n``, ``jacutil``
    (``first``, ``times``, ``median``) and ``peers`` (``{peer: {first, times,
    median, max_abs_diff}}``); AssertionError where a peer's result differs
    from jacutil's.
    """
    task = TASKS[name]
    kind = KINDS[task.kind]
    network = MODELS[task.model].build(seed)
    ours = kind.ours(network)
    theirs = {}
    for peer, (label, build) in kind.peers.items():
        function = build(network)
        if function is None:
            log(not_installed(f"{PEER_NAMES[peer]} {label}", peer))
            continue
        theirs[peer] = function
    rows = []
    for n in sorted(sizes or task.sizes):
        x, y = inputs_for(task, network, n, seed)
        expected, first = first_call(ours, x, y)
        times = repeat_times(ours, x, y, repeats=repeats)
        row = {
            "task": name,
            "kind": task.kind,
            "model": task.model,
            "n": n,
            "jacutil": Timing(first, times).as_dict(),
            "peers": {},
        }
        for peer, function in theirs.items():
            value, first = first_call(function, x, y)  # checked, then timed
            difference = agree(
                value, expected, f"{peer} disagrees with jacutil on {name} at n = {n}"
            )
            times = repeat_times(function, x, y, repeats=repeats)
            timing = Timing(first, times).as_dict()
            row["peers"][peer] = timing | {"max_abs_diff": difference}
        rows.append(row)
        log(_progress(row))
    return rows


def _progress(row):
    parts = [f"jacutil {format_seconds(row['jacutil']['median'])}"]
    for peer, timing in row["peers"].items():
        parts.append(f"{PEER_NAMES[peer]} {format_seconds(timing['median'])}")
    return f"n = {row['n']:>6,}  {row['task']:<22} " + ", ".join(parts)


def run_peer_rows(names=None, sizes=None, *, repeats=5, seed=0, log=print):
    """Time the peer rows; the results as a dict (``peers.json``).

    ``names`` default to all :data:`TASKS`, ``sizes`` (for every task) to
    each task's; the rest as :func:`run_task`. The dict holds ``machine``,
    ``repeats``, ``models`` (labels), ``kinds`` (labels) and ``rows``.
    """
    names = list(names or TASKS)
    rows = []
    for name in names:
        rows += run_task(name, sizes, repeats=repeats, seed=seed, log=log)
    return {
        "machine": machine_summary(),
        "repeats": repeats,
        "models": {TASKS[n].model: MODELS[TASKS[n].model].label for n in names},
        "kinds": {
            kind: {"label": KINDS[kind].label}
            | {peer: label for peer, (label, _) in KINDS[kind].peers.items()}
            for kind in {TASKS[n].kind for n in names}
        },
        "rows": rows,
    }


def peer_ratio(row):
    """jacutil's median over the fastest peer's in a :func:`run_task` row (below
    1: jacutil is faster), or None without peers."""
    medians = [t["median"] for t in row["peers"].values()]
    return row["jacutil"]["median"] / min(medians) if medians else None


SHORT_MODELS = {
    "mlp": "question's MLP",
    "cnn": "CNN",
    "lstm": "LSTM",
    "residual": "residual MLP",
    "two_head": "two-head",
}


def peer_rows_table(results):
    """Markdown: one line per row of :func:`run_peer_rows`'s ``results``,
    jacutil's median against each peer's."""
    lines = [
        "| what | model | n | jacutil | first call | JAX | PyTorch | x fastest peer |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        ratio = peer_ratio(row)
        medians = [
            format_seconds(row["peers"][p]["median"]) if p in row["peers"] else "-"
            for p in PEERS
        ]
        lines.append(
            f"| {results['kinds'][row['kind']]['label']} | "
            f"{SHORT_MODELS.get(row['model'], row['model'])} | {row['n']:,} | "
            f"{format_seconds(row['jacutil']['median'])} | "
            f"{format_seconds(row['jacutil']['first'])} | "
            + " | ".join(medians)
            + f" | {f'{ratio:.2f}' if ratio else '-'} |"
        )
    return "\n".join(lines)


def proof_line(row, kinds=None):
    """One :func:`run_task` row's proof: each peer's largest absolute difference
    from jacutil; ``kinds`` is the results' (the peers' labels), or None."""
    where = f"{row['kind']}, {SHORT_MODELS.get(row['model'], row['model'])}, "
    where += f"n = {row['n']:,}"
    if not row["peers"]:
        return f"- {where}: no peer ran."
    labels = (kinds or {}).get(row["kind"], {})
    said = [
        " ".join([PEER_NAMES[p], labels.get(p, "")]).strip()
        + f": max |peer - jacutil| = {t['max_abs_diff']:.1e}"
        for p, t in row["peers"].items()
    ]
    return f"- {where}: " + "; ".join(said)


def peer_rows_markdown(results):
    """The peer rows' section of :func:`run_peer_rows`'s ``results``: where
    measured, the table, a proof per row."""

    m = results["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    head = (
        "# jacutil against JAX and PyTorch: gradients, norms, more models\n\n"
        f"{m['date']}, {m['cpu_count']} CPUs, load average {m['load_average']}; "
        f"{versions}. Each median is of {results['repeats']} calls after a "
        "warm-up call (trace, compile; jacutil's is `first call`), on the same "
        "weights; `x fastest peer`: jacutil's time over the faster peer's. "
        "Squared error: `keras.losses.mean_squared_error`, one loss per sample."
    )
    proof = (
        f"**Proof** (each peer's result equals jacutil's at {tolerances()}, "
        "checked before it is timed):"
    )
    lines = [proof_line(row, results["kinds"]) for row in results["rows"]]
    models = "**Models**:\n\n" + "\n".join(
        f"- {label}" for label in results["models"].values()
    )
    return (
        "\n\n".join(
            [head, peer_rows_table(results), proof + "\n\n" + "\n".join(lines), models]
        )
        + "\n"
    )
