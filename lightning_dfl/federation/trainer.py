"""``FederatedTrainer``: set-up and the round loop of a federation, on one worker under Fabric.

The loop is explicit, in the spirit of Fabric's build-your-own-trainer example: per round the
algorithm chooses the participants and plans tasks (:mod:`~lightning_dfl.federation.plan`), the
executor runs them level by level (:mod:`~lightning_dfl.federation.executor`), the clock times them
(:mod:`~lightning_dfl.federation.clock`), and the round's metrics go to the Lightning loggers
(:mod:`~lightning_dfl.federation.report`). Callbacks receive named hooks on the way.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger

from lightning_dfl.allocator import tune_allocator
from lightning_dfl.callbacks.base import check_supported
from lightning_dfl.checks import check_bool, check_int, check_output_path
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.errors import RunDiverged, mark_in_round, writing
from lightning_dfl.federation import step_graphs
from lightning_dfl.federation.accounting import RoundAccounting
from lightning_dfl.federation.algorithms import Algorithm, DisPFL
from lightning_dfl.federation.batched import batched_executor, check_batchable
from lightning_dfl.federation.checkpoint import load_checkpoint, save_checkpoint
from lightning_dfl.federation.checkpoint_io import check_file
from lightning_dfl.federation.clock import Clock, build_clock
from lightning_dfl.federation.compact_state import check_store_kind
from lightning_dfl.federation.context import CountingBatches, TaskFields
from lightning_dfl.federation.diagnostics import AUTO_MAX_K, RunDiagnostics, check_diagnostics, personal_spread
from lightning_dfl.federation.executor import SerialExecutor
from lightning_dfl.federation.federation_state import FederationState, HookDispatch
from lightning_dfl.federation.interrupts import Interrupted, resume_command, stop_requests
from lightning_dfl.federation.kernels import (
    apply_benchmark,
    apply_matmul_precision,
    apply_memory_format,
    check_benchmark,
    check_matmul_precision,
    check_memory_format,
    input_converter,
    resolve_memory_format,
    slow_bfloat16,
)
from lightning_dfl.federation.participation import RoundPlanner, check_faults
from lightning_dfl.federation.plan import every_and_last
from lightning_dfl.federation.report import (
    RoundReporter,
    RunSummary,
    build_logger,
    mean_client_density,
    print_summary,
    progress_bar,
)
from lightning_dfl.federation.sharding import ShardedExecutor, check_processes, check_shardable
from lightning_dfl.federation.state import ClientFields, ClientStore
from lightning_dfl.federation.step_graphs import StepGraphs, check_graphable
from lightning_dfl.federation.store_memory import (
    check_store_device,
)
from lightning_dfl.federation.store_setup import build_store, state_fields
from lightning_dfl.module import SparseClassifier
from lightning_dfl.seeding import derive_seed

#: the largest seed (NumPy's and Lightning's seeds are unsigned 32-bit integers)
MAX_SEED = 2**32 - 1
#: the accelerator names a run takes (Lightning's; a Lightning ``Accelerator`` instance is passed through)
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def check_accelerator(accelerator: object) -> None:
    """Refuse an accelerator this package cannot run on (TPUs, a name Lightning does not know) or that the machine
    lacks, naming the setting and the allowed names (Lightning's own message names neither)."""
    from lightning.fabric.accelerators import Accelerator
    from lightning.fabric.connector import _Connector
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if isinstance(accelerator, Accelerator):
        return
    allowed = ", ".join(ACCELERATORS)
    if accelerator not in ACCELERATORS:
        extra = " (lightning-dfl does not run on TPUs)" if str(accelerator).lower() == "tpu" else ""
        raise ValueError(f"accelerator={accelerator!r} is not supported{extra}; allowed: {allowed}")
    if accelerator in ("auto", "cpu"):
        return
    try:
        _Connector(accelerator=accelerator, devices=1)
    except (RuntimeError, ImportError, ValueError, MisconfigurationException) as err:
        message = " ".join(str(err).split())
        raise ValueError(f"accelerator={accelerator!r} is not available on this machine: {message} "
                         f"(allowed: {allowed}, where the machine has it)") from None  # the message holds the cause


class FederatedTrainer:
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
        callbacks: Lightning callbacks; they receive the training hooks and, where they define them, the
            federated hooks of each round and client (on_federated_round_start, on_client_end, ...).
        logger: a Lightning logger, ``True``/``None`` for a CSV logger, ``"tensorboard"`` for a
            TensorBoard logger, ``False`` for none.
        default_root_dir: where loggers write (``<root>/<algorithm>/version_N``).
        seed: seed of every random stream (topology, sampling, data order, masks).
        client_speeds: relative compute speed of each client for the simulated clock (a task
            takes ``1 / speed`` time units; default all 1); a shortcut for ``clock=Clock(speeds=...)``.
        clock: the simulated clock (:class:`~lightning_dfl.federation.clock.Clock`: per-client compute
            times, fixed or drawn with per-round noise, and transfer times); default unit times.
        store_device: where client states live: ``"auto"`` (the default) the worker's GPU when the store fits
            in its free memory with a quarter of it (at least 2 GiB) left for training, else the CPU (on a CPU run,
            always the CPU; the choice and its reason are logged on a GPU run); ``"cpu"``; ``"worker"`` the
            worker's device. A CPU store serving a GPU worker is pinned when twice its size fits in the host's
            available memory (asynchronous copies); see
            :func:`~lightning_dfl.federation.store_memory.resolve_store_device`.
        store: the client store's backend: ``"dense"`` (two dense slots per node) or ``"compact"``
            (each node's active values plus packed mask bits, bit-identical results; see
            :mod:`~lightning_dfl.federation.compact_state`).
        enable_progress_bar: show a progress bar over rounds and a summary at the end.
        checkpoint_every: save the federation's state every this many rounds (and after the last)
            to ``<run folder>/checkpoints/last.ckpt``; 0 never. ``fit(..., ckpt_path=...)`` resumes from it.
        cpu_threads: if set, ``torch.set_num_threads(cpu_threads)`` before training. Small models
            train several times faster on one thread than on many (intra-op overhead).
        dropout: each round each client is inactive with this probability (DisPFL App. B.6): it
            neither trains nor sends, and its neighbours aggregate what they received; in ``[0, 1)``.
        deadline: simulated time per round after which tasks are dropped (stragglers: a client whose
            task would finish later neither trains nor sends this round); ``None``: no deadline.
        resume_allow: settings that may differ from the checkpoint's when resuming with
            ``fit(..., ckpt_path=...)`` (e.g. ``["model/lr"]``); ``rounds``, ``eval_every`` and
            ``checkpoint_every`` may always change.
        diagnostics: log the run's diagnostics (``diag/*``: spectral gap of the realized mixing matrix,
            consensus distance, mask Jaccard and flips; the bytes and mask-Jaccard matrices in
            ``<log_dir>/diagnostics/``; :mod:`~lightning_dfl.federation.diagnostics`): ``True``, ``False``
            or ``"auto"`` (on when K <= 100).
        diag_every: compute the diagnostics every this many rounds (the last always).
        batched_clients: train each plan level's clients together with ``torch.func`` (stacked
            parameters, ``vmap``; :mod:`~lightning_dfl.federation.batched`): the same results up to
            float rounding, for the default local loop in 32-true or 64-true on models without dropout
            (ResNet18, VGG11, the CNNs; BatchNorm's running statistics are stacked per client).
        batched_group_size: with ``batched_clients``, at most this many clients per batched step (a level's
            clients are trained group by group); ``None`` (default): as many as fit in a share of the worker
            device's free memory, measured on a whole batch of the first task (the papers' ResNet18 takes ~1.4 GiB per
            client at batch 128).
        memory_format: the layout of 4-D weights and batches: ``"auto"`` (channels-last for models with 2-D
            convolutions: faster kernels; other rounding), ``"channels_last"`` or ``"contiguous"`` (NCHW).
        matmul_precision: ``torch.set_float32_matmul_precision``: ``"auto"`` (``"high"``, TF32, on GPUs with
            tensor cores, as Lightning recommends; else unchanged), ``"highest"``, ``"high"`` or ``"medium"``.
        benchmark: ``torch.backends.cudnn.benchmark``, as Lightning's: ``True`` times cuDNN's algorithms per
            shape (rounding may differ between runs), ``False`` takes its heuristics, ``None`` leaves it.
        cuda_graphs: on a CUDA GPU, replay each local step's closure from a CUDA graph (same results).
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
        memory_format: str = "auto",
        matmul_precision: str = "auto",
        benchmark: bool | None = None,
        cuda_graphs: bool = False,
        tune_allocator: bool = True,
    ) -> None:
        self.algorithm = algorithm if algorithm is not None else DisPFL()
        if not isinstance(self.algorithm, Algorithm):
            raise ValueError(f"algorithm must be an Algorithm (DisPFL, DPSGD, Local, FedAvg, ...), "
                             f"got {type(self.algorithm).__name__}")
        check_int("rounds", rounds, 1)
        if local_steps is not None and local_epochs is not None:
            raise ValueError(f"local_steps={local_steps!r} and local_epochs={local_epochs!r} are both set: a round runs "
                             "either local_steps steps or local_epochs epochs; set the other to None (null)")
        local_epochs = 5 if local_epochs is None else check_int("local_epochs", local_epochs, 0)
        if local_steps is not None:
            check_int("local_steps (None: local_epochs epochs)", local_steps, 1)
        check_int("eval_every", eval_every, 1)
        check_int("seed", seed, 0, MAX_SEED)  # NumPy's and Lightning's seeds
        if not isinstance(default_root_dir, (str, os.PathLike)):
            raise ValueError(f"default_root_dir must be a folder's path (a str or os.PathLike), got {default_root_dir!r}")
        check_output_path("default_root_dir", default_root_dir)
        devices, num_nodes, strategy = check_processes(devices, num_nodes, strategy)
        world_size = devices * num_nodes
        check_store_device(store_device)
        self.store_kind = check_store_kind(store)
        self.checkpoint_every = check_int("checkpoint_every (0: never)", checkpoint_every, 0)
        self.cpu_threads = None if cpu_threads is None else check_int("cpu_threads", cpu_threads, 1)
        self.clock = build_clock(client_speeds, clock)
        self.dropout, self.deadline = check_faults(dropout, deadline)
        self.resume_allow = tuple(resume_allow)
        if check_bool("batched_clients", batched_clients) and world_size > 1:
            raise ValueError("batched_clients trains a level's clients together in one process; it cannot be "
                             f"combined with {world_size} processes yet: use devices=1, or batched_clients=False")
        self.batched_clients = batched_clients
        if batched_group_size is not None:
            check_int("batched_group_size (None: sized from memory)", batched_group_size, 1)
            if not batched_clients:
                raise ValueError(f"batched_group_size={batched_group_size!r} sizes the groups of batched clients, but "
                                 "batched_clients is false: set batched_clients=True, or leave batched_group_size "
                                 "None (null)")
        self.batched_group_size = batched_group_size
        self.tune_allocator = check_bool("tune_allocator", tune_allocator)
        self.memory_format = check_memory_format(memory_format)
        self.matmul_precision = check_matmul_precision(matmul_precision)
        self.benchmark = check_benchmark(benchmark)
        self.cuda_graphs = check_bool("cuda_graphs", cuda_graphs)
        self.diagnostics = check_diagnostics(diagnostics)
        self.diag_every = check_int("diag_every", diag_every, 1)
        #: the run's diagnostics collector (set up in fit when diagnostics are on)
        self.diag: RunDiagnostics | None = None
        #: the command line that started the run (set by the CLI), for the resume hint
        self.command_line: list[str] | None = None
        #: files written into the run folder when the run starts (the CLI's ``config.yaml``), by name
        self.run_files: dict[str, str] = {}
        self.rounds = rounds
        self.local_epochs = local_epochs
        self.local_steps = local_steps
        self.eval_every = eval_every
        self.seed = seed
        self.client_speeds = list(client_speeds) if client_speeds is not None else None
        self.store_device = store_device
        self.enable_progress_bar = enable_progress_bar
        self.default_root_dir = default_root_dir
        self.precision = precision
        self._fabric_kwargs = {"accelerator": accelerator, "devices": devices, "num_nodes": num_nodes,
                               "precision": precision, "strategy": strategy}
        check_accelerator(accelerator)
        self.fabric = Fabric(**self._fabric_kwargs)  # validates accelerator and precision now; rebuilt in fit
        self.callbacks = self._merge_callbacks(callbacks)
        self.logger = build_logger(logger, default_root_dir, self.algorithm.run_name())
        self.history: list[dict[str, float]] = []
        #: whether fit ran (or started): a trainer runs one fit, see :meth:`fit`
        self._fitted = False
        self.summary: RunSummary | None = None
        self.store: ClientStore | None = None
        #: the engine's record of the federation (built by ``fit``'s set-up)
        self.state: FederationState | None = None
        #: ``state -> executor``; ``None``: the serial one (or the sharded / batched one the settings ask for)
        self.executor_factory: Callable[[FederationState], SerialExecutor] | None = None
        self.executor: SerialExecutor | None = None
        self._extra_metrics: dict[str, float] = {}

    # -- properties Lightning callbacks look for ----------------------------------------
    @property
    def current_round(self) -> int:
        """The round running (or the last one run); 0 before the first."""
        return self.state.current_round if self.state is not None else 0

    @property
    def current_client(self) -> int | None:
        """The client whose task is running (``None`` between tasks)."""
        return self.state.current_client if self.state is not None else None

    @property
    def train_dataloader(self) -> CountingBatches | None:
        """The running task's training batches."""
        return self.state.train_dataloader if self.state is not None else None

    @property
    def max_rounds(self) -> int:
        """T, the total rounds (the name Lightning callbacks look for)."""
        return self.rounds

    @property
    def num_clients(self) -> int:
        return self.datamodule.num_clients

    @property
    def is_global_zero(self) -> bool:
        # before Fabric launches, a process it started knows its rank from the environment only
        return self.fabric.is_global_zero and rank_zero_only.rank == 0

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

    def _checkpoint_left(self) -> str:
        """What a run that stops now leaves to resume from: its last checkpoint (finite weights only), or none."""
        last = getattr(self, "_last_checkpoint", None)  # (path, rounds done): written by this run or resumed from
        if last is not None:
            return f"The last checkpoint, {last[0]} (after round {last[1]}), holds finite weights only"
        if not self.checkpoint_every:
            return "No checkpoint was written (checkpoint_every=0)"
        return (f"No checkpoint was written yet (checkpoint_every={self.checkpoint_every}: the first after round "
                f"{self.checkpoint_every})")

    @property
    def loggers(self) -> list[Logger]:
        return [self.logger] if self.logger else []

    def evaluates(self, round_idx: int) -> bool:
        """Whether ``round_idx`` is an evaluated round: every ``eval_every``-th, and the last."""
        return every_and_last(round_idx, self.eval_every, self.rounds)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Add metrics to the current round's row (callbacks use this)."""
        self._extra_metrics.update(metrics)

    def _merge_callbacks(self, callbacks: list[Callback] | Callback | None) -> list[Callback]:
        """The algorithm's callbacks in their order (a user instance of the same class takes the
        default's place, so e.g. voting still runs before PQI), then the user's other callbacks."""
        if callbacks is not None and not isinstance(callbacks, (Callback, list, tuple)):
            callbacks = [callbacks]  # refused below, by name
        user = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
        wrong = next((c for c in user if not isinstance(c, Callback)), None)
        if wrong is not None:
            raise ValueError(f"callbacks must be Lightning Callback instances (e.g. RigL()), got {wrong!r} "
                             f"({type(wrong).__name__})")
        check_supported(user)
        merged: list[Callback] = []
        for default in self.algorithm.callbacks():
            replacement = next((c for c in user if type(c) is type(default)), None)
            merged.append(replacement if replacement is not None else default)
        return merged + [c for c in user if not any(c is m for m in merged)]

    def _call(self, hook: str, *args: Any) -> None:
        self.state.call(hook, *args)

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
        model.build_for(datamodule)
        self.algorithm.setup(model, datamodule)
        self.module = model
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)
        # the module is Fabric's callback: it re-masks the weights after every optimizer step
        self.fabric = Fabric(**self._fabric_kwargs, callbacks=[model])
        if self.fabric.world_size > 1:  # clients sharded across processes
            check_shardable(self.algorithm, self.callbacks)
            self.fabric.launch()
            if not self.is_global_zero:
                self.logger = None  # process 0 writes the run folder
        self.fabric.seed_everything(self.seed, verbose=False)
        if self.fabric.world_size > 1:  # no DDP wrapper: each process trains other clients, nothing is all-reduced
            self.fabric.strategy.precision.convert_module(model).to(self.fabric.device)
        else:
            self.fabric.setup_module(model)  # device placement and the precision's dtype
        model.check_optimizer_range(next(model.model.parameters()).dtype)
        memory_format = resolve_memory_format(self.memory_format, model.model)
        apply_memory_format(model.model, memory_format)
        apply_matmul_precision(self.matmul_precision, self.fabric.device)
        apply_benchmark(self.benchmark)
        slow = slow_bfloat16(getattr(self.fabric.strategy.precision, "precision", ""), self.fabric.device)
        if slow is not None:
            rank_zero_warn(slow)
        model.mask.to(self.fabric.device)
        self.optimizer = self.fabric.setup_optimizers(self.algorithm.make_optimizer(model))
        if self.batched_clients:  # refused before the store is allocated
            check_batchable(self.algorithm, model, self.optimizer, self.precision, self.callbacks)
        graphs = self._step_graphs(model) if self.cuda_graphs else None
        # "true" precisions (bf16-true, 64-true) need inputs in the module's dtype; mixed ones autocast
        plugin = self.fabric.strategy.precision
        self.convert_input = input_converter(None if isinstance(plugin, MixedPrecision) else plugin.convert_input,
                                             memory_format)
        self.worker = {n: t for n, t in model.model.state_dict(keep_vars=False).items() if t.is_floating_point()}
        self.clock.setup(num_clients, self.algorithm.num_servers, self.seed)
        fields = state_fields(self.algorithm, self.callbacks, self, model)
        self.store = build_store(self.store_kind, self.store_device, self.worker, model, fields, num_clients,
                                 num_clients + self.algorithm.num_servers, self.algorithm.personal_masks, self.seed,
                                 self.fabric.device, self.fabric.world_size // self._fabric_kwargs["num_nodes"])
        self.sample_counts = tuple(datamodule.client_train_size(k) for k in range(num_clients))
        self.planner = RoundPlanner(self.algorithm, self.clock, num_clients, self.rounds, self.sample_counts,
                                    self.store, self.seed, self.dropout, self.deadline)
        self.state = FederationState(
            algorithm=self.algorithm, callbacks=self.callbacks, call=HookDispatch(self, self.callbacks, model),
            module=model, optimizer=self.optimizer, fabric=self.fabric, datamodule=datamodule, store=self.store,
            clock=self.clock, worker=self.worker, seed=self.seed, rounds=self.rounds, num_clients=num_clients,
            local_epochs=self.local_epochs, local_steps=self.local_steps, eval_every=self.eval_every,
            checkpoint_every=self.checkpoint_every, precision=self.precision, convert_input=self.convert_input,
            history=self.history, result_settings={
                "dropout": self.dropout, "deadline": self.deadline, "batched_clients": self.batched_clients,
                **({"batched_group_size": self.batched_group_size} if self.batched_clients else {}),
                "memory_format": self.memory_format, "matmul_precision": self.matmul_precision,
                **({"benchmark": self.benchmark} if self.benchmark is not None else {}),
                "accelerator": self.fabric.device.type,
                # a CPU run's kernels split their reductions by thread: another count rounds differently
                **({"cpu_threads": torch.get_num_threads()} if self.fabric.device.type == "cpu" else {})})
        self.state.step_graphs = graphs
        self.executor = self._make_executor(self.state)
        self.algorithm.init_state(self.store, num_clients)
        for callback in self.callbacks:
            callback.setup(self, model, "fit")
        self.reporter = RoundReporter(self.logger, self.is_global_zero)

    def _start_run(self, model: SparseClassifier, datamodule: FederatedDataModule) -> None:
        """The run starts (set-up and resume checked): its folder is created now, with ``run_files``; a folder
        that cannot be written is a :class:`~lightning_dfl.errors.RunFileError` naming it."""
        with writing(self.default_root_dir):
            self._create_run(model, datamodule)

    def _create_run(self, model: SparseClassifier, datamodule: FederatedDataModule) -> None:
        num_clients = datamodule.num_clients
        self.diag = None
        if self.diagnostics is True or (self.diagnostics == "auto" and num_clients <= AUTO_MAX_K):
            parameters = [n for n, _ in model.model.named_parameters()]
            self.diag = RunDiagnostics(num_clients, num_clients + self.algorithm.num_servers, self.rounds, self.seed,
                                       self.diag_every, parameters, self.log_dir if self.is_global_zero else None)
        self.state.diag = self.diag  # the diagnostics hear every transfer
        if self.logger is not None:
            self.logger.log_hyperparams({
                "algorithm": repr(self.algorithm), "rounds": self.rounds, "local_epochs": self.local_epochs,
                "seed": self.seed, "num_clients": num_clients, **dict(model.hparams),
                **{f"data/{k}": v for k, v in datamodule.hparams.items()},
            })
            if self.log_dir and self.is_global_zero:
                Path(self.log_dir).mkdir(parents=True, exist_ok=True)
                for name, text in self.run_files.items():
                    (Path(self.log_dir) / name).write_text(text)

    def _step_graphs(self, model: SparseClassifier) -> StepGraphs:
        """The worker's captured steps (``cuda_graphs``); ValueError when the device or the run cannot have them."""
        backend = step_graphs.graph_backend(self.fabric.device)
        if backend is None:
            raise ValueError(f"cuda_graphs: true needs a CUDA GPU; this run's device is {self.fabric.device} "
                             "(set accelerator: gpu, or cuda_graphs: false)")
        check_graphable(self.algorithm, model, self.precision, self.callbacks, self.batched_clients)
        return StepGraphs(backend, model, self.optimizer)

    def _make_executor(self, state: FederationState) -> SerialExecutor:
        """The executor the settings ask for: ``executor_factory``'s, sharded (processes), batched, or serial."""
        if self.executor_factory is not None:
            return self.executor_factory(state)
        if self.fabric.world_size > 1:
            return ShardedExecutor(state)
        return batched_executor(state, self.batched_group_size) if self.batched_clients else SerialExecutor(state)

    def client_state(self, client: int) -> ClientFields | TaskFields:
        """A client's declared fields, read and written by name (callbacks keep their per-client
        state here: ``trainer.client_state(k)["voting/delta_first"]``). During the client's own task the
        writes are staged with the task's update: committed when it publishes, discarded if it is contained
        (a non-finite vote or score never reaches the store or a checkpoint)."""
        task = self.state.current_task if self.state is not None else None
        if task is not None and int(task.node) == int(client):
            return TaskFields(task)
        return ClientFields(self.store, client)

    # -- the loop -----------------------------------------------------------------------
    def fit(self, model: SparseClassifier, datamodule: FederatedDataModule,
            ckpt_path: str | None = None) -> RunSummary:
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
        if self.tune_allocator:  # before the data and the store are allocated
            tune_allocator()
        if ckpt_path is not None and not isinstance(ckpt_path, (str, os.PathLike)):
            raise ValueError(f"ckpt_path must be a checkpoint file's path (a str or os.PathLike), got {ckpt_path!r}")
        if ckpt_path is not None:
            check_file(ckpt_path)  # a missing or damaged file fails before any set-up
        elif self.resume_allow:
            raise ValueError(f"resume_allow={list(self.resume_allow)} applies only when resuming: give a checkpoint "
                             "(--ckpt_path) or remove resume_allow")
        self._setup(model, datamodule)
        first_round = load_checkpoint(self.state, ckpt_path, self.resume_allow) if ckpt_path is not None else 0
        self._last_checkpoint = (Path(ckpt_path), first_round) if ckpt_path is not None else None
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
        start = time.perf_counter()
        with stop_requests(self._abandon) as stop, progress_bar(
                self.rounds, enabled=self.enable_progress_bar and self.is_global_zero, completed=first_round) as advance:
            for round_idx in range(first_round, self.rounds):
                try:
                    metrics = self.run_round(round_idx)
                except Exception as err:  # after validation: a bug, unless the run diverged (see lightning_dfl.errors)
                    mark_in_round(err, round_idx)
                    raise
                if stop.requested or (self.checkpoint_every and ((round_idx + 1) % self.checkpoint_every == 0
                                                                 or round_idx == self.rounds - 1)):
                    if self.is_global_zero:  # every process holds the same state
                        done = f"stopped after round {round_idx + 1} of {self.rounds}"  # a second signal waits for the file
                        with stop.hold(lambda code, done=done: self._interrupted(code, done)):
                            save_checkpoint(self.state, self.checkpoint_path)
                        self._last_checkpoint = (self.checkpoint_path, round_idx + 1)
                advance(metrics)
                if stop.requested and round_idx < self.rounds - 1:
                    raise self._interrupted(stop.exit_code, f"stopped after round {round_idx + 1} of {self.rounds}")
        earlier = sum(m.get("time/wall_round_s", 0.0) for m in self.history[:first_round])
        self.summary = RunSummary.from_history(self.algorithm, self.history, earlier + time.perf_counter() - start,
                                               self.log_dir, mean_client_density(self.store, self.num_clients))
        self.reporter.warn_without_accuracy(self.summary, self.deadline)
        if self.state.step_graphs is not None:
            counts = self.state.step_graphs.counts
            rank_zero_info(f"CUDA graphs: {counts['replayed']} local steps replayed, {counts['captured']} captured, "
                           f"{counts['ordinary']} ordinary (warm-up, or the first after the worker's tensors moved)")
            if not any(counts.values()):
                rank_zero_warn(f"cuda_graphs: {type(self.algorithm).__name__} took no step through the default local "
                               "loop (train_locally), so no step was captured: it trains with its own loop")
        self._call("on_train_end")
        self._call("on_fit_end")
        if self.logger is not None:
            with writing(self.reporter.metrics_file()):
                self.logger.finalize("success")
        for callback in self.callbacks:
            callback.teardown(self, model, "fit")
        if self.enable_progress_bar and self.is_global_zero:
            print_summary(self.summary)
        return self.summary

    def _interrupted(self, exit_code: int, what: str) -> Interrupted:
        path = self.checkpoint_path if self.checkpoint_path.is_file() else None
        hint = resume_command(path, self.command_line) if path is not None else ""
        where = f"checkpoint {path}" if path is not None else "no checkpoint was written"
        return Interrupted(exit_code, path, hint, f"{what}; {where}")

    def _abandon(self, exit_code: int) -> Interrupted:
        """A second signal: stop at once; the last checkpoint on disk (if any) resumes."""
        return self._interrupted(exit_code, f"abandoned round {self.current_round + 1} of {self.rounds}")

    def run_round(self, round_idx: int) -> dict[str, float]:
        """Plan and run one round (its ``exchanges_per_round`` exchanges); log and return its metrics."""
        wall = time.perf_counter()
        self.state.current_round = round_idx
        self._extra_metrics = {}
        durations = self.clock.compute_times(round_idx)  # one draw per round: planning and timing share it
        ctx, plan, stragglers = self.planner.first_exchange(round_idx, durations)
        evaluate = self.evaluates(round_idx)
        accounting = RoundAccounting(round_idx, observer=self.diag)  # the diagnostics hear every transfer
        timings = []
        for exchange in range(self.algorithm.exchanges_per_round):
            if exchange:
                rng = np.random.default_rng(derive_seed(self.seed, "plan", round_idx, exchange))
                ctx = dataclasses.replace(ctx, exchange=exchange, rng=rng)
                plan = self.algorithm.plan_round(ctx)
            else:
                self._call("on_federated_round_start")
            accounting.edge_bytes.clear()  # the clock times each exchange's own messages
            for sender, receiver, nbytes in plan.side_transfers:
                accounting.transfer(sender, receiver, 0, nbytes)
            self.executor.run(plan, evaluate, accounting, exchange)
            self.store.end_round()
            if self.diag is not None:
                self.diag.observe(plan)
            timings.append((self.clock.round_metrics(plan, durations, accounting.edge_bytes),
                            any(t.train for t in plan.tasks)))
        accounting.read_device_values()  # the round's losses and accuracies, read from the device at once
        self.executor.settle()  # what the mask searches of contained tasks counted is taken back
        failed = sorted(r.client for r in accounting.records if r.nonfinite)
        if failed and len(failed) == len(accounting.records):
            raise RunDiverged(
                f"round {round_idx + 1} of {self.rounds}: every client that trained ({len(failed)}: {failed}) ended with non-finite "
                "(or above 1e30) weights or loss; the learning rate is probably too high for this model and data (or the data "
                f"hold NaN/inf values). {self._checkpoint_left()}")
        metrics = accounting.metrics()
        active = self.num_clients if ctx.participants is None else len(ctx.participants)
        metrics["clients/active_share"] = active / self.num_clients
        metrics["faults/stragglers"] = float(stragglers)
        self.reporter.warn_partial(round_idx, metrics, self.num_clients, evaluate)
        timing = dict(next((m for m, trains in timings if trains), timings[0][0]))
        timing["duration"] = sum(m["duration"] for m, _ in timings)  # exchanges run one after another
        metrics.update({f"time/{k}": v for k, v in timing.items()})
        metrics["time/elapsed"] = self.clock.advance(timing["duration"])
        if evaluate:
            metrics.update(self.state.consensus_metrics())
        self._extra_metrics.update(self.algorithm.evaluate_round(self.state.evaluation_context(round_idx, evaluate)))
        self._call("on_federated_round_end")
        metrics.update(personal_spread([r.acc_trained for r in accounting.records if r.acc_trained is not None]))
        if self.diag is not None:
            metrics.update(self.diag.end_round(round_idx, self.store))
        metrics.update(self._extra_metrics)
        metrics.update(self.algorithm.round_metrics(metrics))
        self.reporter.update_best(metrics, self.history, self.algorithm.headline)
        metrics["time/wall_round_s"] = time.perf_counter() - wall
        self.history.append(metrics)
        self.reporter.log_round(round_idx, metrics, accounting.client_rows())
        return metrics

    def test_batches(self, client: int) -> CountingBatches:
        """The client's test batches on the worker's device, in the precision's input dtype."""
        return self.state.test_batches(client)
