"""Diagnostics of a decentralized run: why it converges slowly or personalizes badly.

:class:`RunDiagnostics` records them for the trainer and writes the run's diagnostics files; the measures are
pure functions of :mod:`~.mixing` (the realized mixing matrix, its spectral gap, the client pairs) and of
:mod:`~.spread` (consensus distances, mask Jaccard and flips, the accuracy spread).

Per diagnosed round (``FederatedTrainer(diagnostics=..., diag_every=...)``), logged with the other metrics:

* ``diag/spectral_gap``, ``diag/mixing_rho``: the round's realized mixing matrix W (:func:`~.mixing.mixing_matrix`,
  row-stochastic) and rho = the spectral radius of ``(I - J) W`` over the round's participants
  (``J = (1/P) 1 1^T``), gap = 1 - rho, both in [0, 1]. ``(I - J) W`` is the part of W that acts on the
  clients' disagreement; its eigenvalues are W's with one eigenvalue 1 (the consensus) replaced by 0, so
  rho = max_{j >= 2} |lambda_j(W)|, the rate at which repeated mixing shrinks the disagreement. FedAvg's
  server average ``W = 1 c^T`` has gap 1 whatever its sample weights c (``W - J`` would not); Local
  training: W = I, rho = 1, gap = 0. (The largest singular value, a one-round bound, can exceed 1 for a W
  that is not doubly stochastic, e.g. under dropout when a client keeps its model while others average
  towards it: it is not used.)
* ``diag/consensus_distance``: ``(1/K) sum_k ||x_k - x_bar||^2`` over the K clients' published models
  (the model's parameters as dense vectors, zeros outside each published mask, as the engine publishes
  them); ``diag/consensus_distance_masked``: the same restricted pair by pair to the weights both masks
  keep, ``(K-1)/(2K) mean_{(i,j)} ||m_i m_j (x_i - x_j)||^2`` over the round's communicating client pairs
  (off-diagonal support of W; all pairs when there are none, as for Local; a seeded sample of
  ``DISTANCE_PAIRS_PER_CLIENT * K`` of them when there are more), which equals the dense one over all
  pairs when the masks agree (``(1/K) sum_k ||x_k - x_bar||^2 = (1/K^2) sum_{i<j} ||x_i - x_j||^2``).
* ``diag/mask_jaccard_mean``, ``diag/mask_jaccard_min``: Jaccard similarity ``|m_i & m_j| / |m_i | m_j|``
  of the published masks' prunable weights over all client pairs when ``K <= ALL_PAIRS_MAX_K``, else
  over ``JACCARD_PAIRS_PER_CLIENT * K`` pairs drawn without replacement from a per-round seeded stream (O(K)
  pairs, never the training's streams); two empty masks count as identical (1).
* ``diag/mask_flip_fraction``: the fraction of published mask bits that changed since the previous
  diagnosed round (packed bits are kept, 1 bit per prunable weight and client), mean over the
  clients that ran a task this round.

The seconds each diagnosed round's diagnostics took are kept in :attr:`RunDiagnostics.wall_s` (not logged:
metrics stay deterministic, so two runs compare equal but for ``time/wall_round_s``).

``acc/personal_min``, ``acc/personal_p10`` and ``acc/personal_max`` (:func:`~.spread.personal_spread`) are logged
at every evaluated round whether the diagnostics are on or not (they cost nothing).

Files in ``<log_dir>/diagnostics/``: ``edges.csv`` (every round: round, sender, receiver, value and side
bytes of each edge that carried messages; a resumed run starts from the earlier run's rows), and at the last
round ``bytes.csv`` (row j, column k: value bytes node j sent node k over the run, servers included; its
total is the sum of ``comm/total_bytes``), ``mask_bytes.csv`` (the side information: mask bits, indices),
``mask_jaccard.csv`` (the final published masks, K x K; above ``FULL_JACCARD_MAX_K`` clients only the
sampled pairs are filled) and, at the start, ``client_labels.csv`` (each client's training label counts,
dominant label and group).

Cost: the mixing matrix is K x K (plus servers); the consensus distances read every published model once,
in blocks of ``BLOCK_ELEMENTS`` (``DEVICE_BLOCK_ELEMENTS`` on an accelerator; never a K x P copy), with the
sampled pairs' differences taken block by block; sums are float64, and nothing is read on the host but the
two results (and, from a compact store, one count per block). Masks are packed 64 per int64 word (the flip
fraction keeps one packed copy, P/8 bytes per client) and Jaccard counts bits with a word-parallel popcount. ``benchmarks/diagnostics_cost.py`` measures the share of a round.

The diagnostics only read the store: every tensor is gathered into a copy and no random stream of
the run is drawn, so the trained values are bit-identical with diagnostics on and off (tested).
"""

from __future__ import annotations

import csv
import math
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_dfl.checks import check_int
from lightning_dfl.errors import reading, writing
from lightning_dfl.federation.exchange.plan import RoundPlan, every_and_last
from lightning_dfl.federation.metrics.mixing import (
    DISTANCE_PAIRS_PER_CLIENT,
    communicating_pairs,
    diagnostic_pairs,
    mixing_matrix,
    participants_of,
    spectral_gap,
)
from lightning_dfl.federation.metrics.spread import (
    consensus_distances,
    flip_fractions,
    jaccard_matrix,
    jaccard_pairs,
    packed_masks,
)

__all__ = ["AUTO_MAX_K", "DIAGNOSTICS_CHOICES", "FOLDER", "FULL_JACCARD_MAX_K", "RunDiagnostics", "check_diagnostics",
           "read_matrix", "write_matrix"]

#: diagnostics are on by default up to this many clients (``diagnostics="auto"``)
AUTO_MAX_K = 100
#: the final K x K mask-Jaccard matrix is complete up to this many clients
FULL_JACCARD_MAX_K = 512
#: the run folder's sub-folder of diagnostics files
FOLDER = "diagnostics"
DIAGNOSTICS_CHOICES = ("auto", True, False)


def check_diagnostics(value: Any) -> bool | str:
    """``diagnostics`` as given if it is ``"auto"``, ``True`` or ``False`` (the strings ``"true"``/``"false"``/``"on"``/
    ``"off"`` too); else ``ValueError`` naming the value and what is allowed."""
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.lower() in ("true", "on", "false", "off"):
        return value.lower() in ("true", "on")
    raise ValueError(f"diagnostics must be 'auto' (on when K <= {AUTO_MAX_K}), true or false, got {value!r}")


# -- the run's diagnostics -------------------------------------------------------------------------------


class RunDiagnostics:
    """Collects a run's diagnostics: the trainer calls :meth:`transfer` for every message,
    :meth:`observe` for every exchange's plan and :meth:`end_round` once per round.

    Args:
        num_clients: K.
        num_nodes: clients plus servers.
        rounds: T (the last round always writes the run's files).
        seed: the run's seed (the pair samples' stream).
        every: diagnose every this many rounds (the last always); bytes are counted every round.
        parameter_names: the store entries the consensus distance covers (the model's parameters).
        log_dir: the run folder (``None``: no files).
    """

    def __init__(self, num_clients: int, num_nodes: int, rounds: int, seed: int, every: int = 1,
                 parameter_names: Sequence[str] = (), log_dir: str | None = None) -> None:
        self.num_clients, self.num_nodes, self.rounds, self.seed = num_clients, num_nodes, rounds, seed
        self.every = check_int("diag_every", every, 1)
        self.parameter_names = list(parameter_names)
        self.folder = Path(log_dir) / FOLDER if log_dir else None
        self.value_bytes = np.zeros((num_nodes, num_nodes), dtype=np.int64)
        self.index_bytes = np.zeros((num_nodes, num_nodes), dtype=np.int64)
        self._round_edges: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
        self._plans: list[RoundPlan] = []
        self._previous_masks: Tensor | None = None
        self._warned_spectral = False  # the spectral gap failed once: warned, not again
        #: per diagnosed round, the seconds its diagnostics took (inside ``time/wall_round_s``)
        self.wall_s: dict[int, float] = {}

    # -- recording -------------------------------------------------------------------------------
    def diagnoses(self, round_idx: int) -> bool:
        """Whether ``round_idx`` computes the diagnostics: every ``every``-th round and the last."""
        return every_and_last(round_idx, self.every, self.rounds)

    def start(self, store: Any, client_labels: Sequence[Sequence[int]] | None = None,
              groups: Sequence[int] | None = None) -> None:
        """Before the first round to run (after a resume's checkpoint is loaded): the masks that
        the first flip fraction compares with, and ``client_labels.csv``."""
        self._previous_masks = packed_masks(store, range(self.num_clients)) if store.masked_names else None
        if self.folder is None or client_labels is None:
            return
        classes = max((len(c) for c in client_labels), default=0)
        path = self.folder / "client_labels.csv"
        with writing(path):
            self.folder.mkdir(parents=True, exist_ok=True)
            self._write_labels(path, client_labels, groups, classes)

    @staticmethod
    def _write_labels(path: Path, client_labels: Sequence[Sequence[int]], groups: Sequence[int] | None,
                      classes: int) -> None:
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["client", "samples", "dominant_label", "group", *(f"label_{c}" for c in range(classes))])
            for k, counts in enumerate(client_labels):
                counts = [int(c) for c in counts]
                group = "" if groups is None else int(groups[k])
                writer.writerow([k, sum(counts), int(np.argmax(counts)) if counts else "", group, *counts])

    def transfer(self, sender: int, receiver: int, value_bytes: int, index_bytes: int = 0) -> None:
        """One message crossing the network (the executor's accounting figures)."""
        self.value_bytes[sender, receiver] += int(value_bytes)
        self.index_bytes[sender, receiver] += int(index_bytes)
        edge = self._round_edges[(sender, receiver)]
        edge[0] += int(value_bytes)
        edge[1] += int(index_bytes)

    def observe(self, plan: RoundPlan) -> None:
        """One exchange's plan, once it ran."""
        self._plans.append(plan)

    # -- the round's metrics -------------------------------------------------------------------------
    @torch.no_grad()
    def end_round(self, round_idx: int, store: Any) -> dict[str, float]:
        """The round's ``diag/*`` metrics (empty on rounds not diagnosed); writes the run's files."""
        plans, self._plans = self._plans, []
        self._write_edges(round_idx)
        if not self.diagnoses(round_idx):
            return {}
        start = time.perf_counter()
        k = self.num_clients
        clients = list(range(k))
        out: dict[str, float] = {}
        w = mixing_matrix(plans, k, self.num_nodes)
        taking_part = participants_of(plans, k)
        try:  # a diagnostic never ends a run
            out["diag/spectral_gap"], out["diag/mixing_rho"] = spectral_gap(w, taking_part)
        except Exception as err:  # noqa: BLE001 (spectral_gap's fallbacks failed: an unforeseen input)
            out["diag/spectral_gap"] = out["diag/mixing_rho"] = float("nan")
            if not self._warned_spectral:
                self._warned_spectral = True
                rank_zero_warn(f"diag/spectral_gap could not be computed in round {round_idx} ({type(err).__name__}: "
                               f"{err}); it is logged as NaN where that happens, and the run goes on")
        communicating = communicating_pairs(w, taking_part)
        pairs = diagnostic_pairs(k, round_idx, self.seed, communicating or None, DISTANCE_PAIRS_PER_CLIENT,
                                 all_pairs_max_k=0, stream="diag/distance")  # none communicate: from all pairs
        names = [n for n in self.parameter_names if n in store.names] or list(store.names)
        packs_own = hasattr(store, "packed_published_masks")  # then every packing of this run is the store's
        blocks: dict[str, list[Tensor]] = {}
        out["diag/consensus_distance"], out["diag/consensus_distance_masked"] = consensus_distances(
            store, clients, names, pairs, None if packs_own else blocks)
        if store.masked_names:
            if not packs_own and set(store.masked_names) <= set(blocks):  # the masks as the distance pass packed them
                current = torch.cat([b for n in store.masked_names for b in blocks[n]], dim=1)
            else:
                current = packed_masks(store, clients)
            jaccard = jaccard_pairs(current, diagnostic_pairs(k, round_idx, self.seed))
            if len(jaccard):
                out["diag/mask_jaccard_mean"] = float(jaccard.mean())
                out["diag/mask_jaccard_min"] = float(jaccard.min())
            if self._previous_masks is not None and taking_part:
                flips = flip_fractions(self._previous_masks, current, store.masked_size())
                out["diag/mask_flip_fraction"] = float(flips[taking_part].mean())
            self._previous_masks = current
        if round_idx == self.rounds - 1:  # every process: a partitioned store's masks come from their owners
            if store.masked_names:
                self._write_jaccard(store, clients, current, round_idx)
            self._write_bytes()
        self.wall_s[round_idx] = time.perf_counter() - start
        return out

    # -- files -----------------------------------------------------------------------------------------
    def _write_edges(self, round_idx: int) -> None:
        edges, self._round_edges = self._round_edges, defaultdict(lambda: [0, 0])
        if self.folder is None:
            return
        path = self.folder / "edges.csv"
        with writing(path):
            self.folder.mkdir(parents=True, exist_ok=True)
            self._append_edges(path, edges, round_idx)

    @staticmethod
    def _append_edges(path: Path, edges: dict[tuple[int, int], list[int]], round_idx: int) -> None:
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["round", "sender", "receiver", "value_bytes", "index_bytes"])
            for (sender, receiver), (value, index) in sorted(edges.items()):
                writer.writerow([round_idx, sender, receiver, value, index])

    def _write_bytes(self) -> None:
        if self.folder is None:
            return
        for name, matrix in (("bytes.csv", self.value_bytes), ("mask_bytes.csv", self.index_bytes)):
            write_matrix(self.folder / name, matrix, "sender\\receiver", fmt="{:d}")

    def _write_jaccard(self, store: Any, clients: list[int], packed: Tensor, round_idx: int) -> None:
        k = len(clients)
        if k <= FULL_JACCARD_MAX_K:
            matrix = jaccard_matrix(store, clients).numpy()
        else:
            matrix = np.full((k, k), np.nan)
            np.fill_diagonal(matrix, 1.0)
            pairs = diagnostic_pairs(k, round_idx, self.seed)
            for (i, j), v in zip(pairs, jaccard_pairs(packed, pairs).tolist()):
                matrix[i, j] = matrix[j, i] = v
        if self.folder is None:  # a process that writes no files
            return
        write_matrix(self.folder / "mask_jaccard.csv", matrix, "client", fmt="{:.6f}")

    def replay(self, previous_log_dir: str | Path, first_round: int) -> None:
        """A resumed run: count the earlier rounds' bytes from the previous run's ``edges.csv`` (rounds
        before ``first_round``) and start this run's ``edges.csv`` with them."""
        earlier = Path(previous_log_dir) / FOLDER / "edges.csv"
        if not earlier.is_file():
            return
        with reading(earlier), earlier.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if int(r["round"]) < first_round]
        for r in rows:
            s, t = int(r["sender"]), int(r["receiver"])
            self.value_bytes[s, t] += int(r["value_bytes"])
            self.index_bytes[s, t] += int(r["index_bytes"])
        if self.folder is None or (self.folder / "edges.csv").resolve() == earlier.resolve():
            return
        path = self.folder / "edges.csv"
        with writing(path):
            self.folder.mkdir(parents=True, exist_ok=True)
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=["round", "sender", "receiver", "value_bytes", "index_bytes"])
                writer.writeheader()
                writer.writerows(rows)


def write_matrix(path: Path, matrix: np.ndarray, corner: str, fmt: str) -> None:
    """A square matrix as CSV: a header row of column ids after ``corner``, then one row per id."""
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([corner, *range(matrix.shape[1])])
            for i, row in enumerate(matrix):
                writer.writerow([i, *("nan" if isinstance(v, float) and math.isnan(v) else fmt.format(v)
                                      for v in row.tolist())])


#: the values each matrix file may hold: (least, most, NaN allowed); bytes are counts below 2^63
MATRIX_RANGES = {"mask_jaccard.csv": (0.0, 1.0, True), "bytes.csv": (0.0, float(2**63), False),
                 "mask_bytes.csv": (0.0, float(2**63), False)}


def read_matrix(path: str | Path) -> np.ndarray:
    """A matrix written by :func:`write_matrix`, checked: a header and at least one row, square, every cell a number
    within its file's range (:data:`MATRIX_RANGES`); ``ValueError`` naming the file, the cell and what is allowed."""
    where = os.fspath(path)
    with reading(path), Path(path).open(newline="") as f:
        table = list(csv.reader(f))
    rows = table[1:]
    if not rows:
        raise ValueError(f"{where!r} holds {'no header and ' if not table else ''}no rows: a matrix file has a header "
                         "of column ids and one row per node (the run that wrote it stopped while writing?)")
    low, high, nan = MATRIX_RANGES.get(Path(path).name, (-math.inf, math.inf, True))
    values = []
    for i, row in enumerate(rows):
        if len(row) != len(rows) + 1:
            raise ValueError(f"{where!r}: line {i + 2} has {len(row) - 1} values, expected {len(rows)} (one per row "
                             "of this square matrix)")
        for j, cell in enumerate(row[1:]):
            try:
                value = float(cell)
            except ValueError:
                raise ValueError(f"{where!r}: line {i + 2}, column {j + 2} holds {cell!r}, not a number") from None
            if not (low <= value <= high or (nan and math.isnan(value))):
                allowed = f"a number in [{low:g}, {high:g}]" + (" or nan" if nan else "")
                raise ValueError(f"{where!r}: line {i + 2}, column {j + 2} holds {cell!r}; allowed: {allowed}")
            values.append(value)
    return np.array(values, dtype=np.float64).reshape(len(rows), len(rows))

