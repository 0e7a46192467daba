"""``FederationState``: the engine's record of one federation, built once when ``fit`` sets up.

What the executors (serial, sharded, batched), the evaluation context and the checkpoints read: the
algorithm and the callbacks with their hook dispatch, the worker (module, optimizer, Fabric and the
worker's floating tensors), the data, the client store, the clock, the run's sizes, seed and
settings. The few values that change while a round runs live here too, written in one place each:
the round (the trainer's loop), the client in training and its batches (the executor), the metrics
history (the trainer; a checkpoint restores it). The trainer builds the record and runs the loop over
it; nothing below the trainer imports the trainer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.federation.aggregation import masked_average
from lightning_dfl.federation.clock import Clock
from lightning_dfl.federation.context import CountingBatches, EvaluationContext
from lightning_dfl.federation.evaluation import global_test_metrics, shared_model_metrics
from lightning_dfl.federation.plan import every_and_last
from lightning_dfl.federation.store.protocol import ClientStore
from lightning_dfl.transfers import copy_all_, to_device

__all__ = ["FederationState", "HookDispatch"]


class HookDispatch:
    """``dispatch(hook, *args)`` runs ``hook(owner, module, *args)`` on every callback that defines it, as
    Lightning calls its callbacks (with the trainer first). It holds its owner weakly: the record that
    keeps it does not keep a finished trainer, and its store, alive."""

    def __init__(self, owner: Any, callbacks: list[Any], module: Any) -> None:
        self._owner = weakref.ref(owner)
        self.callbacks, self.module = callbacks, module

    def __call__(self, hook: str, *args: Any) -> None:
        owner = self._owner()
        for callback in self.callbacks:
            fn = getattr(callback, hook, None)
            if callable(fn):
                fn(owner, self.module, *args)


@dataclass(eq=False)
class FederationState:
    """One federation's engine record (see the module docstring)."""

    algorithm: Any
    callbacks: list[Any]
    #: ``call(hook, *args)``: the callbacks' hook dispatch (:class:`HookDispatch`)
    call: Callable[..., None]
    module: Any
    optimizer: Any
    fabric: Any
    datamodule: Any
    store: ClientStore
    clock: Clock
    #: the worker's floating parameters and buffers by the store's names (what a task loads and publishes)
    worker: dict[str, Tensor]
    seed: int
    rounds: int
    num_clients: int
    local_epochs: int
    local_steps: int | None
    eval_every: int
    checkpoint_every: int
    precision: Any
    #: the precision's (and memory format's) conversion of a batch, or ``None``
    convert_input: Callable[[Any], Any] | None
    #: the run's diagnostics (they hear every transfer), or ``None``
    diag: Any = None
    #: the trainer's other settings that change results (a checkpoint's identity): dropout, deadline, ...
    result_settings: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    current_round: int = 0
    #: the client whose task is running (``None`` between tasks)
    current_client: int | None = None
    #: the running task's context (``None`` between tasks): callbacks' field writes for its client are staged there
    current_task: Any = None
    #: the running task's training batches (Lightning callbacks look for ``train_dataloader``)
    train_dataloader: CountingBatches | None = None
    #: the worker's captured local steps (``cuda_graphs``: :mod:`~lightning_dfl.federation.step_graphs`), or ``None``
    step_graphs: Any = None

    def evaluates(self, round_idx: int) -> bool:
        """Whether ``round_idx`` is an evaluated round: every ``eval_every``-th, and the last."""
        return every_and_last(round_idx, self.eval_every, self.rounds)

    def train_batches(self, client: int, generator: torch.Generator) -> CountingBatches:
        """The client's training batches drawn with ``generator``, on the worker's device, in the precision's
        input dtype."""
        return CountingBatches(self.datamodule.client_train_batches(client, generator, device=self.fabric.device),
                               self.convert_input)

    def test_batches(self, client: int) -> CountingBatches:
        """The client's test batches on the worker's device, in the precision's input dtype."""
        return CountingBatches(self.datamodule.client_test_batches(client, device=self.fabric.device),
                               self.convert_input)

    def global_test_batches(self) -> Iterable[tuple[Tensor, Tensor]]:
        """The official test split, normalised, on the worker's device in the precision's input dtype."""
        device = self.fabric.device
        for x, y in self.datamodule.test_dataloader():
            batch = (to_device(x, device), to_device(y, device))
            yield self.convert_input(batch) if self.convert_input is not None else batch

    # -- the worker and the round's end --------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: dict[str, Tensor]) -> None:
        """Copy ``weights`` into the worker's floating parameters and buffers (from a pinned store, overlapping)."""
        copy_all_((tensor, weights[name]) for name, tensor in self.worker.items())

    def shared_model(self) -> tuple[dict[str, Tensor], dict[str, Tensor]] | None:
        """The algorithm's shared model (the average of its :meth:`~Algorithm.consensus_sources`) and the
        mask it is tested with; ``None`` when it has none."""
        sources = self.algorithm.consensus_sources(self.num_clients)
        if not sources:
            return None
        # gather gives views and masked_average accumulates source by source: no (K, ...) copy
        average = masked_average(*self.store.gather([(s.node, s.fresh) for s in sources]))
        return average, self.store.mask(sources[0].node)

    def consensus_metrics(self) -> dict[str, float]:
        """The shared model (if any) tested on every client's test set (``acc/consensus_*``), or on the official
        test split when the algorithm's headline is ``"global"``."""
        shared = self.shared_model()
        if shared is None:
            return {}
        average, mask = shared
        self.module.mask.load_(mask, apply=False)
        self.load_weights(average)
        if self.algorithm.headline == "global":
            return global_test_metrics(self.module, self.fabric, self.global_test_batches())
        return shared_model_metrics(self.module, self.fabric, self.num_clients, self.test_batches)

    def evaluation_context(self, round_idx: int, evaluates: bool) -> EvaluationContext:
        """What :meth:`~Algorithm.evaluate_round` may use at ``round_idx``'s end."""
        return EvaluationContext(round_idx=round_idx, num_rounds=self.rounds, num_clients=self.num_clients,
                                 seed=self.seed, evaluates=evaluates, store=self.store, module=self.module,
                                 optimizer=self.optimizer, fabric=self.fabric, local_epochs=self.local_epochs,
                                 local_steps=self.local_steps, worker=self.worker, load_weights=self.load_weights,
                                 test_batches=self.test_batches, draw_train_batches=self.train_batches,
                                 shared_model=self.shared_model)
