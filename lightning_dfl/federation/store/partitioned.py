"""A client store split across processes: each process holds only the nodes it owns, plus what it receives.

With a federation sharded across ``N`` processes (:mod:`~lightning_dfl.federation.loop.ownership`: node ``k`` is
owned by process ``k mod N``), :class:`PartitionedStore` keeps on each process a local store (dense or compact)
of its own nodes only (node ``k`` in local row ``k // N``): their published models in both slots, current masks,
published and private fields. What a process's tasks read of other nodes arrives before a plan level runs, from
the owners, point to point (:meth:`PartitionedStore.receive`: ``torch.distributed`` send/recv over the run's
gloo group, or the default group for an accelerator's store): each route of
:func:`~lightning_dfl.federation.exchange.routing.level_routes` carries one published record (weights and the
mask trained with, in the owner's store format: a compact store's active values, packed mask bits and zero
signs as kept; the value count and the published fields) into this process's *inbox*, kept until the model it
holds is no longer current (its start-of-round model released after its last reader, or the round's end), or
until the executor frees it (:meth:`PartitionedStore.keep_only`: the trainer's ``tasks_per_receive``).
Nothing else moves during a round.

Every process runs the same set-up, so each initializes and writes only its own nodes (what it would write for
another node, its owner writes the same). Reads of other nodes outside the tasks are collectives that every
process calls in the same order: :meth:`~PartitionedStore.fetch` (the shared model's sources),
:meth:`~PartitionedStore.column_blocks` (the diagnostics), :meth:`~PartitionedStore.state_dict` (a checkpoint:
one file, in the one-process format, gathered on process 0) and :meth:`~PartitionedStore.gather_nodes`
(per-node values, as the final density). A checkpoint loads into any number of processes: each keeps its rows.
Any other read of a node this process does not hold is refused, naming the node and its owner.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dfl.federation.store.compact import CompactClientStore
from lightning_dfl.federation.store.fields import ClientState, StateField
from lightning_dfl.federation.store.protocol import ClientStore, gather_published
from lightning_dfl.federation.store.saved_state import StoreLayout
from lightning_dfl.sparse.masks import Masks

__all__ = ["PartitionedStore", "Received", "node_rows", "interleave_rows"]

T = TypeVar("T")


@dataclass
class Received:
    """A published record received from its owner: weights and published mask by name (views into the message
    buffers) or, from a compact store, its record as kept; its value count and its published fields (a tensor, or
    a dict by parameter)."""

    weights: dict[str, Tensor]
    mask: dict[str, Tensor]
    active: int
    fields: dict[str, Tensor | dict[str, Tensor]]
    #: a compact owner's record as it keeps it (``weights`` and ``mask`` are then empty: rebuilt on read)
    record: dict[str, Any] | None = None

    def nbytes(self) -> int:
        tensors = [*self.weights.values(), *self.mask.values()]
        if self.record is not None:
            tensors += [t for part in ("values", "bits", "neg") for t in self.record[part].values()]
        for value in self.fields.values():
            tensors += list(value.values()) if isinstance(value, dict) else [value]
        return sum(t.numel() * t.element_size() for t in tensors)


# -- a saved store's rows: which axis of each part holds the nodes ------------------------------------------------
def _node_axes(state: Mapping[str, Any]) -> dict[str, int]:
    """The axis of the nodes in each part of a saved store (``state_dict()`` of either backend) but its fields
    (axis 1 of a published field's tensors, 0 of a private one's)."""
    if state.get("format") == "compact":
        return {"records": 0, "current_bits": 0, "slot": 0}
    return {"weights": 1, "published_masks": 1, "masks": 0, "slot": 0, "active": 1}


def _select(value: Any, axis: int, rows: Any) -> Any:
    if isinstance(value, dict):
        return {k: _select(v, axis, rows) for k, v in value.items()}
    if isinstance(value, list):
        return [value[i] for i in rows]
    return value.index_select(axis, torch.as_tensor(rows, dtype=torch.long))


def node_rows(state: Mapping[str, Any], specs: Mapping[str, StateField], nodes: Sequence[int]) -> dict[str, Any]:
    """A saved store of every node restricted to ``nodes`` (in that order): the state a store of those nodes
    saves (either backend's format)."""
    axes = _node_axes(state)
    out = {key: _select(value, axes[key], list(nodes)) if key in axes else value for key, value in state.items()}
    if "fields" in state:
        out["fields"] = {name: _select(parts, 1 if specs[name].published else 0, list(nodes))
                         for name, parts in state["fields"].items()}
    return out


def _interleave(values: list[Any], axis: int, world_size: int, num_nodes: int) -> Any:
    first = values[0]
    if isinstance(first, dict):
        return {k: _interleave([v[k] for v in values], axis, world_size, num_nodes) for k in first}
    if isinstance(first, list):
        return [values[node % world_size][node // world_size] for node in range(num_nodes)]
    shape = list(first.shape)
    shape[axis] = num_nodes
    out = first.new_empty(shape)
    for rank, value in enumerate(values):
        out[(slice(None),) * axis + (slice(rank, None, world_size),)] = value
    return out


def interleave_rows(states: list[Mapping[str, Any]], specs: Mapping[str, StateField],
                    num_nodes: int) -> dict[str, Any]:
    """The saved store of every node from the saved local stores of ``len(states)`` processes, process ``r``
    holding nodes ``r, r + N, ...`` in order: the state one process's store saves."""
    first, world_size = states[0], len(states)
    axes = _node_axes(first)
    out = {key: _interleave([s[key] for s in states], axes[key], world_size, num_nodes) if key in axes else value
           for key, value in first.items()}
    if "fields" in first:
        out["fields"] = {name: _interleave([s["fields"][name] for s in states], 1 if specs[name].published else 0,
                                           world_size, num_nodes) for name in first["fields"]}
    return out


class PartitionedStore:
    """The client store of one process of a sharded federation (module docstring): ``local`` holds the nodes
    ``ownership`` gives this process (local row ``k // N``), the inbox what its tasks read of the others.

    It answers the :class:`~lightning_dfl.federation.store.protocol.ClientStore` calls by global node index.
    """

    def __init__(self, local: ClientStore, ownership: Any, num_nodes: int) -> None:
        expected = len(range(ownership.rank, num_nodes, ownership.world_size))
        if local.num_nodes != expected:
            raise ValueError(f"process {ownership.rank} of {ownership.world_size} owns {expected} of {num_nodes} "
                             f"nodes; its local store holds {local.num_nodes}")
        self.local, self.ownership, self.num_nodes = local, ownership, num_nodes
        self.names, self.masked_names, self.device = local.names, local.masked_names, local.device
        self.pin_memory = local.pin_memory
        self._inbox: dict[tuple[int, bool], Received] = {}
        #: ``(receiver, node, fresh)`` of every record some process holds in its inbox (known to every process)
        self._delivered: set[tuple[int, int, bool]] = set()
        self._published_fields = [n for n, s in local.field_specs.items() if s.published]
        self._local_layout: StoreLayout | None = None  # the local store's (cached: the same until a field is declared)
        #: bytes of records this process has sent and received, over the run
        self.sent_bytes = self.received_bytes = 0

    # -- where a node lives --------------------------------------------------------------------------------
    def owned_nodes(self) -> list[int]:
        """The nodes this process holds, in local row order."""
        return list(range(self.ownership.rank, self.num_nodes, self.ownership.world_size))

    def _row(self, node: int, what: str) -> int:
        node = int(node)
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} is not in this federation of {self.num_nodes} nodes")
        if not self.ownership.owns(node):
            raise RuntimeError(f"{what} of node {node} is held by process {self.ownership.owner(node)}, not by this "
                               f"process ({self.ownership.rank} of {self.ownership.world_size}): each process holds "
                               "its own nodes and what its tasks read as sources")
        return node // self.ownership.world_size

    def _received(self, node: int, fresh: bool) -> Received:
        node = int(node)
        if self.ownership.owns(node):
            raise AssertionError("an owned node is read from the local store")
        record = self._inbox.get((node, bool(fresh)))
        if record is None:
            which = "this round's" if fresh else "start-of-round"
            raise RuntimeError(
                f"node {node}'s {which} model is not on process {self.ownership.rank}: it is held by process "
                f"{self.ownership.owner(node)} and was not among the sources of this process's tasks (an algorithm "
                "whose hooks read other nodes beyond their tasks' sources declares partitionable = False)")
        return record

    # -- declared fields -----------------------------------------------------------------------------------
    @property
    def fields(self) -> dict[str, dict[str, Tensor]]:
        """The local store's fields (rows of the owned nodes)."""
        return self.local.fields

    @property
    def field_specs(self) -> dict[str, StateField]:
        return self.local.field_specs

    def declare(self, spec: StateField, template: Mapping[str, Tensor]) -> None:
        self.local.declare(spec, template)
        self._local_layout = None
        self._published_fields = [n for n, s in self.local.field_specs.items() if s.published]

    def read(self, node: int, name: str, fresh: bool = False) -> Tensor | dict[str, Tensor]:
        if self.ownership.owns(node):
            return self.local.read(self._row(node, "the fields"), name, fresh)
        if name not in self.local.field_specs or not self.local.field_specs[name].published:
            self._row(node, f"the private field {name!r}")  # raises: another process's
        return self._received(node, fresh).fields[name]

    def write(self, node: int, name: str, value: Tensor | float | Mapping[str, Tensor]) -> None:
        """Set an owned node's private field; another process's node is its owner's to write (the same set-up
        runs on every process)."""
        if self.ownership.owns(node):
            self.local.write(self._row(node, "the fields"), name, value)

    # -- the round -------------------------------------------------------------------------------------------
    def initialize(self, node: int, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None) -> None:
        """Set an owned node's model before the first round (another process's node: its owner sets it)."""
        if self.ownership.owns(node):
            self.local.initialize(self._row(node, "the model"), weights, mask)

    def publish(self, node: int, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None,
                fields: Mapping[str, Any] | None = None) -> None:
        self.local.publish(self._row(node, "publishing the model"), weights, mask, fields)

    def set_mask(self, node: int, mask: Mapping[str, Tensor]) -> None:
        self.local.set_mask(self._row(node, "the current mask"), mask)

    def release_start(self, node: int) -> None:
        """Free ``node``'s start-of-round model after its last reader: the local record, or the received one."""
        if self.ownership.owns(node):
            self.local.release_start(self._row(node, "the model"))
            return
        self._inbox.pop((int(node), False), None)
        self._delivered = {d for d in self._delivered if d[1:] != (int(node), False)}

    def end_round(self) -> None:
        """The local store's round ends; no received model is current any more."""
        self.local.end_round()
        self._inbox.clear()
        self._delivered.clear()

    # -- reads ------------------------------------------------------------------------------------------------
    def mask(self, node: int) -> Masks:
        return self.local.mask(self._row(node, "the current mask"))

    def published(self, node: int, fresh: bool = False) -> tuple[dict[str, Tensor], Masks]:
        if self.ownership.owns(node):
            return self.local.published(self._row(node, "the model"), fresh)
        record = self._received(node, fresh)
        if record.record is not None:
            return self.local.expand_record(record.record)
        return record.weights, record.mask

    def gather(self, sources: list[tuple[int, bool]]) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]]]:
        """Several ``(node, fresh)`` sources' weights and published masks, by name: owned or received."""
        return gather_published(self, sources)

    def active_values(self, node: int, fresh: bool = False) -> int:
        if self.ownership.owns(node):
            return self.local.active_values(self._row(node, "the model"), fresh)
        return self._received(node, fresh).active

    def masked_size(self) -> int:
        return self.local.masked_size()

    def state(self, node: int) -> ClientState:
        return self.local.state(self._row(node, "the state"))

    def nbytes(self) -> int:
        """Memory held by the local store and the inbox."""
        return self.local.nbytes() + sum(r.nbytes() for r in self._inbox.values())

    def layout(self) -> StoreLayout:
        """The layout of the whole federation's store (every node), as one process's store has."""
        mine = StoreLayout.of(self.local)

        def whole(shape: tuple[int, ...], published: bool) -> tuple[int, ...]:
            axis = 1 if published else 0
            return (*shape[:axis], self.num_nodes, *shape[axis + 1:])

        fields = {name: {p: (whole(shape, self.field_specs[name].published), dtype) for p, (shape, dtype) in parts.items()}
                  for name, parts in mine.fields.items()}
        return StoreLayout(self.num_nodes, mine.shapes, mine.dtypes, mine.masked_names, fields)

    # -- moving records between processes ----------------------------------------------------------------------
    # A record travels in its owner's store format: dense (every weight, the mask as bytes) or compact (the
    # active values, packed mask bits and zero signs as kept: values sized by the mask, so a header of sizes goes
    # first); then its value count and published fields. Each record has its own buffers (one per dtype), so a
    # received record is freed on its own.
    def _compact(self) -> bool:
        return isinstance(self.local, CompactClientStore)

    def _header_width(self) -> int:
        """Sizes sent ahead of each record: a compact record's value count per parameter and zero-sign bytes per
        masked one (none for a dense record: its layout is fixed)."""
        return len(self.names) + len(self.masked_names) if self._compact() else 0

    def _header(self, node: int, fresh: bool) -> list[int]:
        record = self.local.published_record(self._row(node, "the model"), fresh)
        return ([record["values"][n].numel() for n in self.names]
                + [record["neg"][n].numel() if n in record["neg"] else 0 for n in self.masked_names])

    def _record_tensors(self, node: int, fresh: bool) -> list[Tensor]:
        """An owned node's published record as the list of tensors its message carries (:meth:`_wire_layout`)."""
        row = self._row(node, "the model")
        if self._compact():
            record = self.local.published_record(row, fresh)
            empty = torch.empty(0, dtype=torch.uint8, device=self.device)
            tensors = [record["values"][n] for n in self.names]
            tensors += [record["bits"][n] for n in self.masked_names]
            tensors += [record["neg"].get(n, empty) for n in self.masked_names]
        else:
            weights, mask = self.local.published(row, fresh)
            tensors = [weights[n] for n in self.names]
            tensors += [mask[n].view(torch.uint8) for n in self.masked_names]
        tensors.append(torch.tensor([self.local.active_values(row, fresh)], dtype=torch.long, device=self.device))
        for name in self._published_fields:
            value = self.local.read(row, name, fresh)
            tensors += list(value.values()) if isinstance(value, dict) else [value]
        return tensors

    def _wire_layout(self, header: Sequence[int]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of a record's message (:meth:`_record_tensors`), given its :meth:`_header`."""
        if self._local_layout is None:
            self._local_layout = StoreLayout.of(self.local)
        mine = self._local_layout
        if self._compact():
            counts, signs = header[:len(self.names)], header[len(self.names):]
            layout = [((int(c),), mine.dtypes[n]) for n, c in zip(self.names, counts)]
            layout += [((math.ceil(math.prod(mine.shapes[n]) / 8),), torch.uint8) for n in self.masked_names]
            layout += [((int(c),), torch.uint8) for c in signs]
        else:
            layout = [(tuple(mine.shapes[n]), mine.dtypes[n]) for n in self.names]
            layout += [(tuple(mine.shapes[n]), torch.uint8) for n in self.masked_names]
        layout.append(((1,), torch.long))
        for name in self._published_fields:
            layout += [(tuple(t.shape[2:]), t.dtype) for t in self.local.fields[name].values()]
        return layout

    def _buffers(self, layout: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[Tensor], list[Tensor]]:
        """One flat buffer per dtype for a record of ``layout`` (what its message carries) and the record's
        tensors as views of them."""
        sizes: dict[torch.dtype, int] = {}
        for shape, dtype in layout:
            sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
        buffers = {dtype: torch.empty(size, dtype=dtype, device=self.device) for dtype, size in sizes.items()}
        offsets = dict.fromkeys(buffers, 0)
        views = []
        for shape, dtype in layout:
            size = math.prod(shape)
            views.append(buffers[dtype][offsets[dtype]:offsets[dtype] + size].view(shape))
            offsets[dtype] += size
        return list(buffers.values()), views

    def _unpack(self, tensors: list[Tensor]) -> Received:
        n_names, n_masked = len(self.names), len(self.masked_names)
        record = None
        if self._compact():
            at = n_names + 2 * n_masked
            values = dict(zip(self.names, tensors[:n_names]))
            bits = dict(zip(self.masked_names, tensors[n_names:n_names + n_masked]))
            neg = {n: t for n, t in zip(self.masked_names, tensors[n_names + n_masked:at]) if t.numel()}
            record = {"values": values, "bits": bits, "neg": neg}
            weights: dict[str, Tensor] = {}
            mask: dict[str, Tensor] = {}
        else:
            at = n_names + n_masked
            weights = dict(zip(self.names, tensors[:n_names]))
            mask = {n: t.view(torch.bool) for n, t in zip(self.masked_names, tensors[n_names:at])}
        active = int(tensors[at])
        fields: dict[str, Tensor | dict[str, Tensor]] = {}
        at += 1
        for name in self._published_fields:
            parts = list(self.local.fields[name])
            values = dict(zip(parts, tensors[at:at + len(parts)]))
            fields[name] = values[""] if self.field_specs[name].like is None else values
            at += len(parts)
        if record is not None:
            record["active"] = active
        return Received(weights, mask, active, fields, record)

    def _group(self) -> Any:
        return None if self.device.type != "cpu" else self.ownership.group

    def _exchange(self, ops: list[Any]) -> None:
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()

    @torch.no_grad()
    def receive(self, routes: Iterable[tuple[int, bool, int, int]]) -> None:
        """Move the routes' records (``(node, fresh, sender, receiver)``, as
        :class:`~lightning_dfl.federation.exchange.routing.Route`) from their senders into their receivers'
        inboxes, point to point; a record the receiver holds already is not sent again. A collective: every
        process calls it with the same routes (every process plans every round)."""
        pairs: dict[tuple[int, int], list[tuple[int, bool]]] = {}
        for node, fresh, sender, receiver in routes:
            key = (receiver, node, fresh)
            if sender == receiver or key in self._delivered:
                continue
            self._delivered.add(key)
            pairs.setdefault((sender, receiver), []).append((node, fresh))
        rank = self.ownership.rank
        mine = [(pair, records) for pair, records in sorted(pairs.items()) if rank in pair]
        width = self._header_width()
        headers: dict[tuple[int, int], Tensor] = {}
        ops: list[Any] = []
        for (sender, receiver), records in mine:  # the sizes of variable records first
            header = torch.zeros((len(records), width), dtype=torch.long, device=self.device)
            if sender == rank and width:
                header.copy_(torch.tensor([self._header(node, fresh) for node, fresh in records],
                                          dtype=torch.long).view(header.shape))
            headers[(sender, receiver)] = header
            if width:
                ops.append(dist.P2POp(dist.isend if sender == rank else dist.irecv, header,
                                      receiver if sender == rank else sender, group=self._group()))
        self._exchange(ops)
        ops, inbound = [], []
        for (sender, receiver), records in mine:
            sizes = headers[(sender, receiver)].tolist()
            for (node, fresh), header in zip(records, sizes):
                buffers, views = self._buffers(self._wire_layout(header))
                if sender == rank:  # each record copied in as it is read
                    for view, tensor in zip(views, self._record_tensors(node, fresh)):
                        view.copy_(tensor.reshape(view.shape))
                else:
                    inbound.append((node, fresh, views))
                for flat in buffers:
                    ops.append(dist.P2POp(dist.isend if sender == rank else dist.irecv, flat,
                                          receiver if sender == rank else sender, group=self._group()))
                    nbytes = flat.numel() * flat.element_size()
                    if sender == rank:
                        self.sent_bytes += nbytes
                    else:
                        self.received_bytes += nbytes
        self._exchange(ops)
        for node, fresh, views in inbound:
            self._inbox[(node, fresh)] = self._unpack(views)

    def keep_only(self, needed: Iterable[tuple[int, int, bool]]) -> None:
        """Forget every received record but the ``(receiver, node, fresh)`` ones in ``needed`` (this process's
        inbox frees the others; a later :meth:`receive` sends them again). Every process calls it with the same
        ``needed``, so that all agree on what each holds."""
        needed = set(needed)
        self._delivered &= needed
        rank = self.ownership.rank
        for key in [k for k in self._inbox if (rank, *k) not in needed]:
            del self._inbox[key]

    def fetch(self, sources: Iterable[tuple[int, bool]]) -> None:
        """Bring the ``(node, fresh)`` sources' records to every process (a collective; the shared model's
        sources before it is averaged)."""
        world, owner = self.ownership.world_size, self.ownership.owner
        self.receive([(int(node), bool(fresh), owner(node), receiver)
                      for node, fresh in sources for receiver in range(world)])

    def forget(self, sources: Iterable[tuple[int, bool]]) -> None:
        """Free the ``(node, fresh)`` records fetched for every process (:meth:`fetch`; a collective: every process
        calls it with the same sources, so all agree on what each holds)."""
        keys = {(int(node), bool(fresh)) for node, fresh in sources}
        self._delivered = {d for d in self._delivered if d[1:] not in keys}
        for key in keys:
            self._inbox.pop(key, None)

    @torch.no_grad()
    def broadcast_mask(self, node: int) -> Masks:
        """``node``'s current mask on every process, from its owner (a collective)."""
        owner = self.ownership.owner(node)
        if owner == self.ownership.rank:
            mask = {n: m.clone() for n, m in self.mask(node).items()}
        else:
            mask = {n: torch.empty(t.shape, dtype=torch.bool, device=self.device) for n, t in self.local.mask(0).items()}
        for n in self.masked_names:
            dist.broadcast(mask[n].view(torch.uint8), src=_global_rank(self.ownership.group, owner),
                           group=self._group())
        return mask

    def gather_nodes(self, value: Callable[[int], T], nodes: Iterable[int]) -> list[T]:
        """``value(node)`` of each of ``nodes`` in that order, each computed by its owner (a collective; picklable
        values)."""
        nodes = list(nodes)
        return self.ownership.gather({k: value(k) for k in self.ownership.owned(nodes)}, nodes)

    def column_blocks(self, nodes: Sequence[int], name: str, mask: bool, step: int) -> Iterator[tuple[int, Tensor]]:
        """The nodes' current published ``name`` in column blocks (the local store's ``column_blocks``), each
        block's rows gathered from their owners in ``nodes``' order (a collective)."""
        nodes = [int(k) for k in nodes]
        world = self.ownership.world_size
        mine = self.ownership.owned(nodes)
        counts = [sum(1 for k in nodes if k % world == r) for r in range(world)]
        rows = {r: [i for i, k in enumerate(nodes) if k % world == r] for r in range(world)}
        local = self.local.column_blocks([k // world for k in mine], name, mask, step)
        for start, block in local:
            wire = block.view(torch.uint8) if block.dtype == torch.bool else block  # gloo carries no bool
            padded = wire.new_zeros((max(counts), wire.shape[1]))
            padded[:wire.shape[0]] = wire
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded, group=self._group())
            out = wire.new_empty((len(nodes), wire.shape[1]))
            for r in range(world):
                if rows[r]:
                    out[torch.as_tensor(rows[r])] = parts[r][:counts[r]]
            yield start, out.view(torch.bool) if block.dtype == torch.bool else out

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        """Every node's state in one process's format, on process 0 (``None`` on the others): each process's
        local state gathered there (a collective; call between rounds)."""
        mine = self.local.state_dict()
        world = self.ownership.world_size
        states: list[Any] | None = [None] * world if self.ownership.rank == 0 else None
        dist.gather_object(mine, states, dst=_global_rank(self.ownership.group, 0), group=self.ownership.group)
        if states is None:
            return None
        return interleave_rows(states, self.field_specs, self.num_nodes)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a saved store of every node (either backend's format): this process keeps its own nodes' rows."""
        from lightning_dfl.federation.store.factory import load_store_state

        load_store_state(self.local, node_rows(state, self.field_specs, self.owned_nodes()))
        self._inbox.clear()
        self._delivered.clear()


def _global_rank(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
