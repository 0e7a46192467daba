"""``FederatedTrainer``: a federated run's settings, its set-up and the round loop, on one worker under Fabric.

The loop is explicit, as in Fabric's build-your-own-trainer example: :func:`build_federation` sets the run up once;
per round :func:`~lightning_dfl.federation.loop.rounds.run_exchanges` plans, runs and times the exchanges, and
the metrics go to the Lightning loggers (:mod:`~lightning_dfl.federation.metrics.report`). Callbacks receive named hooks
on the way. Nothing below this module imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger

from lightning_dfl import startup
from lightning_dfl.allocator import tune_allocator
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.errors import RunDiverged, mark_in_round, writing
from lightning_dfl.federation.algorithms import Algorithm, DisPFL
from lightning_dfl.federation.algorithms.base import check_plans
from lightning_dfl.federation.loop.callback_hooks import merge_callbacks
from lightning_dfl.federation.loop.clock import Clock, build_clock
from lightning_dfl.federation.loop.executor import SerialExecutor
from lightning_dfl.federation.loop.rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT
from lightning_dfl.federation.loop.rounds import run_exchanges
from lightning_dfl.federation.loop.sharded import release_at_exit
from lightning_dfl.federation.loop.state import FederationState
from lightning_dfl.federation.metrics import report
from lightning_dfl.federation.metrics.diagnostics import RunDiagnostics
from lightning_dfl.federation.trainer.build import build_federation
from lightning_dfl.federation.trainer.checkpoint import (
    check_resume_request,
    checkpoint_left,
    load_checkpoint,
    save_checkpoint,
)
from lightning_dfl.federation.trainer.closed_stdout import tolerating_closed_stdout
from lightning_dfl.federation.trainer.interrupts import Interrupted, stop_requests
from lightning_dfl.federation.trainer.run_folder import RunFolderLock, check_unused
from lightning_dfl.federation.trainer.settings import RunSettings
from lightning_dfl.federation.trainer.view import TrainerView
from lightning_dfl.module import SparseClassifier


class FederatedTrainer(TrainerView):
    """Trains a federation of clients that share one architecture.

    Args:
        algorithm: the federated algorithm (DisPFL, D-PSGD, Local, FedAvg, ...).
        rounds: communication rounds T.
        local_epochs: local epochs E per round (``None``: 5, or none when ``local_steps`` is set; 0: no local
            training, a round only exchanges and aggregates).
        local_steps: if set, each client runs exactly this many optimizer steps per round instead of
            ``local_epochs`` epochs (PSFL's local work; passes over the data restart as needed). Setting
            both is refused: set the other to ``None``.
        eval_every: evaluate every this many rounds (the last round always).
        accelerator: the device type: ``"cpu"``, ``"gpu"``/``"cuda"``, ``"mps"`` or ``"auto"`` (Lightning's).
        devices: processes per machine (an int); more than one in all shards the clients' tasks across them.
        precision: Lightning's precision (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"64-true"``, ...).
        strategy: ``"auto"``, or ``"ddp"`` with several processes (tasks sharded, no gradient all-reduce).
        num_nodes: machines; ``devices x num_nodes`` processes in all, whose results are those of one process.
        rendezvous_timeout: with ``num_nodes`` > 1, seconds the machines have to meet, else the run stops (it does
            not bound training's transfers).
        callbacks: Lightning callbacks; they receive the training hooks and, where they define them, the
            federated hooks of each round and client (on_federated_round_start, on_client_end, ...).
        logger: a Lightning logger, ``True``/``None`` for a CSV logger, ``"tensorboard"`` for a
            TensorBoard logger, ``False`` for none.
        default_root_dir: where loggers write (``<root>/<algorithm>/version_N``).
        seed: seed of every random stream (topology, sampling, data order, masks).
        client_speeds: relative compute speed of each client for the simulated clock (a task
            takes ``1 / speed`` time units; default all 1); a shortcut for ``clock=Clock(speeds=...)``.
        clock: the simulated clock (:class:`~lightning_dfl.federation.loop.clock.Clock`: per-client compute
            times, fixed or drawn with per-round noise, and transfer times); default unit times.
        store_device: where client states live: ``"auto"`` the worker's GPU when the store fits with a quarter
            of its memory left for training, else the CPU (the choice is logged); ``"cpu"``; ``"worker"`` the
            worker's device, whatever it is.
        store: the client store's backend: ``"dense"`` (two dense slots per node) or ``"compact"``
            (each node's active values plus packed mask bits, bit-identical results; see
            :mod:`~lightning_dfl.federation.store.compact`).
        enable_progress_bar: show a progress bar over rounds and a summary at the end.
        checkpoint_every: save the federation's state every this many rounds (and after the last)
            to ``<run folder>/checkpoints/last.ckpt``; 0 never. ``fit(..., ckpt_path=...)`` resumes from it.
        cpu_threads: if set, ``torch.set_num_threads(cpu_threads)`` before training, from 1 to the CPUs the
            process may use. Small models train several times faster on one thread than on many (intra-op
            overhead).
        dropout: each round each client is inactive with this probability (DisPFL App. B.6): it
            neither trains nor sends, and its neighbours aggregate what they received; in ``[0, 1)``.
        deadline: simulated time per round after which tasks are dropped (stragglers: a client whose
            task would finish later neither trains nor sends this round); ``None``: no deadline.
        resume_allow: settings that may differ from the checkpoint's when resuming with
            ``fit(..., ckpt_path=...)`` (e.g. ``["model/lr"]``); ``rounds``, ``eval_every`` and
            ``checkpoint_every`` may always change.
        diagnostics: log the run's diagnostics (``diag/*``: spectral gap of the realized mixing matrix,
            consensus distance, mask Jaccard and flips; the bytes and mask-Jaccard matrices in
            ``<log_dir>/diagnostics/``; :mod:`~lightning_dfl.federation.metrics.diagnostics`): ``True``, ``False``
            or ``"auto"`` (on when K <= 100).
        diag_every: compute the diagnostics every this many rounds (the last always).
        batched_clients: train each plan level's clients together with ``torch.func`` (stacked
            parameters, ``vmap``; :mod:`~lightning_dfl.federation.loop.batched`): the same results up to
            float rounding, for the default local loop in 32-true or 64-true on models without dropout
            (ResNet18, VGG11, the CNNs; BatchNorm's running statistics are stacked per client).
        batched_group_size: with ``batched_clients``, at most this many clients per batched step; ``None``
            (default): as many as fit in a share of the device's free memory, measured on the first task's batch.
        tasks_per_receive: on several processes with a partitioned store (docs/devices.md), each process receives
            the sources of at most this many of its tasks at a time and frees them before the next ones arrive
            (a record read by tasks in several such groups is sent again); ``None`` (default): a whole plan level's
            sources at once. The same results; less memory, more traffic.
        memory_format: the layout of 4-D weights and batches: ``"auto"`` (channels-last for models with 2-D
            convolutions: faster kernels; other rounding), ``"channels_last"`` or ``"contiguous"`` (NCHW).
        matmul_precision: ``torch.set_float32_matmul_precision``: ``"auto"`` (``"high"``, TF32, on GPUs with
            tensor cores, as Lightning recommends; else unchanged), ``"highest"``, ``"high"`` or ``"medium"``.
        benchmark: ``torch.backends.cudnn.benchmark``, as Lightning's: ``True`` times cuDNN's algorithms per
            shape (rounding may differ between runs), ``False`` takes its heuristics, ``None`` leaves it.
        cuda_graphs: on a CUDA GPU, replay each local step's closure from a CUDA graph (same results).
        overwrite: write over a run folder that holds an earlier run's files (they are removed first); ``False``
            (default) refuses it unless the run resumes from a checkpoint in it. A folder is written by one run at a
            time: a second run on it is refused (:mod:`~lightning_dfl.federation.trainer.run_folder`).
        tune_allocator: keep freed activation buffers in the heap, not returned to the OS after every batch
            (glibc's ``mallopt``; :mod:`lightning_dfl.allocator`); ``False`` leaves the allocator as it is.
    """

    is_federated = True

    def __init__(
        self,
        algorithm: Algorithm | None = None,
        rounds: int = 100,
        local_epochs: int | None = None,
        local_steps: int | None = None,
        eval_every: int = 1,
        accelerator: str = "auto",
        devices: int | str = 1,
        precision: str | int | None = None,
        strategy: str = "auto",
        num_nodes: int = 1,
        rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT,
        callbacks: list[Callback] | Callback | None = None,
        logger: Logger | bool | str | None = True,
        default_root_dir: str = "runs",
        seed: int = 0,
        client_speeds: Sequence[float] | None = None,
        clock: Clock | None = None,
        store_device: str = "auto",
        store: str = "dense",
        enable_progress_bar: bool = True,
        checkpoint_every: int = 0,
        cpu_threads: int | None = None,
        dropout: float = 0.0,
        deadline: float | None = None,
        resume_allow: Sequence[str] = (),
        diagnostics: bool | str = "auto",
        diag_every: int = 1,
        batched_clients: bool = False,
        batched_group_size: int | None = None,
        tasks_per_receive: int | None = None,
        memory_format: str = "auto",
        matmul_precision: str = "auto",
        benchmark: bool | None = None,
        cuda_graphs: bool = False,
        tune_allocator: bool = True,
        overwrite: bool = False,
    ) -> None:
        self.algorithm = algorithm if algorithm is not None else DisPFL()
        if not isinstance(self.algorithm, Algorithm):
            raise ValueError(f"algorithm must be an Algorithm (DisPFL, DPSGD, Local, FedAvg, ...), "
                             f"got {type(self.algorithm).__name__}")
        check_plans(self.algorithm)
        #: the run's settings, checked (:class:`~lightning_dfl.federation.trainer.settings.RunSettings`); read by name too
        self.settings = RunSettings(**{k: v for k, v in locals().items() if k in RunSettings.__dataclass_fields__})
        self.clock = build_clock(client_speeds, clock)
        self.callbacks = merge_callbacks(self.algorithm.callbacks(), callbacks)
        self.logger = report.build_logger(logger, default_root_dir, self.algorithm.run_name())
        #: the command line that started the run (set by the CLI), for the resume hint
        self.command_line: list[str] | None = None
        #: files written into the run folder when the run starts (the CLI's ``config.yaml``), by name
        self.run_files: dict[str, str] = {}
        self.history: list[dict[str, float]] = []
        self.summary: report.RunSummary | None = None
        #: built by ``fit``: Fabric, the engine's record, the planner, the executor, the reporter, the diagnostics
        self.fabric = self.federation = self.planner = self.executor = self.reporter = self.diag = None
        #: ``state -> executor``; ``None``: the serial one (or the sharded / batched one the settings ask for)
        self.executor_factory: Callable[[FederationState], SerialExecutor] | None = None
        self._datamodule: FederatedDataModule | None = None
        self._fitted = False  # a trainer runs one fit, see :meth:`fit`
        #: whether stdout's reader went away during fit (the run went on; its printed output is cut short)
        self.stdout_closed = False

    def _call(self, hook: str, *args: Any) -> None:
        self.federation.call(hook, *args)

    # -- set-up --------------------------------------------------------------------------------
    def _setup(self, model: SparseClassifier, datamodule: FederatedDataModule) -> None:
        self._datamodule = datamodule
        federation = build_federation(self.settings, self.algorithm, self.callbacks, self.clock, model, datamodule,
                                      self, self.history, self.executor_factory)
        self.fabric, self.federation = federation.fabric, federation.state
        self.planner, self.executor = federation.planner, federation.executor
        if not self.is_global_zero:
            self.logger = None  # process 0 writes the run folder
        for callback in self.callbacks:
            callback.setup(self, model, "fit")
        self.reporter = report.RoundReporter(self.logger, self.is_global_zero)

    def _start_run(self, model: SparseClassifier, datamodule: FederatedDataModule) -> None:
        """The run starts (set-up and resume checked): its diagnostics, hyperparameters and folder."""
        s = self.settings
        if s.diagnoses(self.num_clients):
            with writing(s.default_root_dir):  # the run folder is made for the diagnostics' files
                self.diag = RunDiagnostics(self.num_clients, self.num_clients + self.algorithm.num_servers, s.rounds,
                                           s.seed, s.diag_every, [n for n, _ in model.model.named_parameters()],
                                           self.log_dir if self.is_global_zero else None)
        self.federation.diag = self.diag  # the diagnostics hear every transfer
        self.reporter.start_run({"algorithm": repr(self.algorithm), "rounds": s.rounds, "local_epochs": s.local_epochs,
                                 "seed": s.seed, "num_clients": self.num_clients, **dict(model.hparams),
                                 **{f"data/{k}": v for k, v in datamodule.hparams.items()}},
                                self.run_files, s.default_root_dir)

    # -- the loop ------------------------------------------------------------------------------
    def fit(self, model: SparseClassifier, datamodule: FederatedDataModule,
            ckpt_path: str | None = None) -> report.RunSummary:
        """Run all rounds (from ``ckpt_path``'s next round when given); return and print the summary.

        A trainer runs one fit: a second call is refused (its metrics, history and run folder would continue the
        first run's); build a new trainer for a new run, or resume with ``ckpt_path``.

        Args:
            ckpt_path: a checkpoint to resume from (``<run folder>/checkpoints/last.ckpt``).
        """
        if self._fitted:
            raise ValueError("this FederatedTrainer already ran fit once; a trainer runs one fit (a second would "
                             "append to the first run's history and metrics.csv): build a new FederatedTrainer, "
                             "or resume with fit(..., ckpt_path=...) on a new one")
        self._fitted = True
        s = self.settings
        if s.tune_allocator:  # before the data and the store are allocated
            tune_allocator()
        check_resume_request(ckpt_path, s.resume_allow)  # a missing or damaged file fails before any set-up
        self._setup(model, datamodule)
        lock = RunFolderLock()
        try:
            with tolerating_closed_stdout() as stdout:  # "fit ... | head" trains on and writes its results
                try:
                    return self._fit(model, datamodule, ckpt_path, lock)
                finally:
                    self.stdout_closed = stdout.closed_by_reader
        finally:
            lock.release()
            startup.fit_ended()

    def _fit(self, model: SparseClassifier, datamodule: FederatedDataModule, ckpt_path: str | None,
             lock: RunFolderLock) -> report.RunSummary:
        """:meth:`fit` once set up: the checkpoint loaded, the run folder locked (``lock``), the rounds."""
        s = self.settings
        first_round = (load_checkpoint(self.federation, ckpt_path, s.resume_allow, rounds=s.rounds)
                       if ckpt_path is not None else 0)
        self._last_checkpoint = (Path(ckpt_path), first_round) if ckpt_path is not None else None
        writes = self.logger is not None or s.checkpoint_every > 0  # else it writes no file there
        if self.is_global_zero and writes:  # process 0 writes the folder: one run at a time, never over an earlier one
            with writing(s.default_root_dir):  # the logger's version folder is made here
                folder = self.run_folder
            lock.acquire(folder)
            check_unused(folder, ckpt_path, s.overwrite)
        self._start_run(model, datamodule)
        if first_round:
            self.reporter.replay(self.history, Path(ckpt_path).parent.parent)
        if self.diag is not None:
            if first_round:
                self.diag.replay(Path(ckpt_path).parent.parent, first_round)
            self.diag.start(self.store, [datamodule.client_label_counts(k) for k in range(self.num_clients)],
                            getattr(datamodule, "client_groups", None))
        self._call("on_fit_start")
        self._call("on_train_start")
        self._startup_s = startup.seconds_waited()
        start = time.perf_counter()
        with stop_requests(self._abandon) as stop, report.progress_bar(
                s.rounds, enabled=s.enable_progress_bar and self.is_global_zero, completed=first_round) as bar:
            self.federation.progress.listener = bar.tasks
            for round_idx in range(first_round, s.rounds):
                try:
                    metrics = self.run_round(round_idx)
                except RunDiverged as err:  # the rounds before it are the run's results: summarized, then it stops
                    mark_in_round(err, round_idx)
                    raise self._diverged(err, round_idx, time.perf_counter() - start) from err
                except Exception as err:  # after validation: a bug (see lightning_dfl.errors)
                    mark_in_round(err, round_idx)
                    raise
                last = round_idx == s.rounds - 1
                stopping = self._agreed(stop.requested)  # a signal to any process stops them all after this round
                if stopping or (s.checkpoint_every and ((round_idx + 1) % s.checkpoint_every == 0 or last)):
                    done = f"stopped after round {round_idx + 1} of {s.rounds}"  # a second signal waits for the file
                    with stop.hold(lambda code, done=done: self._interrupted(code, done)):
                        save_checkpoint(self.federation, self.checkpoint_path)  # process 0 writes
                    self._last_checkpoint = (self.checkpoint_path, round_idx + 1)
                bar.advance(metrics)
                if stopping and not last:  # every process stops here, together
                    if self.fabric.world_size > 1:
                        release_at_exit()
                    raise self._interrupted(stop.exit_code, f"stopped after round {round_idx + 1} of {s.rounds}")
        self._finish(model, first_round, time.perf_counter() - start)
        return self.summary

    def _diverged(self, err: RunDiverged, round_idx: int, wall_s: float) -> RunDiverged:
        """A run that diverged in ``round_idx``: the summary of the rounds before it (``stopped`` says why it
        ends there), written to ``summary.json`` by process 0 where the run has a folder; the error to raise."""
        if not self.history:
            return err
        what = f"diverged in round {round_idx + 1} of {self.settings.rounds}"
        self.summary = report.RunSummary.from_history(self.algorithm, self.history, wall_s, self.log_dir,
                                                      stopped=what, startup_s=self._startup_s,
                                                      checkpoint=self._checkpoint_written())
        if self.is_global_zero and self.log_dir:
            self.summary.save(self.log_dir)
            n = len(self.history)
            where = f"{Path(self.log_dir) / 'summary.json'} summarizes {f'rounds 1 to {n}' if n > 1 else 'round 1'}."
        else:
            where = ""
        text = str(err).rstrip()
        stopped = RunDiverged(f"{text}{' ' if text.endswith('.') else '. '}{where}" if where else text)
        stopped.__dict__.update(err.__dict__)  # its round mark
        return stopped

    def _agreed(self, requested: bool) -> bool:
        """Whether any process was asked to stop (one process: ``requested``)."""
        if self.fabric.world_size == 1:
            return requested
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.federation.ownership.group)
        return bool(flag)

    def _finish(self, model: SparseClassifier, first_round: int, wall_s: float) -> None:
        """The run's summary, the end hooks, the logger's last write and the callbacks' teardown."""
        earlier = sum(m.get("time/wall_round_s", 0.0) for m in self.history[:first_round])
        self.summary = report.RunSummary.from_history(self.algorithm, self.history, earlier + wall_s, self.log_dir,
                                                      report.mean_client_density(self.store, self.num_clients),
                                                      startup_s=self._startup_s, checkpoint=self._checkpoint_written())
        self.reporter.warn_without_accuracy(self.summary, self.settings.deadline)
        if self.federation.worker.step_graphs is not None:
            self.federation.worker.step_graphs.report(type(self.algorithm).__name__)
        self._call("on_train_end")
        self._call("on_fit_end")
        if self.logger is not None:
            with writing(self.reporter.metrics_file()):
                self.logger.finalize("success")
        for callback in self.callbacks:
            callback.teardown(self, model, "fit")
        if self.settings.enable_progress_bar and self.is_global_zero:
            report.print_summary(self.summary)
        if self.fabric.world_size > 1:  # every process ends its run before any returns (none left running alone)
            self.fabric.barrier()
            release_at_exit()

    def _checkpoint_written(self) -> str | None:
        """The run's last checkpoint on disk (written by it, or the one it resumed from), if any."""
        return str(self._last_checkpoint[0]) if self._last_checkpoint is not None else None

    def _interrupted(self, exit_code: int, what: str) -> Interrupted:
        return Interrupted.after(exit_code, what, self.checkpoint_path, self.command_line)

    def _abandon(self, exit_code: int) -> Interrupted:
        """A second signal: stop at once; the last checkpoint on disk (if any) resumes."""
        return self._interrupted(exit_code, f"abandoned round {self.current_round + 1} of {self.settings.rounds}")

    def run_round(self, round_idx: int) -> dict[str, float]:
        """Plan and run one round (its exchanges); log and return its metrics."""
        wall = time.perf_counter()
        self.federation.progress.start_round(round_idx)  # what callbacks log this round (``log_metrics``) is cleared
        evaluate = self.settings.evaluates(round_idx)
        outcome = run_exchanges(round_idx, evaluate, self.planner, self.executor, self.store, self.clock, self.diag,
                                lambda: self._call("on_federated_round_start"))
        outcome.check_finite(self.settings.rounds, checkpoint_left(self._last_checkpoint, self.settings.checkpoint_every))
        metrics = outcome.metrics(self.num_clients, self.clock)
        self.reporter.warn_partial(round_idx, metrics, self.num_clients, evaluate)
        if evaluate:
            metrics.update(self.federation.consensus_metrics())
        evaluated = self.algorithm.evaluate_round(self.federation.evaluation_context(round_idx, evaluate))
        self._call("on_federated_round_end")
        metrics.update(outcome.spread())
        if self.diag is not None:
            metrics.update(self.diag.end_round(round_idx, self.store))
        metrics.update({**evaluated, **self.federation.progress.logged})
        metrics.update(self.algorithm.round_metrics(metrics))
        self.reporter.update_best(metrics, self.history, self.algorithm.headline)
        metrics["time/wall_round_s"] = time.perf_counter() - wall
        self.history.append(metrics)
        self.reporter.log_round(round_idx, metrics, outcome.accounting.client_rows())
        return metrics
