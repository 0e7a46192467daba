"""What a run shows a person: a progress bar over rounds and a closing summary."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

MB = 1e6


@dataclass
class RunSummary:
    """The headline numbers of a finished run."""

    algorithm: str
    rounds: int
    final_accuracy: float
    best_accuracy: float
    final_density: float
    flops_per_client_round: float
    flops_total: float
    busiest_mb_per_round: float
    busiest_mask_mb_per_round: float
    mean_delay: float
    wall_time_s: float
    log_dir: str | None = None

    @classmethod
    def from_history(cls, algorithm: Any, history: list[dict[str, float]], wall_time_s: float,
                     log_dir: str | None) -> "RunSummary":
        last = history[-1]
        headline = [m["acc/headline"] for m in history if "acc/headline" in m]
        rounds = len(history)
        return cls(
            algorithm=getattr(algorithm, "name", str(algorithm)),
            rounds=rounds,
            final_accuracy=headline[-1] if headline else float("nan"),
            best_accuracy=max(headline) if headline else float("nan"),
            final_density=last.get("density/mean", float("nan")),
            flops_per_client_round=last.get("flops/train_per_client", 0.0),
            flops_total=sum(m.get("flops/train_total", 0.0) for m in history),
            busiest_mb_per_round=sum(m.get("comm/busiest_bytes", 0.0) for m in history) / rounds / MB,
            busiest_mask_mb_per_round=sum(m.get("comm/busiest_mask_bytes", 0.0) for m in history) / rounds / MB,
            mean_delay=sum(m.get("time/delay", 0.0) for m in history) / rounds,
            wall_time_s=wall_time_s,
            log_dir=log_dir,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "summary.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path


def print_summary(summary: RunSummary, console: Console | None = None) -> None:
    """Print the summary as a table."""
    console = console or Console()
    table = Table(title=f"{summary.algorithm}: {summary.rounds} rounds in {summary.wall_time_s:.1f} s",
                  show_header=False)
    table.add_row("mean personalized accuracy (final)", f"{100 * summary.final_accuracy:.2f} %")
    table.add_row("best mean accuracy", f"{100 * summary.best_accuracy:.2f} %")
    table.add_row("density (mean over clients)", f"{summary.final_density:.4f}")
    table.add_row("training FLOPs per client per round", f"{summary.flops_per_client_round:.3e}")
    table.add_row("training FLOPs, whole run", f"{summary.flops_total:.3e}")
    table.add_row("busiest node per round (values)", f"{summary.busiest_mb_per_round:.3f} MB (10^6 B)")
    table.add_row("busiest node per round (masks)", f"{summary.busiest_mask_mb_per_round:.3f} MB (10^6 B)")
    if summary.mean_delay:
        table.add_row("mean delay (task units)", f"{summary.mean_delay:.2f}")
    if summary.log_dir:
        table.add_row("metrics", str(summary.log_dir))
    console.print(table)


@contextmanager
def progress_bar(total: int, enabled: bool = True, completed: int = 0) -> Iterator[Callable[[dict[str, float]], None]]:
    """A rich progress bar over rounds; yields ``advance(metrics)``."""
    if not enabled:
        yield lambda metrics: None
        return
    progress = Progress(
        TextColumn("round"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(), TimeRemainingColumn(),
    )
    with progress:
        task = progress.add_task("rounds", total=total, completed=completed, status="")

        def advance(metrics: dict[str, float]) -> None:
            parts = []
            if "acc/headline" in metrics:
                parts.append(f"acc {100 * metrics['acc/headline']:.1f}%")
            if "density/mean" in metrics:
                parts.append(f"density {metrics['density/mean']:.3f}")
            if "train/loss" in metrics:
                parts.append(f"loss {metrics['train/loss']:.3f}")
            progress.update(task, advance=1, status="  ".join(parts))

        yield advance
