"""Per-client state kept off the worker, as one stacked tensor per parameter.

Every node (client, or the server of a centralized baseline) publishes one model per round: its
weights and the mask they were trained with. Readers within a round may need the model a node
published at the start of the round (a snapshot) or the one it publishes in this round (DA-DPFL's
reuse, PSFL's chains, FedAvg's server). The store therefore keeps two slots per node and a
per-node pointer to the current one: a task writes into the other slot, and the round's end flips
the pointers of the nodes that wrote. No model is copied at the round's end.

The node's *current mask* (the one it trains with next, after RigL) is kept separately from the
published mask, since aggregation multiplies the neighbours' average by the receiver's current mask
while each neighbour's model travels with the mask it was trained with (DisPFL Alg. 1, DA-DPFL Eq. 7).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.sparse.masks import Masks


@dataclass
class ClientState:
    """A plain, serializable view of one node: its published model, masks and extras."""

    weights: dict[str, Tensor]
    published_mask: Masks
    mask: Masks
    extras: dict[str, Any] = field(default_factory=dict)


class ClientStore:
    """Published models of ``num_nodes`` nodes sharing one architecture.

    Args:
        template: the worker's parameters and buffers by name (shapes and dtypes).
        masked_names: the names that carry a mask (a subset of ``template``).
        num_nodes: clients plus servers.
        device: where the stacked tensors live (CPU by default).
    """

    def __init__(self, template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int,
                 device: torch.device | str = "cpu") -> None:
        unknown = sorted(set(masked_names) - set(template))
        if unknown:
            raise ValueError(f"masked names not in the template: {unknown}")
        self.num_nodes = num_nodes
        self.device = torch.device(device)
        self.names = list(template)
        self.masked_names = list(masked_names)
        self.weights = {n: torch.zeros((2, num_nodes, *t.shape), dtype=t.dtype, device=self.device)
                        for n, t in template.items()}
        self.published_masks = {n: torch.ones((2, num_nodes, *template[n].shape), dtype=torch.bool,
                                              device=self.device) for n in masked_names}
        self.masks = {n: torch.ones((num_nodes, *template[n].shape), dtype=torch.bool, device=self.device)
                      for n in masked_names}
        self.slot = torch.zeros(num_nodes, dtype=torch.long)
        self.unmasked_size = sum(t.numel() for n, t in template.items() if n not in set(masked_names))
        # values each published model sends (active masked entries + unmasked entries), per slot
        self.active = torch.zeros((2, num_nodes), dtype=torch.long)
        self._written: set[int] = set()
        self.extras: list[dict[str, Any]] = [{} for _ in range(num_nodes)]

    # -- slots --------------------------------------------------------------------------
    def _slot(self, node: int, fresh: bool) -> int:
        current = int(self.slot[node])
        if not fresh:
            return current
        if node not in self._written:
            raise RuntimeError(f"node {node}'s model of this round was read before it was published")
        return 1 - current

    def end_round(self) -> None:
        """Make this round's published models the current ones."""
        for node in self._written:
            self.slot[node] = 1 - self.slot[node]
        self._written.clear()

    # -- writes -------------------------------------------------------------------------
    @torch.no_grad()
    def initialize(self, node: int, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None) -> None:
        """Set a node's current model and mask before the first round (no slot flip)."""
        slot = int(self.slot[node])
        for n in self.names:
            self.weights[n][slot, node].copy_(weights[n])
        for n in self.masked_names:
            m = mask[n] if mask is not None else torch.ones_like(self.masks[n][node])
            self.masks[n][node].copy_(m)
            self.published_masks[n][slot, node].copy_(m)
            self.weights[n][slot, node].mul_(m)
        self.active[slot, node] = self._count(mask)

    @torch.no_grad()
    def publish(self, node: int, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None) -> None:
        """Write the model ``node`` publishes in this round (weights and the mask trained with)."""
        if node in self._written:
            raise RuntimeError(f"node {node} published twice in one round")
        slot = 1 - int(self.slot[node])
        for n in self.names:
            self.weights[n][slot, node].copy_(weights[n])
        for n in self.masked_names:
            self.published_masks[n][slot, node].copy_(mask[n] if mask is not None else True)
        self.active[slot, node] = self._count(mask)
        self._written.add(node)

    def _count(self, mask: Mapping[str, Tensor] | None) -> int:
        if mask is None:
            return self.unmasked_size + self.masked_size()
        return self.unmasked_size + sum(int(mask[n].sum()) for n in self.masked_names)

    @torch.no_grad()
    def set_mask(self, node: int, mask: Mapping[str, Tensor]) -> None:
        """Set the mask ``node`` trains with next."""
        for n in self.masked_names:
            self.masks[n][node].copy_(mask[n])

    # -- reads --------------------------------------------------------------------------
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
        """Values a node's published model sends: active masked entries plus all unmasked entries."""
        return int(self.active[self._slot(node, fresh), node])

    def masked_size(self) -> int:
        """Entries under a mask (one bit each when a mask is sent)."""
        return sum(self.masks[n][0].numel() for n in self.masked_names)

    def state(self, node: int) -> ClientState:
        """A detached copy of one node's state (for checkpoints and inspection)."""
        weights, published_mask = self.published(node)
        return ClientState(
            weights={n: t.detach().cpu().clone() for n, t in weights.items()},
            published_mask={n: m.detach().cpu().clone() for n, m in published_mask.items()},
            mask={n: m.detach().cpu().clone() for n, m in self.mask(node).items()},
            extras=dict(self.extras[node]),
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything the store holds (for checkpoints); call between rounds."""
        if self._written:
            raise RuntimeError("the store can be saved between rounds only")
        return {"weights": self.weights, "published_masks": self.published_masks, "masks": self.masks,
                "slot": self.slot, "active": self.active, "extras": self.extras}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into this store (same nodes, names and shapes)."""
        for key in ("weights", "published_masks", "masks"):
            mine, theirs = getattr(self, key), state[key]
            if set(mine) != set(theirs) or any(mine[n].shape != theirs[n].shape for n in mine):
                raise ValueError(f"the checkpoint's {key} do not fit this store: it has "
                                 f"{ {n: tuple(t.shape) for n, t in theirs.items()} }, the store "
                                 f"{ {n: tuple(t.shape) for n, t in mine.items()} }")
            for n in mine:
                mine[n].copy_(theirs[n])
        self.slot.copy_(state["slot"])
        self.active.copy_(state["active"])
        self.extras = [dict(e) for e in state["extras"]]
        self._written.clear()

    def nbytes(self) -> int:
        """Memory held by the store's tensors."""
        tensors = [*self.weights.values(), *self.published_masks.values(), *self.masks.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
