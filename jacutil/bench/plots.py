"""The log-log plot of every path's median against n, and ``save``.

Introduced in ``07-benchmark``.
"""

import json
from pathlib import Path

from ..teaching.plots import SLOPES_FROM, loglog_scaling
from .report import markdown, series

# Lines that overlap stay apart by their marker and dash, not colour alone.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p", "d", "8")
DASHES = ("-", "--", "-.", (0, (1, 1)), (0, (5, 1, 1, 1, 1, 1)))
FIGSIZE = (11, 5)


def plot(results, ax=None, *, slopes_from=SLOPES_FROM, legend_size=9):
    """Log-log plot of every path's median against n.

    A series gets its fitted slope in the legend only where it ran at
    ``slopes_from`` sizes or more (two points always lie on a line). Each
    line has its own marker and dash, hollow markers let overlapping points
    show, and the legend (``legend_size`` points) sits outside the axes.

    Args:
        results: the benchmark's results dict (``results.json``).
        ax: the matplotlib axes (default: a new figure's).
        slopes_from: the fewest sizes for a fitted slope.
        legend_size: the legend's font size in points.

    Returns:
        The matplotlib ``Axes``.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE)
    colors = plt.cm.tab20.colors
    ax.set_prop_cycle(color=colors[::2] + colors[1::2])  # 20 distinct colours
    ax = loglog_scaling(
        results["sizes"], series(results), ax=ax, slopes_from=slopes_from
    )
    lines = ax.get_lines()
    sloped = any(len(line.get_xdata()) >= slopes_from for line in lines)
    for i, line in enumerate(lines):
        label = line.get_label()
        line.set(
            marker=MARKERS[i % len(MARKERS)],
            linestyle=DASHES[i % len(DASHES)],
            markersize=7,
            markerfacecolor="none",
            markeredgewidth=1.5,
            linewidth=1.5,
        )
        if label.startswith("write floor"):  # black, filled: not a path
            new = "new" in label
            line.set(
                color="black",
                linestyle=":" if new else "--",
                marker="s" if new else "o",
                markerfacecolor="black",
            )
    label = results.get("model_label", "the question's network")
    ax.set_title(f"Per-sample Jacobian of {label.split(' (')[0]}: median time")
    ax.set_xticks(results["sizes"], [f"{n:,}" for n in results["sizes"]])
    ax.minorticks_off()
    title = (
        f"slope: fitted where {slopes_from}+ sizes ran"
        if sloped
        else f"no slopes: fewer than {slopes_from} sizes"
    )
    ax.legend(
        fontsize=legend_size,
        title=title,
        title_fontsize=legend_size,
        loc="center left",
        bbox_to_anchor=(1.01, 0.5),
    )
    ax.figure.tight_layout()
    return ax


def save(results, out):
    """Write results.json, results.md and scaling.png into ``out``.

    A model other than the question's MLP gets its name in the file names:
    results-lstm.json, results-lstm.md, scaling-lstm.png. ``out`` is created
    if needed and returned, a ``pathlib.Path``.
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
    fig, ax = plt.subplots(figsize=FIGSIZE)
    plot(results, ax=ax)
    fig.savefig(out / f"scaling{suffix}.png", dpi=120)
    plt.close(fig)
    return out
