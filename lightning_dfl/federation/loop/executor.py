"""Runs a round's plan: level by level, each task on the one worker, with accounting and the clock.

A task loads its node's state into the worker, receives its sources' messages, aggregates (or,
for a server, takes its server step), trains, lets the callbacks prune and search masks, and
publishes. The serial executor is the reference; the sharded (:mod:`~lightning_dfl.federation.loop.sharded`:
processes) and batched (:mod:`~lightning_dfl.federation.loop.batched`: ``torch.func``) executors walk the same
:meth:`RoundPlan.levels` and derive from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_dfl.deferred import accumulator_dtype, host_reads_are_cheap
from lightning_dfl.federation.algorithms.context import TaskContext
from lightning_dfl.federation.exchange.messages import PUBLISH_BOUND, dtype_bound
from lightning_dfl.federation.exchange.plan import RoundPlan, Task
from lightning_dfl.federation.loop.callback_hooks import defined_hooks, speaks_shard_protocol
from lightning_dfl.federation.loop.start_reads import StartReads
from lightning_dfl.federation.metrics.accounting import ClientRecord, RoundAccounting
from lightning_dfl.federation.store.fields import OPTIMIZER_FIELD, OPTIMIZER_STARTED

if TYPE_CHECKING:
    from lightning_dfl.federation.loop.state import FederationState


def _within_bound(tensors: Iterable[Tensor], bound: float = PUBLISH_BOUND) -> list[Tensor]:
    """0-dim bools, one per dtype, on the floating ``tensors``' device: every entry finite and of magnitude <=
    ``bound`` (:data:`~lightning_dfl.federation.exchange.messages.PUBLISH_BOUND` by default; a dtype's own largest value
    if smaller) (no read). One multi-tensor max-abs per dtype (``torch._foreach_norm`` of order infinity: a few
    kernel launches for the whole model on a GPU); NaN propagates into the maxima."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    checks = []
    for dtype, group in by_dtype.items():
        largest = torch.stack(torch._foreach_norm(group, math.inf))
        checks.append((largest <= min(bound, torch.finfo(dtype).max)).all())
    return checks


@dataclass(frozen=True)
class PlanRun:
    """What every task of a plan shares while the executor runs it: the round's ``accounting`` (records and
    bytes), whether the round ``evaluates``, and which of the round's exchanges the plan is."""

    accounting: RoundAccounting
    evaluates: bool
    exchange: int = 0


class SerialExecutor:
    """Runs every task of a plan in dependency order on the federation's one worker (``state``: the
    :class:`~lightning_dfl.federation.loop.state.FederationState` the trainer built)."""

    #: on an accelerator, a task may publish without reading its finite check (:meth:`_may_select`)
    selects_without_reading = True

    @classmethod
    def check_run(cls, algorithm: Any, callbacks: list[Any]) -> None:
        """Refuse (``ValueError`` naming the reason) an algorithm or callbacks this executor cannot run, before any
        process starts; the serial executor runs any."""

    @classmethod
    def check_worker(cls, algorithm: Any, callbacks: list[Any], module: Any, optimizer: Any, precision: Any) -> None:
        """Refuse a worker (module, optimizer, precision) this executor cannot train on, before the store is
        allocated; the serial executor trains any."""

    @classmethod
    def create(cls, state: FederationState, settings: Any) -> SerialExecutor:
        """The executor of ``state`` with the settings it takes."""
        return cls(state)

    def __init__(self, state: FederationState) -> None:
        self.state = state
        #: the plan's reads of start-of-round models still to come (:meth:`begin_round`), or ``None``
        self.reads: StartReads | None = None
        #: what callbacks counted in tasks whose finite check is not read yet: (record, [(callback, delta)])
        self._unsettled: list[tuple[ClientRecord, list[tuple[Any, Any]]]] = []

    def run(self, plan: RoundPlan, evaluate: bool, accounting: RoundAccounting | None = None,
            exchange: int = 0) -> RoundAccounting:
        """Run ``plan`` (exchange ``exchange`` of its round); add to ``accounting`` (records, bytes)."""
        run = self.plan_run(plan, evaluate, accounting, exchange)
        self.begin_round(plan)
        for level in plan.levels():
            for task in level:
                self.run_task(task, run)
                self.reads_done(task)
        self.state.progress.end_tasks()
        return run.accounting

    def plan_run(self, plan: RoundPlan, evaluate: bool, accounting: RoundAccounting | None,
                 exchange: int) -> PlanRun:
        """What :meth:`run`'s tasks share; a new accounting of the plan's round when none is given."""
        if accounting is None:
            accounting = RoundAccounting(plan.round_idx, observer=self.state.diag)
        return PlanRun(accounting, evaluate, exchange)

    def begin_round(self, plan: RoundPlan) -> None:
        """The plan starts: when the algorithm reads nothing but its plan's sources
        (:attr:`~Algorithm.reads_only_sources`), follow the plan's reads of start-of-round models
        (:class:`~lightning_dfl.federation.loop.start_reads.StartReads`) so that the store frees each one after its
        last read (:meth:`~lightning_dfl.federation.store.protocol.ClientStore.release_start`); else none is
        freed."""
        reads_only_sources = type(self.state.algorithm).declares("reads_only_sources")  # inherited unless changed
        self.reads = StartReads(plan, self.state.store.release_start) if reads_only_sources else None
        self.state.progress.plan_started(len(plan.tasks))

    def sources_read(self, task: Task) -> None:
        """``task`` has read its sources (its messages are built)."""
        if self.reads is not None:
            self.reads.started(task)

    def task_ended(self, task: Task) -> None:
        """``task`` has ended (its node has published, or it was contained)."""
        if self.reads is not None:
            self.reads.finished(task)
        self.state.progress.task_ended()

    def reads_done(self, task: Task) -> None:
        """``task`` has read its sources and ended (:meth:`sources_read`, :meth:`task_ended`)."""
        self.sources_read(task)
        self.task_ended(task)

    def run_task(self, task: Task, run: PlanRun) -> None:
        """One task: :meth:`start_task`, the algorithm's local training, :meth:`finish_task`. The executor's
        loop reports its reads after it (:meth:`reads_done`; the sharded executor once every process holds the
        level's models)."""
        started = self.start_task(task, run)
        if started is not None:
            ctx, record = started
            record.loss = self.state.algorithm.local_train(ctx)
            self.finish_task(ctx, record, run)

    def start_task(self, task: Task, run: PlanRun) -> tuple[TaskContext, ClientRecord] | None:
        """Everything before local training: messages, the server step (then done: ``None``) or the
        aggregation, the "aggregated" evaluation, the batches and the optimizer's set-up."""
        t, algorithm = self.state, self.state.algorithm
        store, worker, module, node = t.store, t.worker, t.worker.module, task.node
        ctx = t.task_context(task, run.exchange)
        messages = []
        for source in task.sources:
            message = algorithm.message(ctx, source)
            if source.node != node:  # a node's own model does not cross the network (the observer: diagnostics)
                run.accounting.transfer(source.node, node, message.value_bytes, message.index_bytes)
            messages.append(message)
        if not task.train:  # a server, or a gossip step: aggregate and publish
            store.publish(node, algorithm.server_step(ctx, messages), store.mask(node))
            return None
        t.progress.start_task(ctx)
        module.mask.load_(store.mask(node), apply=False)
        own, _ = store.published(node)
        worker.load(own)
        t.call("on_client_before_aggregation", node)
        aggregated = algorithm.aggregate(ctx, messages)
        if aggregated is not None:
            worker.load(aggregated)
        module.mask.apply_()
        density, forward_flops = module.density_and_flops()  # one read of the mask's counts
        record = ClientRecord(client=node, density=density)
        if run.evaluates:
            record.acc_aggregated = algorithm.evaluate(ctx, "aggregated")
        generator = ctx.generator("data")
        torch.manual_seed(ctx.seed_of("torch"))
        ctx.train_batches = worker.train_batches(node, generator)
        record.flops = 3 * forward_flops  # per sample, at the mask it trains under (x samples at the end)
        algorithm.configure_optimizer(ctx)
        self._restore_optimizer_state(ctx)
        return ctx, record

    def finish_task(self, ctx: TaskContext, record: ClientRecord, run: PlanRun) -> None:
        """Everything after local training (``record.loss`` set, the worker trained): the finite check, the
        callbacks' pruning, the algorithm's published fields, then :meth:`_publish` of the trained outcome where
        the check holds, else of the fallback (:meth:`_publish`). The check is read (an ``if``), except on an
        accelerator when nothing but selectable effects depends on it (:meth:`_may_select`): then it stays a
        device flag and the outcome is chosen by ``torch.where``."""
        batches = ctx.train_batches
        record.train_samples = batches.samples
        record.flops = record.train_samples * record.flops
        loss = record.loss if record.train_samples > 0 else None  # a task without samples has a NaN loss
        self._stage_optimizer_state(ctx)
        ok = self._finite_flag(loss, ctx.staged)
        if not (isinstance(ok, Tensor) and self._may_select(ctx, ok.device)):
            ok = bool(ok) and self._after_training(ctx)  # one read: weights, loss and staged fields together
        fields = self.state.algorithm.publish_fields(ctx) if ok is True else None
        if fields and not self._fields_within_bound(fields):  # e.g. a delta beyond its float16 field's range
            ok, fields = False, None
        self._publish(ctx, record, run, ok, fields)

    def _after_training(self, ctx: TaskContext) -> bool:
        """The callbacks' ``on_client_train_end`` (pruning, votes) on a finite task; ``False``, with what they
        counted taken back, when what they changed or recorded is not finite."""
        t = self.state
        recorders = [(c, c.shard_snapshot()) for c in t.callbacks if defined_hooks(c, ("on_client_train_end",))
                     and hasattr(c, "shard_snapshot") and hasattr(c, "shard_rollback")]
        mark = len(ctx.writes)
        t.call("on_client_train_end", ctx.node)
        recorded = ctx.written_since(mark)
        # a callback's change of the model (e.g. pruning) or its records staged with the task (e.g. a vote) must be
        # finite too: else the task is contained and what the callbacks counted of it is taken back
        if (self._changes_after_training() or recorded) and not self._finite(staged=recorded):
            for callback, mark in recorders:
                callback.shard_rollback(mark)
            return False
        return True

    def _publish(self, ctx: TaskContext, record: ClientRecord, run: PlanRun, ok: bool | Tensor,
                 fields: dict[str, Any] | None) -> None:
        """A task's one ending. Its outcome where ``ok``: the trained model and mask with ``fields`` and the task's
        staged writes, then the mask search (``on_client_end``) for the mask it trains with next. Its fallback
        otherwise (a non-finite, or too large: :data:`PUBLISH_BOUND`, update is discarded): its start-of-round
        model and mask, the next mask it had, no writes, no search; the record says so, and no neighbour ever
        receives a non-finite value. ``ok`` read (a ``bool``): chosen by ``if``; a device flag: by ``torch.where``
        (the same bits either way), the search runs and the round takes back what it counted when the flag turns
        out false (:meth:`settle`)."""
        t, store, worker, node = self.state, self.state.store, self.state.worker, ctx.node
        module = worker.module
        published_mask = module.mask.masks
        if ok is not True:  # the fallback, or a choice between it and the outcome
            own, own_mask = store.published(node)
            kept_mask = store.mask(node)  # every choice with it is made before set_mask writes over it
            if ok is False:
                ctx.staged.clear()  # the task's field writes go with its update
                worker.load(own)
                module.mask.load_(kept_mask, apply=False)
                published_mask = own_mask
            else:  # the callbacks' search below runs with autograd as after a read (RigL's gradient regrowth)
                with torch.no_grad():
                    for name, value in self._select(ok, worker.tensors, own).items():
                        worker.tensors[name].copy_(value)
                module.mask.load_(self._select(ok, module.mask.masks, kept_mask), apply=False)
                published_mask = self._select(ok, module.mask.masks, own_mask)
        if run.evaluates:  # the model the node publishes (pruned, if a callback pruned; or restored)
            record.acc_trained = t.algorithm.evaluate(ctx, "trained")
        self._commit(ctx)
        store.publish(node, own if ok is False else worker.tensors, published_mask, fields)
        if ok is False:
            record.contained = True
        else:
            self._search(ctx, record, ok, None if ok is True else kept_mask)
        run.accounting.records.append(record)
        t.progress.end_tasks()  # the task has ended: callbacks see no running client until the next one starts

    def _search(self, ctx: TaskContext, record: ClientRecord, ok: bool | Tensor, kept_mask: Any) -> None:
        """The callbacks' mask search (``on_client_end``) for the mask the node trains with next, its batches'
        dense FLOPs, and the task's report. Under a device flag ``ok`` the next mask is chosen (``kept_mask``
        where false), the counts are the flag's, and what the callbacks counted (their shard protocol: a general
        task effect) is kept to be taken back at the round's end should the flag be false."""
        t, module, batches = self.state, self.state.worker.module, ctx.train_batches
        search_from = batches.samples
        marks = [] if ok is True else [(c, c.shard_snapshot()) for c in t.callbacks
                                       if defined_hooks(c, ("on_client_end",))]
        t.call("on_client_end", ctx.node)
        if ctx.staged and ok is not True and not bool(ok):  # a record made with the search goes with the update
            ctx.staged.clear()
        self._commit(ctx)  # what a callback recorded after publishing (committed as before)
        drawn = batches.samples - search_from
        dense = 3 * module.flops_profile.dense_forward_flops()  # the regrowth score is a dense gradient
        if isinstance(ok, Tensor):
            t.store.set_mask(ctx.node, self._select(ok, module.mask.masks, kept_mask))
            record.search_samples = ok.long() * drawn
            record.flops = record.flops + ok.to(accumulator_dtype(ok.device)) * float(drawn * dense)
            record.contained = ~ok
            gained = [(c, c.shard_delta(mark)) for c, mark in marks]  # what this task's searches counted
            if gained:
                self._unsettled.append((record, gained))
        else:
            t.store.set_mask(ctx.node, module.mask.masks)
            record.search_samples = drawn
            record.flops += drawn * dense
        record.extra = dict(ctx.report)

    def _commit(self, ctx: TaskContext) -> None:
        """The task's staged field writes, committed to the store (with its update)."""
        for name, value in ctx.staged.items():
            self.state.store.write(ctx.node, name, value)
        ctx.staged.clear()

    # -- faults ----------------------------------------------------------------------------
    def _finite(self, loss: Tensor | float | None = None, staged: dict[str, Any] | None = None) -> bool:
        """:meth:`_finite_flag` read: one host synchronisation for all of them."""
        return bool(self._finite_flag(loss, staged))

    @torch.no_grad()
    def _finite_flag(self, loss: Tensor | float | None = None, staged: dict[str, Any] | None = None
                     ) -> Tensor | bool:
        """Whether every worker weight and buffer is finite and within :data:`PUBLISH_BOUND` (and ``loss``,
        when given, and every floating value of the task's ``staged`` field writes finite; NaN allowed in
        fields declared with a NaN fill), as a 0-dim bool on the worker's device (not read; ``False`` when a
        host value already says no). A model that is finite but larger would make its receivers' aggregates
        overflow: it is contained at its sender."""
        if loss is not None and not isinstance(loss, Tensor) and not math.isfinite(loss):
            return False
        checks = _within_bound(self.state.worker.tensors.values(), self.state.algorithm.message_bound())  # floating only
        if isinstance(loss, Tensor):
            checks.append(torch.isfinite(loss))
        specs = getattr(self.state.store, "field_specs", {})
        for name, value in (staged or {}).items():
            spec = specs.get(name)  # a field declared with a NaN fill ("not set yet") may hold NaN, never inf
            allow_nan = spec is not None and isinstance(spec.fill, float) and math.isnan(spec.fill)
            for part in (value.values() if isinstance(value, dict) else (value,)):
                if isinstance(part, Tensor) and part.is_floating_point() and part.numel():
                    ok = ~torch.isinf(part).any() if allow_nan else torch.isfinite(part).all()
                    checks.append(ok.to(checks[0].device if checks else part.device))
                elif isinstance(part, float) and (math.isinf(part) or (math.isnan(part) and not allow_nan)):
                    return False
        return torch.stack(checks).all() if checks else True

    @torch.no_grad()
    def _fields_within_bound(self, fields: dict[str, Any]) -> bool:
        """Whether every floating value the task publishes as a field is finite and fits the field's dtype and
        :data:`~lightning_dfl.federation.exchange.messages.PUBLISH_BOUND` (one read)."""
        specs = getattr(self.state.store, "field_specs", {})
        checks: list[Tensor] = []
        for name, value in fields.items():
            spec = specs.get(name)
            for part in (value.values() if isinstance(value, dict) else (value,)):
                if isinstance(part, Tensor) and part.is_floating_point() and part.numel():
                    dtype = spec.dtype if spec is not None and spec.dtype is not None else part.dtype
                    checks += _within_bound([part], dtype_bound(dtype))
                elif isinstance(part, float) and not math.isfinite(part):
                    return False
        return bool(torch.stack([c.to(checks[0].device) for c in checks]).all()) if checks else True  # one read

    def _changes_after_training(self) -> bool:
        """Whether a callback may change the trained worker before it is published (``on_client_train_end``)."""
        return any(defined_hooks(c, ("on_client_train_end",)) for c in self.state.callbacks)

    def _may_select(self, ctx: TaskContext, device: torch.device) -> bool:
        """Whether this task can publish without reading its finite check (:meth:`_publish` by ``torch.where``):
        on an accelerator, when nothing but the model, its mask and the next mask depends on the check (no staged
        field writes or kept optimizer state, no published fields, no per-client report, no callback that
        changes the trained model, and mask searches whose counts can be taken back: callbacks that speak the
        sharding protocol: :func:`~lightning_dfl.callbacks.base.speaks_shard_protocol`), with the store on the worker's
        device (a store in host memory would upload the start-of-round model to select from)."""
        t = self.state
        if not self.selects_without_reading or host_reads_are_cheap(device) or ctx.staged or ctx.report:
            return False
        store = torch.device(t.store.device)
        if store.type != device.type or (store.index or 0) != (device.index or 0):
            return False
        if t.algorithm.overrides("publish_fields") or self._changes_after_training():
            return False
        return all(speaks_shard_protocol(c) for c in t.callbacks if defined_hooks(c, ("on_client_end",)))

    @torch.no_grad()
    def _select(self, ok: Tensor, new: dict[str, Tensor], old: dict[str, Tensor]) -> dict[str, Tensor]:
        """``new`` where ``ok``, else ``old``, name by name (bit for bit either; nothing read)."""
        return {name: torch.where(ok, value, old[name]) for name, value in new.items()}

    def finish_round(self, accounting: RoundAccounting) -> None:
        """The round's tasks all ran: read their records' values from the device at once, then take back what
        the mask searches of contained tasks counted (:meth:`settle` needs the records read)."""
        accounting.read_device_values()
        self.settle()

    def settle(self) -> None:
        """After the round read its records (:meth:`RoundAccounting.read_device_values`): take back what the
        mask searches of contained tasks counted (their masks were never used)."""
        for record, gained in self._unsettled:
            if record.contained:
                for callback, delta in gained:
                    callback.shard_apply(-delta)
        self._unsettled.clear()

    # -- optimizer state kept per client -------------------------------------------------
    def _optimizer_entries(self, ctx: TaskContext) -> list[tuple[str, Tensor]]:
        """(store name, parameter) of every worker parameter the optimizer updates."""
        by_id = {id(p): name for name, p in self.state.worker.module.model.named_parameters()}
        return [(by_id[id(p)], p) for group in ctx.optimizer.param_groups for p in group["params"] if id(p) in by_id]

    @torch.no_grad()
    def _restore_optimizer_state(self, ctx: TaskContext) -> None:
        keys = self.state.algorithm.keep_optimizer_state
        if not keys:
            return
        state = ctx.optimizer.state
        state.clear()
        if not bool(ctx.store.read(ctx.node, OPTIMIZER_STARTED)):
            return  # its first round: the optimizer starts fresh
        for key in keys:
            values = ctx.store.read(ctx.node, OPTIMIZER_FIELD.format(key))
            for name, p in self._optimizer_entries(ctx):
                state[p][key] = values[name].to(p.device, p.dtype).clone()

    @torch.no_grad()
    def _stage_optimizer_state(self, ctx: TaskContext) -> None:
        """The kept optimizer state (:attr:`~Algorithm.keep_optimizer_state`) as staged field writes: committed
        with the task's update, discarded with it."""
        keys = self.state.algorithm.keep_optimizer_state
        if not keys:
            return
        entries, state = self._optimizer_entries(ctx), ctx.optimizer.state
        for key in keys:
            name = OPTIMIZER_FIELD.format(key)
            kept = {entry: state[p][key] for entry, p in entries if key in state.get(p, {})}
            ctx.write(name, {**ctx.store.read(ctx.node, name), **kept})  # the stored views where it holds none
        ctx.write(OPTIMIZER_STARTED, True)

