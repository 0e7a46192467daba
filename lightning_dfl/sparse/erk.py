"""Initial sparse masks: Erdos-Renyi-Kernel (ERK) or uniform layer densities, random positions.

ERK (Evci et al., "Rigging the Lottery", 2020, Sec. 3; the initialization DisPFL and DA-DPFL
use): layer l gets density ``eps * (sum(shape_l) / prod(shape_l)) ** erk_power_scale``, with one
global ``eps`` chosen so that the density over all layers is exactly the target. A layer whose
density would exceed 1 is made dense and ``eps`` is solved again for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from lightning_dfl.sparse.masks import Masks, maskable_parameters

Shape = torch.Size | tuple[int, ...]

DISTRIBUTIONS = ("erk", "uniform")


def _check_density(density: float) -> None:
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")


def _numels(shapes: Mapping[str, Shape]) -> dict[str, int]:
    if not shapes:
        raise ValueError("no layers given (shapes is empty)")
    numels = {name: math.prod(shape) for name, shape in shapes.items()}
    empty = [name for name, n in numels.items() if n <= 0]
    if empty:
        raise ValueError(f"layers with no entries: {empty}")
    return numels


def erk_densities(shapes: Mapping[str, Shape], density: float,
                  erk_power_scale: float = 1.0) -> dict[str, float]:
    """Per-layer densities of the ERK distribution at global ``density`` (RigL, Sec. 3).

    Raw score of a layer: ``(sum(shape) / prod(shape)) ** erk_power_scale`` (kernel dims
    included; ``erk_power_scale=0`` gives the uniform distribution). Layers whose scaled
    score exceeds 1 become dense; the sum over layers of ``density_l * numel_l`` equals
    ``density * sum(numel_l)``.
    """
    _check_density(density)
    if not 0 <= erk_power_scale < math.inf:
        raise ValueError(f"erk_power_scale must be >= 0, got {erk_power_scale!r} (allowed: finite values >= 0)")
    numels = _numels(shapes)
    if density == 1.0:
        return {name: 1.0 for name in shapes}
    raw = {name: (sum(shape) / numels[name]) ** erk_power_scale for name, shape in shapes.items()}
    target = density * sum(numels.values())
    dense: set[str] = set()
    while True:
        sparse = [name for name in shapes if name not in dense]
        budget = target - sum(numels[name] for name in dense)
        eps = budget / sum(raw[name] * numels[name] for name in sparse)
        over = {name for name in sparse if eps * raw[name] > 1.0}
        if not over or len(over) == len(sparse):  # the latter only by float rounding near 1
            break
        # Making a layer dense only raises eps for the rest, so all of them can go at once.
        dense |= over
    return {name: 1.0 if name in dense else min(1.0, eps * raw[name]) for name in shapes}


def uniform_densities(shapes: Mapping[str, Shape], density: float) -> dict[str, float]:
    """The same ``density`` for every layer."""
    _check_density(density)
    _numels(shapes)
    return {name: float(density) for name in shapes}


def active_count(density: float, numel: int) -> int:
    """``round(density * numel)``, halves rounded up: a layer's number of active weights."""
    return min(numel, math.floor(density * numel + 0.5))


def random_masks(shapes: Mapping[str, Shape], densities: Mapping[str, float],
                 generator: torch.Generator) -> Masks:
    """Boolean masks with exactly ``round(d * numel)`` active entries per layer, uniformly placed.

    Layers are drawn in the order of ``shapes``; the result depends only on the generator's
    state. Masks are on the CPU.
    """
    numels = _numels(shapes)
    missing = sorted(set(shapes) - set(densities))
    extra = sorted(set(densities) - set(shapes))
    if missing or extra:
        raise ValueError(f"densities must name the same layers as shapes; missing {missing}, "
                         f"unknown {extra}")
    bad = {name: d for name, d in densities.items() if not 0.0 <= d <= 1.0}
    if bad:
        raise ValueError(f"layer densities must be in [0, 1], got {bad}")
    masks: Masks = {}
    for name, shape in shapes.items():
        n = numels[name]
        k = active_count(densities[name], n)
        flat = torch.zeros(n, dtype=torch.bool)
        if k == n:
            flat.fill_(True)
        elif k > 0:
            flat[torch.randperm(n, generator=generator)[:k]] = True
        masks[name] = flat.view(tuple(shape))
    return masks


def initial_masks(module_or_params: nn.Module | Mapping[str, torch.Tensor], density: float,
                  distribution: str = "erk", *, generator: torch.Generator,
                  erk_power_scale: float = 1.0) -> Masks:
    """Random initial masks at global ``density`` for a module's maskable weights.

    ``module_or_params`` is a module (its :func:`maskable_parameters` are masked) or a
    ``name -> parameter`` mapping such as :func:`maskable_parameters` returns.
    ``distribution`` is ``"erk"`` or ``"uniform"``. Masks are boolean CPU tensors.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    _check_density(density)
    params = (maskable_parameters(module_or_params) if isinstance(module_or_params, nn.Module)
              else module_or_params)
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    if distribution == "erk":
        densities = erk_densities(shapes, density, erk_power_scale)
    else:
        densities = uniform_densities(shapes, density)
    return random_masks(shapes, densities, generator)
