"""Figures of the analysis subcommands (optional: needs ``pip install -e '.[plots]'``).

* :func:`plot_schedule`: DA-DPFL Figs. 8-9, parallelism and delay of dynamic aggregation
  against the neighbourhood size M, one line per maximum wait N (black: N = M).
* :func:`plot_cost_curves`: DA-DPFL Figs. 3-4, ``C_total(theta) = (1 - theta) C_time +
  theta C_energy`` (Sec. VI-A5) per run, with the points where two runs' curves cross.
* :func:`plot_curves`: logged metrics (``acc/headline``, ``density/mean``, ...) against the
  round for several runs, one panel per metric.
* :func:`plot_diagnostics`: a run's diagnostics (spectral gap, consensus distance, mask overlap,
  bytes and mask-Jaccard heatmaps, per-client accuracy; ``lightning-dfl plot diagnostics RUN_DIR``).

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
from lightning_dfl.errors import reading
from lightning_dfl.federation.algorithms.dadpfl_waits import SchedulingStats

DPI = 100
"""Dots per inch of every figure (and of the saved raster files)."""

_MISSING = "plots need matplotlib: pip install -e '.[plots]'"


def agg_figure(width: float, height: float) -> Any:
    """A constrained-layout ``Figure`` on an Agg canvas, ``width x height`` inches at :data:`DPI`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(_MISSING) from err
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


#: label offsets tried by :func:`place_labels`, in points from the point: right first, then around it
_LABEL_DIRECTIONS = ((1, 0), (1, 1), (1, -1), (0, 1), (0, -1), (-1, 0), (-1, 1), (-1, -1))
_LABEL_RADII = (5, 9, 14, 20, 27, 35, 45, 56, 70, 90)


def place_labels(ax: Any, xs: Sequence[float], ys: Sequence[float], texts: Sequence[str], fontsize: float = 7,
                 marker_pt: float = 5.0) -> list[Any]:
    """Annotate each point ``(xs[i], ys[i])`` with ``texts[i]`` so that no label overlaps another label or any
    point's marker (a square of ``marker_pt`` points around it) and stays inside the axes: each label tries
    offsets around its point, nearest first, else takes the one that overlaps least; a label set away from its
    point gets a thin leader line. Call it when the figure is otherwise complete (limits, legends): it draws the
    figure once to know the layout. The labels take no part in the layout."""
    import numpy as np
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    pixels = fig.dpi / 72.0
    points = ax.transData.transform(np.column_stack([np.asarray(xs, float), np.asarray(ys, float)]))
    half = marker_pt * pixels
    taken = [Bbox.from_extents(x - half, y - half, x + half, y + half) for x, y in points]
    frame = ax.get_window_extent(renderer)

    def cost(box: Any) -> float:
        overlap = sum(max(0.0, min(box.x1, o.x1) - max(box.x0, o.x0)) * max(0.0, min(box.y1, o.y1) - max(box.y0, o.y0))
                      for o in taken)
        inside = max(0.0, min(box.x1, frame.x1) - max(box.x0, frame.x0)) * max(
            0.0, min(box.y1, frame.y1) - max(box.y0, frame.y0))
        return overlap + 10.0 * (box.width * box.height - inside)

    labels = []
    for (x, y), text in zip(zip(xs, ys), texts):
        label = ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, 0), fontsize=fontsize)
        label.set_in_layout(False)
        best = None
        for radius in _LABEL_RADII:
            for dx, dy in _LABEL_DIRECTIONS:
                offset = (dx * radius, dy * radius * (0.6 if dx else 1.0))
                label.set_position(offset)
                label.set(ha={1: "left", 0: "center", -1: "right"}[dx], va={1: "bottom", 0: "center", -1: "top"}[dy])
                box = label.get_window_extent(renderer).padded(pixels)
                score = cost(box)
                if best is None or score < best[0]:
                    best = (score, offset, label.get_ha(), label.get_va(), box)
                if score == 0.0:
                    break
            if best[0] == 0.0:
                break
        _, offset, ha, va, box = best
        label.remove()  # the final label, with a leader line when it sits away from its point
        far = math.hypot(*offset) > 1.5 * _LABEL_RADII[1]
        label = ax.annotate(text, (x, y), textcoords="offset points", xytext=offset, fontsize=fontsize, ha=ha, va=va,
                            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5", "shrinkA": 0,
                                        "shrinkB": 0.6 * marker_pt} if far else None)
        label.set_in_layout(False)
        taken.append(box)
        labels.append(label)
    return labels


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
    """The N lines :func:`lightning_dfl.federation.algorithms.dadpfl_waits.schedule_table` most likely simulated.

    A given N appears as itself wherever it is below M; ``None`` (N = M) when every M has a row
    waiting for all its prior neighbours.
    """
    capped = sorted({r.max_wait for r in rows if r.max_wait < r.num_neighbors})
    ms = {r.num_neighbors for r in rows}
    everyone = all(any(r.num_neighbors == m and r.max_wait == m for r in rows) for m in ms)
    return [*capped, *([None] if everyone else [])]


def plot_schedule(rows: Sequence[SchedulingStats], path: str | os.PathLike,
                  max_waits: Sequence[int | None] | None = None, title: str | None = None) -> Path:
    """DA-DPFL Figs. 8-9 from :func:`~lightning_dfl.federation.algorithms.dadpfl_waits.schedule_table` rows; returns the path.

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

    fig = agg_figure(11.0, 4.5)
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
    fig = agg_figure(7.0, 4.5)
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
    ax.set(xlabel="θ (weight of energy against time)", ylabel="C_total(θ): 1 unit per s of time, per J of energy",
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
    fig = agg_figure(5.0 * cols, 4.0 * rows)
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


# ---------------------------------------------------------------------------------------------
# Diagnostics of a run (lightning_dfl.federation.metrics.diagnostics)
# ---------------------------------------------------------------------------------------------

#: the figures :func:`plot_diagnostics` writes, by file name
DIAGNOSTICS_FIGURES = ("diag_overview.png", "diag_mixing.png", "diag_masks.png", "diag_jaccard_heatmap.png",
                       "diag_bytes_heatmap.png", "diag_accuracy_hist.png")
_DIAG_SERIES = ("diag/spectral_gap", "diag/consensus_distance", "diag/consensus_distance_masked",
                "diag/mask_jaccard_mean", "diag/mask_jaccard_min", "diag/mask_flip_fraction")


def _metric_series(metrics_csv: Path, metric: str) -> tuple[list[int], list[float]]:
    """(rounds, values) of one metrics.csv column (empty when the column is absent)."""
    import csv

    with reading(metrics_csv), metrics_csv.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if metric not in (reader.fieldnames or []):
            return [], []
        seen: dict[int, float] = {}
        for row in reader:
            r, v = (row.get("round") or "").strip(), (row.get(metric) or "").strip()
            if r and v:
                seen[int(float(r))] = float(v)
    rounds = sorted(seen)
    return rounds, [seen[r] for r in rounds]


def _read_diagnostics(run_dir: Path) -> dict[str, Any]:
    """What the diagnostics figures draw, read from a run folder."""
    import csv

    import numpy as np

    from lightning_dfl.federation.metrics.diagnostics import FOLDER, read_matrix

    metrics_csv = run_dir / "metrics.csv"
    if not metrics_csv.is_file():
        raise FileNotFoundError(f"no metrics.csv in {os.fspath(run_dir)!r}: give a run folder "
                                "(runs/<algorithm>/version_N)")
    series = {m: _metric_series(metrics_csv, m) for m in _DIAG_SERIES}
    if not series["diag/spectral_gap"][0]:
        raise ValueError(f"{os.fspath(metrics_csv)!r} has no diag/* metrics: train with trainer.diagnostics true "
                         "(the default up to 100 clients)")
    folder = run_dir / FOLDER
    data: dict[str, Any] = {"series": series, "jaccard": None, "bytes": None, "labels": None, "groups": None,
                            "accuracy": None}
    if (folder / "mask_jaccard.csv").is_file():
        data["jaccard"] = read_matrix(folder / "mask_jaccard.csv")
    if (folder / "bytes.csv").is_file():
        data["bytes"] = read_matrix(folder / "bytes.csv")
    elif (folder / "edges.csv").is_file():  # a run stopped before its last round: sum the edges
        with reading(folder / "edges.csv"), (folder / "edges.csv").open() as fh:
            rows = list(csv.DictReader(fh))
        size = 1 + max((max(int(r["sender"]), int(r["receiver"])) for r in rows), default=-1)
        matrix = np.zeros((size, size))
        for r in rows:
            matrix[int(r["sender"]), int(r["receiver"])] += float(r["value_bytes"])
        data["bytes"] = matrix
    if (folder / "client_labels.csv").is_file():
        with reading(folder / "client_labels.csv"), (folder / "client_labels.csv").open() as fh:
            rows = list(csv.DictReader(fh))
        data["labels"] = [int(r["dominant_label"]) if r["dominant_label"] else -1 for r in rows]
        data["groups"] = [int(r["group"]) if r.get("group") else None for r in rows]
    if (run_dir / "clients.csv").is_file():
        final: dict[int, tuple[int, float]] = {}
        with reading(run_dir / "clients.csv"), (run_dir / "clients.csv").open() as fh:
            for row in csv.DictReader(fh):
                if (row.get("acc_trained") or "").strip():
                    k, r = int(row["client"]), int(row["round"])
                    if k not in final or r >= final[k][0]:
                        final[k] = (r, float(row["acc_trained"]))
        data["accuracy"] = [final[k][1] for k in sorted(final)] or None
    return data


def _scale(ax: Any, values: Sequence[float]) -> None:
    """Log scale when every value is positive and they span a factor of 10 or more, else linear (a gap of 0,
    Local's, has no logarithm)."""
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) >= 10 * min(finite):
        ax.set_yscale("log")


#: values this close to 0 are shown as 0 (a gap of -8.9e-16 is a rounding error of an exact 0)
DISPLAY_ZERO = 1e-12


def display_value(value: float, tolerance: float = DISPLAY_ZERO) -> float:
    """``value`` as figures and tables show it: 0.0 where it lies within ``tolerance`` of 0 (for display only;
    the logged metric keeps its value)."""
    return 0.0 if math.isfinite(value) and abs(value) <= tolerance else value


def _draw_mixing(ax_gap: Any, ax_dist: Any, series: Mapping[str, tuple[list[int], list[float]]]) -> None:
    x, y = series["diag/spectral_gap"]
    y = [display_value(v) for v in y]
    ax_gap.plot(x, y, "o-" if len(x) <= 30 else "-", ms=3, color="C0")
    _scale(ax_gap, y)
    ax_gap.set(xlabel="round", ylabel="1 - rho", title="Spectral gap of the realized W")
    for metric, colour, label in (("diag/consensus_distance", "C1", "dense"),
                                  ("diag/consensus_distance_masked", "C2", "on shared weights")):
        x, y = series[metric]
        ax_dist.plot(x, y, "o-" if len(x) <= 30 else "-", ms=3, color=colour, label=label)
    _scale(ax_dist, series["diag/consensus_distance"][1] + series["diag/consensus_distance_masked"][1])
    ax_dist.set(xlabel="round", ylabel="mean ||x_k - x_bar||^2", title="Consensus distance")
    ax_dist.legend(fontsize="small")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_gap, ax_dist):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)


def _draw_masks(ax: Any, series: Mapping[str, tuple[list[int], list[float]]]) -> None:
    for metric, colour, style, label in (("diag/mask_jaccard_mean", "C0", "-", "Jaccard mean"),
                                         ("diag/mask_jaccard_min", "C0", "--", "Jaccard min"),
                                         ("diag/mask_flip_fraction", "C3", "-", "flip fraction")):
        x, y = series[metric]
        if x:
            ax.plot(x, y, style, marker="o" if len(x) <= 30 else None, ms=3, color=colour, label=label)
    ax.set(xlabel="round", ylabel="share", title="Mask overlap and movement", ylim=(-0.02, 1.02))
    ax.legend(fontsize="small")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _whole_ticks(*axes: Any) -> None:
    """Ticks at whole numbers only (clients, counts): no 2.5 between clients 2 and 3."""
    from matplotlib.ticker import MaxNLocator

    for axis in axes:
        axis.set_major_locator(MaxNLocator(integer=True))


def _plain_colorbar(bar: Any) -> None:
    """A colour bar labelled with plain numbers (2, 5, 20), never as powers (2x10^0)."""
    from matplotlib.ticker import LogFormatter

    for which in ("major", "minor"):
        getattr(bar.ax.yaxis, f"set_{which}_formatter")(LogFormatter(labelOnlyBase=False))


def _client_order(labels: Sequence[int] | None, groups: Sequence[int | None] | None, k: int) -> list[int]:
    """Clients sorted by group (when the partition has groups), then dominant label, then id."""
    if labels is None or len(labels) != k:
        return list(range(k))
    group = [g if g is not None else 0 for g in (groups or [None] * k)]
    return sorted(range(k), key=lambda c: (group[c], labels[c], c))


def jaccard_limits(matrix: Any) -> tuple[float, float]:
    """The colour limits of a mask-Jaccard heatmap: the range of its finite off-diagonal values (the diagonal,
    always 1, would squeeze the pairs' differences into a few shades); (0, 1) without any, and a range of
    0.01 around a single value."""
    import numpy as np

    matrix = np.asarray(matrix, dtype=float)
    values = matrix[~np.eye(matrix.shape[0], dtype=bool)] if matrix.ndim == 2 else matrix.ravel()
    values = values[np.isfinite(values)]
    if not values.size:
        return 0.0, 1.0
    low, high = float(values.min()), float(values.max())
    if high - low < 1e-9:
        low, high = low - 0.005, high + 0.005
    return low, high


def _draw_jaccard(ax: Any, fig: Any, data: Mapping[str, Any]) -> None:
    import numpy as np

    matrix = data["jaccard"]
    if matrix is None:
        ax.text(0.5, 0.5, "no final mask-Jaccard matrix\n(the run has not finished)", ha="center", va="center")
        ax.set_axis_off()
        return
    order = _client_order(data["labels"], data["groups"], matrix.shape[0])
    shown = np.array(matrix, dtype=float)[np.ix_(order, order)]
    low, high = jaccard_limits(shown)
    np.fill_diagonal(shown, np.nan)  # each client with itself: 1, drawn grey, outside the colour scale
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    image = ax.imshow(shown, vmin=low, vmax=high, cmap=cmap, interpolation="nearest")
    fig.colorbar(image, ax=ax, shrink=0.8, label="Jaccard, pairs' range (diagonal = 1, grey)")
    if data["labels"] is not None and len(data["labels"]) == matrix.shape[0]:
        keys = [(data["groups"][c] if data["groups"] and data["groups"][c] is not None else 0, data["labels"][c])
                for c in order]
        for i in range(1, len(keys)):
            if keys[i] != keys[i - 1]:
                ax.axhline(i - 0.5, color="white", lw=0.6)
                ax.axvline(i - 0.5, color="white", lw=0.6)
        title = "Final mask Jaccard (by dominant label)"
        if len(order) <= 30:  # "client:label" ticks
            ticks = [f"{c}:{data['labels'][c]}" for c in order]
            ax.set_xticks(range(len(order)), ticks, rotation=90, fontsize="x-small")
            ax.set_yticks(range(len(order)), ticks, fontsize="x-small")
    else:
        title = "Final mask Jaccard"
        if len(order) <= 30:
            ax.set_xticks(range(len(order)), order, fontsize="x-small")
            ax.set_yticks(range(len(order)), order, fontsize="x-small")
    if len(order) > 30:
        _whole_ticks(ax.xaxis, ax.yaxis)
    ax.set(title=title, xlabel="client:dominant label" if data["labels"] is not None else "client",
           ylabel="client")


def _draw_bytes(ax: Any, fig: Any, matrix: Any) -> None:
    import numpy as np

    if matrix is None:
        ax.text(0.5, 0.5, "no bytes matrix", ha="center", va="center")
        ax.set_axis_off()
        return
    mb = np.asarray(matrix, dtype=float) / 1e6
    shown = np.where(mb > 0, mb, np.nan)
    from matplotlib.colors import LogNorm

    positive = mb[mb > 0]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size and positive.max() > positive.min() else None
    image = ax.imshow(shown, cmap="magma", interpolation="nearest", norm=norm)
    bar = fig.colorbar(image, ax=ax, shrink=0.8, label="MB (10^6 B)")
    if norm is not None:
        _plain_colorbar(bar)
    ax.set(title=f"Bytes sent, run total {mb.sum():.3g} MB", xlabel="receiver", ylabel="sender")
    _whole_ticks(ax.xaxis, ax.yaxis)


def _draw_accuracy(ax: Any, accuracy: Sequence[float] | None) -> None:
    import numpy as np

    if not accuracy:
        ax.text(0.5, 0.5, "no per-client accuracy", ha="center", va="center")
        ax.set_axis_off()
        return
    values = 100 * np.asarray(accuracy)
    # edged bars: adjacent bars of equal height stay apart (one wide bar would read as fewer clients)
    ax.hist(values, bins=min(20, max(5, len(values) // 2)), color="C0", alpha=0.8, edgecolor="black", linewidth=0.8)
    ax.axvline(values.mean(), color="k", lw=1.5, label=f"mean {values.mean():.1f}")
    ax.axvline(np.percentile(values, 10), color="C3", ls="--", lw=1.5, label=f"p10 {np.percentile(values, 10):.1f}")
    ax.set(xlabel="final accuracy on own test set (%)", ylabel="clients", title="Per-client accuracy")
    _whole_ticks(ax.yaxis)
    ax.legend(fontsize="small")


def plot_diagnostics(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """The diagnostics figures of a finished (or resumed) run; returns the paths written.

    Reads ``metrics.csv``, ``clients.csv`` and ``diagnostics/`` of ``run_dir`` and writes into ``out_dir``
    (default ``<run_dir>/diagnostics``) the files of :data:`DIAGNOSTICS_FIGURES`: an overview (the five
    below in one 15 x 9 inch figure), the spectral gap and consensus distances per round (log scale where
    every value is positive), mask Jaccard and flip fraction per round, the final K x K mask-Jaccard
    heatmap with clients ordered by group then dominant label (lines between blocks), the bytes heatmap
    (sender x receiver, log colours) and a histogram of the final per-client accuracy.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise NotADirectoryError(f"no run folder {os.fspath(run_dir)!r}: give runs/<algorithm>/version_N")
    check_plot_path("check.png")
    data = _read_diagnostics(run)
    out = Path(out_dir) if out_dir is not None else run / "diagnostics"
    written = []

    fig = agg_figure(15.0, 9.0)
    axes = fig.subplots(2, 3).ravel()
    _draw_mixing(axes[0], axes[1], data["series"])
    _draw_masks(axes[2], data["series"])
    _draw_jaccard(axes[3], fig, data)
    _draw_bytes(axes[4], fig, data["bytes"])
    _draw_accuracy(axes[5], data["accuracy"])
    fig.suptitle(f"Diagnostics of {run.parent.name}/{run.name}")
    written.append(_save(fig, out / DIAGNOSTICS_FIGURES[0]))

    fig = agg_figure(10.0, 4.0)
    _draw_mixing(*fig.subplots(1, 2), data["series"])
    written.append(_save(fig, out / DIAGNOSTICS_FIGURES[1]))
    fig = agg_figure(5.0, 4.0)
    _draw_masks(fig.subplots(), data["series"])
    written.append(_save(fig, out / DIAGNOSTICS_FIGURES[2]))
    fig = agg_figure(6.0, 5.0)
    _draw_jaccard(fig.subplots(), fig, data)
    written.append(_save(fig, out / DIAGNOSTICS_FIGURES[3]))
    fig = agg_figure(6.0, 5.0)
    _draw_bytes(fig.subplots(), fig, data["bytes"])
    written.append(_save(fig, out / DIAGNOSTICS_FIGURES[4]))
    fig = agg_figure(5.0, 4.0)
    _draw_accuracy(fig.subplots(), data["accuracy"])
    written.append(_save(fig, out / DIAGNOSTICS_FIGURES[5]))
    return written


__all__ = ["DIAGNOSTICS_FIGURES", "DPI", "check_plot_path", "plot_cost_curves", "plot_curves", "plot_diagnostics",
           "plot_schedule"]
