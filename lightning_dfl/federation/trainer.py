"""``FederatedTrainer``: runs a federation's rounds with one worker module under Fabric.

The loop is explicit, in the spirit of Fabric's build-your-own-trainer example: per round the
algorithm plans tasks, each task loads one client's state into the worker, aggregates, trains,
evaluates and publishes, callbacks receive named hooks on the way, and an accounting record
becomes one row of metrics in the Lightning loggers.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from torch import Tensor

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation.accounting import ClientRecord, RoundAccounting, mean_std
from lightning_dfl.federation.aggregation import masked_average
from lightning_dfl.federation.algorithms import Algorithm, DisPFL, RoundContext
from lightning_dfl.federation.checkpoint import load_checkpoint, save_checkpoint
from lightning_dfl.federation.plan import Task, clock_metrics
from lightning_dfl.federation.report import RunSummary, print_summary, progress_bar
from lightning_dfl.federation.state import ClientStore
from lightning_dfl.module import SparseClassifier
from lightning_dfl.seeding import derive_seed

_TRAIN_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward",
                "on_before_optimizer_step", "on_train_batch_end")


class CountingBatches:
    """An iterable of batches that counts the samples drawn from it (for FLOPs accounting) and
    converts their floating tensors with ``convert`` (the precision plugin's input dtype)."""

    def __init__(self, batches: Iterable[tuple[Tensor, Tensor]],
                 convert: Callable[[Any], Any] | None = None) -> None:
        self._batches = batches
        self._convert = convert
        self.samples = 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for batch in self._batches:
            self.samples += int(batch[1].shape[0])
            yield self._convert(batch) if self._convert is not None else batch

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]


class FederatedTrainer:
    """Trains a federation of clients that share one architecture.

    Args:
        algorithm: the federated algorithm (DisPFL, D-PSGD, Local, FedAvg, ...).
        rounds: communication rounds T.
        local_epochs: local epochs E per round.
        eval_every: evaluate every this many rounds (the last round always).
        accelerator, devices, precision, strategy: passed to ``lightning.fabric.Fabric``.
        callbacks: Lightning callbacks; they receive the training hooks and the federated hooks
            of :mod:`lightning_dfl.callbacks.base`.
        logger: a Lightning logger, ``True``/``None`` for a CSV logger, ``"tensorboard"`` for a
            TensorBoard logger, ``False`` for none.
        default_root_dir: where loggers write (``<root>/<algorithm>/version_N``).
        seed: seed of every random stream (topology, sampling, data order, masks).
        client_speeds: relative compute speed of each client for the simulated clock (a task
            takes ``1 / speed`` time units; default all 1).
        store_device: where client states live (``"cpu"``, or ``"worker"`` for the worker's device).
        enable_progress_bar: show a progress bar over rounds and a summary at the end.
        checkpoint_every: save the federation's state every this many rounds (and after the last)
            to :attr:`checkpoint_path`; 0 never. ``fit(..., ckpt_path=...)`` resumes from it.
        cpu_threads: if set, ``torch.set_num_threads(cpu_threads)`` before training. Small models
            train several times faster on one thread than on many (intra-op overhead).
    """

    is_federated = True

    def __init__(
        self,
        algorithm: Algorithm | None = None,
        rounds: int = 100,
        local_epochs: int = 5,
        eval_every: int = 1,
        accelerator: str = "auto",
        devices: int | str = 1,
        precision: str | int | None = None,
        strategy: str = "auto",
        callbacks: list[Callback] | Callback | None = None,
        logger: Logger | bool | str | None = True,
        default_root_dir: str = "runs",
        seed: int = 0,
        client_speeds: Sequence[float] | None = None,
        store_device: str = "cpu",
        enable_progress_bar: bool = True,
        checkpoint_every: int = 0,
        cpu_threads: int | None = None,
    ) -> None:
        self.algorithm = algorithm if algorithm is not None else DisPFL()
        if not isinstance(self.algorithm, Algorithm):
            raise ValueError(f"algorithm must be an Algorithm (DisPFL, DPSGD, Local, FedAvg, ...), "
                             f"got {type(self.algorithm).__name__}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        if local_epochs < 0:
            raise ValueError(f"local_epochs must be >= 0, got {local_epochs}")
        if eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {eval_every}")
        if devices not in (1, "1"):
            raise ValueError(f"devices={devices!r}: the federation trains all clients with one worker on one "
                             "device for now (sharding clients across processes is planned); use devices=1 and "
                             "pick the device with accelerator")
        if strategy not in ("auto", "single_device"):
            raise ValueError(f"strategy={strategy!r}: the federation runs one worker per process; "
                             "allowed: 'auto', 'single_device'")
        if store_device not in ("cpu", "worker"):
            raise ValueError(f"store_device must be 'cpu' or 'worker', got {store_device!r}")
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0: never), got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {cpu_threads}")
        self.cpu_threads = cpu_threads
        if client_speeds is not None and any(s <= 0 for s in client_speeds):
            raise ValueError(f"client_speeds must all be > 0, got {list(client_speeds)}")
        self.rounds = rounds
        self.local_epochs = local_epochs
        self.eval_every = eval_every
        self.seed = seed
        self.client_speeds = list(client_speeds) if client_speeds is not None else None
        self.store_device = store_device
        self.enable_progress_bar = enable_progress_bar
        self.default_root_dir = default_root_dir
        self._fabric_kwargs = {"accelerator": accelerator, "devices": 1, "precision": precision, "strategy": strategy}
        self.fabric = Fabric(**self._fabric_kwargs)  # validates accelerator and precision now; rebuilt in fit
        self.callbacks = self._merge_callbacks(callbacks)
        self.logger = self._build_logger(logger)
        self.current_round = 0
        self.current_client: int | None = None
        self.train_dataloader: CountingBatches | None = None
        self.history: list[dict[str, float]] = []
        self.summary: RunSummary | None = None
        self.store: ClientStore | None = None

    # -- properties Lightning callbacks look for ----------------------------------------
    @property
    def max_rounds(self) -> int:
        """T, the total rounds (the name Lightning callbacks look for)."""
        return self.rounds

    @property
    def num_clients(self) -> int:
        return self.datamodule.num_clients

    @property
    def is_global_zero(self) -> bool:
        return self.fabric.is_global_zero

    @property
    def global_rank(self) -> int:
        return self.fabric.global_rank

    @property
    def log_dir(self) -> str | None:
        return getattr(self.logger, "log_dir", None) if self.logger else None

    @property
    def checkpoint_path(self) -> Path:
        """Where checkpoints go: ``<log_dir>/checkpoints/last.ckpt`` (``default_root_dir`` without a logger)."""
        return Path(self.log_dir or self.default_root_dir) / "checkpoints" / "last.ckpt"

    @property
    def loggers(self) -> list[Logger]:
        return [self.logger] if self.logger else []

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Add metrics to the current round's row (callbacks use this)."""
        self._extra_metrics.update(metrics)

    def _merge_callbacks(self, callbacks: list[Callback] | Callback | None) -> list[Callback]:
        """The algorithm's callbacks in their order (a user instance of the same class takes the
        default's place, so e.g. voting still runs before PQI), then the user's other callbacks."""
        user = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
        merged: list[Callback] = []
        for default in self.algorithm.callbacks():
            replacement = next((c for c in user if type(c) is type(default)), None)
            merged.append(replacement if replacement is not None else default)
        return merged + [c for c in user if not any(c is m for m in merged)]

    def _build_logger(self, logger: Logger | bool | str | None) -> Logger | None:
        if logger is False:
            return None
        if isinstance(logger, Logger):
            return logger
        if logger in (True, None, "csv"):
            return CSVLogger(self.default_root_dir, name=self.algorithm.name)
        if logger == "tensorboard":
            try:
                import tensorboard  # noqa: F401
            except ImportError as err:
                raise ValueError("logger='tensorboard' needs TensorBoard: pip install -e '.[tensorboard]'") from err
            return TensorBoardLogger(self.default_root_dir, name=self.algorithm.name)
        raise ValueError(f"logger must be a Lightning Logger, True, False, 'csv' or 'tensorboard', got {logger!r}")

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            fn = getattr(callback, hook, None)
            if callable(fn):
                fn(self, self.module, *args)

    # -- setup --------------------------------------------------------------------------
    def _setup(self, model: SparseClassifier, datamodule: FederatedDataModule) -> None:
        if not isinstance(model, SparseClassifier):
            raise ValueError(f"model must be a SparseClassifier, got {type(model).__name__}")
        if not isinstance(datamodule, FederatedDataModule):
            raise ValueError(f"datamodule must be a FederatedDataModule, got {type(datamodule).__name__}")
        self.datamodule = datamodule
        datamodule.setup("fit")
        num_clients = datamodule.num_clients
        self.algorithm.validate(num_clients)
        if self.client_speeds is not None and len(self.client_speeds) != num_clients:
            raise ValueError(f"client_speeds has {len(self.client_speeds)} entries for {num_clients} clients")
        model.build(datamodule.num_classes, datamodule.in_channels, datamodule.image_size)
        self.module = model
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)
        # the module is Fabric's callback: it re-masks the weights after every optimizer step
        self.fabric = Fabric(**self._fabric_kwargs, callbacks=[model])
        self.fabric.seed_everything(self.seed, verbose=False)
        self.fabric.setup_module(model)  # device placement and the precision's dtype
        model.mask.to(self.fabric.device)
        self.optimizer = self.fabric.setup_optimizers(model.make_optimizer())
        # "true" precisions (bf16-true, 64-true) need inputs in the module's dtype; mixed ones autocast
        plugin = self.fabric.strategy.precision
        self._convert_input = None if isinstance(plugin, MixedPrecision) else plugin.convert_input
        self.worker = {n: t for n, t in model.model.state_dict(keep_vars=False).items() if t.is_floating_point()}
        store_device = "cpu" if self.store_device == "cpu" else self.fabric.device
        num_nodes = num_clients + self.algorithm.num_servers
        self.store = ClientStore(self.worker, list(model.mask.masks), num_nodes, device=store_device)
        shared_mask = model.mask.state()
        for node in range(num_nodes):
            if self.algorithm.personal_masks and node < num_clients:
                generator = torch.Generator().manual_seed(derive_seed(self.seed, "mask", node))
                mask = model.initial_masks(generator)
            else:
                mask = shared_mask
            self.store.initialize(node, self.worker, mask)
        self.sample_counts = tuple(datamodule.client_train_size(k) for k in range(num_clients))
        for callback in self.callbacks:
            callback.setup(self, model, "fit")
        if self.logger is not None:
            self.logger.log_hyperparams({
                "algorithm": repr(self.algorithm), "rounds": self.rounds, "local_epochs": self.local_epochs,
                "seed": self.seed, "num_clients": num_clients, **dict(model.hparams),
                **{f"data/{k}": v for k, v in datamodule.hparams.items()},
            })

    # -- the loop -----------------------------------------------------------------------
    def fit(self, model: SparseClassifier, datamodule: FederatedDataModule,
            ckpt_path: str | None = None) -> RunSummary:
        """Run all rounds (from ``ckpt_path``'s next round when given); return and print the summary."""
        self._setup(model, datamodule)
        first_round = load_checkpoint(self, ckpt_path) if ckpt_path is not None else 0
        self._call("on_fit_start")
        self._call("on_train_start")
        start = time.perf_counter()
        with progress_bar(self.rounds, enabled=self.enable_progress_bar and self.is_global_zero,
                          completed=first_round) as advance:
            for round_idx in range(first_round, self.rounds):
                metrics = self.run_round(round_idx)
                if self.checkpoint_every and ((round_idx + 1) % self.checkpoint_every == 0
                                              or round_idx == self.rounds - 1):
                    save_checkpoint(self, self.checkpoint_path)
                advance(metrics)
        self.summary = RunSummary.from_history(self.algorithm, self.history, time.perf_counter() - start,
                                               self.log_dir)
        self._call("on_train_end")
        self._call("on_fit_end")
        if self.logger is not None:
            self.logger.finalize("success")
        for callback in self.callbacks:
            callback.teardown(self, model, "fit")
        if self.enable_progress_bar and self.is_global_zero:
            print_summary(self.summary)
        return self.summary

    def run_round(self, round_idx: int) -> dict[str, float]:
        """Plan and run one round; log and return its metrics."""
        wall = time.perf_counter()
        self.current_round = round_idx
        self._extra_metrics: dict[str, float] = {}
        rng = np.random.default_rng(derive_seed(self.seed, "plan", round_idx))
        durations = self._durations()
        ctx = RoundContext(round_idx, self.rounds, self.num_clients, self.sample_counts, rng,
                           durations[:self.num_clients] if durations is not None else None)
        plan = self.algorithm.plan_round(ctx)
        self._call("on_federated_round_start")
        evaluate = (round_idx + 1) % self.eval_every == 0 or round_idx == self.rounds - 1
        accounting = RoundAccounting(round_idx)
        for task in plan.order():
            self._run_task(task, accounting, evaluate)
        self.current_client = None
        self.store.end_round()
        self._write_client_rows(accounting.client_rows())
        metrics = accounting.metrics()
        metrics.update({f"time/{k}": v for k, v in clock_metrics(plan, self._durations()).items()})
        if evaluate:
            metrics.update(self._consensus_metrics())
        self._call("on_federated_round_end")
        metrics.update(self._extra_metrics)
        self._update_best(metrics)
        metrics["time/wall_round_s"] = time.perf_counter() - wall
        self.history.append(metrics)
        if self.logger is not None:
            self.logger.log_metrics(metrics, step=round_idx)
        return metrics

    def _write_client_rows(self, rows: list[dict[str, Any]]) -> None:
        """Append per-client rows to ``<log_dir>/clients.csv`` (density, accuracy, FLOPs, bytes)."""
        if not rows or self.log_dir is None or not self.is_global_zero:
            return
        path = Path(self.log_dir) / "clients.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        new = self.current_round == 0 or not path.exists()
        with path.open("w" if new else "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)

    def _durations(self) -> tuple[float, ...] | None:
        """Simulated task durations per node (1 / speed; servers take no time); ``None``: all 1."""
        if self.client_speeds is None:
            return None
        return tuple(1.0 / s for s in self.client_speeds) + (0.0,) * self.algorithm.num_servers

    def _update_best(self, metrics: dict[str, float]) -> None:
        key = "acc/consensus_mean" if self.algorithm.headline == "consensus" else "acc/personal_mean"
        if key in metrics:
            metrics["acc/headline"] = metrics[key]
        previous = [m["acc/headline"] for m in self.history if "acc/headline" in m]
        if "acc/headline" in metrics or previous:
            metrics["acc/best"] = max(previous + ([metrics["acc/headline"]] if "acc/headline" in metrics else []))

    # -- one task -----------------------------------------------------------------------
    @torch.no_grad()
    def _load(self, weights: dict[str, Tensor]) -> None:
        for name, tensor in self.worker.items():
            tensor.copy_(weights[name])

    def _aggregate(self, task: Task) -> dict[str, Tensor]:
        weights, masks = self.store.gather([(s.node, s.fresh) for s in task.sources])
        receiver = self.store.mask(task.node)
        return masked_average(weights, masks, receiver_mask=receiver, coefficients=task.coefficients)

    def _run_task(self, task: Task, accounting: RoundAccounting, evaluate: bool) -> None:
        node, module = task.node, self.module
        mask_bits = self.store.masked_size() if self.algorithm.sends_masks else 0
        for source in task.receives_from():
            accounting.transfer(source.node, node, self.store.active_values(source.node, source.fresh), mask_bits)
        if not task.train:  # a server: aggregate and publish
            self.store.publish(node, self._aggregate(task), self.store.mask(node))
            return
        self.current_client = node
        module.mask.load_(self.store.mask(node), apply=False)
        own, _ = self.store.published(node)
        self._load(own)
        self._call("on_client_before_aggregation", node)
        if task.sources:
            self._load(self._aggregate(task))
        module.mask.apply_()
        record = ClientRecord(client=node, density=module.mask.density())
        test_batches = None
        if evaluate:
            test_batches = self._test_batches(node)
            record.acc_aggregated = self._accuracy(test_batches)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "data", self.current_round, node))
        torch.manual_seed(derive_seed(self.seed, "torch", self.current_round, node))
        batches = CountingBatches(self.datamodule.client_train_batches(node, generator, device=self.fabric.device),
                                  self._convert_input)
        self.train_dataloader = batches
        train_flops_per_sample = 3 * module.forward_flops()
        record.loss = self._train_local(batches)
        record.train_samples = batches.samples
        if evaluate:
            record.acc_trained = self._accuracy(test_batches)
        self._call("on_client_train_end", node)
        self.store.publish(node, self.worker, module.mask.masks)
        search_from = batches.samples
        self._call("on_client_end", node)
        self.store.set_mask(node, module.mask.masks)
        record.search_samples = batches.samples - search_from
        record.flops = record.train_samples * train_flops_per_sample + record.search_samples * 3 * module.forward_flops()
        accounting.records.append(record)
        self.train_dataloader = None

    def _train_local(self, batches: CountingBatches) -> float:
        module, optimizer = self.module, self.optimizer
        optimizer.state.clear()  # a fresh optimizer each round (papers README)
        for group in optimizer.param_groups:
            group["lr"] = module.lr_at(self.current_round)
        module.train()
        loss_sum, count = 0.0, 0
        for _ in range(self.local_epochs):
            self._call("on_train_epoch_start")
            for batch_idx, batch in enumerate(batches):
                self._call("on_train_batch_start", batch, batch_idx)
                with self.fabric.autocast():
                    loss = module.loss(batch)
                self._call("on_before_backward", loss)
                self.fabric.backward(loss)
                self._call("on_after_backward")
                self._call("on_before_optimizer_step", optimizer)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                self._call("on_train_batch_end", loss.detach(), batch, batch_idx)
                n = int(batch[1].shape[0])
                loss_sum += float(loss.detach()) * n
                count += n
            self._call("on_train_epoch_end")
        if count and not math.isfinite(loss_sum):
            raise FloatingPointError(f"client {self.current_client}: the training loss is not finite in round "
                                     f"{self.current_round}; lower the learning rate")
        return loss_sum / count if count else float("nan")

    def _test_batches(self, client: int) -> CountingBatches:
        """The client's test batches on the worker's device, in the precision's input dtype."""
        return CountingBatches(self.datamodule.client_test_batches(client, device=self.fabric.device),
                               self._convert_input)

    def _accuracy(self, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
        with self.fabric.autocast():
            correct, total, _ = self.module.evaluate(batches)
        return correct / total if total else float("nan")

    def _consensus_metrics(self) -> dict[str, float]:
        sources = self.algorithm.consensus_sources(self.num_clients)
        if not sources:
            return {}
        # gather gives views and masked_average accumulates source by source: no (K, ...) copy
        average = masked_average(*self.store.gather([(s.node, s.fresh) for s in sources]))
        self.module.mask.load_(self.store.mask(sources[0].node), apply=False)
        self._load(average)
        accs = [self._accuracy(self._test_batches(k)) for k in range(self.num_clients)]
        mean, std = mean_std(accs)
        return {"acc/consensus_mean": mean, "acc/consensus_std": std}
