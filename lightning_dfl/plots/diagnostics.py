"""A run's diagnostics as figures (``lightning-dfl plot diagnostics RUN_DIR``): spectral gap and consensus
distance, mask overlap, the mask-Jaccard and bytes heatmaps and the per-client accuracy, read from the files
:mod:`lightning_dfl.federation.metrics.diagnostics` writes."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_dfl.errors import reading
from lightning_dfl.plots.canvas import agg_figure, check_plot_path, save_figure

#: the figures :func:`plot_diagnostics` writes, by file name
DIAGNOSTICS_FIGURES = ("diag_overview.png", "diag_mixing.png", "diag_masks.png", "diag_jaccard_heatmap.png",
                       "diag_bytes_heatmap.png", "diag_accuracy_hist.png")
_DIAG_SERIES = ("diag/spectral_gap", "diag/consensus_distance", "diag/consensus_distance_masked",
                "diag/mask_jaccard_mean", "diag/mask_jaccard_min", "diag/mask_flip_fraction")


def _metric_series(metrics: Path, metric: str) -> tuple[list[int], list[float]]:
    """(rounds, values) of one metric of a run, as :func:`~lightning_dfl.cost.read_round_metrics` reads it (its
    metrics.csv or TensorBoard event files); empty when the run has none."""
    from lightning_dfl.cost import MissingMetrics, read_round_metrics

    try:
        seen = read_round_metrics(metrics, [metric])
    except MissingMetrics:
        return [], []
    rounds = sorted(seen)
    return rounds, [seen[r][metric] for r in rounds]


def _read_diagnostics(run_dir: Path) -> dict[str, Any]:
    """What the diagnostics figures draw, read from a run folder (its metrics.csv or TensorBoard event files)."""
    import csv

    import numpy as np

    from lightning_dfl.federation.metrics.diagnostics import FOLDER, read_matrix
    from lightning_dfl.run_metrics import metrics_source

    metrics_csv = metrics_source(run_dir)
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
        data["bytes"] = matrix if rows else None  # no edge logged yet: the placeholder, not an empty heatmap
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

    values = 100 * np.asarray(accuracy if accuracy else [], dtype=float)
    finite = values[np.isfinite(values)]
    if not finite.size:
        ax.text(0.5, 0.5, "no per-client accuracy" + ("\n(every value is NaN: a diverged run?)" if values.size else ""),
                ha="center", va="center")
        ax.set_axis_off()
        return
    if finite.size < values.size:
        warnings.warn(f"{values.size - finite.size} of {values.size} clients' final accuracy is not a number (a "
                      "diverged client?): the histogram shows the others", stacklevel=2)
    values = finite
    # edged bars: adjacent bars of equal height stay apart (one wide bar would read as fewer clients)
    ax.hist(values, bins=min(20, max(5, len(values) // 2)), color="C0", alpha=0.8, edgecolor="black", linewidth=0.8)
    ax.axvline(values.mean(), color="k", lw=1.5, label=f"mean {values.mean():.1f}")
    ax.axvline(np.percentile(values, 10), color="C3", ls="--", lw=1.5, label=f"p10 {np.percentile(values, 10):.1f}")
    ax.set(xlabel="final accuracy on own test set (%)", ylabel="clients", title="Per-client accuracy")
    _whole_ticks(ax.yaxis)
    ax.legend(fontsize="small")


def plot_diagnostics(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """The diagnostics figures of a finished (or resumed) run; returns the paths written.

    Reads ``metrics.csv`` (else the TensorBoard event files), ``clients.csv`` and ``diagnostics/`` of ``run_dir``
    and writes into ``out_dir`` (default ``<run_dir>/diagnostics``) the files of :data:`DIAGNOSTICS_FIGURES`: an
    overview (the five below in one 15 x 9 inch figure), the spectral gap and consensus distances per round (log scale where
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
    written.append(save_figure(fig, out / DIAGNOSTICS_FIGURES[0]))

    fig = agg_figure(10.0, 4.0)
    _draw_mixing(*fig.subplots(1, 2), data["series"])
    written.append(save_figure(fig, out / DIAGNOSTICS_FIGURES[1]))
    fig = agg_figure(5.0, 4.0)
    _draw_masks(fig.subplots(), data["series"])
    written.append(save_figure(fig, out / DIAGNOSTICS_FIGURES[2]))
    fig = agg_figure(6.0, 5.0)
    _draw_jaccard(fig.subplots(), fig, data)
    written.append(save_figure(fig, out / DIAGNOSTICS_FIGURES[3]))
    fig = agg_figure(6.0, 5.0)
    _draw_bytes(fig.subplots(), fig, data["bytes"])
    written.append(save_figure(fig, out / DIAGNOSTICS_FIGURES[4]))
    fig = agg_figure(5.0, 4.0)
    _draw_accuracy(fig.subplots(), data["accuracy"])
    written.append(save_figure(fig, out / DIAGNOSTICS_FIGURES[5]))
    return written


__all__ = ["DIAGNOSTICS_FIGURES", "DISPLAY_ZERO", "display_value", "jaccard_limits", "plot_diagnostics"]
