"""Figures of the analysis subcommands (optional: needs ``pip install -e '.[plots]'``).

* :func:`plot_schedule`: DA-DPFL Figs. 8-9, parallelism and delay of dynamic aggregation
  against the neighbourhood size M, one line per maximum wait N (black: N = M).
* :func:`plot_cost_curves`: DA-DPFL Figs. 3-4, ``C_total(theta) = (1 - theta) C_time +
  theta C_energy`` (Sec. VI-A5) per run, with the points where two runs' curves cross.
* :func:`plot_curves`: logged metrics (``acc/headline``, ``density/mean``, ...) against the
  round for several runs, one panel per metric.

matplotlib is imported inside the functions and drawn on an Agg canvas (no pyplot, so no
global backend switch and no figure kept alive); the file format follows the path's suffix.
Every figure is ``DPI`` dots per inch, so its pixel size is fixed (see each function).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_dfl.checks import is_int
from lightning_dfl.cost import CostCurve
from lightning_dfl.scheduling import SchedulingStats

DPI = 100
"""Dots per inch of every figure (and of the saved raster files)."""

_MISSING = "plots need matplotlib: pip install -e '.[plots]'"


def _agg_figure(width: float, height: float) -> Any:
    """A constrained-layout ``Figure`` on an Agg canvas, ``width x height`` inches at :data:`DPI`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(_MISSING) from err
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def check_plot_path(path: str | os.PathLike) -> Path:
    """``path`` as a ``Path`` once matplotlib is importable and can write its suffix.

    Raises ImportError without matplotlib and ValueError for a suffix matplotlib cannot write
    (the message lists the ones it can: png, pdf, svg, ...). Call it before heavy work.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(_MISSING) from err
    out = Path(path)
    supported = sorted(FigureCanvasAgg(Figure()).get_supported_filetypes())
    suffix = out.suffix.lower().lstrip(".")
    if suffix not in supported:
        raise ValueError(f"plot path {os.fspath(path)!r} must end in one of "
                         f"{', '.join('.' + s for s in supported)} (the figure's format), got {out.suffix!r}")
    return out


def _save(fig: Any, path: str | os.PathLike) -> Path:
    out = check_plot_path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


# ---------------------------------------------------------------------------------------------
# DA-DPFL Figs. 8-9: parallelism and delay against M
# ---------------------------------------------------------------------------------------------


def _infer_max_waits(rows: Sequence[SchedulingStats]) -> list[int | None]:
    """The N lines :func:`lightning_dfl.scheduling.schedule_table` most likely simulated.

    A given N appears as itself wherever it is below M; ``None`` (N = M) when every M has a row
    waiting for all its prior neighbours.
    """
    capped = sorted({r.max_wait for r in rows if r.max_wait < r.num_neighbors})
    ms = {r.num_neighbors for r in rows}
    everyone = all(any(r.num_neighbors == m and r.max_wait == m for r in rows) for m in ms)
    return [*capped, *([None] if everyone else [])]


def plot_schedule(rows: Sequence[SchedulingStats], path: str | os.PathLike,
                  max_waits: Sequence[int | None] | None = None, title: str | None = None) -> Path:
    """DA-DPFL Figs. 8-9 from :func:`~lightning_dfl.scheduling.schedule_table` rows; returns the path.

    Left panel: parallelism against M, one colour per N (solid: share of clients starting at
    time 0, whose mean is ``1/(M+1)`` for every N >= 1, drawn dotted grey as the reference;
    dashed: largest share of clients starting at one same time). Right panel: delay (latest
    start per round, in tasks) against M. ``max_waits`` names the N lines as given to
    ``schedule_table`` (``None``: N = M, drawn black as in the paper; an N above M is waited as
    M); by default they are read off the rows. Size: 11 x 4.5 inches (1100 x 450 px as PNG).
    """
    rows = list(rows)
    if not rows:
        raise ValueError("plot_schedule needs at least one SchedulingStats row")
    setups = sorted({(r.num_clients, r.rounds, r.seed) for r in rows})
    if len(setups) != 1:
        raise ValueError(f"plot_schedule needs rows of one (num_clients, rounds, seed), got {setups}")
    lines = _infer_max_waits(rows) if max_waits is None else list(max_waits)
    if not lines:
        raise ValueError("plot_schedule needs at least one N in max_waits")
    bad = [n for n in lines if n is not None and not (is_int(n) and n >= 0)]
    if bad:
        raise ValueError(f"max_waits must be integers >= 0 or None (N = M), got {bad}")
    k, rounds, seed = setups[0]
    ms = sorted({r.num_neighbors for r in rows})
    by_key = {(r.num_neighbors, r.max_wait): r for r in rows}

    fig = _agg_figure(11.0, 4.5)
    ax_par, ax_delay = fig.subplots(1, 2)
    palette = _palette(sum(n is not None for n in lines))
    numbered = iter(palette)
    for n in lines:
        points = [(m, by_key.get((m, m if n is None else min(n, m)))) for m in ms]
        points = [(m, s) for m, s in points if s is not None]
        if not points:
            continue
        x = [m for m, _ in points]
        colour = "black" if n is None else next(numbered)
        label = "N = M" if n is None else f"N = {n}"
        width = 2.0 if n is None else 1.5
        ax_par.plot(x, [s.parallelism for _, s in points], "o-", color=colour, lw=width, ms=4)
        ax_par.plot(x, [s.max_parallelism for _, s in points], "s--", color=colour, lw=1.0, ms=3, alpha=0.8)
        ax_delay.plot(x, [s.delay for _, s in points], "o-", color=colour, lw=width, ms=4, label=label)
    ax_par.plot(ms, [1.0 / (m + 1) for m in ms], ":", color="darkgrey", lw=2.0, zorder=3)

    from matplotlib.lines import Line2D

    ax_par.legend(handles=[Line2D([], [], color="k", ls="-", marker="o", ms=4, label="share starting at t = 0"),
                           Line2D([], [], color="k", ls="--", marker="s", ms=3, label="largest share at one time"),
                           Line2D([], [], color="darkgrey", ls=":", lw=2.0, label="1 / (M + 1)")],
                  loc="upper right", fontsize="small")
    ax_par.set(xlabel="neighbours M", ylabel="parallelism (share of clients)",
               title="Parallelism (Fig. 8)", ylim=(0.0, 1.05))
    ax_delay.legend(title="max wait", loc="upper left", fontsize="small")
    ax_delay.set(xlabel="neighbours M", ylabel="delay (latest start, tasks)", title="Delay (Fig. 9)")
    ax_delay.set_ylim(bottom=0.0)
    for ax in (ax_par, ax_delay):
        ax.set_xticks(ms)
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"DA-DPFL dynamic aggregation: K = {k} clients, {rounds} rounds (seed {seed})")
    return _save(fig, path)


def _palette(count: int) -> list[Any]:
    """``count`` distinguishable colours (tab10, then viridis for more)."""
    from matplotlib import colormaps

    if count <= 10:
        return [colormaps["tab10"](i) for i in range(count)]
    return [colormaps["viridis"](i / max(count - 1, 1)) for i in range(count)]


# ---------------------------------------------------------------------------------------------
# DA-DPFL Figs. 3-4: C_total(theta)
# ---------------------------------------------------------------------------------------------


def plot_cost_curves(curves: Mapping[str, CostCurve], path: str | os.PathLike, title: str | None = None) -> Path:
    """DA-DPFL Figs. 3-4: ``C_total(theta)`` per run (label: the mapping's key); returns the path.

    Every pair of runs whose lines cross inside the plotted theta range gets a marker labelled
    with that theta. Units follow the paper: (1 - theta) $ per second plus theta $ per joule.
    Size: 7 x 4.5 inches (700 x 450 px as PNG).
    """
    if not curves:
        raise ValueError("plot_cost_curves needs at least one run's CostCurve")
    names = list(curves)
    fig = _agg_figure(7.0, 4.5)
    ax = fig.subplots()
    for name, colour in zip(names, _palette(len(names))):
        c = curves[name]
        ax.plot(c.thetas, c.total, "-", color=colour, lw=1.8,
                label=f"{name} (C_time {c.time:.3g} s, C_energy {c.energy:.3g} J)")
    lo = min(float(min(c.thetas)) for c in curves.values())
    hi = max(float(max(c.thetas)) for c in curves.values())
    marked = False
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            theta = curves[a].crossing(curves[b])
            if theta is None or not lo <= theta <= hi:
                continue
            value = (1.0 - theta) * curves[a].time + theta * curves[a].energy
            ax.plot([theta], [value], "kx", ms=9, mew=2, label=None if marked else "crossing")
            where = (theta - lo) / (hi - lo) if hi > lo else 0.5
            ha = "right" if where > 0.85 else "left" if where < 0.15 else "center"  # stay inside the axes
            ax.annotate(f"θ = {theta:.3f}", (theta, value), textcoords="offset points", xytext=(0, 10),
                        ha=ha, va="bottom", fontsize="small",
                        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85})
            marked = True
    ax.set(xlabel="θ (weight of energy against time)", ylabel="C_total(θ) in USD: (1 - θ) per s + θ per J",
           title=title or "Total cost (1 - θ) C_time + θ C_energy  (DA-DPFL Figs. 3-4)", xlim=(lo, hi))
    top = max(float(max(c.total)) for c in curves.values())
    ax.set_ylim(0.0, 1.15 * top if top > 0 else 1.0)  # headroom for the crossing labels
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# Metric curves over rounds
# ---------------------------------------------------------------------------------------------

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
    fig = _agg_figure(5.0 * cols, 4.0 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    colours = dict(zip(runs, _palette(len(runs))))
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
    return _save(fig, path)


__all__ = ["DPI", "check_plot_path", "plot_cost_curves", "plot_curves", "plot_schedule"]
