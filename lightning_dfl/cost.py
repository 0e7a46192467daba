"""Time, energy and total cost of a client's round (DA-DPFL Sec. VI-A5, Figs. 3-4).

Per client and round, with the papers' defaults (an RTX 4090: 80 TFLOPS, 450 W; 1 Gbps at 1 W;
a correction factor of 5 from measured against theoretical GPU time)::

    T_comp = 5 x FLOPs / 80e12 s        E_comp = 450 W x T_comp
    T_comm = bytes x 8 / 1e9 s          E_comm = 1 W x T_comm
    C_energy = E_comp + E_comm          C_time = (1 + mean delay) (T_comp + T_comm)
    C_total(theta) = (1 - theta) C_time + theta C_energy

The mean delay comes from the simulated clock (0 for methods that do not wait; about 17 for
DA-DPFL at M = N = 10, see :mod:`lightning_dfl.federation.algorithms.dadpfl_waits`). Pure numpy.
"""

from __future__ import annotations

import csv
import io
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_dfl.errors import reading
from lightning_dfl.run_metrics import is_tensorboard, metrics_source, read_tensorboard

ArrayLike = float | Sequence[float] | np.ndarray


def _nonneg(name: str, value: ArrayLike) -> np.ndarray | float:
    arr = np.asarray(value, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return float(arr) if arr.ndim == 0 else arr


class MissingMetrics(ValueError):
    """A run has not logged a metric asked for (:func:`read_round_metrics`): the message names it and what the
    run has."""


@dataclass(frozen=True)
class Workload:
    """One method's per-client, per-round load: training FLOPs, bytes sent (the busiest node's),
    and the mean delay in task units."""

    flops: float
    bytes: float
    mean_delay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("flops", "bytes", "mean_delay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Workload.{name} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True)
class CostModel:
    """The cost model of DA-DPFL Sec. VI-A5 (defaults: the paper's RTX 4090 and 1 Gbps link).

    Every method takes scalars or numpy arrays (element-wise).
    """

    flops_per_second: float = 80e12
    flops_multiplier: float = 5.0
    compute_power_w: float = 450.0
    bandwidth_bps: float = 1e9
    network_power_w: float = 1.0

    def __post_init__(self) -> None:
        for name in ("flops_per_second", "flops_multiplier", "bandwidth_bps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"CostModel.{name} must be finite and > 0, got {value!r}")
        for name in ("compute_power_w", "network_power_w"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"CostModel.{name} must be finite and >= 0, got {value!r}")

    def compute_time(self, flops: ArrayLike):
        """``T_comp = multiplier x FLOPs / FLOPS`` in seconds."""
        return self.flops_multiplier * _nonneg("flops", flops) / self.flops_per_second

    def compute_energy(self, flops: ArrayLike):
        """``E_comp = P_comp x T_comp`` in joules."""
        return self.compute_power_w * self.compute_time(flops)

    def comm_time(self, num_bytes: ArrayLike):
        """``T_comm = bytes x 8 / bandwidth`` in seconds."""
        return _nonneg("bytes", num_bytes) * 8.0 / self.bandwidth_bps

    def comm_energy(self, num_bytes: ArrayLike):
        """``E_comm = P_comm x T_comm`` in joules."""
        return self.network_power_w * self.comm_time(num_bytes)

    def energy(self, flops: ArrayLike, num_bytes: ArrayLike):
        """``C_energy = E_comp + E_comm`` in joules."""
        return self.compute_energy(flops) + self.comm_energy(num_bytes)

    def time(self, flops: ArrayLike, num_bytes: ArrayLike, mean_delay: ArrayLike = 0.0):
        """``C_time = (1 + mean delay) (T_comp + T_comm)`` in seconds."""
        delay = _nonneg("mean_delay", mean_delay)
        return (1.0 + delay) * (self.compute_time(flops) + self.comm_time(num_bytes))

    def total(self, theta: ArrayLike, flops: ArrayLike, num_bytes: ArrayLike, mean_delay: ArrayLike = 0.0):
        """``C_total(theta) = (1 - theta) C_time + theta C_energy``, theta in [0, 1]."""
        th = _theta(theta)
        return (1.0 - th) * self.time(flops, num_bytes, mean_delay) + th * self.energy(flops, num_bytes)

    def curve(self, thetas: ArrayLike, flops: float, num_bytes: float, mean_delay: float = 0.0) -> np.ndarray:
        """``C_total`` at each theta of ``thetas`` (an array)."""
        return np.atleast_1d(np.asarray(self.total(np.asarray(thetas, dtype=np.float64), flops,
                                                   num_bytes, mean_delay), dtype=np.float64))

    def workload_total(self, theta: ArrayLike, load: Workload):
        """``C_total(theta)`` of a :class:`Workload`."""
        return self.total(theta, load.flops, load.bytes, load.mean_delay)

    def crossing_theta(self, a: Workload, b: Workload) -> float | None:
        """The theta in [0, 1] where ``a`` and ``b`` cost the same, or None if they never do there.

        ``C_total`` is linear in theta, so the difference ``(1-theta) dT + theta dE`` (``dT``,
        ``dE``: a's time and energy minus b's) vanishes at ``dT / (dT - dE)``. Identical curves
        (``dT = dE = 0``) have no single crossing: None.
        """
        d_time = self.time(a.flops, a.bytes, a.mean_delay) - self.time(b.flops, b.bytes, b.mean_delay)
        d_energy = self.energy(a.flops, a.bytes) - self.energy(b.flops, b.bytes)
        return _crossing(float(d_time), float(d_energy))


def _crossing(d_time: float, d_energy: float) -> float | None:
    """Where ``(1 - theta) dT + theta dE`` vanishes in [0, 1]: ``dT / (dT - dE)``; None if it never
    does there (parallel or identical lines)."""
    if d_time == d_energy:
        return None
    theta = d_time / (d_time - d_energy)
    return float(theta) if 0.0 <= theta <= 1.0 else None


def _theta(theta: ArrayLike):
    arr = np.asarray(theta, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or np.any((arr < 0) | (arr > 1)):
        raise ValueError(f"theta must lie in [0, 1], got {theta!r}")
    return float(arr) if arr.ndim == 0 else arr


@dataclass(frozen=True)
class CostCurve:
    """A run's cost: ``total[i]`` is ``C_total(thetas[i])``; ``time`` (s) and ``energy`` (J) are
    its two parts, over the rounds read and reduced as asked."""

    thetas: np.ndarray
    total: np.ndarray
    time: float
    energy: float
    rounds: int

    def crossing(self, other: "CostCurve") -> float | None:
        """The theta in [0, 1] where this run's ``C_total`` line meets ``other``'s, else None."""
        return _crossing(self.time - other.time, self.energy - other.energy)


def read_round_metrics(path: str | os.PathLike, columns: Sequence[str],
                       round_col: str = "round") -> dict[int, dict[str, float]]:
    """Per round, the last non-empty value of each of ``columns`` in a CSVLogger ``metrics.csv``, or the last
    value of each of these scalars in a TensorBoard run's event files (``path``: a run folder, its
    ``metrics.csv`` or an event file; see :mod:`lightning_dfl.run_metrics`).

    Lightning's CSVLogger writes one row per logging call, with empty cells for metrics not
    logged in that call; rows without a round are skipped. A round that lacks any of the
    columns is left out. A row cut short (fewer cells than the header, or a last line without its line end: a
    run stopped while writing it) is left out with a warning naming the file. TensorBoard's rows are its steps
    (the round, as ``metrics.csv``'s ``step``), their values 32-bit floats.
    """
    if os.path.isdir(path):
        path = metrics_source(path)
    if is_tensorboard(path):
        tags, steps = read_tensorboard(path)
        missing = [c for c in (round_col, *columns) if c not in tags]
        if missing:
            raise MissingMetrics(f"{os.fspath(path)!r} (TensorBoard event files) has no scalar(s) {missing}; its "
                             f"scalars are {tags}")
        rounds: dict[int, dict[str, float]] = {}
        for row in steps.values():
            if round_col in row:
                rounds.setdefault(int(row[round_col]), {}).update({c: row[c] for c in columns if c in row})
        return {r: v for r, v in sorted(rounds.items()) if all(c in v for c in columns)}
    with reading(path), open(path, newline="") as fh:
        text = fh.read()
        unfinished = bool(text) and not text.endswith(("\n", "\r"))
        reader = csv.DictReader(io.StringIO(text, newline=""))
        header = reader.fieldnames or []
        missing = [c for c in (round_col, *columns) if c not in header]
        if missing:
            raise MissingMetrics(f"{os.fspath(path)!r} has no column(s) {missing}; its columns are {header}")
        rows = list(reader)
        cut = sorted(i for i, row in enumerate(rows) if None in row.values() or (unfinished and i == len(rows) - 1))
        if cut:
            warnings.warn(f"{os.fspath(path)!r}: {len(cut)} row(s) cut short (line(s) "
                          f"{', '.join(str(i + 2) for i in cut)}: fewer cells than its header, or no line end; a run "
                          "stopped while writing?) are left out", stacklevel=2)
        seen: dict[int, dict[str, float]] = {}
        for i, row in enumerate(rows):
            if cut and i in cut:
                continue
            cell = (row.get(round_col) or "").strip()
            if not cell:
                continue
            values = seen.setdefault(int(float(cell)), {})
            for col in columns:
                text = (row.get(col) or "").strip()
                if text:
                    values[col] = float(text)
    return {r: v for r, v in sorted(seen.items()) if all(c in v for c in columns)}


def run_cost_curve(path: str | os.PathLike, thetas: ArrayLike = np.linspace(0.0, 1.0, 101),
                   model: CostModel | None = None, reduce: str = "sum", round_col: str = "round",
                   flops_col: str = "flops/train_per_client", bytes_col: str = "comm/busiest_bytes",
                   delay_col: str | None = "time/delay") -> CostCurve:
    """The cost curve of a finished run from its ``metrics.csv`` or TensorBoard event files (``path``: as
    :func:`read_round_metrics` takes).

    Each round's ``C_time`` and ``C_energy`` come from that round's per-client training FLOPs,
    the busiest node's bytes and the delay (``delay_col=None``: 0, for methods that do not
    wait). ``reduce`` combines rounds: ``"sum"`` (the whole run), ``"mean"`` (per round) or
    ``"last"`` (the final round, as DA-DPFL's Table II reports).
    """
    if reduce not in ("sum", "mean", "last"):
        raise ValueError(f"reduce must be 'sum', 'mean' or 'last', got {reduce!r}")
    model = CostModel() if model is None else model
    th = np.atleast_1d(np.asarray(_theta(thetas), dtype=np.float64))
    columns = [flops_col, bytes_col] + ([delay_col] if delay_col is not None else [])
    per_round = read_round_metrics(path, columns, round_col)
    if not per_round:
        raise ValueError(f"{os.fspath(path)!r} has no round with all of {columns}")
    rows = list(per_round.values())
    flops = np.array([r[flops_col] for r in rows])
    num_bytes = np.array([r[bytes_col] for r in rows])
    delay = np.array([r[delay_col] for r in rows]) if delay_col is not None else np.zeros(len(rows))
    times = np.atleast_1d(model.time(flops, num_bytes, delay))
    energies = np.atleast_1d(model.energy(flops, num_bytes))
    if reduce == "sum":
        c_time, c_energy = float(times.sum()), float(energies.sum())
    elif reduce == "mean":
        c_time, c_energy = float(times.mean()), float(energies.mean())
    else:
        c_time, c_energy = float(times[-1]), float(energies[-1])
    total = (1.0 - th) * c_time + th * c_energy
    return CostCurve(thetas=th, total=total, time=c_time, energy=c_energy, rounds=len(rows))


__all__ = ["CostCurve", "CostModel", "MissingMetrics", "Workload", "read_round_metrics", "run_cost_curve"]
