"""The round's realized mixing matrix W (from its exchanges' plans), its spectral gap, and the client pairs the
pairwise diagnostics use (the communicating pairs, or a seeded sample of them). Pure functions of the plans and
of W: :mod:`~lightning_dfl.federation.metrics.diagnostics` logs them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.federation.exchange.plan import RoundPlan
from lightning_dfl.seeding import derive_seed

__all__ = ["ALL_PAIRS_MAX_K", "DISTANCE_PAIRS_PER_CLIENT", "JACCARD_PAIRS_PER_CLIENT", "all_pairs",
           "communicating_pairs", "diagnostic_pairs", "mixing_matrix", "participants_of", "sample_pairs",
           "spectral_gap", "spectral_radius"]

#: up to this many clients mask Jaccard uses every pair, above it ``JACCARD_PAIRS_PER_CLIENT * K`` drawn pairs
ALL_PAIRS_MAX_K = 32
#: Jaccard pairs per client drawn above ``ALL_PAIRS_MAX_K`` (the cost stays O(K))
JACCARD_PAIRS_PER_CLIENT = 4
#: the masked consensus distance uses at most this many pairs per client (a seeded sample of the
#: communicating pairs when there are more; each pair costs a pass over the model)
DISTANCE_PAIRS_PER_CLIENT = 1


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
