"""Masked, weighted model averaging (DisPFL Alg. 1 line 7, DA-DPFL Eq. 7, FedAvg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


@torch.no_grad()
def masked_average(
    weights: Mapping[str, Tensor],
    masks: Mapping[str, Tensor],
    receiver_mask: Mapping[str, Tensor] | None = None,
    coefficients: Sequence[float] | Tensor | None = None,
) -> dict[str, Tensor]:
    """Element-wise average of stacked models over the nodes that hold each weight.

    For a masked parameter (DA-DPFL Eq. 7 with coefficients ``a_j``, all 1 by default)::

        w = (sum_j a_j w_j) / (sum_j a_j m_j) * m_receiver,   0 where no source holds the weight

    where each ``w_j`` is zero outside its own mask ``m_j`` (the mask it was trained with).
    Unmasked parameters (biases, norm layers) take ``sum_j a_j w_j / sum_j a_j``. With dense masks
    and ``a_j`` = sample counts this is FedAvg; with dense masks and equal ``a_j``, D-PSGD.

    Args:
        weights: name -> tensor of shape ``(S, *shape)``, one row per source.
        masks: name -> boolean ``(S, *shape)`` for the masked names.
        receiver_mask: name -> boolean ``shape``: the receiver's current mask (omitted: no masking).
        coefficients: ``S`` non-negative weights of the sources.
    """
    first = next(iter(weights.values()))
    num_sources = first.shape[0]
    if coefficients is None:
        coef = torch.ones(num_sources, dtype=torch.float32, device=first.device)
    else:
        coef = torch.as_tensor(coefficients, dtype=torch.float32, device=first.device)
        if coef.shape != (num_sources,) or bool((coef < 0).any()) or float(coef.sum()) <= 0:
            raise ValueError(f"coefficients must be {num_sources} non-negative numbers with a positive sum, "
                             f"got {coef.tolist()}")
    uniform = coefficients is None
    out: dict[str, Tensor] = {}
    for name, stacked in weights.items():
        if not stacked.is_floating_point():
            out[name] = stacked[0].clone()
            continue
        c = coef.to(stacked.dtype).view(-1, *([1] * (stacked.dim() - 1)))
        numerator = stacked.sum(dim=0) if uniform else (stacked * c).sum(dim=0)
        if name in masks:
            if uniform:
                denominator = masks[name].sum(dim=0, dtype=stacked.dtype)
            else:
                denominator = (masks[name].to(stacked.dtype) * c).sum(dim=0)
            averaged = numerator.div_(denominator.clamp_min_(1e-12))  # 0 where nobody holds the weight
            if receiver_mask is not None:
                averaged.mul_(receiver_mask[name])
        else:
            averaged = numerator.div_(float(coef.sum()))
        out[name] = averaged
    return out
