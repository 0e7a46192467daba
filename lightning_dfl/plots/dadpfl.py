"""DA-DPFL's figures: Figs. 8-9 (parallelism and delay of dynamic aggregation against M, one line per
maximum wait N; black: N = M) and Figs. 3-4 (``C_total(theta) = (1 - theta) C_time + theta C_energy``,
Sec. VI-A5, per run, with the points where two runs' curves cross)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_dfl.checks import is_int
from lightning_dfl.cost import CostCurve
from lightning_dfl.federation.algorithms.dadpfl_waits import SchedulingStats
from lightning_dfl.plots.canvas import agg_figure, palette, save_figure

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
    numbered = iter(palette(sum(n is not None for n in lines)))
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
    return save_figure(fig, path)


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
    for name, colour in zip(names, palette(len(names))):
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
    return save_figure(fig, path)


__all__ = ["plot_cost_curves", "plot_schedule"]
