"""The client store of a run, built when ``fit`` sets up: the fields it declares (the algorithm's, the
kept optimizer state, the callbacks'), its backend (``store="dense"`` or ``"compact"``, :func:`store_class`)
and device (checked to fit before anything is allocated, :mod:`~lightning_dfl.federation.store.memory`), and
every node's initial model and mask.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_dfl.errors import ConfigurationError
from lightning_dfl.federation.store.compact import CompactClientStore
from lightning_dfl.federation.store.dense import DenseClientStore
from lightning_dfl.federation.store.fields import OPTIMIZER_FIELD, OPTIMIZER_STARTED, StateField
from lightning_dfl.federation.store.memory import check_store_fits, pin_store_memory, resolve_store_device, store_bytes
from lightning_dfl.federation.store.partitioned import PartitionedStore
from lightning_dfl.federation.store.protocol import ClientStore
from lightning_dfl.federation.store.records import FORMAT as COMPACT_FORMAT
from lightning_dfl.federation.store.records import dense_state_dict
from lightning_dfl.federation.store.saved_state import SavedStateError, StoreLayout
from lightning_dfl.seeding import derive_seed
from lightning_dfl.sparse.masks import Masks

__all__ = ["MASK_THREADS", "STORE_KINDS", "build_store", "check_store_kind", "check_store_state", "load_store_state",
           "node_initial_masks", "state_fields", "store_class"]

#: the client store backends of ``FederatedTrainer(store=...)``
STORE_KINDS = ("dense", "compact")


def check_store_kind(value: Any) -> str:
    """``value`` if it names a store backend, else ``ValueError`` naming the allowed values."""
    if value not in STORE_KINDS:
        raise ValueError(f"store must be one of {', '.join(repr(k) for k in STORE_KINDS)}, got {value!r}")
    return value


def store_class(kind: str) -> type[ClientStore]:
    """The store class of a backend named by ``FederatedTrainer(store=...)``."""
    return CompactClientStore if check_store_kind(kind) == "compact" else DenseClientStore

#: threads that draw the clients' initial masks at set-up (``torch.randperm`` of a large layer is serial)
MASK_THREADS = 8


def _state_field(callback: Any, spec: Any) -> StateField:
    """A callback's declared field: a :class:`StateField` (or, as callbacks wrote them before, its keyword
    arguments as a dict)."""
    if isinstance(spec, StateField):
        return spec
    if isinstance(spec, dict):
        return StateField(**spec)
    raise ConfigurationError(f"{type(callback).__name__}.client_state_fields returned {spec!r} ({type(spec).__name__}); "
                    "allowed: StateField (lightning_dfl.state_field) or a dict of its arguments")


def state_fields(algorithm: Any, callbacks: list[Any], owner: Any, model: Any) -> list[StateField]:
    """The store's declared fields: the algorithm's, its kept optimizer state, the callbacks'
    (``client_state_fields(owner, model)``, ``owner`` the trainer the callbacks see)."""
    fields = list(algorithm.state_fields())
    for key in algorithm.keep_optimizer_state:
        fields.append(StateField(OPTIMIZER_FIELD.format(key), like="weights", dtype=None))
    if algorithm.keep_optimizer_state:
        fields.append(StateField(OPTIMIZER_STARTED, dtype=torch.bool))
    for callback in callbacks:
        declare = getattr(callback, "client_state_fields", None)
        if callable(declare):
            fields.extend(_state_field(callback, spec) for spec in declare(owner, model))
    return fields


def node_initial_masks(model: Any, personal: bool, seed: int, num_clients: int,
                       nodes: Sequence[int]) -> Iterator[Masks]:
    """The initial mask of each of ``nodes`` in that order: with ``personal`` masks a client's own random one
    (seeded by its index), else the module's. Drawn on a few threads (each client has its own generator, so the
    masks do not depend on the threads), a few ahead of the node being initialized."""
    shared = model.mask.state()
    nodes = list(nodes)
    if not personal:
        yield from (shared for _ in nodes)
        return

    def draw(node: int) -> Masks:
        if node >= num_clients:
            return shared
        return model.draw_initial_masks(torch.Generator().manual_seed(derive_seed(seed, "mask", node)))

    workers = max(1, min(MASK_THREADS, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        for start in range(0, len(nodes), 2 * workers):
            yield from pool.map(draw, nodes[start:start + 2 * workers])


def build_store(kind: str, where: str, worker: dict[str, Tensor], model: Any, fields: list[StateField],
                num_clients: int, num_nodes: int, personal_masks: bool, seed: int, worker_device: torch.device,
                processes: int, ownership: Any = None) -> ClientStore | PartitionedStore:
    """The run's client store (``kind``: dense or compact; ``where``: its ``store_device`` setting), checked to
    fit before it is allocated, every node initialized with its initial mask. With an ``ownership`` of several
    processes, this process's :class:`~lightning_dfl.federation.store.partitioned.PartitionedStore`: a store of
    the nodes it owns only (``processes``: those on this machine, for the memory check).

    Node k starts from w0 * m_k (DisPFL Alg. 1 line 2; DA-DPFL the same): w0 is the one shared dense
    initialization, the worker's weights before the module's own mask zeroed any
    (:meth:`~lightning_dfl.module.SparseClassifier.shared_initialization`), and m_k the node's initial mask
    (with personal masks its own random one; else the module's, and w0 * m_k is the worker's model).
    The store multiplies by the mask, so the weights a client's mask keeps are all w0's (none is zero)
    and two clients agree wherever both masks keep a weight."""
    partitioned = ownership is not None and ownership.world_size > 1
    nodes = list(range(ownership.rank, num_nodes, ownership.world_size)) if partitioned else list(range(num_nodes))
    if not nodes:
        raise ValueError(f"{ownership.world_size} processes for {num_nodes} nodes (clients plus servers): process "
                         f"{ownership.rank} would own none; use at most {num_nodes} processes")
    masked, density = list(model.mask.masks), model.mask.density()
    estimate = store_bytes(kind, worker, masked, len(nodes), density, fields)
    device, reason = resolve_store_device(where, worker_device, estimate)
    if where == "auto" and worker_device.type != "cpu":
        rank_zero_info(f"Client store on {device}: {reason}")
    check_store_fits(kind, worker, masked, len(nodes), density, device, processes=processes)
    store = store_class(kind)(worker, masked, len(nodes), device=device, fields=fields,
                              pin_memory=pin_store_memory(device, worker_device, estimate, processes))
    shared = model.shared_initialization(worker)
    for row, mask in enumerate(node_initial_masks(model, personal_masks, seed, num_clients, nodes)):
        store.initialize(row, shared, mask)
    return PartitionedStore(store, ownership, num_nodes) if partitioned else store


def check_store_state(saved: Mapping[str, Any], layout: StoreLayout) -> None:
    """Refuse a saved store (``state_dict()`` of either backend) that cannot load into a store of ``layout``: the
    check of its format's store (:meth:`~lightning_dfl.federation.store.protocol.ClientStore.check_saved_state`;
    either backend's format loads into either store). Raises one
    :class:`~lightning_dfl.federation.store.saved_state.SavedStateError`; nothing is loaded."""
    kind = saved.get("format")
    if kind == COMPACT_FORMAT:
        CompactClientStore.check_saved_state(saved, layout)
    elif kind is not None:
        raise SavedStateError(f"its store has format {kind!r}; a store is the dense layout (no format) or 'compact'")
    else:
        DenseClientStore.check_saved_state(saved, layout)


def load_store_state(store: ClientStore, state: Mapping[str, Any]) -> None:
    """Restore a saved store (``state_dict()`` of either backend) into ``store``: a compact store's records are
    expanded into the dense layout for a dense store (:func:`~lightning_dfl.federation.store.records.dense_state_dict`);
    a compact store compresses a dense one itself."""
    if isinstance(store, DenseClientStore) and state.get("format") == COMPACT_FORMAT:
        state = dense_state_dict(state, store)
    store.load_state_dict(state)
