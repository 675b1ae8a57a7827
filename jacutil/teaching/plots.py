"""Log-log scaling plots with fitted slopes (notebooks 01-04, 07)."""

import numpy as np

SLOPES_FROM = 3  # a slope fitted to two points says nothing about the shape


def fitted_slope(sizes, values):
    """Least-squares slope (a ``float``) of log(values) against log(sizes), both
    positive, shape (k,), k >= 2: 1 is linear, 2 is quadratic.

    >>> round(fitted_slope([1, 2, 4], [3, 12, 48]), 6)
    2.0
    """
    return float(np.polyfit(np.log(sizes), np.log(values), 1)[0])


def loglog_scaling(
    sizes,
    series,
    *,
    ylabel="seconds",
    xlabel="n_samples",
    ax=None,
    slopes=True,
    slopes_from=SLOPES_FROM,
):
    """Plot each ``series[name]`` against ``sizes`` on log-log axes, with slopes.

    A slope is fitted only to a curve measured at ``slopes_from`` (three)
    sizes or more (two points always fit a line exactly). ``slopes=False``
    for curves that are not power laws (a V-shaped time against chunk size):
    a slope fitted to them would mislead. ``series`` maps a label to k values
    (``None`` or NaN where missing); drawn on ``ax`` (default: a new figure's),
    which is returned.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for name, values in series.items():
        ran = [v is not None and np.isfinite(v) for v in values]
        pairs = [(s, v) for s, v, ok in zip(sizes, values, ran, strict=True) if ok]
        xs, ys = zip(*pairs, strict=True)
        label = name
        if slopes and len(xs) >= slopes_from:
            label = f"{name} (slope {fitted_slope(xs, ys):.2f})"
        ax.loglog(xs, ys, "o-", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return ax
