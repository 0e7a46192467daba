"""The mask a sparse-training callback works on: the module's own, or one the callback owns.

lightning-dfl's modules carry a :class:`~lightning_dfl.sparse.masks.ModelMask` as
``pl_module.mask``; the callback then changes that mask and the module enforces it. A foreign
``LightningModule`` has none: the callback builds one at ``setup("fit")``, attaches its gradient
hooks, re-masks the weights after every optimizer step, follows the module to its device and
saves the mask in its checkpoint state. :class:`MaskOwner` is that bookkeeping, shared by the
sparse-training callbacks (:class:`~lightning_dfl.callbacks.rigl.RigL`,
:class:`~lightning_dfl.callbacks.pqi.PQIPruning`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_dfl.sparse.masks import Masks, ModelMask


def module_mask(pl_module: Any) -> ModelMask | None:
    """``pl_module.mask`` when it is a :class:`ModelMask`, else None."""
    mask = getattr(pl_module, "mask", None)
    return mask if isinstance(mask, ModelMask) else None


def federated_mask(pl_module: Any, owner: str) -> ModelMask:
    """``pl_module.mask``, which a callback needs in a federation so that each client's mask
    travels with its state; a clear error names ``owner`` when the module has none."""
    mask = module_mask(pl_module)
    if mask is None:
        raise RuntimeError(
            f"{owner} in a federation needs the module's own ModelMask (`pl_module.mask`), so that each "
            f"client's mask travels with its state; {type(pl_module).__name__} has none")
    return mask


class MaskOwner:
    """Finds the module's mask or owns one for a foreign module.

    Args:
        owner: the callback's name, for error messages.
        error: the exception :meth:`setup` raises when the module has no Conv/Linear weight.
    """

    def __init__(self, owner: str, error: type[Exception] = ValueError) -> None:
        self.owner = owner
        self.error = error
        self.own: ModelMask | None = None  # only when the module brings no mask
        self.pending: Masks | None = None  # restored before the mask was built

    @property
    def owns_mask(self) -> bool:
        return self.own is not None

    def get(self, pl_module: Any) -> ModelMask:
        """The module's mask, else the one built for this module in :meth:`setup`."""
        mask = module_mask(pl_module)
        if mask is not None:
            return mask
        if self.own is None or self.own.module is not pl_module:
            raise RuntimeError(f"{self.owner} has no mask for this module: it brings no `mask` (ModelMask) "
                               "and the callback's own mask is built in `setup('fit')`")
        return self.own

    def setup(self, pl_module: Any, build: Callable[[], Masks]) -> None:
        """Build (or re-attach, or restore) the callback's mask unless the module has its own."""
        if module_mask(pl_module) is not None:
            return
        if self.own is not None and self.own.module is pl_module:
            self.own.attach()
            return
        if self.pending is not None:
            masks, self.pending = self.pending, None
        else:
            masks = build()
        if not masks:
            raise self.error(f"{self.owner} found no Conv/Linear weights to mask in {type(pl_module).__name__}")
        self.own = ModelMask(pl_module, masks).attach()

    def follow_device(self, pl_module: Any) -> None:
        """Rebuild the owned mask on the parameters' device (the strategy moves the module after setup)."""
        own = self.own
        if own is not None and any(own.masks[n].device != p.device for n, p in own.params.items()):
            own.detach()
            self.own = ModelMask(pl_module, own.masks).attach()

    def apply_(self) -> None:
        """Re-mask the weights with the owned mask (after an optimizer step); no-op otherwise."""
        if self.own is not None:
            self.own.apply_()

    def teardown(self) -> None:
        if self.own is not None:
            self.own.detach()

    def state(self) -> Masks | None:
        """A CPU copy of the owned mask, or None when the module owns its mask."""
        return self.own.state() if self.own is not None else None

    def load_state(self, masks: Masks | None) -> None:
        """Restore an owned mask now, or when it is built at ``setup``."""
        if masks is None:
            return
        if self.own is not None:
            self.own.load_(masks, apply=True)
        else:
            self.pending = {name: m.clone() for name, m in masks.items()}
