"""The figures' canvas: an Agg ``Figure`` of fixed DPI, the path check, saving, colours and label placement.

matplotlib is optional (``pip install -e '.[plots]'``): it is imported inside the functions, so importing
:mod:`lightning_dfl.plots` needs none, and a figure asked for without it raises ``ImportError`` saying how to
install it. Figures are drawn on an Agg canvas (no pyplot, so no global backend switch and no figure kept alive);
the file format follows the path's suffix.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_dfl.checks import check_output_path
from lightning_dfl.errors import MissingExtra

DPI = 100
"""Dots per inch of every figure (and of the saved raster files)."""

#: the error a figure gives without matplotlib
MISSING_MATPLOTLIB = "plots need matplotlib: pip install -e '.[plots]'"


def agg_figure(width: float, height: float) -> Any:
    """A constrained-layout ``Figure`` on an Agg canvas, ``width x height`` inches at :data:`DPI`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise MissingExtra(MISSING_MATPLOTLIB) from err
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
    (the message lists the ones it can: png, pdf, svg, ...), or for a path that cannot be a file (an existing
    folder, a path under a file: :func:`~lightning_dfl.checks.check_output_path`). Call it before heavy work.
    """
    check_output_path("plot path", path, folder=False)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise MissingExtra(MISSING_MATPLOTLIB) from err
    out = Path(path)
    supported = sorted(FigureCanvasAgg(Figure()).get_supported_filetypes())
    suffix = out.suffix.lower().lstrip(".")
    if suffix not in supported:
        raise ValueError(f"plot path {os.fspath(path)!r} must end in one of "
                         f"{', '.join('.' + s for s in supported)} (the figure's format), got {out.suffix!r}")
    return out


def save_figure(fig: Any, path: str | os.PathLike) -> Path:
    """Save ``fig`` to ``path`` (checked by :func:`check_plot_path`, its folder created) at :data:`DPI`."""
    out = check_plot_path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


def palette(count: int) -> list[Any]:
    """``count`` distinguishable colours (tab10, then viridis for more)."""
    from matplotlib import colormaps

    if count <= 10:
        return [colormaps["tab10"](i) for i in range(count)]
    return [colormaps["viridis"](i / max(count - 1, 1)) for i in range(count)]


__all__ = ["DPI", "MISSING_MATPLOTLIB", "agg_figure", "check_plot_path", "palette", "place_labels", "save_figure"]
