"""Clients sharded across processes: each Fabric process trains some of a plan level's tasks.

Every process holds the plan, algorithm and callbacks and plans every round identically.
:class:`ShardedExecutor` walks the plan's levels like the serial executor; in each level a task runs on its
node's owner (node ``k`` on process ``k mod world_size``: :mod:`~lightning_dfl.federation.loop.ownership`).
The store:

* partitioned (an algorithm that declares ``partitionable``:
  :class:`~lightning_dfl.federation.store.partitioned.PartitionedStore`): each process holds its own nodes;
  before a level, each receives the published records its tasks read from their owners, point to point
  (:func:`~lightning_dfl.federation.exchange.routing.level_routes`); nothing else moves. With
  ``tasks_per_receive`` a level runs in groups (each process's next that many tasks): before each group, what
  the earlier ones received and this one does not read is freed, and its sources are received;
* else replicated: every process holds every node, and after the level each task's owner broadcasts what
  the task wrote (:meth:`ClientStore.task_views`: the published model, masks and fields, the next mask,
  its private fields), so every process holds every published model before the next level reads it.

After the level:

* Python state changed inside tasks (a callback's per-round votes, PQI's events, RigL's update
  count, an algorithm's per-task notes) travels as *task deltas*: an object that changes state in
  its task hooks implements the sharding protocol ::

      shard_snapshot() -> S        # a marker of its current state
      shard_delta(S) -> D          # what it gained since S (picklable)
      shard_rollback(S) -> None    # undo those gains
      shard_apply(D) -> None       # add a gain (possibly another process's)

  Each process rolls its own gains back and applies every task's delta in level order, so every
  process ends the level in the state a single process reaches (and checkpoints agree);
* accounting (client records, bytes) is gathered once per exchange and replayed in process order.

No gradient is all-reduced (each process trains other clients). On a CPU the results are
bit-identical to one process (tested with 2 gloo processes). An algorithm class opts in with
``shardable = True``, inherited by a subclass that overrides none of the behaviour hooks
(``Algorithm.declares``); a callback with task hooks must implement the protocol.
"""

from __future__ import annotations

import atexit
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dfl.checks import check_int
from lightning_dfl.federation.exchange.plan import RoundPlan
from lightning_dfl.federation.exchange.routing import level_routes
from lightning_dfl.federation.loop.callback_hooks import SHARD_PROTOCOL, defined_hooks, speaks_shard_protocol
from lightning_dfl.federation.loop.executor import SerialExecutor
from lightning_dfl.federation.metrics.accounting import RoundAccounting
from lightning_dfl.federation.store.partitioned import PartitionedStore

if TYPE_CHECKING:
    from lightning_dfl.federation.loop.state import FederationState

__all__ = ["SHARD_PROTOCOL", "ShardedExecutor", "check_machines_meet", "check_shardable", "release_at_exit"]

#: callback hooks that run inside a client's task
TASK_HOOKS = ("on_client_before_aggregation", "on_client_train_end", "on_client_end", "on_train_batch_start",
              "on_train_batch_end", "on_before_backward", "on_after_backward", "on_before_optimizer_step")


def _opted_in(cls: type) -> bool:
    """Whether ``cls`` says ``shardable = True`` (:meth:`Algorithm.declares
    <lightning_dfl.federation.algorithms.base.Algorithm.declares>`: inherited unless a subclass changes
    a behaviour hook without declaring it again)."""
    declares = getattr(cls, "declares", None)
    return bool(declares("shardable")) if declares is not None else bool(vars(cls).get("shardable", False))


def check_processes(devices: Any, num_nodes: Any, strategy: str) -> tuple[int, int, str]:
    """``(devices, num_nodes, strategy)`` checked: processes per machine and machines (ints >= 1; ``devices`` may
    be a digit string), and a strategy that fits their product (``"auto"``/``"single_device"`` for one process,
    ``"auto"``/``"ddp"`` for several: each process trains its own clients, so several give ``"ddp"``)."""
    devices = check_int("devices (processes per node)", int(devices) if isinstance(devices, str) and devices.isdigit()
                        else devices, 1)
    num_nodes = check_int("num_nodes", num_nodes, 1)
    world_size = devices * num_nodes
    allowed = ("auto", "single_device") if world_size == 1 else ("auto", "ddp")
    if strategy not in allowed:
        raise ValueError(f"strategy={strategy!r} with {world_size} process(es): each process trains its own "
                         f"clients with one worker; allowed: {', '.join(repr(a) for a in allowed)}")
    return devices, num_nodes, "ddp" if world_size > 1 else strategy


def check_machines_meet(num_nodes: int, environment: Any, environ: Mapping[str, str]) -> None:
    """Refuse ``num_nodes`` > 1 under Lightning's plain environment (no cluster scheduler) when this machine has
    no ``NODE_RANK`` (or ``GROUP_RANK``), ``MASTER_ADDR`` or ``MASTER_PORT`` (each machine would pick a port of its
    own): the run would wait for machines never started; and a ``NODE_RANK`` outside ``0 .. num_nodes - 1`` or a
    ``MASTER_PORT`` that is no port."""
    if num_nodes == 1 or type(environment).__name__ != "LightningEnvironment":
        return  # one machine, or a scheduler's environment (SLURM, torchelastic, ...) that sets the ranks itself
    missing = [name for name, present in (("NODE_RANK", "NODE_RANK" in environ or "GROUP_RANK" in environ),
                                          ("MASTER_ADDR", "MASTER_ADDR" in environ),
                                          ("MASTER_PORT", "MASTER_PORT" in environ)) if not present]
    if missing:
        names = " and ".join(missing) if len(missing) < 3 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        raise ValueError(f"num_nodes={num_nodes}: {names} not set, so the other machines cannot be "
                         "found; start the same command on each machine with MASTER_ADDR=<the first machine's "
                         "address> MASTER_PORT=<a free port> NODE_RANK=<0 on the first, 1, 2, ...> (docs/devices.md, "
                         "\"Several machines\"), or set num_nodes=1")
    name = "NODE_RANK" if "NODE_RANK" in environ else "GROUP_RANK"
    node = environ[name].strip()
    if not (node.isascii() and node.isdigit() and int(node) < num_nodes):
        raise ValueError(f"{name}={environ[name]!r}: with num_nodes={num_nodes} each machine's {name} is one of "
                         f"0 .. {num_nodes - 1} (0 on the first machine, the one at MASTER_ADDR)")
    port = environ["MASTER_PORT"].strip()
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"MASTER_PORT={environ['MASTER_PORT']!r} is no TCP port: give an integer in 1 .. 65535, a "
                         "free port of the first machine, the same on every machine")


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_releasing = False


def release_at_exit() -> None:
    """Destroy the process group when the interpreter exits, while it is still whole (idempotent).

    Left to its destructor during the interpreter's finalization, a gloo group's worker threads can still hold
    work whose tensors need the GIL, and the process aborts after its run ("terminate called without an active
    exception", SIGABRT: pytorch/pytorch#190489; seen after sharded DisPFL-family and Ditto runs). Called once
    every process ended its run together (a process that failed alone could leave a collective the
    destruction would wait on), so the group also stays usable after ``fit`` returns (the store's reads)."""
    global _releasing
    if not _releasing:
        atexit.register(_destroy_process_group)
        _releasing = True


def check_shardable(algorithm: Any, callbacks: list[Any]) -> None:
    """Raise ``ValueError`` unless the algorithm and every callback can run sharded."""
    if not _opted_in(type(algorithm)):
        from lightning_dfl.federation.algorithms import ALGORITHMS

        # the class names, as --trainer.algorithm takes them (the registry's lowercase names are not accepted there)
        able = [ALGORITHMS.get(name).__name__ for name in ALGORITHMS.names() if _opted_in(ALGORITHMS.get(name))]
        raise ValueError(f"{type(algorithm).__name__} cannot shard its clients across processes yet; use devices=1, "
                         f"or one of: {', '.join(able)}")
    for callback in callbacks:
        hooks = defined_hooks(callback, TASK_HOOKS)
        if hooks and not speaks_shard_protocol(callback):
            raise ValueError(f"callback {type(callback).__name__} changes state in task hooks ({', '.join(hooks)}) "
                             f"but does not implement the sharding protocol ({', '.join(SHARD_PROTOCOL)}; see "
                             "lightning_dfl.federation.loop.sharded); use devices=1")


class _LoggedAccounting(RoundAccounting):
    """A process's share of a round's accounting, with its transfers kept to replay elsewhere."""

    def __init__(self, round_idx: int, observer: Any = None) -> None:
        super().__init__(round_idx, observer=observer)
        self.log: list[tuple[int, int, int, int]] = []

    def transfer(self, sender: int, receiver: int, value_bytes: int, index_bytes: int = 0, *,
                 notify: bool = True) -> None:
        super().transfer(sender, receiver, value_bytes, index_bytes, notify=notify)
        self.log.append((sender, receiver, value_bytes, index_bytes))


class ShardedExecutor(SerialExecutor):
    """Runs a plan level by level with each level's tasks spread over the Fabric processes."""

    #: a task's callbacks' changes travel to the other processes as it ends: its finite check is read first
    selects_without_reading = False

    @classmethod
    def check_run(cls, algorithm: Any, callbacks: list[Any]) -> None:
        """:func:`check_shardable`."""
        check_shardable(algorithm, callbacks)

    @classmethod
    def create(cls, state: FederationState, settings: Any) -> ShardedExecutor:
        """The sharded executor with the settings' ``tasks_per_receive``."""
        return cls(state, settings.tasks_per_receive)

    def __init__(self, state: FederationState, tasks_per_receive: int | None = None) -> None:
        super().__init__(state)
        #: with a partitioned store, the tasks per process whose sources are received at a time (None: a level's)
        self.tasks_per_receive = tasks_per_receive
        ownership = state.ownership
        if ownership.world_size != state.worker.fabric.world_size:
            raise ValueError(f"the federation's ownership spans {ownership.world_size} process(es), Fabric runs "
                             f"{state.worker.fabric.world_size}: build the state with Ownership.of_fabric(fabric)")
        self.ownership, self.rank, self.world_size = ownership, ownership.rank, ownership.world_size
        # a gloo group carries the CPU store and the pickled deltas whatever the accelerator's backend
        self.group = ownership.group
        #: bytes of store state this process has broadcast (as a task's owner), over the run
        self.broadcast_bytes = 0

    def _stateful(self) -> list[Any]:
        t = self.state
        return [obj for obj in (t.algorithm, *t.callbacks) if speaks_shard_protocol(obj)]

    def owner(self, node: int) -> int:
        """The process that runs ``node``'s tasks: its owner (:mod:`~lightning_dfl.federation.loop.ownership`)."""
        return self.ownership.owner(node)

    def run(self, plan: RoundPlan, evaluate: bool, accounting: RoundAccounting | None = None,
            exchange: int = 0) -> RoundAccounting:
        run = self.plan_run(plan, evaluate, accounting, exchange)
        mine = _LoggedAccounting(plan.round_idx, observer=run.accounting.observer)  # its own told in its tasks
        own = dataclasses.replace(run, accounting=mine)  # what this process's tasks record
        stateful = self._stateful()
        self.begin_round(plan)
        partitioned = isinstance(self.state.store, PartitionedStore)
        for level in plan.levels():
            before = [obj.shard_snapshot() for obj in stateful]
            deltas: dict[int, list[Any]] = {}
            for chunk in self._chunks(level):
                if partitioned:  # each process receives what its tasks read, from the owners
                    self._receive([level[position] for position in chunk])
                for position in chunk:
                    task = level[position]
                    if self.owner(task.node) != self.rank:
                        continue
                    marks = [obj.shard_snapshot() for obj in stateful]
                    self.run_task(task, own)
                    deltas[position] = [obj.shard_delta(m) for obj, m in zip(stateful, marks)]
            for obj, mark in zip(stateful, before):
                obj.shard_rollback(mark)
            if not partitioned:
                self._sync_store([task.node for task in level])
            for task in level:  # every process has the level's models now; none reads the old ones again
                self.reads_done(task)
            gathered: list[dict[int, list[Any]]] = [{} for _ in range(self.world_size)]
            dist.all_gather_object(gathered, deltas, group=self.group)
            for position, task in enumerate(level):
                for obj, delta in zip(stateful, gathered[self.owner(task.node)][position]):
                    obj.shard_apply(delta)
        self.state.progress.end_tasks()
        shares: list[Any] = [None] * self.world_size
        mine.read_device_values()  # numbers, not device tensors, travel between processes
        dist.all_gather_object(shares, (mine.records, mine.log), group=self.group)
        for rank, (records, log) in enumerate(shares):
            run.accounting.records.extend(records)
            for transfer in log:
                run.accounting.transfer(*transfer, notify=rank != self.rank)  # the owner told its own in its task
        return run.accounting

    def _chunks(self, level: list[Any]) -> list[list[int]]:
        """The level's task positions in the groups whose sources are received together: all at once, or
        (``tasks_per_receive``) group ``i`` holds each process's ``i``-th run of that many of its tasks; every
        process runs its own tasks in level order either way."""
        if self.tasks_per_receive is None:
            return [list(range(len(level)))]
        size = self.tasks_per_receive
        chunks: list[list[int]] = []
        for rank in range(self.world_size):
            mine = [position for position, task in enumerate(level) if self.owner(task.node) == rank]
            for i in range(0, len(mine), size):
                if len(chunks) <= i // size:
                    chunks.append([])
                chunks[i // size].extend(mine[i:i + size])
        return [sorted(chunk) for chunk in chunks]

    def _receive(self, tasks: list[Any]) -> None:
        """Every process receives the sources ``tasks`` read from their owners (:meth:`PartitionedStore.receive`);
        with ``tasks_per_receive``, it first frees what it received for earlier tasks and these do not read."""
        store = self.state.store
        routes = level_routes(tasks, self.owner)
        if self.tasks_per_receive is not None:
            store.keep_only((r.receiver, r.node, r.fresh) for r in routes)
        store.receive(dataclasses.astuple(r) for r in routes)

    @torch.no_grad()
    def _sync_store(self, nodes: list[int]) -> None:
        """Every task's owner broadcasts what the task wrote to the store, packed by dtype."""
        store = self.state.store
        for node in nodes:
            owner = self.owner(node)
            views = store.task_views(node)
            by_dtype: dict[torch.dtype, list[Tensor]] = {}
            for view in views:
                by_dtype.setdefault(view.dtype, []).append(view.view(torch.uint8) if view.dtype == torch.bool else view)
            for parts in by_dtype.values():
                flat = torch.cat([p.reshape(-1) for p in parts])
                dist.broadcast(flat, src=owner, group=None if flat.is_cuda else self.group)
                if owner == self.rank:
                    self.broadcast_bytes += flat.numel() * flat.element_size()
                if owner != self.rank:
                    offset = 0
                    for p in parts:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
            if owner != self.rank:
                store.mark_published(node)
