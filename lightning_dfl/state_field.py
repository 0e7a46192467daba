"""``StateField``: a per-node value an algorithm or a callback declares, to be kept in the client store.

Below every layer that declares one: algorithms (``Algorithm.state_fields``) and callbacks
(``client_state_fields``) build them without importing the federation; the store
(:mod:`lightning_dfl.federation.store.fields`) keeps them; a plain ``Trainer``'s callback keeps its one
client's record as tensors built from the same declarations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StateField"]


@dataclass(frozen=True)
class StateField:
    """A per-node value an algorithm or a callback declares; it lives in the store.

    Args:
        name: unique key, by convention ``"<owner>/<what>"`` (``"ditto/personal"``, ``"voting/delta_first"``).
        shape: the value's shape per node (``()`` for a scalar); ignored when ``like`` is set.
        dtype: its dtype (``None`` with ``like="weights"``: each parameter's own dtype).
        fill: the initial value of every entry (``float("nan")`` marks "not set yet").
        like: ``"weights"``: one tensor per model entry with the weights' shapes (a personal model,
            momentum buffers, tracking variables); ``"mask"``: one per masked parameter (a mask
            history, initial masks); ``None``: a single tensor of ``shape``.
        published: neighbours read it like the model (two slots: start of round and this round's,
            written with the store's ``publish``);
            else private to the node.
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = torch.float32
    fill: float = 0.0
    like: str | None = None
    published: bool = False

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a state field needs a non-empty name, got {self.name!r}")
        if self.like not in (None, "weights", "mask"):
            raise ValueError(f"field {self.name!r}: like must be None, 'weights' or 'mask', got {self.like!r}")
        if self.like is None and self.dtype is None:
            raise ValueError(f"field {self.name!r}: a dtype is needed unless like='weights'")
