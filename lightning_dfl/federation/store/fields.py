r"""Per-client values algorithms and callbacks declare (:class:`StateField`), and their storage.

Algorithms and callbacks keep per-client state in the store, as declared :class:`StateField`\ s (Ditto's
personal model, momentum buffers, a peer weight row, voting's Delta history): the store is the one place a
checkpoint (and a shard) needs, and callbacks keep no per-client state. Both stores keep these fields the
same way, in one :class:`DeclaredFields` each: one stacked tensor per field (per parameter for a ``like``
field), two slots per node for a published field (start of round and this round's, chosen by the store's
slot pointers), one for a private field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_dfl.sparse.masks import Masks
from lightning_dfl.state_field import StateField
from lightning_dfl.transfers import copy_all_

if TYPE_CHECKING:
    from lightning_dfl.federation.store.protocol import ClientStore

__all__ = ["OPTIMIZER_FIELD", "OPTIMIZER_STARTED", "ClientFields", "ClientState", "DeclaredFields", "StateField"]

#: the field of a kept optimizer state entry (``Algorithm.keep_optimizer_state``), and whether a client's optimizer
#: has started (its first task starts it fresh)
OPTIMIZER_FIELD = "optimizer/{}"
OPTIMIZER_STARTED = "optimizer/started"


@dataclass
class ClientState:
    """A plain, serializable copy of one node: its published model, masks and declared fields."""

    weights: dict[str, Tensor]
    published_mask: Masks
    mask: Masks
    extras: dict[str, Any] = field(default_factory=dict)


class DeclaredFields:
    """The declared fields of ``num_nodes`` nodes: ``tensors[name][part]`` is ``(2, nodes, ...)`` for a published
    field (indexed by slot, then node) and ``(nodes, ...)`` for a private one; ``part`` is a parameter's name for
    a ``like`` field, else ``""``. ``where``: the factory arguments of the tensors (device, pinned memory)."""

    def __init__(self, num_nodes: int, masked_names: list[str], where: Mapping[str, Any]) -> None:
        self.num_nodes = num_nodes
        self.masked_names = list(masked_names)
        self.where = dict(where)
        self.specs: dict[str, StateField] = {}
        self.tensors: dict[str, dict[str, Tensor]] = {}

    def declare(self, spec: StateField, template: Mapping[str, Tensor]) -> None:
        """Allocate a declared field for every node, filled with ``spec.fill``."""
        if spec.name in self.specs:
            raise ValueError(f"state field {spec.name!r} is declared twice")
        if spec.like == "weights":
            parts = {n: (tuple(t.shape), spec.dtype or t.dtype) for n, t in template.items() if t.is_floating_point()}
        elif spec.like == "mask":
            parts = {n: (tuple(template[n].shape), spec.dtype) for n in self.masked_names}
        else:
            parts = {"": (tuple(spec.shape), spec.dtype)}
        lead = (2, self.num_nodes) if spec.published else (self.num_nodes,)
        self.tensors[spec.name] = {part: torch.full((*lead, *shape), spec.fill, dtype=dtype, **self.where)
                                   for part, (shape, dtype) in parts.items()}
        self.specs[spec.name] = spec

    def parts(self, name: str) -> dict[str, Tensor]:
        if name not in self.tensors:
            raise KeyError(f"no state field {name!r}; declared: {sorted(self.tensors)}")
        return self.tensors[name]

    def is_published(self, name: str) -> bool:
        """Whether the declared field ``name`` is published (``KeyError`` if none is declared)."""
        self.parts(name)
        return self.specs[name].published

    def read(self, node: int, name: str, slot: int | None) -> Tensor | dict[str, Tensor]:
        """A view of ``node``'s field ``name`` (a published field's in ``slot``)."""
        parts = self.parts(name)
        spec = self.specs[name]
        if spec.published:
            views = {part: t[slot, node] for part, t in parts.items()}
        else:
            views = {part: t[node] for part, t in parts.items()}
        return views[""] if spec.like is None else views

    def write(self, node: int, name: str, value: Tensor | float | Mapping[str, Tensor]) -> None:
        """Set ``node``'s private field ``name``."""
        parts = self.parts(name)
        if self.specs[name].published:
            raise RuntimeError(f"field {name!r} is published: write it with publish(node, ..., fields={{...}})")
        self.copy_in(parts, node, None, value, name)

    def check_published(self, names: Mapping[str, Any]) -> None:
        """Refuse values for fields that are not published fields (undeclared names pass: they are refused
        where they are written)."""
        private = sorted(n for n in names if n in self.specs and not self.specs[n].published)
        if private:
            raise ValueError(f"fields {private} are not published fields; write them with write()")

    def publish(self, node: int, slot: int, current: int, values: Mapping[str, Any]) -> None:
        """Write ``node``'s published fields into ``slot``: those in ``values`` from them, the others copied
        from its ``current`` slot."""
        for name, spec in self.specs.items():
            if not spec.published:
                continue
            parts = self.tensors[name]
            if name in values:
                self.copy_in(parts, node, slot, values[name], name)
            else:
                for t in parts.values():
                    t[slot, node].copy_(t[current, node])

    @staticmethod
    def copy_in(parts: dict[str, Tensor], node: int, slot: int | None, value: Tensor | float | Mapping[str, Tensor],
                name: str) -> None:
        """Copy ``value`` (on any device) into ``node``'s entries of a field (its ``slot`` if published)."""
        if isinstance(value, Mapping):
            missing = sorted(set(parts) - set(value))
            if missing:
                raise ValueError(f"field {name!r}: no value for {missing}")
            copy_all_((t[node] if slot is None else t[slot, node], value[part]) for part, t in parts.items())
        else:
            if set(parts) != {""}:
                raise ValueError(f"field {name!r} holds one tensor per parameter: pass a dict")
            target = parts[""][node] if slot is None else parts[""][slot, node]
            copy_all_([(target, torch.as_tensor(value, dtype=target.dtype))])

    def views(self, node: int, slot: int) -> list[Tensor]:
        """Views of everything ``node``'s task writes: its published fields' ``slot``, its private fields."""
        return [t[slot, node] if spec.published else t[node]
                for name, spec in self.specs.items() for t in self.tensors[name].values()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.tensors.values() for t in parts.values())


class ClientFields:
    """One node's declared fields as a mapping: ``fields[name]`` reads a view, ``fields[name] = value``
    writes a private field (the duck-typed handle callbacks get from ``trainer.client_state(k)``)."""

    def __init__(self, store: ClientStore, node: int) -> None:
        self.store = store
        self.node = node

    def __getitem__(self, name: str) -> Tensor | dict[str, Tensor]:
        return self.store.read(self.node, name)

    def __setitem__(self, name: str, value: Tensor | float | Mapping[str, Tensor]) -> None:
        self.store.write(self.node, name, value)

    def __contains__(self, name: object) -> bool:
        return name in self.store.fields
