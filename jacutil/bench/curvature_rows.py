"""jacutil.curvature against BackPACK, curvlinops, JAX and laplace-torch.

``python -m jacutil.bench.curvature_rows`` times each of :data:`ROWS` for
jacutil and its peer on the same weights (``jacutil.peers.curvature_peers``
rebuilds the Keras model) and prints a Markdown table with each row's ratio
jacutil / peer (below 1: jacutil is faster): the exact diagonal of G
(``jacutil.curvature.diagonal.ggn_diagonal``), one product G v
(``ggn_operator(...).matvec``), the empirical NTK J J.T
(``jacutil.curvature.ntk.empirical_ntk``) and the predictive covariance
J* Sigma J*.T of a last-layer Laplace posterior, prior precision and noise
fixed (``Laplace(...).predictive_variance``, whose last layer is a Dense:
J = A (phi (x) I) from the layer's inputs, never formed, as laplace-torch
does); operators and posteriors are built once, outside the clock.

The MLP is the question's (``jacutil.question_mlp``) with the squared error
0.5 |f - y|^2; the CNN is ``jacutil.small_cnn``, whose last Dense has no
activation (it outputs logits), with the softmax cross-entropy. Every loss
is summed over samples. Timed as ``peer_rows.py`` times, each peer's result
checked against jacutil's first (:func:`check_row`). A row whose jacutil
function is missing or fails, or whose peer is not installed, says so in
the table. Introduced in ``11-curvature-and-uncertainty``.
"""

import argparse
import importlib.util
from dataclasses import dataclass

import numpy as np

from ..teaching.timing import Timing, first_call, repeat_times
from . import paths
from .machine import machine_summary
from .runner import max_abs_diff
from .skipping import format_seconds

RTOL = 1e-4  # float32 models: sums over 1,000 samples in another order
LAPLACE_ATOL = 1e-4  # the predictive covariance, absolute (the bound)
PRIOR_PRECISION, SIGMA_NOISE = 1.0, 0.5


@dataclass
class Row:
    """One row: what (``kind``, a key of :data:`LABELS`), on which model
    (``"mlp"`` or ``"cnn"``) and n, against which peer (in words);
    ``library`` is the module the peer needs (to say when it is missing),
    ``aim`` the ratio jacutil / peer the issue aims at, or None."""

    kind: str
    model: str
    n: int
    peer: str
    library: str
    aim: float = None


ROWS = [
    Row("diag", "mlp", 1000, "BackPACK DiagGGNExact", "backpack", 1.0),
    Row("diag", "cnn", 1000, "BackPACK DiagGGNExact", "backpack", 1.0),
    Row("ggn", "mlp", 1000, "curvlinops GGNLinearOperator", "curvlinops", 1.0),
    Row("ggn", "cnn", 1000, "curvlinops GGNLinearOperator", "curvlinops", 1.0),
    Row("ntk", "mlp", 1000, "JAX jit(vmap(jacrev)) + einsum", "jax", 1.0),
    Row("laplace", "mlp", 1000, "laplace-torch FullLLLaplace", "laplace", 1.0),
]
LABELS = {
    "diag": "diagonal of G",
    "ggn": "G v (one product)",
    "ntk": "empirical NTK J J.T",
    "laplace": "last-layer Laplace predictive J* Sigma J*.T",
}
MODELS = {
    "mlp": ("question's MLP", "squared_error"),
    "cnn": ("small CNN (logits)", "softmax_cross_entropy"),
}
LOSS_LABELS = {"squared_error": "squared error", "softmax_cross_entropy": "softmax CE"}


def row_inputs(name, n, seed):
    """(x, y): the bench model's n inputs, and its targets (None for the CNN)."""
    bench_model = paths.MODELS[name]
    y = bench_model.targets(n, seed) if bench_model.targets else None
    return bench_model.inputs(n, seed), y


class NotAvailable(Exception):
    """A row's function is missing (not written yet) or its peer not installed."""


def jacutil_function(row, model, x, y, seed):
    """jacutil's function of the row, ``f()``, with its setup done."""
    loss = MODELS[row.model][1]
    try:
        if row.kind == "diag":
            from ..curvature.diagonal import ggn_diagonal

            return lambda: ggn_diagonal(model, x, loss)
        if row.kind == "ggn":
            from ..curvature.ggn import ggn_operator

            G = ggn_operator(model, x, loss)
            v = _vector(G.shape[0], seed)
            return lambda: G.matvec(v)
        if row.kind == "ntk":
            from ..curvature.ntk import empirical_ntk

            return lambda: empirical_ntk(model, x)
        from ..curvature.laplace import Laplace

        posterior = Laplace(
            model, x, y, loss, "last_layer",
            prior_precision=PRIOR_PRECISION, sigma_noise=SIGMA_NOISE,
        )  # fmt: skip
        x_test = _test_inputs(row, seed)
        return lambda: posterior.predictive_variance(x_test)
    except ImportError as error:
        raise NotAvailable(f"jacutil's function is not available ({error})") from error


def peer_function(row, model, x, y, seed):
    """The peer's function of the row, ``f()``, with its setup done."""
    missing = [
        name
        for name in ({"jax": ()}.get(row.library, ("torch",)) + (row.library,))
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise NotAvailable(f"{', '.join(missing)} not installed")
    from ..peers import curvature_peers as peers

    loss = MODELS[row.model][1]
    if row.kind == "diag":
        diag = peers.backpack_ggn_diagonal(model, loss)
        return lambda: diag(x)
    if row.kind == "ggn":
        matvec = peers.curvlinops_ggn(model, x, loss)
        v = _vector(model.count_params(), seed)
        return lambda: matvec(v)
    if row.kind == "ntk":
        ntk = peers.jax_ntk(model)
        return lambda: ntk(x)
    variance = peers.laplace_torch_variance(
        model, x, y, structure="last_layer",
        prior_precision=PRIOR_PRECISION, sigma_noise=SIGMA_NOISE,
    )  # fmt: skip
    x_test = _test_inputs(row, seed)
    return lambda: variance(x_test)


def _vector(m, seed):
    return np.random.default_rng(seed + 7).standard_normal(m).astype(np.float32)


def _test_inputs(row, seed):
    return row_inputs(row.model, row.n, seed + 1)[0]


def check_row(row, theirs, ours):
    """The largest absolute difference of the peer's answer from jacutil's
    on ``row``; AssertionError beyond the row's tolerance (:data:`RTOL` of
    the largest value, :data:`LAPLACE_ATOL` for Laplace)."""
    if theirs.shape != ours.shape:
        raise AssertionError(
            f"{row.peer} returned shape {theirs.shape}, jacutil {ours.shape} "
            f"({row.kind}, {row.model})"
        )
    difference = max_abs_diff(theirs.astype(np.float64), ours)
    bound = (
        LAPLACE_ATOL
        if row.kind == "laplace"
        else RTOL * max(1.0, float(np.max(np.abs(ours))))
    )
    if difference > bound:
        raise AssertionError(
            f"{row.peer} disagrees with jacutil on {row.kind}, {row.model}, "
            f"n = {row.n}: max |peer - jacutil| = {difference:.2e} > {bound:.1e}"
        )
    return difference


def run_row(row, *, repeats=5, seed=0, log=print):
    """Time one :class:`Row`, jacutil then its peer, the peer checked first.

    ``repeats`` timed calls after the warm-up call; ``seed`` the model's and
    data's; progress goes to ``log``. Returns a dict: ``row``, ``jacutil``
    and ``peer`` (each ``{first, times, median}``, or None), ``max_abs_diff``
    (or None) and ``note`` (why a side did not run, or ``""``);
    AssertionError where the peer's result differs from jacutil's.
    Introduced in ``11-curvature-and-uncertainty``.
    """
    model = paths.MODELS[row.model].build(seed)
    x, y = row_inputs(row.model, row.n, seed)
    result = {"row": row, "jacutil": None, "peer": None, "max_abs_diff": None}
    result["note"] = ""
    side = "jacutil"
    try:
        ours = jacutil_function(row, model, x, y, seed)
        value, first = first_call(ours)
        expected = np.asarray(value).astype(np.float64)
        result["jacutil"] = Timing(first, repeat_times(ours, repeats=repeats)).as_dict()
        side = row.peer
        peer = peer_function(row, model, x, y, seed)
    except NotAvailable as error:
        result["note"] = f"{side}: {error}"
        log(f"{row.kind}-{row.model}: {result['note']}")
        return result
    value, first = first_call(peer)  # checked, then timed
    result["max_abs_diff"] = check_row(row, np.asarray(value), expected)
    result["peer"] = Timing(first, repeat_times(peer, repeats=repeats)).as_dict()
    log(
        f"{row.kind}-{row.model} n = {row.n:,}: jacutil "
        f"{format_seconds(result['jacutil']['median'])}, {row.peer} "
        f"{format_seconds(result['peer']['median'])}"
    )
    return result


def ratio(result):
    """jacutil's median over the peer's in a :func:`run_row` result (below 1:
    jacutil is faster), or None when either did not run. Introduced in
    ``11-curvature-and-uncertainty``."""
    if result["jacutil"] is None or result["peer"] is None:
        return None
    return result["jacutil"]["median"] / result["peer"]["median"]


def table(results):
    """The :func:`run_row` results as a Markdown table, with each row's ratio
    and aim. Introduced in ``11-curvature-and-uncertainty``."""
    lines = [
        "| what | model | loss | n | jacutil | first call | peer | peer's | "
        "jacutil / peer | aim | max abs diff |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    notes = []
    for result in results:
        row = result["row"]
        mine, theirs = result["jacutil"], result["peer"]
        r = ratio(result)
        diff = result["max_abs_diff"]
        loss = "-" if row.kind == "ntk" else LOSS_LABELS[MODELS[row.model][1]]
        lines.append(
            f"| {LABELS[row.kind]} | {MODELS[row.model][0]} | {loss} | {row.n:,} | "
            f"{format_seconds(mine['median']) if mine else 'not available'} | "
            f"{format_seconds(mine['first']) if mine else '-'} | {row.peer} | "
            f"{format_seconds(theirs['median']) if theirs else 'not available'} | "
            f"{f'{r:.2f}x' if r else '-'} | "
            f"{f'<= {row.aim:.1f}x' if row.aim else '-'} | "
            f"{f'{diff:.1e}' if diff is not None else '-'} |"
        )
        if result["note"]:
            notes.append(f"- {row.kind}, {row.model}: {result['note']}")
    return "\n".join(lines + ([""] + notes if notes else []))


def run_all(kinds=None, *, repeats=5, seed=0, log=print):
    """Run the rows (or those of ``kinds``, keys of :data:`LABELS`; ValueError
    for another) and return their :func:`run_row` results; ``repeats``,
    ``seed`` and ``log`` as there. Introduced in
    ``11-curvature-and-uncertainty``.
    """
    unknown = set(kinds or ()) - set(LABELS)
    if unknown:
        raise ValueError(
            f"unknown kinds {sorted(unknown)}; choose among {sorted(LABELS)}."
        )
    rows = [r for r in ROWS if not kinds or r.kind in kinds]
    return [run_row(r, repeats=repeats, seed=seed, log=log) for r in rows]


def main(argv=None):
    """``python -m jacutil.bench.curvature_rows``: run the rows, print the table.

    ``argv`` defaults to ``sys.argv[1:]``; returns the :func:`run_row`
    results. Introduced in ``11-curvature-and-uncertainty``.
    """

    parser = argparse.ArgumentParser(
        prog="python -m jacutil.bench.curvature_rows",
        description="Time jacutil.curvature against BackPACK, curvlinops, JAX "
        "and laplace-torch on the same weights.",
    )
    parser.add_argument("--kinds", nargs="+", choices=sorted(LABELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--wide",
        action="store_true",
        help="run the wide last-layer Laplace rows (1,000 classes x 2,048 "
        "features) instead, each in a fresh process",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="PyTorch's intra-op threads (default: its own choice). On a small "
        "machine shared with TensorFlow's threads and other work, one thread "
        "gives the peers steady times; their own choice can vary tenfold",
    )
    args = parser.parse_args(argv)
    if args.wide:
        return wide_main(seed=args.seed)
    threads = "its own choice"
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            parser.error(
                f"--torch-threads must be at least 1; got {args.torch_threads}"
            )
        from ..peers.curvature_peers import load_torch

        load_torch().set_num_threads(args.torch_threads)
        threads = str(args.torch_threads)
    results = run_all(args.kinds, repeats=args.repeats, seed=args.seed)
    m = machine_summary()
    print(
        f"\n{m['date']}, {m['cpu_count']} CPUs, load average {m['load_average']}. "
        f"Median of {args.repeats} calls after a warm-up call, same weights; "
        f"PyTorch threads: {threads}.\n"
    )
    print(table(results))
    return results


# -- a wide last layer: Laplace on 1,000 classes x 2,048 features ----------------
#
# Not one of ROWS (their models are the bench's MLP and CNN, timed call after
# call in this process): a head Input(features) -> Dense(classes) on random
# float32 features, softmax cross-entropy, fitted once in a fresh process
# that reports its seconds and peak resident memory. Run them with
# ``python -m jacutil.bench.curvature_rows --wide`` (``make bench`` does).


@dataclass
class WideRow:
    """Last-layer Laplace on Input(features) -> Dense(classes): fit on
    ``n`` samples, then the predictive covariance of ``n_test``; with
    ``hessian_structure`` (``"auto"``: low rank where n r < m)."""

    features: int
    classes: int
    n: int
    n_test: int
    hessian_structure: str
    peer: str = "laplace-torch KronLLLaplace"


WIDE_ROWS = [
    WideRow(2048, 1000, 1000, 32, "kron"),
    WideRow(2048, 2, 1000, 100, "auto"),
]
WIDE_CHILD = """
import json, os, resource, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
features, classes, n, n_test, structure, seed = json.loads(sys.argv[1])
rng = np.random.default_rng(seed)
x = rng.standard_normal((n + n_test, features)).astype("float32")
y = rng.integers(0, classes, n)
out = {}
if structure == "peer":  # laplace-torch, on the same weights
    import torch
    from laplace import Laplace
    from jacutil import keras
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(classes)])
    layer = torch.nn.Linear(features, classes)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(model.layers[0].kernel.numpy().T))
        layer.bias.copy_(torch.from_numpy(model.layers[0].bias.numpy()))
    net = torch.nn.Sequential(torch.nn.Identity(), layer)
    data = torch.utils.data.TensorDataset(torch.from_numpy(x[:n]), torch.from_numpy(y))
    start = time.perf_counter()
    la = Laplace(net, "classification", subset_of_weights="last_layer",
                 hessian_structure="kron")
    la.fit(torch.utils.data.DataLoader(data, batch_size=256))
    out["fit_s"] = time.perf_counter() - start
    start = time.perf_counter()
    la(torch.from_numpy(x[n:]), pred_type="glm", link_approx="probit")
    out["predictive_s"] = time.perf_counter() - start
else:
    from jacutil import keras
    from jacutil.curvature.laplace import laplace
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(classes)])
    start = time.perf_counter()
    la = laplace(model, x[:n], y, "softmax_cross_entropy",
                 hessian_structure=structure)
    la.log_marginal_likelihood()
    out["fit_s"] = time.perf_counter() - start
    start = time.perf_counter()
    la.predictive_variance(x[n:])
    out["predictive_s"] = time.perf_counter() - start
    out["chosen"], out["m"] = la.hessian_structure, la.n_params
try:  # VmHWM starts afresh at exec; ru_maxrss keeps the parent's (fork)
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
    out["peak_bytes"] = peak * 1024
except (OSError, StopIteration):
    out["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(out))
"""


def run_wide_row(row, *, seed=0, log=print):
    """One :class:`WideRow`, jacutil then laplace-torch (where installed),
    each in a fresh process: a dict with ``row``, ``jacutil`` and ``peer``
    (``{fit_s, predictive_s, peak_bytes, ...}``, or None) and ``note``. The
    fit's seconds include the log marginal likelihood at the stored prior.
    Introduced in ``11-curvature-and-uncertainty``."""
    import json

    from ..teaching.memory_sweeps import fresh_python

    def measured(structure):
        spec = [row.features, row.classes, row.n, row.n_test, structure, seed]
        return fresh_python(["-c", WIDE_CHILD, json.dumps(spec)], "the wide row failed")

    result = {"row": row, "jacutil": measured(row.hessian_structure), "peer": None}
    missing = [m for m in ("torch", "laplace") if importlib.util.find_spec(m) is None]
    result["note"] = f"{', '.join(missing)} not installed" if missing else ""
    if not missing and row.hessian_structure == "kron":
        result["peer"] = measured("peer")
    elif not missing:
        result["note"] = "laplace-torch's peer row is its Kronecker structure"
    log(f"wide {row.classes} x {row.features}: {result['jacutil']}")
    return result


def wide_table(results):
    """The :func:`run_wide_row` results as a Markdown table. Introduced in
    ``11-curvature-and-uncertainty``."""
    lines = [
        "| head (classes x features) | n | test | hessian | m | jacutil fit | "
        "predictive | peak memory | peer | peer fit | peer predictive | "
        "peer peak |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    notes = []
    for result in results:
        row, ours, theirs = result["row"], result["jacutil"], result["peer"]

        def cells(t):
            if t is None:
                return ["-", "-", "-"]
            return [format_seconds(t["fit_s"]), format_seconds(t["predictive_s"]),
                    f"{t['peak_bytes'] / 2**20:,.0f} MiB"]  # fmt: skip

        lines.append(
            f"| {row.classes:,} x {row.features:,} | {row.n:,} | {row.n_test} | "
            f"{ours['chosen']} | {ours['m']:,} | {' | '.join(cells(ours))} | "
            f"{row.peer} | {' | '.join(cells(theirs))} |"
        )
        if result["note"]:
            notes.append(f"- {row.classes:,} x {row.features:,}: {result['note']}")
    return "\n".join(lines + ([""] + notes if notes else []))


def wide_main(seed=0):
    """Run :data:`WIDE_ROWS` and print their table; returns the results.
    Introduced in ``11-curvature-and-uncertainty``."""
    results = [run_wide_row(row, seed=seed) for row in WIDE_ROWS]
    m = machine_summary()
    print(
        f"\n{m['date']}, {m['cpu_count']} CPUs, load average {m['load_average']}. "
        "One fit and one predictive each, in a fresh process.\n"
    )
    print(wide_table(results))
    return results


if __name__ == "__main__":
    main()
