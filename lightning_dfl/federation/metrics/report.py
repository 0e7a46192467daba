"""What a run reports: metrics per round to the loggers (flushed every round), per-client rows to
``clients.csv``, the best headline accuracy, a progress bar over rounds and a closing summary."""

from __future__ import annotations

import csv
import json
import math
import numbers
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
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

from lightning_dfl.errors import MissingExtra, reading, writing

MB = 1e6
CLIENTS_CSV = "clients.csv"


_VERSION = re.compile(r"version_(\d+)")


def claim_version_folder(parent: str | os.PathLike) -> int:
    """Create ``parent/version_N`` for the next free ``N`` (one above the highest there) and return ``N``.

    The folder is claimed with an atomic ``os.mkdir``: two runs started at once with the same ``parent``
    never share a folder (the one that loses the race takes the next number).
    """
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    taken = [int(m[1]) for entry in os.scandir(parent) if entry.is_dir() and (m := _VERSION.fullmatch(entry.name))]
    version = max(taken, default=-1) + 1
    while True:
        try:
            os.mkdir(parent / f"version_{version}")
            return version
        except FileExistsError:
            version += 1


class _ClaimsVersionFolder:
    """A Lightning logger whose ``version_N`` folder is created atomically when its version is first needed
    (Lightning's lists the folders, then creates one later: two runs started at once could share it)."""

    root_dir: str

    def _get_next_version(self) -> int:
        if "://" in str(self.root_dir):  # a remote file system: Lightning's own numbering
            return super()._get_next_version()  # type: ignore[misc]
        return claim_version_folder(self.root_dir)


class RunCSVLogger(_ClaimsVersionFolder, CSVLogger):
    """Lightning's CSV logger, its run folder claimed atomically (:func:`claim_version_folder`)."""


class RunTensorBoardLogger(_ClaimsVersionFolder, TensorBoardLogger):
    """Lightning's TensorBoard logger, its run folder claimed atomically (:func:`claim_version_folder`)."""


def build_logger(logger: Logger | bool | str | None, root: str, name: str) -> Logger | None:
    """The run's logger: a Lightning ``Logger`` as given, ``True``/``None``/``"csv"`` for a CSV logger,
    ``"tensorboard"`` for a TensorBoard logger (the ``tensorboard`` extra), ``False`` for none. The run
    folder (``root/name/version_N``) is created when the run first needs it, not here."""
    if logger is False:
        return None
    if isinstance(logger, Logger):
        return logger
    if logger in (True, None, "csv"):
        return RunCSVLogger(root, name=name)
    if logger == "tensorboard":
        try:
            import tensorboard  # noqa: F401
        except ImportError as err:
            raise MissingExtra("logger='tensorboard' needs TensorBoard: pip install -e '.[tensorboard]'") from err
        return RunTensorBoardLogger(root, name=name)
    raise ValueError(f"logger must be a Lightning Logger, True, False, 'csv' or 'tensorboard', got {logger!r}")


#: per kind of headline (``Algorithm.headline``): the metric ``acc/headline`` copies and what it is
HEADLINES = {
    "personal": ("acc/personal_mean", "mean personalized accuracy"),
    "aggregated": ("acc/aggregated_mean", "mean personalized accuracy after aggregation, before local training"),
    "consensus": ("acc/consensus_mean", "shared model's mean accuracy over clients"),
    "global": ("acc/global", "global model's accuracy, official test split"),
    "subnetwork": ("acc/subnetwork_mean", "mean subnetwork accuracy (server model x client mask)"),
    "own_model": ("acc/own_model_mean", "mean accuracy of each client's own last-trained model"),
}


class RoundReporter:
    """Writes each round's metrics to the logger and flushes it (a killed run keeps its
    ``metrics.csv``), and appends per-client rows to ``<log_dir>/clients.csv``."""

    def __init__(self, logger: Any, is_global_zero: bool = True) -> None:
        self.logger = logger
        self.is_global_zero = is_global_zero
        self._client_fields: list[str] | None = None
        self._warned_partial = False

    def start_run(self, hparams: dict[str, Any], run_files: dict[str, str], root: str | os.PathLike) -> None:
        """Log the run's hyperparameters and, on process 0, write ``run_files`` (by name) into its folder; a folder
        under ``root`` that cannot be written is a :class:`~lightning_dfl.errors.RunFileError` naming it."""
        if self.logger is None:
            return
        with writing(root):
            self.logger.log_hyperparams(hparams)
            if self.log_dir and self.is_global_zero:
                Path(self.log_dir).mkdir(parents=True, exist_ok=True)
                for name, text in run_files.items():
                    (Path(self.log_dir) / name).write_text(text)

    def warn_partial(self, round_idx: int, metrics: dict[str, float], num_clients: int, evaluated: bool) -> None:
        """Once per run: an evaluated round whose stragglers (clients that missed the deadline) are left out of
        ``acc/personal_mean``, which averages the ``acc/personal_count`` clients that met it."""
        stragglers = int(metrics.get("faults/stragglers", 0))
        if self._warned_partial or not evaluated or not stragglers:
            return
        self._warned_partial = True
        count = int(metrics.get("acc/personal_count", 0))
        what = (f"acc/personal_mean averages only the {count} of {num_clients} clients evaluated "
                "(acc/personal_count)" if count else "no client was evaluated: the round has no acc/personal_mean")
        rank_zero_warn(f"round {round_idx + 1}: {stragglers} client(s) missed the deadline; {what} (said once per run)")

    @staticmethod
    def warn_without_accuracy(summary: Any, deadline: float | None) -> None:
        """A run that ends without any headline accuracy (``final_accuracy`` null): say so, and why if known."""
        if not math.isnan(summary.final_accuracy):
            return
        why = (f": no client met the deadline ({deadline:g}) in an evaluated round" if deadline is not None
               else ": no evaluated round produced one")
        rank_zero_warn(f"the run has no accuracy (final_accuracy is null in summary.json){why}")

    @property
    def log_dir(self) -> str | None:
        return getattr(self.logger, "log_dir", None) if self.logger else None

    def metrics_file(self) -> str | None:
        """What the logger writes: ``<log_dir>/metrics.csv`` for a CSV logger, else its folder."""
        if self.log_dir is None:
            return None
        return str(Path(self.log_dir) / "metrics.csv") if isinstance(self.logger, CSVLogger) else self.log_dir

    def log_round(self, round_idx: int, metrics: dict[str, float], client_rows: list[dict[str, Any]]) -> None:
        """Log one round and flush the logger; append its client rows. A failed write (disk full, read-only
        folder) is a :class:`~lightning_dfl.errors.RunFileError` naming the file."""
        if self.logger is not None:
            with writing(self.metrics_file()):
                self.logger.log_metrics(metrics, step=round_idx)
                self.logger.save()
        self._write_client_rows(client_rows)

    def replay(self, history: list[dict[str, float]], previous_log_dir: Path) -> None:
        """A resumed run: log the checkpoint's rounds again (so this run's metrics cover every round)
        and start its ``clients.csv`` from the previous run's."""
        if self.logger is not None:
            with writing(self.metrics_file()):
                for round_idx, metrics in enumerate(history):
                    self.logger.log_metrics(metrics, step=round_idx)
                self.logger.save()
        if self.log_dir is None or not self.is_global_zero:
            return
        earlier = Path(previous_log_dir) / CLIENTS_CSV
        mine = Path(self.log_dir) / CLIENTS_CSV
        if earlier.is_file() and earlier.resolve() != mine.resolve():
            with reading(earlier), earlier.open(newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["round"]) < len(history)]
            if rows:
                with writing(mine), mine.open("w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                    writer.writeheader()
                    writer.writerows(rows)
                self._client_fields = list(rows[0])

    def _write_client_rows(self, rows: list[dict[str, Any]]) -> None:
        if not rows or self.log_dir is None or not self.is_global_zero:
            return
        path = Path(self.log_dir) / CLIENTS_CSV
        with writing(path):
            self._append_client_rows(path, rows)

    def _append_client_rows(self, path: Path, rows: list[dict[str, Any]]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fields = list(dict.fromkeys(k for row in rows for k in row))
        if self._client_fields is None or not path.exists():
            with path.open("w", newline="") as f:
                csv.DictWriter(f, fieldnames=fields).writeheader()
            self._client_fields = fields
        elif set(fields) - set(self._client_fields):  # a new column: rewrite with the wider header
            old = list(csv.DictReader(path.open()))
            self._client_fields += [k for k in fields if k not in self._client_fields]
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self._client_fields)
                writer.writeheader()
                writer.writerows(old)
        with path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self._client_fields).writerows(rows)

    @staticmethod
    def update_best(metrics: dict[str, float], history: list[dict[str, float]], headline: str) -> None:
        """Add ``acc/headline`` (the metric :data:`HEADLINES` names for ``headline``) and ``acc/best`` so far."""
        key = HEADLINES.get(headline, HEADLINES["personal"])[0]
        if key in metrics:
            metrics["acc/headline"] = metrics[key]
        previous = [m["acc/headline"] for m in history if "acc/headline" in m]
        if "acc/headline" in metrics or previous:
            metrics["acc/best"] = max(previous + ([metrics["acc/headline"]] if "acc/headline" in metrics else []))


def _finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-inf) inside dicts and lists replaced by ``None``
    (numpy floats become plain floats)."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def mean_client_density(store: Any, num_clients: int) -> float:
    """The mean over clients ``0..num_clients-1`` of their current masks' density (active share of the masked
    set; 1 without one), summed by client id. A round's ``density/mean`` covers only its trained clients
    (Sub-FedAvg samples 5 of 20), so the summary's "mean over clients" is taken here, over all of them."""
    size = store.masked_size()
    if not size or not num_clients:
        return 1.0

    def density(k: int) -> float:
        return sum(int(m.sum()) for m in store.mask(k).values()) / size

    from_owners = getattr(store, "gather_nodes", None)  # a partitioned store: each process its own clients'
    values = from_owners(density, range(num_clients)) if from_owners else [density(k) for k in range(num_clients)]
    return sum(values) / num_clients


@dataclass
class RunSummary:
    """The headline numbers of a finished run."""

    algorithm: str
    rounds: int
    final_accuracy: float
    best_accuracy: float
    #: the mean over every client (not only the last round's participants) of its final mask's density
    final_density: float
    flops_per_client_round: float
    flops_total: float
    busiest_mb_per_round: float
    busiest_mask_mb_per_round: float
    mean_delay: float
    wall_time_s: float
    log_dir: str | None = None
    #: the method as results name it, non-original settings in brackets ("BEER (fresh minibatch)")
    label: str | None = None
    #: the metric the accuracies are (``acc/personal_mean``, ``acc/global``, ...; see :data:`HEADLINES`)
    headline_metric: str = HEADLINES["personal"][0]
    #: what that metric is, as the printed summary names it
    headline: str = HEADLINES["personal"][1]
    #: why the run ended before its last round (``None``: it ran them all), e.g. "diverged in round 380 of 400"
    stopped: str | None = None
    #: seconds from the command's start to the first round (imports, configuration, data, model; see
    #: :mod:`lightning_dfl.startup`); ``None`` where not measured
    startup_s: float | None = None
    #: the last checkpoint the run wrote (``checkpoint_every``), ``None`` if it wrote none
    checkpoint: str | None = None

    @classmethod
    def from_history(cls, algorithm: Any, history: list[dict[str, float]], wall_time_s: float,
                     log_dir: str | None, final_density: float | None = None,
                     stopped: str | None = None, startup_s: float | None = None,
                     checkpoint: str | None = None) -> "RunSummary":
        """``final_density``: the mean over all clients (:func:`mean_client_density`); without it, the last
        round's ``density/mean``, which covers only the clients that trained in it. ``stopped``: why the
        history ends before the run's last round."""
        last = history[-1]
        headline = [m["acc/headline"] for m in history if "acc/headline" in m]
        rounds = len(history)
        metric, described = HEADLINES.get(getattr(algorithm, "headline", "personal"), HEADLINES["personal"])
        return cls(
            algorithm=getattr(algorithm, "name", str(algorithm)),
            rounds=rounds,
            final_accuracy=headline[-1] if headline else float("nan"),
            best_accuracy=max(headline) if headline else float("nan"),
            final_density=last.get("density/mean", float("nan")) if final_density is None else final_density,
            flops_per_client_round=last.get("flops/train_per_client", 0.0),
            flops_total=sum(m.get("flops/train_total", 0.0) for m in history),
            busiest_mb_per_round=sum(m.get("comm/busiest_bytes", 0.0) for m in history) / rounds / MB,
            busiest_mask_mb_per_round=sum(m.get("comm/busiest_mask_bytes", 0.0) for m in history) / rounds / MB,
            mean_delay=sum(m.get("time/delay", 0.0) for m in history) / rounds,
            wall_time_s=wall_time_s,
            log_dir=log_dir,
            label=algorithm.label() if hasattr(algorithm, "label") else None,
            headline_metric=metric,
            headline=described,
            stopped=stopped,
            startup_s=startup_s,
            checkpoint=checkpoint,
        )

    def to_json(self) -> str:
        """The summary as strict JSON: a value that is not a finite number (e.g. the accuracy of a run
        that never evaluated) is written as ``null``, never as the invalid tokens ``NaN``/``Infinity``."""
        return json.dumps(_finite_or_null(asdict(self)), indent=2, allow_nan=False)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "summary.json"
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.to_json())
        return path


def summary_title(summary: RunSummary) -> str:
    """The summary's first line: the method, its rounds' time and the start-up before them, e.g.
    ``DisPFL: 40 rounds in 48.1 s (after 8.2 s of start-up)``."""
    title = f"{summary.label or summary.algorithm}: {summary.rounds} rounds in {summary.wall_time_s:.1f} s"
    return title if summary.startup_s is None else f"{title} (after {summary.startup_s:.1f} s of start-up)"


def print_summary(summary: RunSummary, console: Console | None = None) -> None:
    """Print the summary as a table, then the run's folder and last checkpoint, one line each and never cut
    (a narrow terminal folds a table cell's path; a path below it is whole, to copy)."""
    console = console or Console()
    # what the accuracy is goes in the caption (wrapped as text): the rows' labels stay short enough not to wrap
    table = Table(title=summary_title(summary), caption=f"accuracy: {summary.headline}", show_header=False)
    table.add_row("accuracy, final round", f"{100 * summary.final_accuracy:.2f} %")
    table.add_row("accuracy, best round", f"{100 * summary.best_accuracy:.2f} %")
    table.add_row("density (mean over all clients)", f"{summary.final_density:.4f}")
    table.add_row("training FLOPs per client per round", f"{summary.flops_per_client_round:.3e}")
    table.add_row("training FLOPs, whole run", f"{summary.flops_total:.3e}")
    table.add_row("busiest node per round (values)", f"{summary.busiest_mb_per_round:.3f} MB (10^6 B)")
    table.add_row("busiest node per round (masks)", f"{summary.busiest_mask_mb_per_round:.3f} MB (10^6 B)")
    if summary.mean_delay:
        table.add_row("mean delay (task units)", f"{summary.mean_delay:.2f}")
    console.print(table)
    for what, path in (("run folder", summary.log_dir), ("checkpoint", summary.checkpoint)):
        if path:
            console.print(f"{what}: {path}", soft_wrap=True, markup=False, highlight=False)


def progress_status(metrics: dict[str, float]) -> str:
    """The progress bar's text after a round: accuracy, density and the training loss to 3 significant digits
    (``loss 0.00036``, not ``loss 0.000``)."""
    parts = []
    if "acc/headline" in metrics:
        parts.append(f"acc {100 * metrics['acc/headline']:.1f}%")
    if "density/mean" in metrics:
        parts.append(f"density {metrics['density/mean']:.3f}")
    if "train/loss" in metrics:
        parts.append(f"loss {metrics['train/loss']:.3g}")
    return "  ".join(parts)


class RoundBar:
    """The progress bar's updates: :meth:`tasks` inside a round, :meth:`advance` after it."""

    def __init__(self, progress: Progress | None = None, task: Any = None) -> None:
        self._progress, self._task = progress, task

    def tasks(self, ended: int, planned: int) -> None:
        """``ended`` of the round's ``planned`` tasks so far (a long round shows it is moving)."""
        if self._progress is not None:
            self._progress.update(self._task, status=f"tasks {ended}/{planned}")

    def advance(self, metrics: dict[str, float]) -> None:
        """A round ended with ``metrics``."""
        if self._progress is not None:
            self._progress.update(self._task, advance=1, status=progress_status(metrics))


@contextmanager
def progress_bar(total: int, enabled: bool = True, completed: int = 0) -> Iterator[RoundBar]:
    """A rich progress bar over rounds, counting the round's tasks while it runs; yields its :class:`RoundBar`."""
    if not enabled:
        yield RoundBar()
        return
    progress = Progress(
        TextColumn("round"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(), TimeRemainingColumn(),
    )
    with progress:
        yield RoundBar(progress, progress.add_task("rounds", total=total, completed=completed, status=""))
