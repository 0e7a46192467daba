r"""Per-client state kept off the worker, as one stacked tensor per parameter.

Every node (client, or the server of a centralized baseline) publishes one model per round: its
weights and the mask they were trained with. Readers within a round may need the model a node
published at the start of the round (a snapshot) or the one it publishes in this round (DA-DPFL's
reuse, PSFL's chains, FedAvg's server). The store therefore keeps two slots per node and a
per-node pointer to the current one: a task writes into the other slot, and the round's end flips
the pointers of the nodes that wrote. No model is copied at the round's end.

The node's *current mask* (the one it trains with next, after RigL) is kept separately from the
published mask, since aggregation multiplies the neighbours' average by the receiver's current mask
while each neighbour's model travels with the mask it was trained with (DisPFL Alg. 1, DA-DPFL Eq. 7).

Algorithms and callbacks keep per-client state in the store too, as declared :class:`StateField`\ s
(Ditto's personal model, momentum buffers, a peer weight row, voting's Delta history): the store is
the one place a checkpoint (and later a shard) needs, and callbacks keep no per-client state.

This is the dense store (``FederatedTrainer(store="dense")``, the default);
:class:`~lightning_dfl.federation.compact_state.CompactClientStore` (``store="compact"``) has the
same API and results and keeps each node's active values plus packed mask bits.

The store lives on one device (``store.device``: the CPU, or the worker's GPU; see
:func:`~lightning_dfl.federation.store_memory.resolve_store_device`). Every tensor given to it (weights,
masks, field values, a checkpoint's tensors) may be on any device and is copied onto the store's where it
enters; what it hands out (views, rebuilt tensors) is on the store's device; its ``state_dict`` holds CPU
tensors. A CPU store serving a GPU worker may be pinned (``pin_memory``): its copies from and to the worker
then run asynchronously (:func:`~lightning_dfl.transfers.copy_all_`), each finished when the
store's method returns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.deferred import host_reads_are_cheap
from lightning_dfl.federation.compact_records import FORMAT as COMPACT_FORMAT
from lightning_dfl.federation.compact_records import dense_state_dict
from lightning_dfl.federation.plan import RoundPlan, Task
from lightning_dfl.sparse.masks import Masks, count_active_together, zero_inactive_
from lightning_dfl.transfers import copy_all_, to_device

# -- declared per-client fields ---------------------------------------------------------------


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
            written with :meth:`ClientStore.publish`); else private to the node.
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


@dataclass
class ClientState:
    """A plain, serializable copy of one node: its published model, masks and declared fields."""

    weights: dict[str, Tensor]
    published_mask: Masks
    mask: Masks
    extras: dict[str, Any] = field(default_factory=dict)


class StartReads:
    """The reads of start-of-round models a plan has still to make, so that a store can free a node's
    start-of-round model once it holds the node's new one and no task will read the old one again
    (:meth:`ClientStore.release_start`).

    A node's start-of-round model is read by every task that lists it as a non-fresh source (when the
    task starts: its messages) and by the node's own task (the model it starts from, and falls back to
    when its update is non-finite: until the task ends). ``release(node)`` is called when the last of
    these reads has been made; the store's :meth:`ClientStore.task_started` and
    :meth:`ClientStore.task_finished` report them.
    Nodes without a task keep their one model and are never released.
    """

    def __init__(self, plan: RoundPlan, release: Callable[[int], None]) -> None:
        self.release = release
        self.pending: Counter[int] = Counter()
        for task in plan.tasks:
            self.pending[task.node] += 1
            for node in self._others(task):
                self.pending[node] += 1

    @staticmethod
    def _others(task: Task) -> list[int]:
        return [s.node for s in task.sources if not s.fresh and s.node != task.node]

    def _read(self, node: int) -> None:
        self.pending[node] -= 1
        if self.pending[node] == 0:
            self.release(node)

    def started(self, task: Task) -> None:
        """``task`` has read its sources (its messages are built)."""
        for node in self._others(task):
            self._read(node)

    def finished(self, task: Task) -> None:
        """``task`` has ended (its node has published)."""
        self._read(task.node)


class ClientStore:
    """Published models of ``num_nodes`` nodes sharing one architecture.

    Args:
        template: the worker's parameters and buffers by name (shapes and dtypes).
        masked_names: the names that carry a mask (a subset of ``template``).
        num_nodes: clients plus servers.
        device: where the stacked tensors live (CPU by default).
        fields: per-node values declared by the algorithm and the callbacks.
        pin_memory: a CPU store's tensors are allocated in pinned memory (for a GPU worker: asynchronous
            copies); ignored on another device.
    """

    def __init__(self, template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int,
                 device: torch.device | str = "cpu", fields: Iterable[StateField] = (),
                 pin_memory: bool = False) -> None:
        self._init_layout(template, masked_names, num_nodes, device, pin_memory)
        where = self._where()
        self.weights = {n: torch.zeros((2, num_nodes, *t.shape), dtype=t.dtype, **where) for n, t in template.items()}
        self.published_masks = {n: torch.ones((2, num_nodes, *template[n].shape), dtype=torch.bool, **where)
                                for n in masked_names}
        self.masks = {n: torch.ones((num_nodes, *template[n].shape), dtype=torch.bool, **where) for n in masked_names}
        self.slot = torch.zeros(num_nodes, dtype=torch.long)
        self.unmasked_size = sum(t.numel() for n, t in template.items() if n not in set(masked_names))
        # values each published model sends (active masked entries + unmasked entries), per slot (:attr:`active`)
        self._active = torch.zeros((2, num_nodes), dtype=torch.long)
        self._written: set[int] = set()
        self.field_specs: dict[str, StateField] = {}
        self.fields: dict[str, dict[str, Tensor]] = {}
        for spec in fields:
            self.declare(spec, template)

    def _init_layout(self, template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int,
                     device: torch.device | str, pin_memory: bool = False) -> None:
        """The names, nodes and device every store backend has (the masked names checked)."""
        self._reads: StartReads | None = None  # the running plan's reads of start-of-round models
        self._pending: dict[tuple[int, int], Tensor] = {}  # value counts still on an accelerator, by (slot, node)
        unknown = sorted(set(masked_names) - set(template))
        if unknown:
            raise ValueError(f"masked names not in the template: {unknown}")
        self.num_nodes = num_nodes
        self.device = torch.device(device)
        #: whether the store's preallocated tensors are in pinned host memory
        self.pin_memory = bool(pin_memory) and self.device.type == "cpu"
        self.names = list(template)
        self.masked_names = list(masked_names)

    def _where(self) -> dict[str, Any]:
        """The factory arguments of the store's preallocated tensors: its device, pinned if asked."""
        return {"device": self.device, "pin_memory": True} if self.pin_memory else {"device": self.device}

    def _cpu(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` for a checkpoint: themselves on the CPU, else copied to it."""
        if self.device.type == "cpu":
            return dict(tensors)
        return {n: t.cpu() for n, t in tensors.items()}

    # -- declared fields ----------------------------------------------------------------
    def declare(self, spec: StateField, template: Mapping[str, Tensor]) -> None:
        """Allocate a declared field for every node, filled with ``spec.fill``."""
        if spec.name in self.field_specs:
            raise ValueError(f"state field {spec.name!r} is declared twice")
        if spec.like == "weights":
            parts = {n: (tuple(t.shape), spec.dtype or t.dtype) for n, t in template.items() if t.is_floating_point()}
        elif spec.like == "mask":
            parts = {n: (tuple(template[n].shape), spec.dtype) for n in self.masked_names}
        else:
            parts = {"": (tuple(spec.shape), spec.dtype)}
        lead = (2, self.num_nodes) if spec.published else (self.num_nodes,)
        self.fields[spec.name] = {part: torch.full((*lead, *shape), spec.fill, dtype=dtype, **self._where())
                                  for part, (shape, dtype) in parts.items()}
        self.field_specs[spec.name] = spec

    def _field(self, name: str) -> dict[str, Tensor]:
        if name not in self.fields:
            raise KeyError(f"no state field {name!r}; declared: {sorted(self.fields)}")
        return self.fields[name]

    def read(self, node: int, name: str, fresh: bool = False) -> Tensor | dict[str, Tensor]:
        """A view of ``node``'s field ``name`` (a tensor, or a dict by parameter for ``like`` fields);
        a published field reads the start-of-round value, or this round's if ``fresh``."""
        spec, parts = self.field_specs.get(name), self._field(name)
        if spec.published:
            slot = self._slot(node, fresh)
            views = {part: t[slot, node] for part, t in parts.items()}
        else:
            views = {part: t[node] for part, t in parts.items()}
        return views[""] if spec.like is None else views

    @torch.no_grad()
    def write(self, node: int, name: str, value: Tensor | float | Mapping[str, Tensor]) -> None:
        """Set ``node``'s private field ``name`` (published fields are written by :meth:`publish`)."""
        spec, parts = self.field_specs.get(name), self._field(name)
        if spec.published:
            raise RuntimeError(f"field {name!r} is published: write it with publish(node, ..., fields={{...}})")
        self._copy_parts(parts, node, None, value, name)

    def _copy_parts(self, parts: dict[str, Tensor], node: int, slot: int | None,
                    value: Tensor | float | Mapping[str, Tensor], name: str) -> None:
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

    # -- slots --------------------------------------------------------------------------
    def _slot(self, node: int, fresh: bool) -> int:
        current = int(self.slot[node])
        if not fresh:
            return current
        if node not in self._written:
            raise RuntimeError(f"node {node}'s model of this round was read before it was published")
        return 1 - current

    def release_start(self, node: int) -> None:
        """Say that ``node``'s start-of-round model will not be read again in this round (called through
        :meth:`begin_round`'s tracking). The dense store keeps its two slots anyway; the compact store
        frees the record."""

    def begin_round(self, plan: RoundPlan | None) -> None:
        """A plan starts: with ``plan`` the store follows its reads of start-of-round models
        (:class:`StartReads`) and calls :meth:`release_start` for each node once no task will read its
        start-of-round model again; ``None`` (an algorithm that reads models other than its plan's
        sources, see :attr:`~lightning_dfl.federation.algorithms.base.Algorithm.reads_only_sources`):
        nothing is released."""
        self._reads = StartReads(plan, self.release_start) if plan is not None else None

    def task_started(self, task: Task) -> None:
        """``task`` has read its sources (its messages are built)."""
        if self._reads is not None:
            self._reads.started(task)

    def task_finished(self, task: Task) -> None:
        """``task`` has ended (its node has published, or it was contained)."""
        if self._reads is not None:
            self._reads.finished(task)

    def end_round(self) -> None:
        """Make this round's published models the current ones (their value counts read, all at once)."""
        self._reads = None
        self._read_pending()
        for node in self._written:
            self.slot[node] = 1 - self.slot[node]
        self._written.clear()

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

    def _check_publish(self, node: int, fields: Mapping[str, Any] | None) -> dict[str, Any]:
        if node in self._written:
            raise RuntimeError(f"node {node} published twice in one round")
        fields = dict(fields or {})
        private = sorted(n for n in fields if not self.field_specs.get(n, StateField(n, published=True)).published)
        if private:
            raise ValueError(f"fields {private} are not published fields; write them with write()")
        return fields

    def _publish_fields(self, node: int, fields: Mapping[str, Any]) -> None:
        """Write ``node``'s published fields into its other slot (those not given keep their value) and
        mark it written."""
        current = int(self.slot[node])
        slot = 1 - current
        for name, spec in self.field_specs.items():
            if not spec.published:
                continue
            parts = self.fields[name]
            if name in fields:
                self._copy_parts(parts, node, slot, fields[name], name)
            else:
                for t in parts.values():
                    t[slot, node].copy_(t[current, node])
        self._written.add(node)

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
        share a federation (:mod:`~lightning_dfl.federation.sharding`) copy these from the task's owner."""
        slot = 1 - int(self.slot[node])
        views = [self.weights[n][slot, node] for n in self.names]
        views += [self.published_masks[n][slot, node] for n in self.masked_names]
        views += [self.active[slot:slot + 1, node], *(self.masks[n][node] for n in self.masked_names)]
        for name, spec in self.field_specs.items():
            views += [t[slot, node] if spec.published else t[node] for t in self.fields[name].values()]
        return views

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

    def state(self, node: int) -> ClientState:
        """A detached copy of one node's state (for checkpoints and inspection)."""
        weights, published_mask = self.published(node)

        def copy(value: Tensor | dict[str, Tensor]) -> Tensor | dict[str, Tensor]:
            if isinstance(value, dict):
                return {n: t.detach().cpu().clone() for n, t in value.items()}
            return value.detach().cpu().clone()

        return ClientState(
            weights=copy(weights),
            published_mask=copy(published_mask),
            mask=copy(self.mask(node)),
            extras={name: copy(self.read(node, name)) for name in self.fields},
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything the store holds, on the CPU (for checkpoints: the store's own tensors on a CPU, copies
        from another device); call between rounds."""
        if self._written:
            raise RuntimeError("the store can be saved between rounds only")
        return {"weights": self._cpu(self.weights), "published_masks": self._cpu(self.published_masks),
                "masks": self._cpu(self.masks), "slot": self.slot, "active": self.active,
                "fields": {name: self._cpu(parts) for name, parts in self.fields.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into this store (same nodes, names, fields and shapes); a
        compact store's (:class:`~lightning_dfl.federation.compact_state.CompactClientStore`) is expanded."""
        if state.get("format") == COMPACT_FORMAT:
            state = dense_state_dict(state, self)
        pairs = [(key, getattr(self, key), state[key]) for key in ("weights", "published_masks", "masks")]
        pairs += self._field_pairs(state)
        self._check_pairs(pairs)
        copy_all_((mine[n], theirs[n]) for _, mine, theirs in pairs for n in mine)  # from any device
        self.slot.copy_(state["slot"])
        self._pending.clear()
        self._active.copy_(state["active"])
        self._written.clear()

    def _field_pairs(self, state: Mapping[str, Any]) -> list[tuple[str, dict[str, Tensor], Mapping[str, Tensor]]]:
        theirs_fields = state.get("fields", {})
        if set(theirs_fields) != set(self.fields):
            raise ValueError(f"the checkpoint's state fields {sorted(theirs_fields)} differ from this run's "
                             f"{sorted(self.fields)}")
        return [(f"field {name!r}", self.fields[name], theirs_fields[name]) for name in self.fields]

    @staticmethod
    def _check_pairs(pairs: list[tuple[str, dict[str, Tensor], Mapping[str, Tensor]]]) -> None:
        for key, mine, theirs in pairs:
            if set(mine) != set(theirs) or any(mine[n].shape != theirs[n].shape for n in mine):
                raise ValueError(f"the checkpoint's {key} do not fit this store: it has "
                                 f"{ {n: tuple(t.shape) for n, t in theirs.items()} }, the store "
                                 f"{ {n: tuple(t.shape) for n, t in mine.items()} }")

    def nbytes(self) -> int:
        """Memory held by the store's tensors."""
        tensors = [*self.weights.values(), *self.published_masks.values(), *self.masks.values()]
        tensors += [t for parts in self.fields.values() for t in parts.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


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
