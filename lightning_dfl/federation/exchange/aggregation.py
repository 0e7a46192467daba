"""Masked, weighted model averaging (DisPFL Alg. 1 line 7, DA-DPFL Eq. 7, FedAvg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_dfl.sparse.masks import zero_inactive_all_


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

    The sums accumulate source by source, reading each source once in order (``weights[n][j]`` and
    ``masks[n][j]`` for every name before source ``j + 1``: sequences that fetch or rebuild sources on demand
    work), so no ``(S, *shape)`` copy is made. Half-precision sources
    (float16, bfloat16) are summed and divided in float32 and the result cast back: in float16 the sum of a
    few models overflows, and the divisor's floor (1e-12) is 0, so an entry nobody holds was 0 / 0 = NaN.
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
    floating = []
    for name, sources in weights.items():
        if sources[0].is_floating_point():
            floating.append(name)
        else:
            out[name] = sources[0].clone()
    if not floating:
        return out
    masked = [n for n in floating if n in masks]
    dtypes = [weights[n][0].dtype for n in floating]
    accumulate = dict(zip(floating, (_accumulation_dtype(d) for d in dtypes)))
    # numerators and denominators in one pass over the sources (each read once, in order: they may be streamed)
    numerators, denominators = _weighted_sums(
        [[weights[n] for n in floating], [masks[n] for n in masked]], coef,
        [[accumulate[n] for n in floating], [accumulate[n] for n in masked]])
    by_name = dict(zip(floating, numerators))
    if masked:  # 0 where nobody holds the weight
        torch._foreach_clamp_min_(denominators, 1e-12)
        torch._foreach_div_([by_name[n] for n in masked], denominators)
        if receiver_mask is not None:
            kept = [n for n in masked if n in receiver_mask]
            zero_inactive_all_([by_name[n] for n in kept], [receiver_mask[n] for n in kept])
    unmasked = [by_name[n] for n in floating if n not in masks]
    if unmasked:
        torch._foreach_div_(unmasked, num_sources if coef is None else sum(coef))
    out.update({n: by_name[n].to(d) for n, d in zip(floating, dtypes)})
    return {n: out[n] for n in weights}


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums of ``dtype`` tensors accumulate in: float32 for the 16-bit floats, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _weighted_sums(families: list[list[Sequence[Tensor]]], coef: list[float] | None,
                   dtypes: list[list[torch.dtype]]) -> list[list[Tensor]]:
    """For each family (weights, masks) and each of its entries (``S`` sources of one parameter),
    ``sum_j coef_j * source_j`` accumulated source by source from zeros in ``dtypes``: source ``j`` of every
    entry of every family before source ``j + 1``, each family's entries at once (``torch._foreach_add_``: a few
    multi-tensor kernels per source on a GPU instead of one per parameter; on a CPU the same ``add_`` per
    tensor as ever)."""
    totals = [[torch.zeros(group[0].shape, dtype=dtype, device=group[0].device) for group, dtype in zip(family, kinds)]
              for family, kinds in zip(families, dtypes)]
    num_sources = next((len(family[0]) for family in families if family), 0)
    for j in range(num_sources):
        for sums, family in zip(totals, families):
            if not family:
                continue
            if coef is None:
                torch._foreach_add_(sums, [group[j] for group in family])
            elif coef[j]:
                torch._foreach_add_(sums, [group[j] for group in family], alpha=coef[j])
    return totals
