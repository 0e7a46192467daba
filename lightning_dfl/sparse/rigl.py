"""RigL local mask search (DisPFL Alg. 2, DA-DPFL Alg. 3).

One update of a layer's mask with ``n`` active weights:

1. drop fraction from the cosine schedule (Alg. 3 line 3)::

       alpha_t = alpha_0 / 2 * (1 + cos(pi t / T))

2. ``k = ceil(alpha_t * n)`` (the rounding of the DisPFL authors' ``fire_mask``; float noise
   below ``1e-12 n`` is ignored, so ``0.3 * 10`` drops 3, not 4);
3. drop the ``k`` active weights of smallest ``|w|`` (line 6);
4. regrow exactly ``k`` among the positions inactive after the drop, by largest
   ``|dense gradient|`` (line 7) or uniformly at random (DisPFL's published runs). A weight
   dropped in step 3 may regrow, so a fully dense layer stays dense.

Each layer keeps its number of active weights exactly. Ties are broken by flat index (the
lower index is dropped first and grown first). Weights are never modified here: zeroing
dropped weights (and, for the copy neighbours receive, not zeroing them) is the caller's job.
Pure PyTorch; no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lightning_dfl.checks import check_int, is_number
from lightning_dfl.deferred import host_reads_are_cheap
from lightning_dfl.sparse.masks import Masks, ModelMask, active_counts, count_active_together
from lightning_dfl.sparse.select import (
    largest_k_mask_among,
    largest_k_masks_together,
    smallest_k_mask_among,
    smallest_k_masks_together,
)
from lightning_dfl.transfers import to_device

#: Regrowth criteria: ``"gradient"`` (RigL, by |dense gradient|) or ``"random"`` (SET-like).
REGROWTH_MODES = ("gradient", "random")

# Relative slack for ceil() of products that are integers in exact arithmetic.
_CEIL_EPS = 1e-12


def cosine_drop_fraction(alpha0: float, step: int, total: int) -> float:
    """``alpha_t = alpha_0 / 2 * (1 + cos(pi t / T))`` (DA-DPFL Alg. 3 line 3; DisPFL Alg. 2).

    ``step`` (``t``, from 0) past ``total`` (``T``) is clamped to ``T``, where the fraction is 0.
    """
    if not is_number(alpha0) or not 0.0 <= alpha0 <= 1.0:
        raise ValueError(f"alpha0 (initial drop fraction) must be a number in [0, 1], got {alpha0!r}")
    check_int("total (T, the number of rounds or steps)", total, 1)
    check_int("step (t)", step, 0)
    t = min(step, total)
    return float(alpha0) / 2.0 * (1.0 + math.cos(math.pi * t / total))


def num_dropped(drop_fraction: float, num_active: int) -> int:
    """``ceil(drop_fraction * num_active)``, ignoring float noise (see the module docstring)."""
    product = drop_fraction * num_active
    return max(0, min(num_active, math.ceil(product - _CEIL_EPS * max(1.0, product))))


def num_dropped_together(drop_fraction: float, num_active: Tensor) -> Tensor:
    """:func:`num_dropped` of every entry of an int64 tensor of active counts, on its device, not read: the same
    float64 operations, so the same integers."""
    product = num_active.double() * float(drop_fraction)
    k = torch.ceil(product - _CEIL_EPS * product.clamp_min(1.0)).long()
    return k.clamp_min(0).minimum(num_active)


def _check_drop_fraction(drop_fraction: float) -> None:
    if not is_number(drop_fraction, finite=False):
        raise ValueError(f"drop_fraction must be a number in [0, 1], got {drop_fraction!r}")
    if not 0.0 <= drop_fraction <= 1.0:  # also rejects NaN
        raise ValueError(f"drop_fraction must lie in [0, 1], got {drop_fraction!r}")


def _layer_update(weight: Tensor, mask: Tensor, k: int, active: int, score: Tensor | None,
                  generator: torch.Generator | None) -> Tensor:
    """Drop ``k`` smallest-|w| active entries, regrow ``k`` inactive ones (by score, else random);
    ``active`` is the mask's number of active entries.

    On an accelerator it works on whole layers with sentinels (inactive entries rank last for dropping,
    kept ones last for regrowth) instead of gathering index lists: a few linear passes per layer, and no
    read of the device's values (the random candidates' count is ``n - active + k``). On the CPU it selects
    among each step's candidates alone, in NumPy (:func:`~lightning_dfl.sparse.select.smallest_k_mask_among`):
    the same masks.
    """
    flat = mask.reshape(-1)
    if k == 0 or active == flat.numel():  # a dense layer regrows exactly what it dropped
        return flat.clone().view_as(mask)
    # finite (an infinite weight or score ranks as the largest float), so an active weight always ranks before
    # an inactive one as masked_fill(~flat, inf) would rank them
    magnitude = torch.nan_to_num(weight.detach().reshape(-1).to(flat.device).abs(), nan=0.0)
    dropped = smallest_k_mask_among(magnitude, flat, k)
    kept = flat & ~dropped
    if score is not None:
        ranked = torch.nan_to_num(score.detach().reshape(-1).to(flat.device).abs(), nan=0.0)
        grown = largest_k_mask_among(ranked, ~kept, k)
    else:
        num_candidates = flat.numel() - active + k  # the inactive entries and the just-dropped ones
        if host_reads_are_cheap(flat.device):  # the same positions; NumPy's is several times faster there
            candidates = torch.from_numpy(np.flatnonzero((~kept).numpy()))
        else:
            candidates = torch.nonzero_static(~kept, size=num_candidates).squeeze(1)
        device = generator.device if generator is not None else torch.device("cpu")
        pick = torch.randperm(num_candidates, generator=generator, device=device)[:k]
        grown = torch.zeros_like(kept)
        grown[candidates[to_device(pick, flat.device)]] = True
    return (kept | grown).view_as(mask)


def rigl_masks(
    weights: Mapping[str, Tensor],
    masks: Mapping[str, Tensor],
    drop_fraction: float,
    scores: Mapping[str, Tensor] | None = None,
    mode: str = "gradient",
    generator: torch.Generator | None = None,
) -> Masks:
    """New masks after one RigL drop-and-regrow step (DisPFL Alg. 2, DA-DPFL Alg. 3 lines 5-8).

    Args:
        weights: current weights by name (at least every name in ``masks``); read only.
        masks: current masks by name (boolean, or 0/1 of any dtype).
        drop_fraction: ``alpha_t`` in ``[0, 1]``; ``ceil(alpha_t * n)`` of a layer's ``n``
            active weights are dropped and as many regrown.
        scores: regrowth scores by name for ``mode="gradient"`` (the dense gradient; its
            absolute value is ranked). Ignored for ``mode="random"``.
        mode: ``"gradient"`` or ``"random"``.
        generator: random source for ``mode="random"`` (the global RNG when ``None``).

    Returns:
        boolean masks, by the names and on the devices of ``masks``; per layer the number of
        active entries is unchanged.
    """
    if mode not in REGROWTH_MODES:
        raise ValueError(f"mode must be one of {REGROWTH_MODES}, got {mode!r}")
    _check_drop_fraction(drop_fraction)
    missing = sorted(set(masks) - set(weights))
    if missing:
        raise ValueError(f"weights are missing for masked parameters {missing}")
    if mode == "gradient":
        if scores is None:
            raise ValueError('mode="gradient" needs scores (the dense gradient by parameter name)')
        missing = sorted(set(masks) - set(scores))
        if missing:
            raise ValueError(f"scores are missing for masked parameters {missing}")
    for name, mask in masks.items():
        if weights[name].shape != mask.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, "
                             f"its mask {tuple(mask.shape)}")
        if mode == "gradient" and scores[name].shape != mask.shape:
            raise ValueError(f"score {name!r} has shape {tuple(scores[name].shape)}, "
                             f"its mask {tuple(mask.shape)}")

    binary = {name: mask.detach() if mask.dtype == torch.bool else mask.detach() != 0 for name, mask in masks.items()}
    devices = {flat.device for flat in binary.values()}
    if mode == "gradient" and binary and len(devices) == 1 and not host_reads_are_cheap(next(iter(devices))):
        # an accelerator: every layer at once, the drop counts computed where the masks are (nothing read)
        ks = num_dropped_together(float(drop_fraction), count_active_together(binary))
        return _layers_update_together(weights, binary, ks, scores)
    actives = active_counts(binary)  # every layer's count in one read
    ks = {name: num_dropped(float(drop_fraction), active) for name, active in actives.items()}
    return {name: _layer_update(weights[name], flat, ks[name], actives[name],
                                scores[name] if mode == "gradient" else None, generator)
            for name, flat in binary.items()}


def _layers_update_together(weights: Mapping[str, Tensor], binary: Mapping[str, Tensor], k: Tensor,
                            scores: Mapping[str, Tensor]) -> Masks:
    """:func:`_layer_update` by gradient of every layer of ``binary`` at once (their values concatenated, each
    layer selected as a part of them: :func:`~lightning_dfl.sparse.select.smallest_k_masks_together`; ``k``: their
    drop counts, an int64 tensor on their device), with the same result (a layer that drops nothing, or a dense
    one, regrows exactly what it dropped); a few kernels for all layers. New masks are views of one buffer."""
    names = list(binary)
    device = binary[names[0]].device
    sizes = [binary[n].numel() for n in names]

    def joined(tensors: Mapping[str, Tensor]) -> Tensor:
        return torch.cat([tensors[n].detach().reshape(-1).to(device) for n in names])

    flat = joined(binary)
    magnitude = torch.nan_to_num(joined(weights).abs(), nan=0.0)
    kept = flat & ~smallest_k_masks_together(magnitude.masked_fill(~flat, math.inf), sizes, k)
    ranked = torch.nan_to_num(joined(scores).abs(), nan=0.0)
    grown = largest_k_masks_together(ranked.masked_fill(kept, -math.inf), sizes, k)
    return {n: part.view_as(binary[n]) for n, part in zip(names, (kept | grown).split(sizes))}


def dense_gradients(
    module: nn.Module,
    mask: ModelMask,
    loss_fn: Callable[[Any], Tensor],
    batches: Iterable[Any],
    eval_mode: bool = True,
    absolute: bool = True,
) -> dict[str, Tensor]:
    """``|dense gradient|`` of the loss per masked parameter: RigL's regrowth score (Alg. 3 line 4); with
    ``absolute=False`` the signed gradient (to be averaged over processes before its magnitude is taken).

    ``loss_fn(batch)`` returns a scalar loss computed with ``module``; the gradients of all
    ``batches`` are averaged. The mask's gradient hooks are bypassed
    (:meth:`ModelMask.dense_gradients`) so that inactive weights get their gradient too. Like the
    DisPFL authors' ``screen_gradients``, the pass runs in eval mode by default (no dropout, no
    batch-norm statistics update). The module's previous ``.grad`` tensors and the training
    flags of all its submodules are restored; weights are not changed.
    """
    modes = {sub: sub.training for sub in module.modules()}
    params = [p for p in module.parameters()]
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    count = 0
    try:
        if eval_mode:
            module.eval()
        with torch.enable_grad(), mask.dense_gradients():
            for batch in batches:
                loss = loss_fn(batch)
                if not isinstance(loss, Tensor) or loss.numel() != 1:
                    raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                     + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else ""))
                loss.backward()
                count += 1
        if count == 0:
            raise ValueError("dense_gradients needs at least one batch, got none")
        # every layer at once (a few kernels on an accelerator); a parameter the loss did not reach scores 0
        present = [name for name, param in mask.params.items() if param.grad is not None]
        scores = dict(zip(present, torch._foreach_div([mask.params[n].grad.detach() for n in present], count)))
        if absolute:
            torch._foreach_abs_(list(scores.values()))
        total = {name: scores[name] if name in scores else torch.zeros_like(param) for name, param in mask.params.items()}
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        for sub, training in modes.items():
            sub.training = training
    return total
