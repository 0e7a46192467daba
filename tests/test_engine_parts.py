"""The engine's record in its three parts (the run's fixed values, the worker, the round's progress), the contexts
that refer to them, and the executor class the settings choose."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, RunSettings, Task
from lightning_dfl.federation.algorithms import DisPFL, Local
from lightning_dfl.federation.loop.batched import BatchedExecutor
from lightning_dfl.federation.loop.executor import SerialExecutor
from lightning_dfl.federation.loop.sharded import ShardedExecutor
from lightning_dfl.federation.trainer.build import executor_for
from lightning_dfl.module import SparseClassifier


class SeesProgress(FederatedCallback):
    """Records what the trainer says of the running task, inside and between tasks."""

    def __init__(self) -> None:
        self.inside, self.between = [], []

    def on_client_train_end(self, trainer, pl_module, client_id):
        self.inside.append((int(client_id), trainer.current_client, trainer.train_dataloader is not None))

    def on_federated_round_end(self, trainer, pl_module):
        self.between.append((trainer.current_client, trainer.train_dataloader))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    seen = SeesProgress()
    trainer = FederatedTrainer(algorithm=Local(), rounds=2, local_epochs=1, logger=False, enable_progress_bar=False,
                               accelerator="cpu", callbacks=[seen], seed=3,
                               default_root_dir=str(tmp_path_factory.mktemp("parts")))
    trainer.fit(SparseClassifier(arch="cnn_digits", density=0.5), FederatedDataModule(num_clients=3))
    return trainer, seen


def test_the_run_spec_is_frozen_and_holds_the_settings(fitted):
    trainer, _ = fitted
    spec = trainer.federation.spec
    assert (spec.seed, spec.rounds, spec.num_clients, spec.local_epochs) == (3, 2, 3, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rounds = 5


def test_a_task_context_refers_to_the_worker_and_the_spec_it_copies_nothing(fitted):
    trainer, _ = fitted
    federation, worker = trainer.federation, trainer.federation.worker
    ctx = federation.task_context(Task(node=1), exchange=0)
    assert ctx.module is trainer.module and ctx.optimizer is worker.optimizer and ctx.fabric is worker.fabric
    assert (ctx.seed, ctx.num_rounds, ctx.num_clients, ctx.round_idx) == (3, 2, 3, 1)
    copy = ctx.worker_weights()
    name = next(iter(copy))
    assert torch.equal(copy[name], worker.tensors[name]) and copy[name].data_ptr() != worker.tensors[name].data_ptr()
    weights, _ = trainer.store.published(2)
    ctx.load_weights(weights)  # into the module itself: every context sees it
    assert all(torch.equal(worker.tensors[n], weights[n]) for n in weights)
    assert all(torch.equal(t, weights[n]) for n, t in trainer.worker_tensors.items())
    evaluation = federation.evaluation_context(1, True)
    assert evaluation.module is ctx.module and evaluation.local_epochs == 1
    fine_tune = evaluation.task(0, 1, local_epochs=3, local_steps=None, train_batches=None)
    assert fine_tune.worker is worker and fine_tune.local_epochs == 3 and fine_tune.step_graphs is None


def test_the_progress_names_the_running_task_and_nothing_between_tasks(fitted):
    trainer, seen = fitted
    assert seen.inside and all(client == current and batches for client, current, batches in seen.inside)
    assert seen.between == [(None, None), (None, None)]
    assert trainer.federation.progress.round_idx == 1 and len(trainer.federation.progress.history) == 2


def test_the_settings_choose_the_executor_class_and_each_class_checks_what_it_runs():
    assert executor_for(RunSettings(accelerator="cpu")) is SerialExecutor
    assert executor_for(RunSettings(accelerator="cpu", batched_clients=True)) is BatchedExecutor
    assert executor_for(RunSettings(accelerator="cpu", devices=2, strategy="ddp")) is ShardedExecutor
    SerialExecutor.check_run(DisPFL(), [])
    ShardedExecutor.check_run(DisPFL(), [])
    with pytest.raises(ValueError, match="OptedOut cannot shard its clients"):
        class OptedOut(DisPFL):
            shardable = False

        ShardedExecutor.check_run(OptedOut(), [])
    module = SparseClassifier(arch="cnn_digits", density=0.5)
    module.build_for(FederatedDataModule(num_clients=3))
    optimizer = torch.optim.Adam(module.parameters())
    SerialExecutor.check_worker(Local(), [], module, optimizer, "32-true")
    with pytest.raises(ValueError, match="only one-group SGD is batched"):
        BatchedExecutor.check_worker(Local(), [], module, optimizer, "32-true")
