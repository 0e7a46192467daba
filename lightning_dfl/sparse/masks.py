"""Boolean weight masks and their enforcement by hooks.

A mask is a ``dict`` from parameter name to a boolean tensor of the parameter's shape.
:class:`ModelMask` binds such a dict to a module: gradient hooks zero the gradients of
inactive weights, and :meth:`ModelMask.apply_` re-masks the weights after every optimizer
step, so that no optimizer (momentum, weight decay) can revive a pruned weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor, nn

from lightning_dfl.deferred import host_reads_are_cheap
from lightning_dfl.transfers import copy_all_, to_device

Masks = dict[str, Tensor]

#: Layer types whose ``weight`` is maskable by default (biases and norm layers stay dense).
DEFAULT_MASKABLE_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def maskable_parameters(
    module: nn.Module,
    layer_types: tuple[type[nn.Module], ...] = DEFAULT_MASKABLE_TYPES,
    exclude: Callable[[str], bool] | None = None,
) -> dict[str, nn.Parameter]:
    """The ``weight`` parameters of ``layer_types`` layers, by their name in ``module``.

    ``exclude`` is called with each candidate's full parameter name and drops it when true.
    """
    found: dict[str, nn.Parameter] = {}
    for layer_name, layer in module.named_modules():
        if isinstance(layer, layer_types) and getattr(layer, "weight", None) is not None:
            name = f"{layer_name}.weight" if layer_name else "weight"
            if exclude is None or not exclude(name):
                found[name] = layer.weight
    return found


def zero_inactive_(tensor: Tensor, mask: Tensor) -> Tensor:
    """``tensor`` times ``mask`` in place, with plain ``+0.0`` at the inactive entries (a bare product leaves
    ``-0.0`` where a negative value was masked; adding ``0.0`` clears that sign and changes nothing else), so
    that a pruned weight is stored as a plain zero (the compact client store then needs no sign bits). A mask
    on another device than ``tensor`` is copied to its device first."""
    if mask.device != tensor.device:
        mask = mask.to(tensor.device)
    return tensor.mul_(mask).add_(0.0)


def zero_inactive_all_(tensors: list[Tensor], masks: list[Tensor]) -> None:
    """:func:`zero_inactive_` of each tensor with its mask, all at once (``torch._foreach_mul_`` and
    ``_foreach_add_``: a few multi-tensor kernels on a GPU instead of two per tensor; on a CPU the same ``mul_``
    and ``add_`` per tensor). Masks on another device than their tensors: one by one, as :func:`zero_inactive_`."""
    if any(m.device != t.device for t, m in zip(tensors, masks)):
        for tensor, mask in zip(tensors, masks):
            zero_inactive_(tensor, mask)
        return
    if tensors:
        torch._foreach_mul_(tensors, masks)
        torch._foreach_add_(tensors, 0.0)


#: from this many masks on, :func:`count_active_together` counts them in one pass over their concatenation
#: (a fixed few kernels) instead of one count per mask
COUNT_TOGETHER_FROM = 6


def count_active_together(masks: Mapping[str, Tensor]) -> Tensor:
    """Active entries per mask, in the masks' order, as one int64 tensor on their device, not read: one count
    per mask for a few masks; for more, of non-empty masks on one device, a running sum over all of them read
    at each mask's end (a fixed few kernels on an accelerator, whatever the number of layers)."""
    tensors = [m.reshape(-1) for m in masks.values()]
    if not tensors:
        return torch.zeros(0, dtype=torch.long)
    device = tensors[0].device
    if host_reads_are_cheap(device) or len(tensors) < COUNT_TOGETHER_FROM or any(t.numel() == 0 or t.device != device for t in tensors):
        return torch.stack([t.count_nonzero() for t in tensors])
    return sums_by_part(torch.cat([t if t.dtype == torch.bool else t != 0 for t in tensors]),
                        [t.numel() for t in tensors])


def sums_by_part(flags: Tensor, sizes: Sequence[int]) -> Tensor:
    """The set entries of each part of a bool tensor's last dimension (consecutive parts of ``sizes`` entries,
    none empty) as int64 ``[..., len(sizes)]``: a running sum read at each part's end, a few kernels whatever the
    number of parts, nothing read on the host."""
    ends = to_device(torch.tensor(np.cumsum(sizes) - 1, dtype=torch.long), flags.device)
    running = flags.cumsum(-1, dtype=torch.long).index_select(-1, ends)
    return running.diff(dim=-1, prepend=torch.zeros_like(running[..., :1]))


def active_counts(masks: Mapping[str, Tensor]) -> dict[str, int]:
    """Active entries per mask, read from the device in one transfer (one host synchronisation for all
    layers, not one per layer)."""
    if not masks:
        return {}
    return dict(zip(masks, count_active_together(masks).tolist()))


def density(masks: Mapping[str, Tensor], counts: Mapping[str, int] | None = None) -> float:
    """Share of active entries over all masked entries (``counts``: the masks' :func:`active_counts`,
    when already read)."""
    total = sum(m.numel() for m in masks.values())
    if total == 0:
        return 1.0
    return float(sum((active_counts(masks) if counts is None else counts).values())) / total


def sparsity(masks: Mapping[str, Tensor]) -> float:
    """Share of zeros over the masked set (DA-DPFL's s_k; see the papers' errata)."""
    return 1.0 - density(masks)


def count_active(masks: Mapping[str, Tensor]) -> int:
    """Number of active entries over all masks."""
    return sum(active_counts(masks).values())


class ModelMask:
    """Masks bound to a module's parameters and enforced by hooks.

    Args:
        module: the model whose parameters are masked.
        masks: initial masks by parameter name (boolean, on any device); each name must be a
            parameter of ``module`` with the same shape.

    The mask tensors live on the parameters' device and are updated in place
    (:meth:`load_`), so hooks stay valid when a new client's mask is loaded.
    """

    def __init__(self, module: nn.Module, masks: Mapping[str, Tensor]) -> None:
        params = dict(module.named_parameters())
        unknown = sorted(set(masks) - set(params))
        if unknown:
            raise ValueError(f"masks name parameters that the module does not have: {unknown}; "
                             f"the module has {sorted(params)}")
        self.module = module
        self.params: dict[str, nn.Parameter] = {name: params[name] for name in masks}
        self.masks: Masks = {}
        for name, mask in masks.items():
            if mask.shape != self.params[name].shape:
                raise ValueError(f"mask {name!r} has shape {tuple(mask.shape)}, "
                                 f"the parameter has {tuple(self.params[name].shape)}")
            self.masks[name] = mask.detach().to(device=self.params[name].device, dtype=torch.bool).clone()
        self._handles: list = []
        self._dense_gradients = False
        self._cast: dict[tuple[str, torch.dtype], Tensor] = {}

    def _as(self, name: str, dtype: torch.dtype) -> Tensor:
        """The mask as 0/1 of ``dtype`` (cached until the mask changes)."""
        key = (name, dtype)
        cached = self._cast.get(key)
        if cached is None:
            cached = self._cast[key] = self.masks[name].to(dtype)
        return cached

    def tensors(self) -> list[Tensor]:
        """Every tensor the hooks and :meth:`apply_` read: the masks and their cached casts."""
        return [*self.masks.values(), *self._cast.values()]

    # -- enforcement -------------------------------------------------------------------
    def attach(self) -> "ModelMask":
        """Register gradient hooks (inactive gradients are zeroed) and mask the weights."""
        if not self._handles:
            for name, param in self.params.items():
                self._handles.append(param.register_hook(self._grad_hook(name)))
        self.apply_()
        return self

    def detach(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _grad_hook(self, name: str) -> Callable[[Tensor], Tensor]:
        def hook(grad: Tensor) -> Tensor:
            if self._dense_gradients:
                return grad
            return grad * self._as(name, grad.dtype)

        return hook

    @contextmanager
    def dense_gradients(self) -> Iterator[None]:
        """Within this block gradients are not masked (RigL's regrowth scores)."""
        previous, self._dense_gradients = self._dense_gradients, True
        try:
            yield
        finally:
            self._dense_gradients = previous

    @torch.no_grad()
    def apply_(self) -> None:
        """Zero the inactive weights (call after every optimizer step): :func:`zero_inactive_all_` of every
        parameter."""
        zero_inactive_all_(list(self.params.values()), [self._as(n, p.dtype) for n, p in self.params.items()])

    def to(self, device: torch.device | str) -> "ModelMask":
        """Move the mask tensors to ``device`` (after the module was moved)."""
        self.masks = {name: mask.to(device) for name, mask in self.masks.items()}
        self._cast.clear()
        return self

    # -- state ---------------------------------------------------------------------------
    @torch.no_grad()
    def load_(self, masks: Mapping[str, Tensor], apply: bool = True) -> None:
        """Copy ``masks`` (on any device) into this mask in place; zero newly inactive weights if ``apply``.
        From a client store in pinned memory the copies run asynchronously, all done when this returns."""
        if set(masks) != set(self.masks):
            raise ValueError(f"expected masks for {sorted(self.masks)}, got {sorted(masks)}")
        copy_all_((self.masks[name], mask) for name, mask in masks.items())
        # the masks cast to the parameters' dtypes follow in one multi-tensor copy (0/1 exactly), not a cast each
        copy_all_((cast, self.masks[name]) for (name, _), cast in self._cast.items())
        if apply:
            self.apply_()

    def state(self) -> Masks:
        """A detached copy of the masks on the CPU."""
        return {name: mask.detach().cpu().clone() for name, mask in self.masks.items()}

    def density(self) -> float:
        return density(self.masks)

    def sparsity(self) -> float:
        return sparsity(self.masks)

    def num_active(self) -> int:
        return count_active(self.masks)

    def num_masked(self) -> int:
        return sum(m.numel() for m in self.masks.values())

    def __contains__(self, name: str) -> bool:
        return name in self.masks

    def __iter__(self) -> Iterator[str]:
        return iter(self.masks)

    def __len__(self) -> int:
        return len(self.masks)

    def __repr__(self) -> str:
        return f"ModelMask(layers={len(self.masks)}, density={self.density():.4f})"
