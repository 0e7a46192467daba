"""``build_federation``: a run's set-up, from its settings, algorithm, callbacks, model and data to the pieces
the round loop runs: Fabric (built once, with the module as its callback), the engine's record
(:class:`~lightning_dfl.federation.loop.state.FederationState`) with the client store, the round planner
and the executor the settings ask for (serial, sharded across processes, or batched).

The order is the run's contract: the data and the algorithm's checks first, then Fabric and the device (seeded),
the module's placement and speed settings, the optimizer, what each executor refuses (before the store is
allocated), the store, and the algorithm's initial state.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation.algorithms.context import RunSpec
from lightning_dfl.federation.loop import step_graphs
from lightning_dfl.federation.loop.batched import BatchedExecutor
from lightning_dfl.federation.loop.callback_hooks import HookDispatch
from lightning_dfl.federation.loop.clock import Clock
from lightning_dfl.federation.loop.executor import SerialExecutor
from lightning_dfl.federation.loop.ownership import Ownership
from lightning_dfl.federation.loop.planner import RoundPlanner
from lightning_dfl.federation.loop.rendezvous import meet_machines
from lightning_dfl.federation.loop.sharded import ShardedExecutor, check_machines_meet
from lightning_dfl.federation.loop.state import FederationState, RoundProgress
from lightning_dfl.federation.loop.step_graphs import StepGraphs, check_graphable
from lightning_dfl.federation.loop.worker import Worker
from lightning_dfl.federation.store.factory import build_store, state_fields
from lightning_dfl.federation.store.memory import check_least_store_fits
from lightning_dfl.federation.trainer.kernel_settings import (
    apply_benchmark,
    apply_matmul_precision,
    apply_memory_format,
    input_converter,
    resolve_memory_format,
    slow_bfloat16,
)
from lightning_dfl.federation.trainer.settings import RunSettings
from lightning_dfl.module import SparseClassifier

__all__ = ["BuiltFederation", "build_federation", "executor_for"]


@dataclasses.dataclass(frozen=True)
class BuiltFederation:
    """What :func:`build_federation` returns: the pieces the round loop runs."""

    fabric: Fabric
    state: FederationState
    planner: RoundPlanner
    executor: SerialExecutor


def _store_on_cpu(settings: RunSettings) -> bool:
    """Whether the client store will be on the CPU: asked for, or no CUDA GPU to hold it."""
    import torch

    return settings.store_device == "cpu" or settings.accelerator == "cpu" or not torch.cuda.is_available()


def build_federation(settings: RunSettings, algorithm: Any, callbacks: list[Any], clock: Clock,
                     model: SparseClassifier, datamodule: FederatedDataModule, owner: Any, history: list[dict[str, float]],
                     executor_factory: Callable[[FederationState], SerialExecutor] | None = None) -> BuiltFederation:
    """Set a run up (module docstring). ``owner`` is what the callbacks' hooks receive as the trainer, ``history``
    the list the rounds' metrics are appended to (a checkpoint restores it); ``executor_factory``
    (``state -> executor``) replaces the executor the settings ask for."""
    if not isinstance(model, SparseClassifier):
        raise ValueError(f"model must be a SparseClassifier, got {type(model).__name__}")
    if not isinstance(datamodule, FederatedDataModule):
        raise ValueError(f"datamodule must be a FederatedDataModule, got {type(datamodule).__name__}")
    # a model too large for the data, or a dense store of it too large for the memory: refused before the data loads
    least = model.check_for(datamodule)
    if least is not None:
        check_least_store_fits(settings.store, _store_on_cpu(settings), least,
                               datamodule.num_clients + algorithm.num_servers, settings.num_nodes)
    datamodule.setup("fit")
    num_clients = datamodule.num_clients
    algorithm.validate(num_clients)
    clock.setup(num_clients, algorithm.num_servers, settings.seed)  # refuses client_speeds of another length now
    model.build_for(datamodule)
    algorithm.setup(model, datamodule)
    # the module is Fabric's callback: it re-masks the weights after every optimizer step
    fabric = Fabric(**settings.fabric_kwargs(), callbacks=[model])
    executor_type = executor_for(settings)  # its checks hold with an executor_factory too
    executor_type.check_run(algorithm, callbacks)  # before any process starts
    if settings.tasks_per_receive is not None and not type(algorithm).declares("partitionable"):
        raise ValueError(f"tasks_per_receive={settings.tasks_per_receive!r} bounds the sources each process receives "
                         f"from a partitioned store, but {type(algorithm).__name__} keeps every node on every process "
                         "(partitionable = False: docs/devices.md); leave it None (null)")
    environment = getattr(fabric.strategy, "cluster_environment", None)
    check_machines_meet(settings.num_nodes, environment, os.environ)
    if fabric.world_size > 1:  # clients sharded across processes
        # the machines meet within rendezvous_timeout; the first one's store then serves the process group's
        meeting = meet_machines(settings.num_nodes, environment, settings.rendezvous_timeout)
        fabric.launch()
        del meeting
    if settings.cpu_threads is not None:  # after the launch: Fabric's launcher sets CPUs / local processes itself
        import torch

        torch.set_num_threads(settings.cpu_threads)
    fabric.seed_everything(settings.seed, verbose=False)
    if fabric.world_size > 1:  # no DDP wrapper: each process trains other clients, nothing is all-reduced
        fabric.strategy.precision.convert_module(model).to(fabric.device)
    else:
        fabric.setup_module(model)  # device placement and the precision's dtype
    model.check_optimizer_range(next(model.model.parameters()).dtype)
    memory_format = resolve_memory_format(settings.memory_format, model.model)
    apply_memory_format(model.model, memory_format)
    apply_matmul_precision(settings.matmul_precision, fabric.device)
    apply_benchmark(settings.benchmark)
    slow = slow_bfloat16(getattr(fabric.strategy.precision, "precision", ""), fabric.device)
    if slow is not None:
        rank_zero_warn(slow)
    model.mask.to(fabric.device)
    optimizer = fabric.setup_optimizers(algorithm.make_optimizer(model))
    executor_type.check_worker(algorithm, callbacks, model, optimizer, settings.precision)  # before the store
    graphs = _step_graphs(settings, algorithm, callbacks, model, optimizer, fabric) if settings.cuda_graphs else None
    # "true" precisions (bf16-true, 64-true) need inputs in the module's dtype; mixed ones autocast
    plugin = fabric.strategy.precision
    convert_input = input_converter(None if isinstance(plugin, MixedPrecision) else plugin.convert_input,
                                    memory_format)
    tensors = {n: t for n, t in model.model.state_dict(keep_vars=False).items() if t.is_floating_point()}
    fields = state_fields(algorithm, callbacks, owner, model)
    ownership = Ownership.of_fabric(fabric)
    # several processes: each holds only its own nodes when the algorithm reads others as sources only
    partition = ownership if type(algorithm).declares("partitionable") else None
    store = build_store(settings.store, settings.store_device, tensors, model, fields, num_clients,
                        num_clients + algorithm.num_servers, algorithm.personal_masks, settings.seed, fabric.device,
                        fabric.world_size // settings.num_nodes, partition)
    sample_counts = tuple(datamodule.client_train_size(k) for k in range(num_clients))
    planner = RoundPlanner(algorithm, clock, num_clients, settings.rounds, sample_counts, store, settings.seed,
                           settings.dropout, settings.deadline)
    spec = RunSpec(seed=settings.seed, rounds=settings.rounds, num_clients=num_clients,
                   local_epochs=settings.local_epochs, local_steps=settings.local_steps, eval_every=settings.eval_every,
                   checkpoint_every=settings.checkpoint_every, precision=settings.precision,
                   result_settings=settings.result_settings(fabric.device))
    worker = Worker(module=model, optimizer=optimizer, fabric=fabric, datamodule=datamodule, tensors=tensors,
                    convert_input=convert_input, step_graphs=graphs)
    state = FederationState(spec=spec, worker=worker, algorithm=algorithm, callbacks=callbacks,
                            call=HookDispatch(owner, callbacks, model), store=store, clock=clock,
                            progress=RoundProgress(history=history), ownership=ownership)
    executor = executor_factory(state) if executor_factory is not None else executor_type.create(state, settings)
    algorithm.init_state(store, num_clients)
    return BuiltFederation(fabric, state, planner, executor)


def _step_graphs(settings: RunSettings, algorithm: Any, callbacks: list[Any], model: SparseClassifier,
                 optimizer: Any, fabric: Fabric) -> StepGraphs:
    """The worker's captured steps (``cuda_graphs``); ValueError when the device or the run cannot have them."""
    backend = step_graphs.graph_backend(fabric.device)
    if backend is None:
        raise ValueError(f"cuda_graphs: true needs a CUDA GPU; this run's device is {fabric.device} "
                         "(set accelerator: gpu, or cuda_graphs: false)")
    check_graphable(algorithm, model, settings.precision, callbacks)
    return StepGraphs(backend, model, optimizer)


def executor_for(settings: RunSettings) -> type[SerialExecutor]:
    """The executor class the settings ask for: sharded (several processes), batched, or serial."""
    if settings.world_size > 1:
        return ShardedExecutor
    return BatchedExecutor if settings.batched_clients else SerialExecutor
