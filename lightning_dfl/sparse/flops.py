"""FLOPs of sparse Conv/Linear networks, counted as the papers' tables count them.

Convention (DisPFL Table 1, DA-DPFL Table II / Sec. VI-A5): only Conv and Linear layers,
2 FLOPs per multiply-add, active (unmasked) weights only; a training sample costs 3 forward
passes (forward + backward w.r.t. activations and weights). A weight entry of a layer is used
once per output position (conv: ``H_out * W_out``; linear: 1, or the product of any extra
leading dims), so per-sample forward FLOPs are ``sum_l 2 * positions_l * active_l``; this
holds for grouped and depthwise convs too, since their weight tensors hold only the
``in_channels / groups`` inputs each output sees.

:func:`profile_flops` runs one forward pass with hooks to record ``positions_l``; the
resulting :class:`FlopsProfile` then evaluates any mask by summing counts, cheap enough per
client per round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd, _ConvTransposeNd

#: Layer types counted.
COUNTED_TYPES: tuple[type[nn.Module], ...] = (_ConvNd, nn.Linear)


@dataclass(frozen=True)
class LayerFlops:
    """One counted layer: how often each weight entry is used per sample, and its size."""

    positions: int
    numel: int

    @property
    def dense_macs(self) -> int:
        return self.positions * self.numel


@dataclass(frozen=True)
class FlopsProfile:
    """Per-sample use counts of each Conv/Linear weight for one architecture and input shape.

    ``layers`` maps weight names (``"layer1.0.conv1.weight"``, as in ``named_parameters``)
    to :class:`LayerFlops`. Masks are given by the same names, either as boolean/0-1 tensors
    or as precomputed active counts; a counted layer absent from the masks counts as dense.
    """

    input_shape: tuple[int, ...]
    layers: dict[str, LayerFlops] = field(default_factory=dict)

    def active_counts(self, masks: Mapping[str, Tensor | int] | None = None) -> dict[str, int]:
        """Active weights per counted layer (dense where ``masks`` has no entry)."""
        masks = masks or {}
        unknown = sorted(set(masks) - set(self.layers))
        if unknown:
            raise ValueError(f"masks name layers this profile does not count: {unknown}; "
                             f"it counts {sorted(self.layers)}")
        counts: dict[str, int] = {}
        for name, layer in self.layers.items():
            mask = masks.get(name)
            if mask is None:
                counts[name] = layer.numel
                continue
            if isinstance(mask, Tensor):
                if mask.numel() != layer.numel:
                    raise ValueError(f"mask {name!r} has {mask.numel()} entries, "
                                     f"the weight has {layer.numel}")
                count = int(torch.count_nonzero(mask))
            else:
                count = int(mask)
                if not 0 <= count <= layer.numel:
                    raise ValueError(f"active count for {name!r} must be in [0, {layer.numel}], "
                                     f"got {mask!r}")
            counts[name] = count
        return counts

    def forward_macs(self, masks: Mapping[str, Tensor | int] | None = None) -> int:
        """Multiply-adds of one sample's forward pass over the active weights."""
        counts = self.active_counts(masks)
        return sum(layer.positions * counts[name] for name, layer in self.layers.items())

    def forward_flops(self, masks: Mapping[str, Tensor | int] | None = None) -> float:
        """Per-sample forward FLOPs: ``sum_l 2 * positions_l * active_l``."""
        return 2.0 * self.forward_macs(masks)

    def deferred_forward_flops(self, counts: Mapping[str, Tensor]) -> Tensor:
        """:meth:`forward_flops` at active ``counts`` given as 0-dim integer tensors on a device (a mask's
        ``count_nonzero()``), as a 0-dim float64 tensor there, computed without reading it (the same value:
        integer sums, then one exact conversion)."""
        unknown = sorted(set(counts) - set(self.layers))
        if unknown:
            raise ValueError(f"masks name layers this profile does not count: {unknown}; "
                             f"it counts {sorted(self.layers)}")
        device = next(iter(counts.values())).device if counts else torch.device("cpu")
        names = [n for n in self.layers if n in counts]
        dense = sum(layer.dense_macs for n, layer in self.layers.items() if n not in counts)  # layers without a mask
        if not names:
            return 2.0 * torch.full((), dense, dtype=torch.int64, device=device).to(torch.float64)
        # every layer's product in one multi-tensor kernel, summed in int64 (exact in any order)
        products = torch._foreach_mul([counts[n].to(torch.int64) for n in names],
                                      [self.layers[n].positions for n in names])
        macs = torch.stack(products).sum() + dense
        return 2.0 * macs.to(torch.float64)

    def dense_forward_flops(self) -> float:
        """Per-sample forward FLOPs with every weight active."""
        return 2.0 * sum(layer.dense_macs for layer in self.layers.values())

    def training_flops(self, num_samples: int,
                       masks: Mapping[str, Tensor | int] | None = None) -> float:
        """FLOPs of training on ``num_samples`` samples: ``3 * num_samples * forward_flops``."""
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples!r}")
        return 3.0 * num_samples * self.forward_flops(masks)


def profile_flops(model: nn.Module, input_shape: tuple[int, ...]) -> FlopsProfile:
    """Record each Conv/Linear weight's output positions per sample by one forward pass.

    ``input_shape`` is one sample's shape without the batch dim, e.g. ``(3, 32, 32)``. The
    pass runs on a batch of 2 zeros in eval mode under ``no_grad`` on the model's device;
    every module's training flag is restored and no parameter or buffer changes. A layer
    called several times per forward counts once per call; one never called counts 0.
    """
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be one sample's shape (no batch dim) with positive "
                         f"sizes, e.g. (3, 32, 32); got {input_shape!r}")
    batch = 2
    counted = {module: f"{name}.weight" if name else "weight"
               for name, module in model.named_modules()
               if isinstance(module, COUNTED_TYPES) and isinstance(getattr(module, "weight", None), Tensor)}
    positions = {name: 0 for name in counted.values()}
    numels = {name: module.weight.numel() for module, name in counted.items()}

    def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        # Divide by the batch we fed, not the tensor's first dim: models may fold dims into it.
        if isinstance(module, _ConvTransposeNd):  # each weight entry is used once per input pixel
            per_sample = inputs[0].numel() // (batch * module.in_channels)
        elif isinstance(module, _ConvNd):  # once per output pixel
            per_sample = output.numel() // (batch * module.out_channels)
        else:  # Linear: once per row of the flattened leading dims
            per_sample = output.numel() // (batch * module.out_features)
        positions[counted[module]] += per_sample

    modes = {module: module.training for module in model.modules()}
    handles = [module.register_forward_hook(hook) for module in counted]
    reference = next(iter(model.parameters()), None)
    device = reference.device if reference is not None else torch.device("cpu")
    dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros((batch, *shape), device=device, dtype=dtype))
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    layers = {name: LayerFlops(positions=positions[name], numel=numels[name]) for name in positions}
    return FlopsProfile(input_shape=shape, layers=layers)

