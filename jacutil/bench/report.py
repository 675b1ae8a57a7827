"""The results as tables: ratios, one Markdown table per n, a summary.

Every table gives each path's median and its ratios: to the nested loop, to
the fastest path, to the write floor (filling a preallocated array of J's
shape) and, when JAX or PyTorch ran, to the faster of the two at that n.
``results`` is always the benchmark's results dict (``results.json``), and
``n`` a number of samples. Introduced in ``07-benchmark``.
"""

from typing import NamedTuple

import numpy as np

from ..teaching.plots import SLOPES_FROM, fitted_slope
from .floor import FLOOR, FLOOR_NEW
from .paths import PEER_NAMES, PEERS
from .runner import tolerances
from .skipping import format_seconds

FLOORS = (FLOOR, FLOOR_NEW)


class Ratios(NamedTuple):
    """One path's time against others at one n (None where there is none)."""

    loop: float | None  # loop time / this time: how many times faster
    fastest: float  # this time / the fastest path's
    floor: float  # this time / the write floor's
    peer: float | None  # this time / the faster peer's (JAX, PyTorch)


def results_at(results, n):
    """``{path: result}`` at n: a dict from path name to its result dict."""
    return {r["path"]: r for r in results["results"] if r["n"] == n}


def _medians(at):
    return {p: r["median"] for p, r in at.items() if r["median"] is not None}


def fastest_peer(results, n):
    """The name (a ``str``) of the faster peer that ran at n, or None."""
    ran = {p: t for p, t in _medians(results_at(results, n)).items() if p in PEERS}
    return min(ran, key=ran.get) if ran else None


def ratios(results, n):
    """``{path: Ratios(loop, fastest, floor, peer)}`` at n; the loop predicted if
    skipped. A :class:`Ratios` is a tuple too: ``(x loop, x fastest, x floor,
    x peer)``.
    """
    at = results_at(results, n)
    ran = _medians(at)
    floor = ran[FLOOR]
    ran = {p: t for p, t in ran.items() if p not in FLOORS}
    if not ran:
        return {}
    fastest = min(ran.values())
    peer = ran.get(fastest_peer(results, n))
    loop = at.get("loop", {})
    loop = loop.get("median") or loop.get("predicted")
    return {
        p: Ratios(
            loop / t if loop else None,
            t / fastest,
            t / floor,
            t / peer if peer else None,
        )
        for p, t in ran.items()
    }


def _floor_line(results, n):
    at = results_at(results, n)
    n_outputs, n_params = results.get("shape", (2, 2850))
    mbytes = n * n_outputs * n_params * 4 / 1e6
    line = (
        f"**n = {n:,}** - the floor fills a preallocated {n:,} x {n_outputs} x "
        f"{n_params:,} float32 array ({mbytes:,.1f} MB) in "
        f"{format_seconds(at[FLOOR]['median'])}"
    )
    if FLOOR_NEW in at:
        line += f"; a new one (np.full) takes {format_seconds(at[FLOOR_NEW]['median'])}"
    return line


def table_at(results, n):
    """A Markdown table of every path at n, fastest first."""
    at = results_at(results, n)
    labels = results["labels"]
    share = ratios(results, n)
    lines = [
        _floor_line(results, n),
        "",
        "| path | median | first call | peak memory | loop / path | "
        "x fastest | x floor | x peer |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def order(item):
        r = item[1]
        return (r["median"] is None, r["median"] or r["predicted"] or np.inf)

    for path, r in sorted(at.items(), key=order):
        if path in FLOORS:
            continue
        label = labels.get(path, path)
        if r["median"] is None:
            guess = f"~{format_seconds(r['predicted'])}" if r["predicted"] else "-"
            lines.append(f"| {label} | {guess} | skipped: {r['skipped']} | | | | | |")
            continue
        peak = f"{r['peak'] / 2**20:,.0f} MiB" if r["peak"] is not None else "-"
        ratio = share[path]
        vs_loop = f"{ratio.loop:,.0f}" if ratio.loop else "-"
        vs_peer = f"{ratio.peer:.2f}" if ratio.peer else "-"
        lines.append(
            f"| {label} | {format_seconds(r['median'])} | "
            f"{format_seconds(r['first'])} | {peak} | {vs_loop} | "
            f"{ratio.fastest:.2f} | {ratio.floor:.1f} | {vs_peer} |"
        )
    return "\n".join(lines)


def peer_proof(results, n):
    """A line proving each peer's J equals the reference's at n, or "".

    Every path's J is checked against the compiled per-sample stage before
    it is timed; this prints the peers' largest absolute differences ("" where
    no peer ran at n, or none kept a difference).
    """
    at = results_at(results, n)
    said = [
        f"{PEER_NAMES[p]} max |J_peer - J| = {at[p]['max_abs_diff']:.1e}"
        for p in PEERS
        if at.get(p, {}).get("max_abs_diff") is not None
    ]
    if not said:
        return ""
    return (
        f"Proof at n = {n:,} (each peer's J equals jacutil's compiled per-sample "
        f"stage at {tolerances()}, checked before it is timed): "
        + "; ".join(said)
        + "."
    )


def summary(results):
    """``[{n, best, jacutil, jax, torch, per_peer, per_floor}]``, one per n.

    ``best`` is the fastest jacutil path (not a peer), ``jacutil`` its median;
    ``per_peer`` its time over the faster peer's (None without peers),
    ``per_floor`` over the write floor's.
    """
    rows = []
    for n in results["sizes"]:
        ran = _medians(results_at(results, n))
        ours = {p: t for p, t in ran.items() if p not in PEERS + FLOORS}
        if not ours:
            continue
        best = min(ours, key=ours.get)
        peers = [ran[p] for p in PEERS if p in ran]
        rows.append(
            {
                "n": n,
                "best": best,
                "jacutil": ours[best],
                **{p: ran.get(p) for p in PEERS},
                "per_peer": ours[best] / min(peers) if peers else None,
                "per_floor": ours[best] / ran[FLOOR],
            }
        )
    return rows


def summary_table(results):
    """Markdown: per n, the best jacutil path against the peers and the floor."""
    lines = [
        "| n | best jacutil path | median | JAX | PyTorch | x fastest peer | x floor |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in summary(results):
        per_peer = f"{row['per_peer']:.2f}" if row["per_peer"] else "-"
        lines.append(
            f"| {row['n']:,} | {results['labels'][row['best']]} | "
            f"{format_seconds(row['jacutil'])} | {format_seconds(row['jax'])} | "
            f"{format_seconds(row['torch'])} | {per_peer} | "
            f"{row['per_floor']:.1f} |"
        )
    return "\n".join(lines)


def markdown(results):
    """All the tables in Markdown, and where they were measured."""
    m = results["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    versions += "".join(f", {k}={v}" for k, v in m.get("threads", {}).items())
    label = results.get("model_label", "the question's network (10-64-32-2, float32)")
    head = [
        f"# Per-sample Jacobian of {label}",
        "",
        f"{m['date']}, {m['cpu_count']} CPUs ({m['processor']}), load average "
        f"{m['load_average']}; {versions}. Medians of {results['repeats']} runs "
        f"after the first call; peak memory measured {results['memory']}. "
        "`loop / path`: how many times faster than the nested loop (~: the loop "
        "was predicted, not run); `x floor`: time over the write floor (filling "
        "a preallocated array of J's shape); `x peer`: time over the faster of "
        "JAX and PyTorch at that n.",
    ]
    tables = [summary_table(results)]
    for n in results["sizes"]:
        proof = peer_proof(results, n)
        tables.append(table_at(results, n) + (f"\n\n{proof}" if proof else ""))
    if "profile" in results:
        tables.append(profile_table(results["profile"]))
    return "\n\n".join(["\n".join(head), *tables]) + "\n"


def profile_table(profile):
    """Markdown: where the hand-derived path's time goes, from the dict
    ``profile_dense`` returns."""

    lines = [
        f"**Where the hand-derived path's time goes, n = {profile['n']:,}** "
        "(each piece includes the ones above it)",
        "",
        "| piece | median |",
        "|---|---:|",
    ]
    for name, seconds in profile["seconds"].items():
        lines.append(f"| {name} | {format_seconds(seconds)} |")
    return "\n".join(lines)


def series(results):
    """``{label: [median or None per size]}`` for the plot, the floors included."""
    out = {}
    for path, label in results["labels"].items():
        values = []
        for n in results["sizes"]:
            r = results_at(results, n).get(path)
            values.append(r["median"] if r else None)
        if sum(v is not None for v in values):
            out[label] = values
    return out


def slopes(results):
    """``{label: fitted slope of log(median) against log(n)}``, where a path
    ran at three sizes or more (two points always lie on a line)."""
    out = {}
    for label, values in series(results).items():
        ran = [(n, v) for n, v in zip(results["sizes"], values, strict=True) if v]
        if len(ran) >= SLOPES_FROM:
            out[label] = fitted_slope([n for n, _ in ran], [v for _, v in ran])
    return out
