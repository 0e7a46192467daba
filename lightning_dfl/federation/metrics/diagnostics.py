"""Diagnostics of a decentralized run: why it converges slowly or personalizes badly.

Per diagnosed round (``FederatedTrainer(diagnostics=..., diag_every=...)``), logged with the other metrics:

* ``diag/spectral_gap``, ``diag/mixing_rho``: the round's realized mixing matrix W (:func:`mixing_matrix`,
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

``acc/personal_min``, ``acc/personal_p10`` and ``acc/personal_max`` (:func:`personal_spread`) are logged
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
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_dfl.checks import check_int
from lightning_dfl.errors import reading, writing
from lightning_dfl.federation.exchange.plan import RoundPlan, every_and_last
from lightning_dfl.seeding import derive_seed

#: diagnostics are on by default up to this many clients (``diagnostics="auto"``)
AUTO_MAX_K = 100
#: up to this many clients mask Jaccard uses every pair, above it ``JACCARD_PAIRS_PER_CLIENT * K`` drawn pairs
ALL_PAIRS_MAX_K = 32
#: Jaccard pairs per client drawn above ``ALL_PAIRS_MAX_K`` (the cost stays O(K))
JACCARD_PAIRS_PER_CLIENT = 4
#: the masked consensus distance uses at most this many pairs per client (a seeded sample of the
#: communicating pairs when there are more; each pair costs a pass over the model)
DISTANCE_PAIRS_PER_CLIENT = 1
#: the final K x K mask-Jaccard matrix is complete up to this many clients
FULL_JACCARD_MAX_K = 512
#: elements of one gathered block (rows x a slice of one parameter) on a CPU: 4 MB of float32; measured fastest
#: on a 2-core CPU for both stores (the compact store decodes a block's rows together: fewer, larger blocks)
BLOCK_ELEMENTS = 1 << 20
#: the same on an accelerator (64 MB of float32): a block costs a few dozen kernel launches and one read of
#: its mask counts (the compact store) whatever its size, so fewer, larger blocks
DEVICE_BLOCK_ELEMENTS = 1 << 24
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


# -- the realized mixing matrix ------------------------------------------------------------------------


def _exchange_matrix(plan: RoundPlan, num_clients: int, num_nodes: int) -> Tensor:
    """The node x node matrix of one exchange: row n = the combination of start-of-exchange models that
    node n's task started from (``e_n`` without a task or without sources)."""
    matrix = torch.eye(num_nodes, dtype=torch.float64)
    rows: dict[int, Tensor] = {}
    for task in plan.order():
        row = torch.zeros(num_nodes, dtype=torch.float64)
        if not task.sources:
            row[task.node] = 1.0
        else:
            coefficients = task.coefficients if task.coefficients is not None else (1.0,) * len(task.sources)
            server = task.node >= num_clients
            for source, c in zip(task.sources, coefficients):
                # a fresh source is replaced by its task's row (chains compose; training is ignored),
                # except that a server reads clients' trained models as they are (see mixing_matrix)
                if source.fresh and not (server and source.node < num_clients):
                    row += float(c) * rows[source.node]
                else:
                    row[source.node] += float(c)
            total = float(sum(float(c) for c in coefficients))
            if total != 0.0:
                row /= total
            else:
                row.zero_()
                row[task.node] = 1.0
        rows[task.node] = row
        matrix[task.node] = row
    return matrix


def mixing_matrix(plans: Sequence[RoundPlan], num_clients: int, num_nodes: int | None = None) -> Tensor:
    """The round's realized K x K mixing matrix W (float64) from its exchanges' plans.

    Row k holds the coefficients task k applied to the models it read (uniform when the task's
    ``coefficients`` are ``None``: for masked averaging, DA-DPFL Eq. 7, W is the topology's matrix
    with uniform coefficients over the sources; the masks are not part of W). A source read fresh
    from a task earlier in the same exchange (DA-DPFL's reuse, PSFL's chains) is replaced by that
    task's row, so chains compose; local training between them is ignored. Exchanges (gossip steps,
    ``exchanges_per_round > 1``) compose as the product ``W_{Q-1} ... W_0``. A server's row holds its
    coefficients over the clients' trained models it averages, and a client that starts from a
    server's model gets the server's row of the same round (FedAvg: ``W = 1 c^T`` over the
    participants, c the sample weights); a server that averaged no clients contributes nothing, and a
    row left without client weight falls back to ``e_k``. Clients without a task keep ``e_k``.
    """
    num_nodes = num_clients if num_nodes is None else num_nodes
    total = torch.eye(num_nodes, dtype=torch.float64)
    for plan in plans:
        total = _exchange_matrix(plan, num_clients, num_nodes) @ total
    w = total[:num_clients, :num_clients].clone()
    if num_nodes > num_clients:
        w += total[:num_clients, num_clients:] @ total[num_clients:, :num_clients]
        sums = w.sum(dim=1)
        empty = sums <= 1e-12
        w[~empty] /= sums[~empty, None]
        w[empty] = torch.eye(num_clients, dtype=torch.float64)[empty]
    return w


def participants_of(plans: Iterable[RoundPlan], num_clients: int) -> list[int]:
    """The clients that ran a task in any of the plans, sorted."""
    return sorted({t.node for plan in plans for t in plan.tasks if t.node < num_clients})


def spectral_gap(w: Tensor, participants: Sequence[int] | None = None) -> tuple[float, float]:
    """``(gap, rho)`` of a mixing matrix over ``participants`` (all by default): rho = the spectral radius
    of ``(I - J) W_P`` with ``J = (1/P) 1 1^T`` (W_P's eigenvalues less one 1: the rate at which repeated
    mixing shrinks the disagreement; in [0, 1] for a row-stochastic W_P), gap = 1 - rho; NaN for fewer
    than 2. Not the largest singular value: for a W that is not doubly stochastic (clients that keep
    their model while others pull towards it, as under dropout) that one-round bound can exceed 1."""
    if participants is not None:
        index = torch.as_tensor(list(participants), dtype=torch.long)
        w = w[index][:, index]
    p = w.shape[0]
    if p < 2:
        return float("nan"), float("nan")
    w = w.to(torch.float64)
    centered = w - w.mean(dim=0, keepdim=True)  # (I - J) W
    rho = spectral_radius(centered)
    return 1.0 - rho, rho


def spectral_radius(m: Tensor, squarings: int = 60) -> float:
    """The largest eigenvalue modulus of a small square matrix, robustly: torch's ``eigvals``; where LAPACK's
    QR iteration fails to converge (it did on a rank-1 PSFL warm-up matrix under dropout, in float64 only),
    NumPy's; where that fails too, Gelfand's formula rho = lim ||M^k||^(1/k) by ``squarings`` normalised
    squarings (k = 2^60). NaN only for a matrix that is not finite."""
    if not bool(torch.isfinite(m).all()):
        return float("nan")
    try:
        return float(torch.linalg.eigvals(m).abs().max())
    except (RuntimeError, torch.linalg.LinAlgError):  # the first path of the recorded runs, kept for their bits
        pass
    a = m.detach().cpu().numpy()
    try:
        return float(np.abs(np.linalg.eigvals(a)).max())
    except np.linalg.LinAlgError:
        pass
    log_norm, exponent = 0.0, 1.0  # a = B * exp(log_norm / exponent)^exponent, B normalised
    norm = float(np.linalg.norm(a))
    if norm == 0.0:
        return 0.0
    b, log_norm = a / norm, math.log(norm)
    for _ in range(squarings):
        b = b @ b
        norm = float(np.linalg.norm(b))
        if norm == 0.0:  # nilpotent: every eigenvalue is 0
            return 0.0
        b, log_norm, exponent = b / norm, 2.0 * log_norm + math.log(norm), 2.0 * exponent
    return math.exp(log_norm / exponent)


def communicating_pairs(w: Tensor, nodes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Unordered client pairs ``i < j`` with ``W[i, j] > 0`` or ``W[j, i] > 0`` (restricted to ``nodes``)."""
    support = (w > 0) | (w > 0).T
    support.fill_diagonal_(False)
    if nodes is not None:
        keep = torch.zeros(w.shape[0], dtype=torch.bool)
        keep[list(nodes)] = True
        support &= keep[:, None] & keep[None, :]
    i, j = torch.nonzero(torch.triu(support, diagonal=1), as_tuple=True)
    return list(zip(i.tolist(), j.tolist()))


def all_pairs(num: int) -> list[tuple[int, int]]:
    i, j = torch.triu_indices(num, num, offset=1)
    return list(zip(i.tolist(), j.tolist()))


def sample_pairs(num: int, count: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """``count`` distinct unordered pairs of ``range(num)`` drawn uniformly (all of them if fewer)."""
    total = num * (num - 1) // 2
    if count >= total:
        return all_pairs(num)
    chosen = torch.randperm(total, generator=generator)[:count].sort().values.to(torch.float64)
    # invert the row-major index of the strict upper triangle: row i starts at i (2 num - i - 1) / 2
    i = torch.floor(((2 * num - 1) - torch.sqrt((2 * num - 1) ** 2 - 8 * chosen)) / 2).long()
    start = i * (2 * num - i - 1) // 2
    i = torch.where(start > chosen.long(), i - 1, i)
    start = i * (2 * num - i - 1) // 2
    j = chosen.long() - start + i + 1
    return list(zip(i.tolist(), j.tolist()))


def diagnostic_pairs(num: int, round_idx: int, seed: int, candidates: list[tuple[int, int]] | None = None,
                     per_client: int = JACCARD_PAIRS_PER_CLIENT, all_pairs_max_k: int = ALL_PAIRS_MAX_K,
                     stream: str = "diag") -> list[tuple[int, int]]:
    """The pairs a round's pairwise diagnostic uses: ``candidates`` (default: all pairs) when ``num`` is at
    most ``all_pairs_max_k`` or they are at most ``per_client * num``, else ``per_client * num`` of them
    drawn without replacement from the ``(stream, round)`` stream (never one the training draws from)."""
    budget = per_client * num
    generator = torch.Generator().manual_seed(derive_seed(seed, stream, round_idx))
    if candidates is None:
        return all_pairs(num) if num <= all_pairs_max_k else sample_pairs(num, budget, generator)
    if num <= all_pairs_max_k or len(candidates) <= budget:
        return list(candidates)
    keep = torch.randperm(len(candidates), generator=generator)[:budget].sort().values
    return [candidates[int(i)] for i in keep]


# -- gathering published tensors in bounded blocks -------------------------------------------------------


def block_elements(device: torch.device | str) -> int:
    """Elements of one gathered block on ``device``: :data:`BLOCK_ELEMENTS` on a CPU, else
    :data:`DEVICE_BLOCK_ELEMENTS`."""
    return BLOCK_ELEMENTS if torch.device(device).type == "cpu" else DEVICE_BLOCK_ELEMENTS


def _step(rows: int, device: torch.device | str, multiple: int = 1) -> int:
    """Columns per block when ``rows`` rows are read at once on ``device``: at most :func:`block_elements` /
    ``rows`` elements, a multiple of ``multiple`` (the store's
    :meth:`~lightning_dfl.federation.store.protocol.ClientStore.column_blocks`)."""
    return max(multiple, (block_elements(device) // max(rows, 1)) // multiple * multiple)


def consensus_distances(store: Any, clients: Sequence[int], names: Sequence[str],
                        pairs: Sequence[tuple[int, int]], packed: dict[str, list[Tensor]] | None = None
                        ) -> tuple[float, float]:
    """``(dense, masked)`` consensus distances of the clients' current published models as stored (the engine
    publishes them zero outside their masks; see the module docstring); ``pairs`` index into ``clients``.
    Masked is NaN without pairs. Float32 blocks: the pair differences taken from the stored values, the dense
    distance from the block centred on its column means; float64 sums, read once at the end. ``packed``: a dict
    that receives, per masked name read, the mask blocks packed by :func:`pack_words` (what
    :func:`packed_masks` gives, without reading the masks again)."""
    k = len(clients)
    masked_names = set(store.masked_names)
    pi = torch.as_tensor([p[0] for p in pairs], dtype=torch.long, device=store.device)
    pj = torch.as_tensor([p[1] for p in pairs], dtype=torch.long, device=store.device)
    dense = torch.zeros((), dtype=torch.float64, device=store.device)
    pairwise = torch.zeros(len(pairs), dtype=torch.float64, device=store.device)
    step = _step(k, store.device, 64)
    for name in names:
        weights = store.column_blocks(clients, name, False, step)
        masks = store.column_blocks(clients, name, True, step) if name in masked_names else None
        for (_, x), mask in zip(weights, masks if masks is not None else iter(lambda: None, 0)):
            if mask is not None and packed is not None:
                packed.setdefault(name, []).append(pack_words(mask[1]))
            x = x.float()
            chunk = max(1, block_elements(x.device) // max(x.shape[1], 1))  # pair differences of at most a block at once
            for lo in range(0, len(pairs), chunk):  # from the stored values: one rounding per difference
                a, b = pi[lo:lo + chunk], pj[lo:lo + chunk]
                diff = x.index_select(0, a).sub_(x.index_select(0, b))
                if mask is not None:
                    m = mask[1]
                    diff.mul_(m.index_select(0, a).logical_and_(m.index_select(0, b)))
                pairwise[lo:lo + chunk] += torch.linalg.vector_norm(diff, dim=1, dtype=torch.float64).square()
            x.sub_(x.mean(dim=0))  # centred on the mean
            dense += torch.linalg.vector_norm(x, dtype=torch.float64).square()
    dense_value = float(dense) / k if k else float("nan")
    masked_value = (k - 1) / (2 * k) * float(pairwise.mean()) if pairs else float("nan")
    return dense_value, masked_value


# masks as packed bits: 64 mask entries per int64 word


def _shift(n: int, like: Tensor) -> Tensor:
    # a 0-dim tensor shift is vectorized on CPU; a Python int shift of int64 is several times slower
    return torch.tensor(n, dtype=like.dtype, device=like.device)


def pack_words(bits: Tensor) -> Tensor:
    """A ``(rows, n)`` bool tensor as ``(rows, ceil(n / 64))`` int64 words (bit order is fixed, so two packings
    compare bit for bit; padding bits are 0)."""
    rows, n = bits.shape
    pad = (-n) % 64
    b = bits.contiguous().view(torch.uint8)
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    eight = b.view(torch.int64)  # 8 entries (bytes 0/1) per word
    packed = (eight * 0x0102040810204080).bitwise_right_shift_(_shift(56, eight))  # those 8 entries as 8 bits
    return packed.bitwise_and_(0xFF).to(torch.uint8).view(torch.int64).view(rows, -1)


def popcount(words: Tensor) -> Tensor:
    """Set bits per row of an int64 tensor, summed over its last dimension (int64)."""
    one, two, four = _shift(1, words), _shift(2, words), _shift(4, words)
    x = words - (words >> one).bitwise_and_(0x5555555555555555)
    x = (x >> two).bitwise_and_(0x3333333333333333).add_(x.bitwise_and_(0x3333333333333333))
    x = x.add_(x >> four).bitwise_and_(0x0F0F0F0F0F0F0F0F)  # one count per byte, every word now >= 0
    for n in (8, 16, 32):
        x = x.add_(x >> _shift(n, x))
    return x.bitwise_and_(0x7F).sum(dim=-1)


def packed_masks(store: Any, clients: Sequence[int]) -> Tensor:
    """The clients' current published masks (prunable weights), packed: ``(K, words)`` int64 (a store that
    keeps its masks packed, the compact one, gives its own packing: the popcounts are the same)."""
    own = getattr(store, "packed_published_masks", None)
    if own is not None:
        return own(clients)
    parts = [pack_words(m) for name in store.masked_names
             for _, m in store.column_blocks(clients, name, True, _step(len(clients), store.device, 64))]
    return torch.cat(parts, dim=1) if parts else torch.zeros((len(clients), 0), dtype=torch.int64)


def jaccard_pairs(packed: Tensor, pairs: Sequence[tuple[int, int]]) -> Tensor:
    """Jaccard similarity ``|m_i & m_j| / |m_i | m_j|`` of packed masks for each pair (float64; two empty
    masks: 1), in blocks of pairs."""
    counts = popcount(packed)
    out = torch.empty(len(pairs), dtype=torch.float64)
    step = max(1, block_elements(packed.device) // 2 // max(packed.shape[1], 1))
    for lo in range(0, len(pairs), step):
        chunk = pairs[lo:lo + step]
        pi = torch.as_tensor([p[0] for p in chunk], dtype=torch.long, device=packed.device)
        pj = torch.as_tensor([p[1] for p in chunk], dtype=torch.long, device=packed.device)
        inter = popcount(packed[pi] & packed[pj]).double()
        union = counts[pi].double() + counts[pj].double() - inter
        out[lo:lo + len(chunk)] = torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(inter)).cpu()
    return out


def jaccard_matrix(store: Any, clients: Sequence[int]) -> Tensor:
    """The full K x K Jaccard matrix of the clients' published masks (float64; O(K^2 P) by blocks of
    exact float32 products)."""
    k = len(clients)
    gram = torch.zeros((k, k), dtype=torch.float64, device=store.device)
    for name in store.masked_names:
        # a block row holds at most 2^24 entries: every float32 dot product is an exact integer
        for _, m in store.column_blocks(clients, name, True, _step(k, store.device, 64)):
            a = m.to(torch.float32)
            gram += (a @ a.T).to(torch.float64)
    counts = gram.diagonal()
    union = counts[:, None] + counts[None, :] - gram
    return torch.where(union > 0, gram / union.clamp_min(1), torch.ones_like(gram)).cpu()


def flip_fractions(previous: Tensor, current: Tensor, masked_size: int) -> Tensor:
    """Per row, the fraction of mask bits that differ between two :func:`packed_masks`."""
    return popcount(previous ^ current).double().cpu() / max(masked_size, 1)


# -- per-client accuracy spread ----------------------------------------------------------------------------


def personal_spread(accuracies: Sequence[float]) -> dict[str, float]:
    """``acc/personal_min``, ``acc/personal_p10`` (10th percentile, linear interpolation) and
    ``acc/personal_max`` of the clients' accuracies (empty without any)."""
    values = [float(a) for a in accuracies if a is not None]
    if not values:
        return {}
    return {"acc/personal_min": min(values), "acc/personal_p10": float(np.percentile(values, 10)),
            "acc/personal_max": max(values)}


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
        if round_idx == self.rounds - 1 and self.folder is not None:
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


def read_matrix(path: str | Path) -> np.ndarray:
    """A matrix written by :func:`write_matrix`."""
    with reading(path), Path(path).open(newline="") as f:
        rows = list(csv.reader(f))[1:]
    return np.array([[float(v) for v in row[1:]] for row in rows], dtype=np.float64)


__all__ = ["AUTO_MAX_K", "RunDiagnostics", "check_diagnostics", "consensus_distances", "flip_fractions",
           "jaccard_matrix", "jaccard_pairs", "mixing_matrix", "pack_words", "packed_masks", "personal_spread", "popcount", "read_matrix",
           "spectral_gap", "spectral_radius"]
