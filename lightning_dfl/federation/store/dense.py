r"""The dense client store (``FederatedTrainer(store="dense")``, the default): one stacked tensor per parameter.

Every node publishes one model per round: its weights and the mask they were trained with. Readers within a
round may need the model a node published at the start of the round or the one it publishes in this round.
:class:`DenseClientStore` therefore keeps two slots per node and a per-node pointer to the current one
(:attr:`~lightning_dfl.federation.store.protocol.ClientStore.slot`): a task writes into the other slot, and
the round's end flips the pointers of the nodes that wrote. No model is copied at the round's end.

The node's *current mask* (the one it trains with next, after RigL) is kept separately from the
published mask, since aggregation multiplies the neighbours' average by the receiver's current mask
while each neighbour's model travels with the mask it was trained with (DisPFL Alg. 1, DA-DPFL Eq. 7).

What both stores share (the declared fields, the slots, the checks) is
:class:`~lightning_dfl.federation.store.protocol.ClientStore`'s;
:class:`~lightning_dfl.federation.store.compact.CompactClientStore` (``store="compact"``) has the same API
and results and keeps each node's active values plus packed mask bits. A compact store's checkpoint is
expanded for a dense store by :func:`~lightning_dfl.federation.store.factory.load_store_state`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.deferred import host_reads_are_cheap
from lightning_dfl.federation.store.fields import StateField
from lightning_dfl.federation.store.protocol import ClientStore
from lightning_dfl.federation.store.saved_state import (
    INT_DTYPES,
    SavedStateError,
    StoreLayout,
    check_fields,
    check_slots,
    named,
    tensor_of,
)
from lightning_dfl.sparse.masks import Masks, count_active_together, zero_inactive_
from lightning_dfl.transfers import copy_all_, to_device

__all__ = ["DenseClientStore"]


class DenseClientStore(ClientStore):
    """Published models of ``num_nodes`` nodes in two dense slots each, current masks as bool tensors
    (:class:`~lightning_dfl.federation.store.protocol.ClientStore`'s arguments)."""

    def __init__(self, template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int,
                 device: torch.device | str = "cpu", fields: Iterable[StateField] = (),
                 pin_memory: bool = False) -> None:
        super().__init__(template, masked_names, num_nodes, device, fields, pin_memory)
        where = self._where()
        self.weights = {n: torch.zeros((2, num_nodes, *t.shape), dtype=t.dtype, **where) for n, t in template.items()}
        self.published_masks = {n: torch.ones((2, num_nodes, *template[n].shape), dtype=torch.bool, **where)
                                for n in masked_names}
        self.masks = {n: torch.ones((num_nodes, *template[n].shape), dtype=torch.bool, **where) for n in masked_names}
        self.unmasked_size = sum(t.numel() for n, t in template.items() if n not in set(masked_names))
        # values each published model sends (active masked entries + unmasked entries), per slot (:attr:`active`)
        self._active = torch.zeros((2, num_nodes), dtype=torch.long)
        self._pending: dict[tuple[int, int], Tensor] = {}  # value counts still on an accelerator, by (slot, node)

    # -- the round ------------------------------------------------------------------------
    def release_start(self, node: int) -> None:
        """The dense store keeps its two slots: nothing is freed."""

    def _commit_round(self) -> None:
        """The value counts still on an accelerator are read, all at once; the slot flip makes the rest."""
        self._read_pending()

    # -- writes -------------------------------------------------------------------------
    @torch.no_grad()
    def initialize(self, node: int, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None) -> None:
        """Set a node's current model and mask before the first round (no slot flip)."""
        slot = int(self.slot[node])
        pairs = [(self.weights[n][slot, node], weights[n]) for n in self.names]
        if mask is not None:
            pairs += [(self.masks[n][node], mask[n]) for n in self.masked_names]
        else:
            for n in self.masked_names:
                self.masks[n][node].fill_(True)
        copy_all_(pairs)
        for n in self.masked_names:  # the mask now on the store's device
            self.published_masks[n][slot, node].copy_(self.masks[n][node])
            zero_inactive_(self.weights[n][slot, node], self.masks[n][node])
        self._set_active(slot, node, mask)

    @torch.no_grad()
    def publish(self, node: int, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None,
                fields: Mapping[str, Tensor | float | Mapping[str, Tensor]] | None = None) -> None:
        """Write the model ``node`` publishes in this round (weights and the mask trained with) and
        its published fields (those not given keep their start-of-round value)."""
        fields = self._check_publish(node, fields)
        current = int(self.slot[node])
        slot = 1 - current
        pairs = [(self.weights[n][slot, node], weights[n]) for n in self.names]
        if mask is not None:
            pairs += [(self.published_masks[n][slot, node], mask[n]) for n in self.masked_names]
        else:
            for n in self.masked_names:
                self.published_masks[n][slot, node].fill_(True)
        copy_all_(pairs)
        self._set_active(slot, node, mask)
        self._publish_fields(node, fields)

    @property
    def active(self) -> Tensor:
        """Values each published model sends (active masked entries plus unmasked entries), ``(2, nodes)`` int64
        on the host by slot; counts still on an accelerator are read first, all at once."""
        self._read_pending()
        return self._active

    def _set_active(self, slot: int, node: int, mask: Mapping[str, Tensor] | None) -> None:
        """Count the values of the model in ``slot`` of ``node``: on an accelerator kept there, not read, until
        :attr:`active` is read (at the latest at :meth:`end_round`: once for every model of the round)."""
        self._pending.pop((slot, node), None)
        if mask is None or not self.masked_names:
            self._active[slot, node] = self.unmasked_size + self.masked_size()
            return
        count = count_active_together({n: mask[n] for n in self.masked_names}).sum() + self.unmasked_size
        if host_reads_are_cheap(count.device):
            self._active[slot, node] = int(count)
        else:
            self._pending[slot, node] = count

    def _read_pending(self) -> None:
        if not self._pending:
            return
        keys, counts = list(self._pending), list(self._pending.values())
        device = counts[0].device
        values = torch.stack([c.to(device) for c in counts]).tolist()  # one read
        for (slot, node), value in zip(keys, values):
            self._active[slot, node] = value
        self._pending.clear()

    def task_views(self, node: int) -> list[Tensor]:
        """Views of everything ``node``'s task writes this round: the slot it publishes into (weights,
        mask, value count, published fields), its current mask and its private fields. Processes that
        share a federation (:mod:`~lightning_dfl.federation.loop.sharded`) copy these from the task's owner."""
        slot = 1 - int(self.slot[node])
        views = [self.weights[n][slot, node] for n in self.names]
        views += [self.published_masks[n][slot, node] for n in self.masked_names]
        views += [self.active[slot:slot + 1, node], *(self.masks[n][node] for n in self.masked_names)]
        return views + self._field_views(node)

    def mark_published(self, node: int) -> None:
        """Record that ``node`` published this round (its views were copied from another process)."""
        self._written.add(node)

    @torch.no_grad()
    def set_mask(self, node: int, mask: Mapping[str, Tensor]) -> None:
        """Set the mask ``node`` trains with next."""
        copy_all_((self.masks[n][node], mask[n]) for n in self.masked_names)

    # -- reads --------------------------------------------------------------------------
    def column_blocks(self, nodes: Sequence[int], name: str, mask: bool, step: int) -> Iterator[tuple[int, Tensor]]:
        """The nodes' current published ``name`` (its mask when ``mask``), flattened, in column blocks of ``step``
        entries: ``(start, block)`` with ``block`` a ``(len(nodes), width)`` copy, so that readers of many nodes
        (the diagnostics) never hold every node's whole model at once. Both stores give the same blocks."""
        flat = (self.published_masks if mask else self.weights)[name].reshape(2 * self.num_nodes, -1)
        index = torch.as_tensor(list(nodes), dtype=torch.long)
        rows = to_device(self.slot[index] * self.num_nodes + index, self.device)
        for start in range(0, flat.shape[1], step):
            yield start, flat[:, start:start + step].index_select(0, rows)

    def mask(self, node: int) -> Masks:
        return {n: self.masks[n][node] for n in self.masked_names}

    def published(self, node: int, fresh: bool = False) -> tuple[dict[str, Tensor], Masks]:
        """Views of a node's published weights and mask (start of round, or this round's if ``fresh``)."""
        slot = self._slot(node, fresh)
        return ({n: self.weights[n][slot, node] for n in self.names},
                {n: self.published_masks[n][slot, node] for n in self.masked_names})

    def gather(self, sources: list[tuple[int, bool]]) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]]]:
        """Views of several ``(node, fresh)`` sources' weights and published masks, by name."""
        slots = [(self._slot(node, fresh), node) for node, fresh in sources]
        return ({n: [t[s, k] for s, k in slots] for n, t in self.weights.items()},
                {n: [t[s, k] for s, k in slots] for n, t in self.published_masks.items()})

    def active_values(self, node: int, fresh: bool = False) -> int:
        """Values a node's published model sends: active masked entries plus all unmasked entries (a model
        published this round whose count is still on the accelerator is read now; the others are not)."""
        slot = self._slot(node, fresh)
        if (slot, node) in self._pending:
            self._read_pending()
        return int(self._active[slot, node])

    def masked_size(self) -> int:
        """Entries under a mask (one bit each when a mask is sent)."""
        return sum(self.masks[n][0].numel() for n in self.masked_names)

    def state_dict(self) -> dict[str, Any]:
        """Everything the store holds, on the CPU (for checkpoints: the store's own tensors on a CPU, copies
        from another device); call between rounds."""
        self._check_between_rounds()
        return {"weights": self._cpu(self.weights), "published_masks": self._cpu(self.published_masks),
                "masks": self._cpu(self.masks), "slot": self.slot, "active": self.active,
                "fields": {name: self._cpu(parts) for name, parts in self.fields.items()}}

    @staticmethod
    def check_saved_state(saved: Mapping[str, Any], layout: StoreLayout) -> None:
        """Refuse a dense store's saved state (:meth:`state_dict`'s, no ``format``) that cannot load into a store
        of ``layout`` with one :class:`~lightning_dfl.federation.store.saved_state.SavedStateError`: a missing
        part, parameter names, node count, shapes or dtypes that differ, slots or fields that do not fit. Nothing
        is loaded; the values themselves are checked elsewhere."""
        keys = ("weights", "published_masks", "masks", "slot", "active", "fields")
        lacking = [k for k in keys if k not in saved]
        if lacking:
            raise SavedStateError(f"its store has no {lacking} (it holds {sorted(map(str, saved))}): neither a dense "
                                  "store nor a compact one (format 'compact')")
        n_nodes = layout.num_nodes
        for key, names, lead, dtype in (("weights", list(layout.shapes), (2, n_nodes), None),
                                        ("published_masks", layout.masked_names, (2, n_nodes), torch.bool),
                                        ("masks", layout.masked_names, (n_nodes,), torch.bool)):
            theirs = named(saved[key], f"its store's {key}", names)
            for n in names:
                nodes = getattr(theirs[n], "shape", ())[len(lead) - 1:len(lead)]
                if nodes and nodes[0] != n_nodes:
                    raise SavedStateError(f"its store's {key} {n!r} hold {nodes[0]} nodes, this run has {n_nodes} "
                                          "(clients plus servers)")
                tensor_of(theirs[n], f"its store's {key} {n!r}", (*lead, *layout.shapes[n]),
                          (dtype or layout.dtypes[n],))
        check_slots(saved["slot"], n_nodes)
        tensor_of(saved["active"], "its store's active counts", (2, n_nodes), INT_DTYPES)
        check_fields(saved, layout)

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into this store (same nodes, names, fields and shapes); a compact
        store's is expanded by :func:`~lightning_dfl.federation.store.factory.load_store_state`."""
        if "weights" not in state:
            raise ValueError(f"a dense store loads a dense store's state (weights, masks, slots); this one holds "
                             f"{sorted(state)} (a compact store's: load it with store.factory.load_store_state)")
        pairs = [(key, getattr(self, key), state[key]) for key in ("weights", "published_masks", "masks")]
        pairs += self._field_pairs(state)
        self._check_pairs(pairs)
        copy_all_((mine[n], theirs[n]) for _, mine, theirs in pairs for n in mine)  # from any device
        self.slot.copy_(state["slot"])
        self._pending.clear()
        self._active.copy_(state["active"])
        self._written.clear()

    def nbytes(self) -> int:
        """Memory held by the store's tensors."""
        tensors = [*self.weights.values(), *self.published_masks.values(), *self.masks.values()]
        return sum(t.numel() * t.element_size() for t in tensors) + self._fields.nbytes()
