"""Logged metrics (``acc/headline``, ``density/mean``, ...) against the round for several runs, one panel
per metric (``lightning-dfl curves``)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_dfl.plots.canvas import agg_figure, palette, save_figure

_COLUMNS = 3  # panels per row in plot_curves


def plot_curves(runs: Mapping[str, Mapping[int, Mapping[str, float]]], metrics: Sequence[str],
                path: str | os.PathLike, title: str | None = None) -> Path:
    """Each of ``metrics`` against the round, one panel per metric, one line per run; returns the path.

    ``runs[name][round][metric]`` is the value a run logged (e.g. from
    :func:`lightning_dfl.cost.read_round_metrics`); a round without the metric is skipped, so
    metrics logged every few rounds (``acc/*`` with ``eval_every``) draw with markers at their
    rounds. Panels fill rows of three: 5 x 4 inches each (two metrics: 1000 x 400 px as PNG).
    """
    metrics = list(metrics)
    if not runs:
        raise ValueError("plot_curves needs at least one run")
    if not metrics:
        raise ValueError("plot_curves needs at least one metric, e.g. ['acc/headline', 'density/mean']")
    if len(set(metrics)) != len(metrics):
        raise ValueError(f"metrics must be distinct, got {metrics}")
    series: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for metric in metrics:
        series[metric] = {}
        for name, by_round in runs.items():
            points = sorted((int(r), float(v[metric])) for r, v in by_round.items() if metric in v)
            if points:
                series[metric][name] = ([r for r, _ in points], [v for _, v in points])
        if not series[metric]:
            raise ValueError(f"no run logged {metric!r} (runs: {list(runs)})")
    cols = min(len(metrics), _COLUMNS)
    rows = math.ceil(len(metrics) / cols)
    fig = agg_figure(5.0 * cols, 4.0 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    colours = dict(zip(runs, palette(len(runs))))
    for ax, metric in zip(axes, metrics):
        for name, (x, y) in series[metric].items():
            ax.plot(x, y, "-", marker="o" if len(x) <= 30 else None, ms=3, color=colours[name])
        ax.set(xlabel="round", ylabel=metric, title=metric)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes[len(metrics):]:
        ax.set_axis_off()
    fig.legend(handles=[Line2D([], [], color=c, marker="o", ms=3, label=n) for n, c in colours.items()],
               loc="outside upper center", ncols=min(len(runs), 4), fontsize="small")
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


__all__ = ["plot_curves"]
