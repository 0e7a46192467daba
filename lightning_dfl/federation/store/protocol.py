"""What a client store is (:class:`ClientStore`), with the logic both stores share.

A store keeps what every node (client, or the server of a centralized baseline) publishes: its weights
and the mask they were trained with, plus the node's *current mask* (the one it trains with next) and the
declared per-node fields (:mod:`~lightning_dfl.federation.store.fields`). Readers within a round may need
the model a node published at the start of the round (a snapshot) or the one it publishes in this round
(DA-DPFL's reuse, PSFL's chains, FedAvg's server).

:class:`ClientStore` is an abstract base: it holds no model. It owns what does not depend on how a model
is kept: the node names and device, the checks of the arguments, the per-node slot pointers of the
published fields and which nodes have written this round, the declared fields, and the checks of a
checkpoint's fields.
Its two implementations keep the models: :class:`~lightning_dfl.federation.store.dense.DenseClientStore`
(``FederatedTrainer(store="dense")``, two dense slots per node) and
:class:`~lightning_dfl.federation.store.compact.CompactClientStore` (``store="compact"``, one record of
active values and packed mask bits per node); neither subclasses the other, and they give the same results.

The store lives on one device (``store.device``: the CPU, or the worker's GPU; see
:func:`~lightning_dfl.federation.store.memory.resolve_store_device`). Every tensor given to it (weights,
masks, field values, a checkpoint's tensors) may be on any device and is copied onto the store's where it
enters; what it hands out (views, rebuilt tensors) is on the store's device; its ``state_dict`` holds CPU
tensors. A CPU store serving a GPU worker may be pinned (``pin_memory``): its copies from and to the worker
then run asynchronously (:func:`~lightning_dfl.transfers.copy_all_`), each finished when the store's method
returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_dfl.federation.store.fields import ClientState, DeclaredFields, StateField
from lightning_dfl.federation.store.saved_state import StoreLayout
from lightning_dfl.sparse.masks import Masks

T = TypeVar("T")

__all__ = ["ClientStore", "FieldPairs", "gather_published", "stream_published"]

#: a checkpoint's tensors paired with a store's, by what they are: ``(what, mine, theirs)``
FieldPairs = list[tuple[str, dict[str, Tensor], Mapping[str, Tensor]]]


def gather_published(store: Any, sources: list[tuple[int, bool]]) -> tuple[dict[str, list[Tensor]],
                                                                           dict[str, list[Tensor]]]:
    """:meth:`ClientStore.gather` from ``store.published`` of each ``(node, fresh)`` source, by name (for stores
    that rebuild each source's tensors: the compact one, the partitioned one)."""
    expanded = [store.published(node, fresh) for node, fresh in sources]
    return ({n: [w[n] for w, _ in expanded] for n in store.names},
            {n: [m[n] for _, m in expanded] for n in store.masked_names})


class _Streamed:
    """Sources read in order, ``per_fetch`` at a time (:func:`stream_published`): each group is fetched when its
    first source is read and forgotten when the next group is; one source's tensors are kept while it is read."""

    def __init__(self, store: Any, sources: list[tuple[int, bool]], per_fetch: int) -> None:
        self.store, self.sources, self.per_fetch = store, sources, per_fetch
        self._group: list[tuple[int, bool]] = []
        self._index = -1
        self._record: tuple[dict[str, Tensor], Masks] = ({}, {})

    def read(self, j: int, part: int, name: str) -> Tensor:
        if j != self._index:
            start = j - j % self.per_fetch
            group = self.sources[start:start + self.per_fetch]
            if group != self._group:
                self.close()
                self.store.fetch(group)
                self._group = group
            self._record, self._index = self.store.published(*self.sources[j]), j
        return self._record[part][name]

    def close(self) -> None:
        """Forget the group fetched last."""
        if self._group:
            self.store.forget(self._group)
        self._group, self._index, self._record = [], -1, ({}, {})


class _Column(Sequence[Tensor]):
    """One name's weights (``part`` 0) or published masks (1) of streamed sources."""

    def __init__(self, streamed: _Streamed, part: int, name: str) -> None:
        self.streamed, self.part, self.name = streamed, part, name

    def __len__(self) -> int:
        return len(self.streamed.sources)

    def __getitem__(self, j: Any) -> Any:
        if not isinstance(j, int):
            raise TypeError("streamed sources are read one index at a time")
        if not -len(self) <= j < len(self):
            raise IndexError(j)
        return self.streamed.read(j % len(self), self.part, self.name)


@contextmanager
def stream_published(store: Any, sources: list[tuple[int, bool]], per_fetch: int = 16,
                     ) -> Iterator[tuple[dict[str, Sequence[Tensor]], dict[str, Sequence[Tensor]]]]:
    """The ``(node, fresh)`` sources' weights and published masks by name, as sequences that bring each source
    when it is read (:meth:`ClientStore.fetch`, ``per_fetch`` sources at a time, then
    :meth:`ClientStore.forget`) and rebuild one source at a time, for a reader that goes through them in order
    (:func:`~lightning_dfl.federation.exchange.aggregation.masked_average`). A store split across processes
    holds at most ``per_fetch`` of them at once, instead of every source; a compact store rebuilds one. Every
    process must read them in the same order (each group's fetch is a collective)."""
    streamed = _Streamed(store, list(sources), per_fetch)
    try:
        yield ({n: _Column(streamed, 0, n) for n in store.names}, {n: _Column(streamed, 1, n) for n in store.masked_names})
    finally:
        streamed.close()


class ClientStore(ABC):
    """Published models of ``num_nodes`` nodes sharing one architecture (abstract: see the module docstring).

    Args:
        template: the worker's parameters and buffers by name (shapes and dtypes).
        masked_names: the names that carry a mask (a subset of ``template``).
        num_nodes: clients plus servers.
        device: where the store's tensors live (CPU by default).
        fields: per-node values declared by the algorithm and the callbacks.
        pin_memory: a CPU store's tensors are allocated in pinned memory (for a GPU worker: asynchronous
            copies); ignored on another device.
    """

    def __init__(self, template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int,
                 device: torch.device | str = "cpu", fields: Iterable[StateField] = (),
                 pin_memory: bool = False) -> None:
        unknown = sorted(set(masked_names) - set(template))
        if unknown:
            raise ValueError(f"masked names not in the template: {unknown}")
        self.num_nodes = num_nodes
        self.device = torch.device(device)
        #: whether the store's preallocated tensors are in pinned host memory
        self.pin_memory = bool(pin_memory) and self.device.type == "cpu"
        self.names = list(template)
        self.masked_names = list(masked_names)
        #: per node, the slot of its current published fields (and of the dense store's models)
        self.slot = torch.zeros(num_nodes, dtype=torch.long)
        self._written: set[int] = set()  # the nodes that published in this round
        self._fields = DeclaredFields(num_nodes, self.masked_names, self._where())
        for spec in fields:
            self.declare(spec, template)

    def _where(self) -> dict[str, Any]:
        """The factory arguments of the store's preallocated tensors: its device, pinned if asked."""
        return {"device": self.device, "pin_memory": True} if self.pin_memory else {"device": self.device}

    def _cpu(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` for a checkpoint: themselves on the CPU, else copied to it."""
        if self.device.type == "cpu":
            return dict(tensors)
        return {n: t.cpu() for n, t in tensors.items()}

    # -- declared fields ----------------------------------------------------------------
    @property
    def fields(self) -> dict[str, dict[str, Tensor]]:
        """The declared fields' tensors by name, then by part (:class:`~.fields.DeclaredFields`)."""
        return self._fields.tensors

    @property
    def field_specs(self) -> dict[str, StateField]:
        return self._fields.specs

    def declare(self, spec: StateField, template: Mapping[str, Tensor]) -> None:
        """Allocate a declared field for every node, filled with ``spec.fill``."""
        self._fields.declare(spec, template)

    def read(self, node: int, name: str, fresh: bool = False) -> Tensor | dict[str, Tensor]:
        """A view of ``node``'s field ``name`` (a tensor, or a dict by parameter for ``like`` fields);
        a published field reads the start-of-round value, or this round's if ``fresh``."""
        slot = self._slot(node, fresh) if self._fields.is_published(name) else None
        return self._fields.read(node, name, slot)

    @torch.no_grad()
    def write(self, node: int, name: str, value: Tensor | float | Mapping[str, Tensor]) -> None:
        """Set ``node``'s private field ``name`` (published fields are written by :meth:`publish`)."""
        self._fields.write(node, name, value)

    # -- slots and the round ------------------------------------------------------------
    def _slot(self, node: int, fresh: bool) -> int:
        """The slot of ``node``'s start-of-round published fields, or this round's if ``fresh`` (which it
        must have published)."""
        current = int(self.slot[node])
        if not fresh:
            return current
        if node not in self._written:
            raise RuntimeError(f"node {node}'s model of this round was read before it was published")
        return 1 - current

    def end_round(self) -> None:
        """Make this round's published models the current ones (:meth:`_commit_round`), and the published
        fields' slots of the nodes that wrote."""
        self._commit_round()
        for node in self._written:
            self.slot[node] = 1 - self.slot[node]
        self._written.clear()

    def _check_publish(self, node: int, fields: Mapping[str, Any] | None) -> dict[str, Any]:
        """The published fields given to :meth:`publish`, checked (once per round, published fields only)."""
        if node in self._written:
            raise RuntimeError(f"node {node} published twice in one round")
        fields = dict(fields or {})
        self._fields.check_published(fields)
        return fields

    def _publish_fields(self, node: int, fields: Mapping[str, Any]) -> None:
        """Write ``node``'s published fields into its other slot (those not given keep their value) and
        mark it written."""
        current = int(self.slot[node])
        self._fields.publish(node, 1 - current, current, fields)
        self._written.add(node)

    def _field_views(self, node: int) -> list[Tensor]:
        """:meth:`task_views`' part of the fields: the slot ``node`` publishes into, its private fields."""
        return self._fields.views(node, 1 - int(self.slot[node]))

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

    # -- checkpoints --------------------------------------------------------------------
    def _check_between_rounds(self) -> None:
        if self._written:
            raise RuntimeError("the store can be saved between rounds only")

    def _field_pairs(self, state: Mapping[str, Any]) -> FieldPairs:
        """A checkpoint's fields paired with the store's (the same names, or ``ValueError``)."""
        theirs_fields = state.get("fields", {})
        if set(theirs_fields) != set(self.fields):
            raise ValueError(f"the checkpoint's state fields {sorted(theirs_fields)} differ from this run's "
                             f"{sorted(self.fields)}")
        return [(f"field {name!r}", self.fields[name], theirs_fields[name]) for name in self.fields]

    @staticmethod
    def _check_pairs(pairs: FieldPairs) -> None:
        """``ValueError`` unless each pair holds the same names with the same shapes."""
        for key, mine, theirs in pairs:
            if set(mine) != set(theirs) or any(mine[n].shape != theirs[n].shape for n in mine):
                raise ValueError(f"the checkpoint's {key} do not fit this store: it has "
                                 f"{ {n: tuple(t.shape) for n, t in theirs.items()} }, the store "
                                 f"{ {n: tuple(t.shape) for n, t in mine.items()} }")

    def fetch(self, sources: Iterable[tuple[int, bool]]) -> None:
        """Make the ``(node, fresh)`` sources' published models readable here: every node is (a store split
        across processes, :class:`~lightning_dfl.federation.store.partitioned.PartitionedStore`, brings them
        from their owners; a collective there: every process calls it with the same sources)."""
        del sources  # every node is here: nothing to bring

    def forget(self, sources: Iterable[tuple[int, bool]]) -> None:
        """Say that the fetched ``(node, fresh)`` sources will not be read again (:meth:`fetch`'s undo: a store
        split across processes frees what it received; a collective there)."""
        del sources  # nothing was brought

    def broadcast_mask(self, node: int) -> Masks:
        """``node``'s current mask, readable on every process (a store split across processes sends it from its
        owner: a collective there)."""
        return self.mask(node)

    def gather_nodes(self, value: Callable[[int], T], nodes: Iterable[int]) -> list[T]:
        """``value(node)`` of each of ``nodes``, in that order, on every process: here each is computed where the
        node is (a store split across processes computes each on its owner and gathers them: a collective there,
        with picklable values; an algorithm's planning reads other nodes' fields through it)."""
        return [value(int(node)) for node in nodes]

    # -- what each store implements -----------------------------------------------------
    @abstractmethod
    def release_start(self, node: int) -> None:
        """Say that ``node``'s start-of-round model will not be read again in this round (called by the
        executor's :class:`~lightning_dfl.federation.loop.start_reads.StartReads` after its last read)."""

    @abstractmethod
    def _commit_round(self) -> None:
        """:meth:`end_round`'s part of the models: this round's published ones become the current ones."""

    @abstractmethod
    def initialize(self, node: int, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None) -> None:
        """Set a node's current model and mask before the first round (the weights times the mask)."""

    @abstractmethod
    def publish(self, node: int, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None,
                fields: Mapping[str, Tensor | float | Mapping[str, Tensor]] | None = None) -> None:
        """Write the model ``node`` publishes in this round (weights and the mask trained with) and
        its published fields (those not given keep their start-of-round value)."""

    @abstractmethod
    def set_mask(self, node: int, mask: Mapping[str, Tensor]) -> None:
        """Set the mask ``node`` trains with next."""

    @abstractmethod
    def task_views(self, node: int) -> list[Tensor]:
        """Tensors holding everything ``node``'s task writes this round, in a fixed order: its published
        weights, mask and value count, its current mask and its fields. Processes that share a federation
        (:mod:`~lightning_dfl.federation.loop.sharded`) copy these from the task's owner."""

    @abstractmethod
    def mark_published(self, node: int) -> None:
        """Record that ``node`` published this round (its :meth:`task_views` were copied from another process)."""

    @abstractmethod
    def column_blocks(self, nodes: Sequence[int], name: str, mask: bool, step: int) -> Iterator[tuple[int, Tensor]]:
        """The nodes' current published ``name`` (its mask when ``mask``), flattened, in column blocks of ``step``
        entries: ``(start, block)`` with ``block`` a ``(len(nodes), width)`` copy, so that readers of many nodes
        (the diagnostics) never hold every node's whole model at once. Both stores give the same blocks."""

    @abstractmethod
    def mask(self, node: int) -> Masks:
        """``node``'s current mask."""

    @abstractmethod
    def published(self, node: int, fresh: bool = False) -> tuple[dict[str, Tensor], Masks]:
        """A node's published weights and mask (start of round, or this round's if ``fresh``); read-only."""

    @abstractmethod
    def gather(self, sources: list[tuple[int, bool]]) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]]]:
        """Several ``(node, fresh)`` sources' weights and published masks, by name."""

    @abstractmethod
    def active_values(self, node: int, fresh: bool = False) -> int:
        """Values a node's published model sends: active masked entries plus all unmasked entries."""

    @abstractmethod
    def masked_size(self) -> int:
        """Entries under a mask (one bit each when a mask is sent)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything the store holds, on the CPU (for checkpoints); call between rounds."""

    @staticmethod
    @abstractmethod
    def check_saved_state(saved: Mapping[str, Any], layout: StoreLayout) -> None:
        """Refuse a saved state of this store's format that cannot load into a store of ``layout`` (one
        :class:`~lightning_dfl.federation.store.saved_state.SavedStateError` naming what is wrong); nothing is
        loaded. :func:`~lightning_dfl.federation.store.factory.check_store_state` picks the store by the format."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` into this store (either backend's:
        :func:`~lightning_dfl.federation.store.factory.load_store_state`)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Memory held by the store's tensors."""
