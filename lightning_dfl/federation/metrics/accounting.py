"""Per-round accounting: accuracy, density, FLOPs, communication and the simulated clock.

Conventions (papers README): FLOPs count Conv and Linear layers, 2 per multiply-add, active
weights only, training = 3 x forward for the samples actually processed (mask-search batches
included); communication counts active values x 4 bytes (unmasked parameters included) and, as
their own column, one bit per masked entry for each model that travels with its mask; the
busiest node's figure is max(download, upload) over nodes, the server included.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from lightning_dfl.deferred import read_values
from lightning_dfl.stats import mean_std

#: the record's fields a task may leave as 0-dim device tensors until the round reads them
_DEFERRED_FIELDS = ("loss", "acc_aggregated", "acc_trained", "density", "flops", "search_samples", "contained")


@dataclass
class ClientRecord:
    """What one client's task produced (``loss`` and the accuracies may be 0-dim device tensors until
    :meth:`RoundAccounting.read_device_values`)."""

    client: int
    density: float
    train_samples: int = 0
    search_samples: int | Tensor = 0
    flops: float = 0.0
    loss: float = float("nan")
    acc_aggregated: float | None = None
    acc_trained: float | None = None
    #: its update was contained: not finite (weights, loss or staged fields) or beyond
    #: :data:`~lightning_dfl.federation.exchange.messages.PUBLISH_BOUND`, and discarded: it published its start-of-round
    #: model (a 0-dim bool on the device until read, when the task did not read its finite check). Reported as
    #: ``nonfinite`` in clients.csv and ``faults/nonfinite_clients`` (the names users' plots read)
    contained: bool | Tensor = False
    #: further per-client numbers an algorithm reports (``TaskContext.report``), as clients.csv columns
    extra: dict[str, float] = field(default_factory=dict)


class TransferObserver(Protocol):
    """What else wants every message's bytes (the run's diagnostics,
    :class:`~lightning_dfl.federation.metrics.diagnostics.RunDiagnostics`): told by :meth:`RoundAccounting.transfer`."""

    def transfer(self, sender: int, receiver: int, value_bytes: int, index_bytes: int = 0) -> None: ...


@dataclass
class RoundAccounting:
    """Collects the records of one round and turns them into logged metrics.

    The one byte ledger callers write to: :meth:`transfer` counts a message and passes it on to the
    ``observer`` (``RoundAccounting(round_idx, observer=diagnostics)``), so a caller never tells the
    diagnostics itself."""

    round_idx: int
    records: list[ClientRecord] = field(default_factory=list)
    download: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    upload: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    mask_download: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    mask_upload: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    #: bytes per (sender, receiver) edge, for the clock's transfer times
    edge_bytes: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    #: told of every transfer after it is counted (``None``: nobody)
    observer: TransferObserver | None = field(default=None, repr=False, compare=False)

    def transfer(self, sender: int, receiver: int, value_bytes: int, index_bytes: int = 0, *,
                 notify: bool = True) -> None:
        """One message crossing the network: its values' bytes and its side information's (mask
        bits, indices), as the message's codec counted them; passed on to the :attr:`observer` unless
        ``notify`` is false (a transfer the observer was already told of, e.g. replayed from a shard)."""
        self.upload[sender] += value_bytes
        self.download[receiver] += value_bytes
        self.edge_bytes[(sender, receiver)] += value_bytes + index_bytes
        if index_bytes:
            self.mask_upload[sender] += index_bytes
            self.mask_download[receiver] += index_bytes
        if notify and self.observer is not None:
            self.observer.transfer(sender, receiver, value_bytes, index_bytes)

    def read_device_values(self) -> None:
        """Turn the records' values still on the device (losses and accuracies left there by the tasks,
        :mod:`lightning_dfl.deferred`) into numbers: one read for the whole round."""
        slots = [(r, name) for r in self.records for name in _DEFERRED_FIELDS]
        values = read_values([getattr(r, name) for r, name in slots])
        for (record, name), value in zip(slots, values):
            setattr(record, name, value)
        for record in self.records:
            record.search_samples, record.contained = int(record.search_samples), bool(record.contained)  # read as numbers
            if any(isinstance(v, Tensor) for v in record.extra.values()):
                record.extra = dict(zip(record.extra, read_values(list(record.extra.values()))))

    def client_rows(self) -> list[dict[str, float | int | None]]:
        """One row per client that ran a task: its density, accuracies, FLOPs and bytes."""
        return [{
            "round": self.round_idx, "client": r.client, "density": r.density,
            "acc_aggregated": r.acc_aggregated, "acc_trained": r.acc_trained, "loss": r.loss,
            "train_samples": r.train_samples, "flops": r.flops, "nonfinite": int(r.contained),
            "bytes_received": self.download.get(r.client, 0), "bytes_sent": self.upload.get(r.client, 0),
            **r.extra,
        } for r in sorted(self.records, key=lambda r: r.client)]

    def metrics(self) -> dict[str, float]:
        """The round's metrics, named ``group/name``."""
        out: dict[str, float] = {"round": float(self.round_idx)}
        records = sorted(self.records, key=lambda r: r.client)  # sums independent of task order
        trained = [r.acc_trained for r in records if r.acc_trained is not None]
        aggregated = [r.acc_aggregated for r in records if r.acc_aggregated is not None]
        if trained:
            out["acc/personal_mean"], out["acc/personal_std"] = mean_std(trained)
            out["acc/personal_count"] = float(len(trained))  # the clients averaged (stragglers are not)
        if aggregated:
            out["acc/aggregated_mean"], out["acc/aggregated_std"] = mean_std(aggregated)
        losses = [r.loss for r in records if not math.isnan(r.loss)]
        if losses:
            out["train/loss"] = sum(losses) / len(losses)
        densities = [r.density for r in records]
        if densities:
            out["density/mean"], out["density/std"] = mean_std(densities)
            out["density/min"], out["density/max"] = min(densities), max(densities)
        flops = [r.flops for r in records]
        out["flops/train_total"] = float(sum(flops))
        out["flops/train_per_client"] = float(sum(flops) / len(flops)) if flops else 0.0
        out["samples/train"] = float(sum(r.train_samples for r in records))
        out["faults/nonfinite_clients"] = float(sum(r.contained for r in records))
        nodes = set(self.download) | set(self.upload)
        busiest = max((max(self.download[n], self.upload[n]) for n in nodes), default=0)
        busiest_mask = max((max(self.mask_download[n], self.mask_upload[n]) for n in nodes), default=0)
        out["comm/busiest_bytes"] = float(busiest)
        out["comm/busiest_mask_bytes"] = float(busiest_mask)
        out["comm/total_bytes"] = float(sum(self.upload.values()))
        out["comm/total_mask_bytes"] = float(sum(self.mask_upload.values()))
        return out
