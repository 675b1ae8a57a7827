"""The log-log plot of every path's median against n, and ``save``.

Introduced in ``07-benchmark``.
"""

import json
from pathlib import Path

from .report import markdown, series


def plot(results, ax=None):
    """Log-log plot of every path's median against n, with fitted slopes."""
    import matplotlib.pyplot as plt

    from ..plots import loglog_scaling

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4.5))
    colors = plt.cm.tab20.colors
    ax.set_prop_cycle(color=colors[::2] + colors[1::2])  # 20 distinct colours
    ax = loglog_scaling(results["sizes"], series(results), ax=ax)
    for line in ax.get_lines():
        label = line.get_label()
        if label.startswith("write floor"):
            line.set(color="black", linestyle=":" if "new" in label else "--")
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
