"""Analysis subcommands: ``lightning-dfl schedule`` (Figs. 8-9), ``lightning-dfl cost`` (Sec. VI-A5,
Figs. 3-4), ``lightning-dfl curves`` (logged metrics against the round) and ``lightning-dfl export``
(a client's channel-pruned model as a physically smaller network, :mod:`lightning_dfl.export`).

``--plot FILE`` (png, pdf, svg, ... by suffix) saves the figure of :mod:`lightning_dfl.plots`;
figures need matplotlib (``pip install -e '.[plots]'``), the printed tables do not.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from lightning_dfl.checks import check_int
from lightning_dfl.cost import CostModel, read_round_metrics, run_cost_curve
from lightning_dfl.federation.algorithms.dadpfl_waits import format_schedule_table, schedule_table
from lightning_dfl.run_metrics import is_event_file, metrics_source, run_folder


def schedule(num_clients: int = 100, neighbors: list[int] = [2, 5, 10, 20, 50],  # noqa: B006
             max_waits: list[int | None] = [1, 2, 5, 10, None], rounds: int = 10_000, seed: int = 0,
             plot: str | None = None) -> str:
    """Print the parallelism and delay of DA-DPFL's dynamic aggregation against M for several N.

    Args:
        num_clients: K.
        neighbors: the values of M (in-neighbours per client).
        max_waits: the values of N (prior neighbours waited for at most); null means N = M.
        rounds: Monte Carlo rounds per (M, N).
        seed: seed of the random topologies and reuse permutations.
        plot: also save Figs. 8-9 (parallelism and delay against M, one line per N) to this file.
    """
    if not neighbors or not max_waits:  # named by their options (schedule_table's error names its arguments)
        empty = "neighbors (M)" if not neighbors else "max_waits (N)"
        raise ValueError(f"--{empty} must be a non-empty list, got []: e.g. --neighbors '[2,5,10]' --max_waits "
                         "'[1,2,null]'")
    check_int("seed", seed, 0)  # numpy's refusal of -1 names no option
    if plot is not None:
        from lightning_dfl.plots import check_plot_path

        check_plot_path(plot)
    with _cells_progress("simulating (M, N)") as progress:
        rows = schedule_table(num_clients, neighbors, max_waits, rounds, seed, progress)
    table = format_schedule_table(rows)
    print(table)
    if plot is not None:
        from lightning_dfl.plots import plot_schedule

        print(f"figure: {plot_schedule(rows, plot, max_waits=max_waits)}")
    return table


@contextlib.contextmanager
def _cells_progress(what: str) -> Iterator[Callable[[int, int], None]]:
    """A bar on stderr while a table's cells are computed, gone when they are (shown only on a terminal);
    yields ``progress(done, total)``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:  # a log file gets the table alone
        yield lambda done, total: None
        return
    bar = Progress(TextColumn(what), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(), console=console,
                   transient=True)
    task = bar.add_task(what, total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _run_files(runs: list[str] | str | None, command: str) -> dict[str, Path]:
    """Each distinct run (in order) with what holds its metrics: its metrics.csv or TensorBoard event files
    (:func:`~lightning_dfl.run_metrics.metrics_source`; one run may be given alone, ``--runs DIR``); a clear error
    when none is given."""
    runs = [runs] if isinstance(runs, str) else runs
    if not runs:
        raise ValueError(f"{command} needs --runs: a list of run folders or metrics.csv files, e.g. "
                         "--runs '[runs/dadpfl/version_0,runs/dispfl/version_0]'")
    return {run: metrics_source(run) for run in dict.fromkeys(runs)}


def _run_labels(runs: list[str]) -> dict[str, str]:
    """Short names of runs: ``<algorithm>/version_N`` for a run folder, its metrics.csv or an event file, else
    the path as given (also when two short names would clash)."""
    labels = {}
    for run in runs:
        path = Path(run)
        folder = path if path.is_dir() else path.parent if path.name == "metrics.csv" or is_event_file(path) else None
        labels[run] = f"{folder.parent.name}/{folder.name}" if folder is not None else run
    if len(set(labels.values())) != len(labels):
        return {run: run for run in runs}
    return labels


#: what ``lightning-dfl cost`` prints: C_total's unit, and the rounds it covers per ``reduce``
COST_UNITS = ("C_total(theta) = (1 - theta) x time in s + theta x energy in J, per client, {over} "
              "(one cost unit per second and per joule, the paper's 'USD')")
COST_REDUCTIONS = {"sum": "summed over the run's rounds", "mean": "mean over rounds", "last": "final round"}


def cost(runs: list[str] | str | None = None, thetas: list[float] = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],  # noqa: B006
         reduce: str = "sum", flops_per_second: float = 80e12, flops_multiplier: float = 5.0,
         compute_power_w: float = 450.0, bandwidth_bps: float = 1e9, network_power_w: float = 1.0,
         plot: str | None = None) -> str:
    """Print C_total(theta) = (1 - theta) C_time + theta C_energy of finished runs (DA-DPFL Sec. VI-A5).

    Per client and round: T_comp = multiplier x FLOPs / flops_per_second, E_comp = power x T_comp,
    T_comm = bytes x 8 / bandwidth, E_comm = network power x T_comm, C_time = (1 + delay)(T_comp +
    T_comm), with the round's training FLOPs per client, busiest-node bytes and simulated delay.

    Args:
        runs: run folders (``runs/<algorithm>/version_N``: their ``metrics.csv``, else their TensorBoard event
            files) or their ``metrics.csv``: a list, or one run.
        thetas: the weights of energy against time.
        reduce: ``sum`` (whole run), ``mean`` (per round) or ``last`` (final round, as Table II).
        plot: also save Figs. 3-4 (C_total against theta per run, crossings marked) to this file.
    """
    files = _run_files(runs, "cost")
    runs = list(files)
    if not thetas:  # else a table of no rows
        raise ValueError("cost needs --thetas: weights of energy against time in [0, 1], e.g. '[0,0.5,1]'")
    if plot is not None:
        from lightning_dfl.plots import check_plot_path

        check_plot_path(plot)
    model = CostModel(flops_per_second=flops_per_second, flops_multiplier=flops_multiplier,
                      compute_power_w=compute_power_w, bandwidth_bps=bandwidth_bps, network_power_w=network_power_w)
    curves = {run: run_cost_curve(files[run], thetas, model, reduce=reduce) for run in runs}
    names = _run_labels(runs)
    header = ["theta", *(names[r] for r in runs)]
    rows = [[f"{t:.2f}", *(f"{curves[r].total[i]:.4g}" for r in runs)] for i, t in enumerate(thetas)]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(0, COST_UNITS.format(over=COST_REDUCTIONS[reduce]))
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            crossing = curves[a].crossing(curves[b])
            where = "no crossing in [0, 1]" if crossing is None else f"theta = {crossing:.3f}"
            lines.append(f"{names[a]} vs {names[b]}: {where}")
    text = "\n".join(lines)
    print(text)
    if plot is not None:
        from lightning_dfl.plots import plot_cost_curves

        print(f"figure: {plot_cost_curves({names[r]: curves[r] for r in runs}, plot)}")
    return text


def curves(runs: list[str] | str | None = None, metrics: list[str] = ["acc/headline", "density/mean"],  # noqa: B006
           plot: str | None = None, round_col: str = "round") -> str:
    """Plot logged metrics against the round for several finished runs, one panel per metric.

    Args:
        runs: run folders (``runs/<algorithm>/version_N``: their ``metrics.csv``, else their TensorBoard event
            files) or their ``metrics.csv``: a list, or one run.
        metrics: metrics.csv columns (TensorBoard scalars), e.g. ``acc/headline``, ``density/mean``,
            ``comm/busiest_bytes``, ``time/delay``, ``voting/score_mean``.
        plot: the figure's file (png, pdf, svg, ... by suffix); None: ``curves.png`` in the first run's folder
            (never the working folder, where it would replace another run's figure unasked).
        round_col: the column holding the round.
    """
    from lightning_dfl.plots import check_plot_path, plot_curves

    files = _run_files(runs, "curves")
    runs = list(files)
    if plot is None:
        plot = str(run_folder(files[runs[0]]) / "curves.png")
    if not metrics:
        raise ValueError("curves needs --metrics: metrics.csv columns, e.g. '[acc/headline,density/mean]'")
    check_plot_path(plot)
    names = _run_labels(runs)
    per_run: dict[str, dict[int, dict[str, float]]] = {}
    for run in runs:
        merged: dict[int, dict[str, float]] = {}
        for metric in metrics:  # one metric at a time: metrics logged on different rounds all stay
            values = read_round_metrics(files[run], [metric], round_col)
            if not values:
                raise ValueError(f"{str(files[run])!r} has a {metric!r} column but no round with a value in it")
            if all(math.isnan(v[metric]) for v in values.values()):
                warnings.warn(f"{str(files[run])!r}: {metric} is NaN in every round (a diverged run?); its panel "
                              f"shows no line for {names[run]}", stacklevel=2)
            for r, v in values.items():
                merged.setdefault(r, {}).update(v)
        per_run[names[run]] = merged
    out = plot_curves(per_run, metrics, plot)
    print(f"figure: {out}")
    return str(out)


def export(checkpoint: str, client: int = 0, out: str = "client.pt2", latency: bool = True, threads: int = 1,
           batch_size: int = 1, test_images: bool = True, data_root: str | None = None) -> str:
    """Export a client's channel-pruned model as a physically smaller network (PRISAM).

    Args:
        checkpoint: a federation checkpoint (``<run>/checkpoints/last.ckpt``) of a ``vgg11`` (norm: batch) or
            ``resnet20`` run; PRISAM's stored channel masks are used, else the channels whose BN scale and
            shift are all zero are dropped.
        client: the client whose published model is exported.
        out: the ``.pt2`` file to write (``torch.export.load(out).module()`` runs it on any batch size).
        latency: also time the full and the exported model on the CPU (median of 50 after 10 warm-up).
        threads: CPU threads for the timing.
        batch_size: samples per timed forward.
        test_images: also check the exported and the saved model against the masked one on the client's own
            test images (the data rebuilt from the checkpoint's data settings); false: random inputs only.
        data_root: the data's folder when it moved since the run (replaces the checkpoint's ``data.root``).
    """
    from lightning_dfl.export import export_client
    from lightning_dfl.federation.trainer.settings import usable_cpus

    if latency:  # far more threads than CPUs crashed OpenMP's runtime (libgomp: out of memory) after the export
        check_int(f"threads (at most the {usable_cpus()} CPUs this process may use)", threads, 1, usable_cpus())
    text = export_client(checkpoint, client, out, latency, threads, batch_size, test_images, data_root).table()
    print(text)
    return text


SUBCOMMANDS = {"schedule": schedule, "cost": cost, "curves": curves, "export": export}
