"""``FederationState``: the engine's record of one federation, built once when ``fit`` sets up.

Three parts, each with one kind of value: the run's fixed values (:class:`~lightning_dfl.federation.algorithms.context.RunSpec`: seed, sizes, the settings a
checkpoint's identity holds), the worker (:class:`~lightning_dfl.federation.loop.worker.Worker`: module, optimizer,
Fabric, tensors, batches), and the round's progress (:class:`RoundProgress`: the round, the running task, the
metrics history), beside the algorithm, the callbacks with their hook dispatch, the client store and the clock.
What the executors (serial, sharded, batched), the contexts and the checkpoints read. The trainer builds the
record and runs the loop over it; nothing below the trainer imports the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_dfl.federation.algorithms.context import EvaluationContext, RunSpec, TaskContext
from lightning_dfl.federation.exchange.aggregation import masked_average
from lightning_dfl.federation.loop.clock import Clock
from lightning_dfl.federation.loop.ownership import Ownership
from lightning_dfl.federation.loop.worker import Worker
from lightning_dfl.federation.metrics.evaluation import global_test_metrics, shared_model_metrics
from lightning_dfl.federation.store.protocol import ClientStore, stream_published

__all__ = ["FederationState", "RoundProgress", "SOURCES_PER_FETCH"]

#: the shared model's sources a process holds at a time while averaging them (:func:`stream_published`)
SOURCES_PER_FETCH = 16


@dataclass(eq=False)
class RoundProgress:
    """Where the run is: the round (written by the trainer's loop), the running task (by the executors: its
    client, its context and its training batches; ``None`` between tasks), and the rounds' metrics (by the
    trainer; a checkpoint restores them)."""

    round_idx: int = 0
    #: the client whose task is running
    client: int | None = None
    #: the running task's context: callbacks' field writes for its client are staged there
    task: TaskContext | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    #: what callbacks logged for the round's row (``trainer.log_metrics``), cleared as each round starts
    logged: dict[str, float] = field(default_factory=dict)
    #: the round's tasks planned so far (its exchanges' plans, as each starts) and those ended, on this process
    tasks_planned: int = 0
    tasks_ended: int = 0
    #: ``listener(tasks_ended, tasks_planned)`` after each task ends: the progress bar's count inside a round
    listener: Callable[[int, int], None] | None = None

    def start_round(self, round_idx: int) -> None:
        """Round ``round_idx`` starts: nothing logged, no task planned yet."""
        self.round_idx = round_idx
        self.logged.clear()
        self.tasks_planned = self.tasks_ended = 0

    def plan_started(self, num_tasks: int) -> None:
        """An exchange's plan of ``num_tasks`` tasks starts."""
        self.tasks_planned += num_tasks

    def task_ended(self) -> None:
        """A task of the round has ended (trained and published, or contained)."""
        self.tasks_ended += 1
        if self.listener is not None:
            self.listener(self.tasks_ended, self.tasks_planned)

    def start_task(self, ctx: TaskContext) -> None:
        """``ctx``'s task runs: its client and its context are the running ones (its batches once drawn)."""
        self.client, self.task = ctx.node, ctx

    def end_tasks(self) -> None:
        """No task runs (between tasks, or after a plan)."""
        self.client = self.task = None


@dataclass(eq=False)
class FederationState:
    """One federation's engine record (see the module docstring)."""

    spec: RunSpec
    worker: Worker
    algorithm: Any
    callbacks: list[Any]
    #: ``call(hook, *args)``: the callbacks' hook dispatch (:class:`HookDispatch`)
    call: Callable[..., None]
    store: ClientStore
    clock: Clock
    progress: RoundProgress = field(default_factory=RoundProgress)
    #: the run's diagnostics (they hear every transfer), or ``None``
    diag: Any = None
    #: which process owns each node (:mod:`~lightning_dfl.federation.loop.ownership`; one process: all)
    ownership: Ownership = field(default_factory=Ownership)

    def task_context(self, task: Any, exchange: int) -> TaskContext:
        """The context of ``task`` (exchange ``exchange`` of the running round) on the worker, with the callbacks."""
        return TaskContext(task=task, round_idx=self.progress.round_idx, exchange=exchange, spec=self.spec,
                           worker=self.worker, store=self.store, call=self.call, local_epochs=self.spec.local_epochs,
                           local_steps=self.spec.local_steps, step_graphs=self.worker.step_graphs)

    # -- the round's end -----------------------------------------------------------------------
    def shared_model(self) -> tuple[dict[str, Tensor], dict[str, Tensor]] | None:
        """The algorithm's shared model (the average of its :meth:`~Algorithm.consensus_sources`) and the
        mask it is tested with; ``None`` when it has none."""
        sources = self.algorithm.consensus_sources(self.spec.num_clients)
        if not sources:
            return None
        pairs = [(s.node, s.fresh) for s in sources]
        store = self.store
        mask = store.broadcast_mask(sources[0].node)  # the first one's, from its owner where each holds its own
        # masked_average reads the sources in order, source by source: streamed, a few brought at a time from
        # their owners (and a compact store's rebuilt one at a time), so no (K, ...) copy is ever held
        with stream_published(store, pairs, SOURCES_PER_FETCH) as (weights, masks):
            return masked_average(weights, masks), mask

    def consensus_metrics(self) -> dict[str, float]:
        """The shared model (if any) tested on every client's test set (``acc/consensus_*``; each process tests
        the clients it owns), or on the official test split when the algorithm's headline is ``"global"``."""
        shared = self.shared_model()
        if shared is None:
            return {}
        average, mask = shared
        worker = self.worker
        worker.module.mask.load_(mask, apply=False)
        worker.load(average)
        if self.algorithm.headline == "global":
            return global_test_metrics(worker.module, worker.fabric, worker.global_test_batches())
        return shared_model_metrics(worker.module, worker.fabric, self.spec.num_clients, worker.test_batches,
                                    owners=self.ownership)

    def evaluation_context(self, round_idx: int, evaluates: bool) -> EvaluationContext:
        """What :meth:`~Algorithm.evaluate_round` may use at ``round_idx``'s end."""
        return EvaluationContext(round_idx=round_idx, evaluates=evaluates, spec=self.spec, worker=self.worker,
                                 store=self.store, shared_model=self.shared_model, owners=self.ownership)
