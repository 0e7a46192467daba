"""Analysis subcommands: ``lightning-dfl schedule`` (Figs. 8-9) and ``lightning-dfl cost`` (Sec. VI-A5)."""

from __future__ import annotations

from pathlib import Path

from lightning_dfl.cost import CostModel, run_cost_curve
from lightning_dfl.scheduling import format_schedule_table, schedule_table


def schedule(num_clients: int = 100, neighbors: list[int] = [2, 5, 10, 20, 50],  # noqa: B006
             max_waits: list[int | None] = [1, 2, 5, 10, None], rounds: int = 10_000, seed: int = 0) -> str:
    """Print the parallelism and delay of DA-DPFL's dynamic aggregation against M for several N.

    Args:
        num_clients: K.
        neighbors: the values of M (in-neighbours per client).
        max_waits: the values of N (prior neighbours waited for at most); null means N = M.
        rounds: Monte Carlo rounds per (M, N).
        seed: seed of the random topologies and reuse permutations.
    """
    table = format_schedule_table(schedule_table(num_clients, neighbors, max_waits, rounds, seed))
    print(table)
    return table


def _metrics_file(run: str) -> Path:
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.csv at {run!r}: give a run folder (runs/<algorithm>/version_N) "
                                "or its metrics.csv")
    return path


def cost(runs: list[str] | None = None, thetas: list[float] = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],  # noqa: B006
         reduce: str = "sum", flops_per_second: float = 80e12, flops_multiplier: float = 5.0,
         compute_power_w: float = 450.0, bandwidth_bps: float = 1e9, network_power_w: float = 1.0) -> str:
    """Print C_total(theta) = (1 - theta) C_time + theta C_energy of finished runs (DA-DPFL Sec. VI-A5).

    Per client and round: T_comp = multiplier x FLOPs / flops_per_second, E_comp = power x T_comp,
    T_comm = bytes x 8 / bandwidth, E_comm = network power x T_comm, C_time = (1 + delay)(T_comp +
    T_comm), with the round's training FLOPs per client, busiest-node bytes and simulated delay.

    Args:
        runs: run folders (``runs/<algorithm>/version_N``) or their ``metrics.csv``.
        thetas: the weights of energy against time.
        reduce: ``sum`` (whole run), ``mean`` (per round) or ``last`` (final round, as Table II).
    """
    if not runs:
        raise ValueError("cost needs --runs: a list of run folders or metrics.csv files, e.g. "
                         "--runs '[runs/dadpfl/version_0,runs/dispfl/version_0]'")
    model = CostModel(flops_per_second=flops_per_second, flops_multiplier=flops_multiplier,
                      compute_power_w=compute_power_w, bandwidth_bps=bandwidth_bps, network_power_w=network_power_w)
    curves = {run: run_cost_curve(_metrics_file(run), thetas, model, reduce=reduce) for run in runs}
    names = {run: f"{Path(run).parent.name}/{Path(run).name}" if Path(run).is_dir() else run for run in runs}
    header = ["theta", *(names[r] for r in runs)]
    rows = [[f"{t:.2f}", *(f"{curves[r].total[i]:.4g}" for r in runs)] for i, t in enumerate(thetas)]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            d_time = curves[a].time - curves[b].time
            d_energy = curves[a].energy - curves[b].energy
            crossing = d_time / (d_time - d_energy) if d_time != d_energy else float("nan")
            where = f"theta = {crossing:.3f}" if 0.0 <= crossing <= 1.0 else "no crossing in [0, 1]"
            lines.append(f"{names[a]} vs {names[b]}: {where}")
    text = "\n".join(lines)
    print(text)
    return text


SUBCOMMANDS = {"schedule": schedule, "cost": cost}
