"""Where a run folder keeps its per-round scalars: ``metrics.csv`` (the CSV logger) or TensorBoard event files
(``events.out.tfevents.*``, ``trainer.logger: tensorboard``), and the reader of the event files (TensorBoard's
own ``EventAccumulator``; needs the ``tensorboard`` extra). :func:`lightning_dfl.cost.read_round_metrics` reads
either. No torch, no Lightning.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path

from lightning_dfl.errors import MissingExtra

METRICS_CSV = "metrics.csv"
#: the names of TensorBoard's event files (``events.out.tfevents.<time>.<host>.<pid>.<n>``)
EVENTS_GLOB = "events.out.tfevents.*"
_EVENTS_PREFIX = "events.out.tfevents."
#: the value Lightning's TensorBoard logger writes at step 0 with the hyperparameters: not a metric of the run
_LIGHTNING_HP_METRIC = "hp_metric"
MISSING_TENSORBOARD = "reading it needs TensorBoard: pip install -e '.[tensorboard]'"


def is_event_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is named as a TensorBoard event file."""
    return Path(path).name.startswith(_EVENTS_PREFIX)


def event_files(folder: str | os.PathLike) -> list[Path]:
    """The TensorBoard event files directly in ``folder``, by name."""
    return sorted(p for p in Path(folder).glob(EVENTS_GLOB) if p.is_file())


def is_tensorboard(path: str | os.PathLike) -> bool:
    """Whether ``path`` (from :func:`metrics_source`) is read as TensorBoard events: an event file, or a folder."""
    return is_event_file(path) or Path(path).is_dir()


def metrics_source(run: str | os.PathLike) -> Path:
    """What holds a run's per-round scalars: ``<run>/metrics.csv`` where there is one, else ``run`` itself when it
    holds TensorBoard event files; a ``metrics.csv`` or event file given as ``run`` is taken as it is. Neither: a
    one-line ``FileNotFoundError`` naming ``run`` and what a run folder holds."""
    path = Path(run)
    if path.is_dir():
        if (path / METRICS_CSV).is_file():
            return path / METRICS_CSV
        if event_files(path):
            return path
    elif path.is_file():
        return path
    raise FileNotFoundError(f"no metrics.csv or TensorBoard event files ({EVENTS_GLOB}) at {os.fspath(run)!r}: give "
                            "a run folder (runs/<algorithm>/version_N), its metrics.csv or one of its event files")


def run_folder(source: str | os.PathLike) -> Path:
    """The run folder of a :func:`metrics_source`: the folder itself, or the file's folder."""
    path = Path(source)
    return path if path.is_dir() else path.parent


def read_tensorboard(path: str | os.PathLike) -> tuple[list[str], dict[int, dict[str, float]]]:
    """``(tags, rows)`` of a TensorBoard run (a folder's event files, or one event file): per step the last value
    of each scalar written at it, as floats, with the step itself as ``"step"`` (as Lightning's CSV logger writes
    it). TensorBoard keeps scalars as 32-bit floats: they agree with the CSV logger's to about 7 digits. Every
    event is read (no sampling); Lightning's placeholder ``hp_metric`` is left out."""
    path = Path(path)
    try:
        import tensorboard  # noqa: F401
    except ImportError as err:
        raise MissingExtra(f"{os.fspath(path)!r} is a TensorBoard run ({EVENTS_GLOB}): {MISSING_TENSORBOARD}") from err
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                  for p in ([path] if path.is_file() else event_files(path)))
    tags, rows = _read_events(os.fspath(path), stamp)
    return list(tags), {step: dict(values) for step, values in rows.items()}


@functools.lru_cache(maxsize=8)
def _read_events(path: str, stamp: tuple) -> tuple[tuple[str, ...], Mapping[int, Mapping[str, float]]]:
    """:func:`read_tensorboard`'s work, kept while the event files stay as they were (``stamp``): ``curves`` reads
    one metric at a time."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    accumulator = ea.EventAccumulator(path, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})  # 0: keep every event
    accumulator.Reload()
    found = accumulator.Tags()
    series: dict[str, list[tuple[int, float]]] = {}
    for tag in found.get(ea.SCALARS, []):
        series[tag] = [(e.step, float(e.value)) for e in accumulator.Scalars(tag)]
    for tag in found.get(ea.TENSORS, []):  # scalars written as tensors (add_scalar(new_style=True))
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == "scalars":
            series.setdefault(tag, []).extend((e.step, float(tensor_util.make_ndarray(e.tensor_proto).item()))
                                              for e in accumulator.Tensors(tag))
    series.pop(_LIGHTNING_HP_METRIC, None)
    rows: dict[int, dict[str, float]] = {}
    for tag, events in series.items():
        for step, value in events:
            rows.setdefault(step, {"step": float(step)})[tag] = value
    return tuple(sorted({*series, *(["step"] if rows else [])})), {step: rows[step] for step in sorted(rows)}


__all__ = ["EVENTS_GLOB", "METRICS_CSV", "MISSING_TENSORBOARD", "event_files", "is_event_file", "is_tensorboard",
           "metrics_source", "read_tensorboard", "run_folder"]
