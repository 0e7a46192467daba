"""Masked, weighted model averaging (DisPFL Alg. 1 line 7, DA-DPFL Eq. 7, FedAvg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_dfl.sparse.masks import zero_inactive_


@torch.no_grad()
def masked_average(
    weights: Mapping[str, Tensor | Sequence[Tensor]],
    masks: Mapping[str, Tensor | Sequence[Tensor]],
    receiver_mask: Mapping[str, Tensor] | None = None,
    coefficients: Sequence[float] | Tensor | None = None,
) -> dict[str, Tensor]:
    """Element-wise average of several models over the nodes that hold each weight.

    For a masked parameter (DA-DPFL Eq. 7 with coefficients ``a_j``, all 1 by default)::

        w = (sum_j a_j w_j) / (sum_j a_j m_j) * m_receiver,   0 where no source holds the weight

    where each ``w_j`` is zero outside its own mask ``m_j`` (the mask it was trained with).
    Unmasked parameters (biases, norm layers) take ``sum_j a_j w_j / sum_j a_j``. With dense masks
    and ``a_j`` = sample counts this is FedAvg; with dense masks and equal ``a_j``, D-PSGD.

    Args:
        weights: name -> the sources' tensors, stacked ``(S, *shape)`` or a sequence of ``S``.
        masks: name -> the sources' boolean masks, likewise, for the masked names.
        receiver_mask: name -> boolean ``shape``: the receiver's current mask (omitted: no masking).
        coefficients: ``S`` non-negative weights of the sources.

    The sums accumulate source by source, so no ``(S, *shape)`` copy is made.
    """
    first = next(iter(weights.values()))
    num_sources = len(first)
    if coefficients is None:
        coef = None
    else:
        coef = [float(c) for c in torch.as_tensor(coefficients, dtype=torch.float64).reshape(-1)]
        if len(coef) != num_sources or any(c < 0 for c in coef) or sum(coef) <= 0:
            raise ValueError(f"coefficients must be {num_sources} non-negative numbers with a positive sum, "
                             f"got {coef}")
    out: dict[str, Tensor] = {}
    for name, sources in weights.items():
        if not sources[0].is_floating_point():
            out[name] = sources[0].clone()
            continue
        numerator = _weighted_sum(sources, coef)
        if name in masks:
            denominator = _weighted_sum(masks[name], coef, dtype=numerator.dtype)
            averaged = numerator.div_(denominator.clamp_min_(1e-12))  # 0 where nobody holds the weight
            if receiver_mask is not None and name in receiver_mask:
                zero_inactive_(averaged, receiver_mask[name])
        else:
            averaged = numerator.div_(num_sources if coef is None else sum(coef))
        out[name] = averaged
    return out


def _weighted_sum(tensors: Tensor | Sequence[Tensor], coef: list[float] | None,
                  dtype: torch.dtype | None = None) -> Tensor:
    total = torch.zeros(tensors[0].shape, dtype=dtype or tensors[0].dtype, device=tensors[0].device)
    for j, t in enumerate(tensors):
        if coef is None:
            total.add_(t)
        elif coef[j]:
            total.add_(t, alpha=coef[j])
    return total
