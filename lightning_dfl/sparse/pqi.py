"""PQ-index-driven further pruning (DA-DPFL Alg. 2, with the SAP paper's PQ index).

DA-DPFL prints the PQ index exponent and the exponent of ``(1 - I)`` incorrectly; this module
follows the SAP paper it cites (see the papers' errata):

* PQ index over the ``d`` active weights of a layer (Alg. 2 line 6)::

      I(w) = 1 - d^(1/q - 1/p) ||w||_p / ||w||_q
           = 1 - (mean |w|^p)^(1/p) / (mean |w|^q)^(1/q)        in [0, 1)

* lower bound of weights to keep (line 7): ``r = d (1 + eta_c)^(-q/(q-p)) (1 - I)^(qp/(q-p))``
* number to prune (line 9): ``c = floor(d * min(gamma (1 - r/d), beta))``

Defaults are SAP's, which the authors' code runs: ``p=0.5, q=1, gamma=1, eta_c=0, beta=0.9``.
Pure PyTorch; no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_dfl.sparse.select import smallest_k

#: SAP defaults (the papers' errata): norm indices, compression, scaling and threshold.
DEFAULT_P = 0.5
DEFAULT_Q = 1.0
DEFAULT_ETA_C = 0.0
DEFAULT_GAMMA = 1.0
DEFAULT_BETA = 0.9

# Rounding slack for floor() of products that are integers in exact arithmetic.
_FLOOR_EPS = 1e-9


def _check_pq(p: float, q: float) -> None:
    if not (math.isfinite(p) and math.isfinite(q)):
        raise ValueError(f"p and q must be finite, got p={p!r}, q={q!r}")
    if not 0 < p < q:
        raise ValueError(f"the PQ index needs 0 < p < q, got p={p!r}, q={q!r}")
    if q < 1:
        raise ValueError(f"the PQ index needs q >= 1, got q={q!r}")


def _check_prune_args(eta_c: float, gamma: float, beta: float) -> None:
    if not (math.isfinite(eta_c) and eta_c >= 0):
        raise ValueError(f"eta_c (compression hyper-parameter) must be >= 0, got {eta_c!r}")
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"gamma (scaling factor) must be >= 0, got {gamma!r}")
    if not (math.isfinite(beta) and 0 <= beta <= 1):
        raise ValueError(f"beta (pruning threshold) must lie in [0, 1], got {beta!r}")


def pq_index(weights: Tensor, p: float = DEFAULT_P, q: float = DEFAULT_Q) -> float:
    """PQ index ``I(w) = 1 - (mean|w|^p)^(1/p) / (mean|w|^q)^(1/q)`` (Alg. 2 line 6, SAP form).

    ``weights`` are the layer's active weights (any shape; flattened). The result lies in
    ``[0, 1)``: 0 when all magnitudes are equal, towards 1 the more the mass concentrates on
    few weights (the more compressible the layer). Computed in float64.

    An empty tensor or one of zeros only carries no compressibility information: its index is
    defined as 0.0, which makes :func:`pqi_prune_count` prune nothing.
    """
    _check_pq(p, q)
    w = weights.detach().reshape(-1).to(torch.float64).abs()
    if w.numel() == 0:
        return 0.0
    scale = float(w.max())
    if scale == 0.0:
        return 0.0
    if not math.isfinite(scale):
        raise ValueError("pq_index got non-finite weights (inf or nan)")
    w = w / scale  # the index is scale invariant; this keeps the powers in range
    norm_p = float(w.pow(p).mean()) ** (1.0 / p)
    norm_q = float(w.pow(q).mean()) ** (1.0 / q)
    # Power-mean inequality: norm_p <= norm_q; clamp float noise into [0, 1).
    return min(max(1.0 - norm_p / norm_q, 0.0), math.nextafter(1.0, 0.0))


def pqi_keep_bound(d: int, index: float, p: float = DEFAULT_P, q: float = DEFAULT_Q,
                   eta_c: float = DEFAULT_ETA_C) -> float:
    """Lower bound of weights to keep, ``r = d (1+eta_c)^(-q/(q-p)) (1-I)^(qp/(q-p))`` (Alg. 2 line 7)."""
    _check_pq(p, q)
    if d < 0:
        raise ValueError(f"d (number of active weights) must be >= 0, got {d!r}")
    if not 0 <= index < 1:
        raise ValueError(f"the PQ index must lie in [0, 1), got {index!r}")
    if not (math.isfinite(eta_c) and eta_c >= 0):
        raise ValueError(f"eta_c (compression hyper-parameter) must be >= 0, got {eta_c!r}")
    return d * (1.0 + eta_c) ** (-q / (q - p)) * (1.0 - index) ** (q * p / (q - p))


def pqi_prune_count(d: int, index: float, p: float = DEFAULT_P, q: float = DEFAULT_Q,
                    eta_c: float = DEFAULT_ETA_C, gamma: float = DEFAULT_GAMMA,
                    beta: float = DEFAULT_BETA) -> int:
    """Weights to prune in a layer, ``floor(d * min(gamma (1 - r/d), beta))`` (Alg. 2 line 9)."""
    _check_prune_args(eta_c, gamma, beta)
    r = pqi_keep_bound(d, index, p, q, eta_c)  # also validates d, index, p, q
    if d == 0:
        return 0
    share = min(gamma * (1.0 - r / d), beta)
    count = math.floor(d * share + _FLOOR_EPS)
    return min(max(count, 0), d)


def prune_budget(masks: Mapping[str, Tensor], target_sparsity: float) -> int:
    """How many active weights may still be pruned before the masked set passes ``target_sparsity``.

    Sparsity is the share of zeros over all masked entries (the papers' errata). The budget
    lands the masked set on the largest sparsity not above the target; 0 when already there.
    """
    if not (math.isfinite(target_sparsity) and 0 <= target_sparsity <= 1):
        raise ValueError(f"target_sparsity must lie in [0, 1], got {target_sparsity!r}")
    total = sum(m.numel() for m in masks.values())
    active = sum(int(m.count_nonzero()) for m in masks.values())
    # Slack so that e.g. 100 * 0.7 = 70.00000000000001 floors to 70.
    allowed_zeros = math.floor(total * target_sparsity + 1e-6)
    return max(allowed_zeros - (total - active), 0)


def _scale_counts(counts: dict[str, int], max_prune: int) -> dict[str, int]:
    """Scale all counts by one common factor so that they sum to ``max_prune`` exactly.

    Floors each scaled count, then hands the remaining units to the layers with the largest
    fractional parts (ties: the layer that comes first), so no layer exceeds its own count.
    """
    total = sum(counts.values())
    if total <= max_prune:
        return dict(counts)
    names = list(counts)
    # Exact integer arithmetic: count * max_prune / total = floor + frac / total.
    floors = [counts[name] * max_prune // total for name in names]
    fracs = [counts[name] * max_prune % total for name in names]
    remainder = max_prune - sum(floors)
    # Largest fractional part first; sorted() is stable, so ties keep layer order.
    order = sorted(range(len(names)), key=lambda i: -fracs[i])
    for i in order[:remainder]:
        floors[i] += 1
    return dict(zip(names, floors))


def smallest_active(weights: Tensor, mask: Tensor, count: int) -> Tensor:
    """Flat indices of the ``count`` smallest-magnitude active weights.

    Ties are broken by flat index (the earlier entry goes first), so the result is
    deterministic on every device.
    """
    if count <= 0:
        return torch.empty(0, dtype=torch.long, device=weights.device)
    active = mask.reshape(-1).nonzero().squeeze(1)
    scores = weights.detach().abs().reshape(-1)[active]
    return active[smallest_k(scores, min(count, active.numel()))]


@torch.no_grad()
def pqi_prune_masks(
    weights: Mapping[str, Tensor],
    masks: Mapping[str, Tensor],
    p: float = DEFAULT_P,
    q: float = DEFAULT_Q,
    eta_c: float = DEFAULT_ETA_C,
    gamma: float = DEFAULT_GAMMA,
    beta: float = DEFAULT_BETA,
    max_prune: int | None = None,
) -> tuple[dict[str, Tensor], dict[str, int]]:
    """One PQI pruning event (DA-DPFL Alg. 2), layer by layer over the active weights.

    For each masked layer, computes the PQ index of its active weights, the count of
    :func:`pqi_prune_count`, and drops that many smallest-magnitude active weights from its
    mask. With ``max_prune`` (see :func:`prune_budget`), when the counts add up to more, every
    layer's count is scaled by one common factor so that exactly ``max_prune`` are pruned (no
    overshoot of the target sparsity).

    Returns the new boolean masks (new tensors; the inputs are untouched) and the number
    pruned per layer. The caller zeros the pruned weights (e.g. ``ModelMask.load_``).
    """
    _check_pq(p, q)
    _check_prune_args(eta_c, gamma, beta)
    if max_prune is not None and (isinstance(max_prune, bool) or int(max_prune) != max_prune
                                  or max_prune < 0):
        raise ValueError(f"max_prune must be a non-negative integer or None, got {max_prune!r}")
    missing = sorted(set(masks) - set(weights))
    if missing:
        raise ValueError(f"no weights given for masked layers {missing}")
    for name, mask in masks.items():
        if weights[name].shape != mask.shape:
            raise ValueError(f"layer {name!r}: weights have shape {tuple(weights[name].shape)}, "
                             f"the mask has {tuple(mask.shape)}")

    bool_masks = {name: mask.bool() for name, mask in masks.items()}
    counts: dict[str, int] = {}
    for name, mask in bool_masks.items():
        active = weights[name].detach()[mask]
        index = pq_index(active, p, q)
        counts[name] = pqi_prune_count(active.numel(), index, p, q, eta_c, gamma, beta)
    if max_prune is not None:
        counts = _scale_counts(counts, int(max_prune))

    new_masks: dict[str, Tensor] = {}
    for name, mask in bool_masks.items():
        flat = mask.reshape(-1).clone()
        flat[smallest_active(weights[name], mask, counts[name])] = False
        new_masks[name] = flat.view(mask.shape)
    return new_masks, counts


__all__ = [
    "DEFAULT_BETA",
    "DEFAULT_ETA_C",
    "DEFAULT_GAMMA",
    "DEFAULT_P",
    "DEFAULT_Q",
    "pq_index",
    "pqi_keep_bound",
    "pqi_prune_count",
    "pqi_prune_masks",
    "prune_budget",
    "smallest_active",
]
