"""``RunSettings``: a federated run's settings, checked once when the trainer is built.

The values a :class:`~lightning_dfl.federation.trainer.trainer.FederatedTrainer` takes besides its objects (the
algorithm, callbacks, logger and clock): sizes, devices, the store, faults, speed options. Each value is
checked by the function of its concept (``check_processes`` in sharding, ``check_store_kind`` with the
compact store, ...); the cross-field rules live here. Frozen: a run's settings do not change while it runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import lightning_utilities.core.rank_zero as rank_zero
import torch
from lightning.fabric.accelerators import CPUAccelerator
from lightning.fabric.connector import _Connector

from lightning_dfl.checks import check_bool, check_int, check_output_path
from lightning_dfl.federation.exchange.plan import every_and_last
from lightning_dfl.federation.loop.planner import check_faults
from lightning_dfl.federation.loop.rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT, check_rendezvous_timeout
from lightning_dfl.federation.loop.sharded import check_processes
from lightning_dfl.federation.metrics.diagnostics import AUTO_MAX_K, check_diagnostics
from lightning_dfl.federation.store.factory import check_store_kind
from lightning_dfl.federation.store.memory import check_store_device
from lightning_dfl.federation.trainer.kernel_settings import (
    check_benchmark,
    check_matmul_precision,
    check_memory_format,
)
from lightning_dfl.seeding import MAX_SEED

__all__ = ["ACCELERATORS", "MAX_SEED", "RunSettings", "check_accelerator"]

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


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, as ``os.sched_getaffinity``; ``os.cpu_count`` where the
    platform has none): more intra-op threads than that only wait for each other, and a huge count crashes
    OpenMP's runtime (``cpu_threads=100000`` segfaulted in libgomp)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """A run's settings (the trainer's arguments of the same names; see its docstring), checked and normalised
    when built: ``local_epochs`` ``None`` becomes 5, ``devices`` an int, ``dropout`` a float, ..."""

    rounds: int = 100
    local_epochs: int | None = None
    local_steps: int | None = None
    eval_every: int = 1
    accelerator: Any = "auto"
    devices: int | str = 1
    precision: Any = None
    strategy: str = "auto"
    num_nodes: int = 1
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT
    default_root_dir: str | os.PathLike = "runs"
    seed: int = 0
    store_device: str = "auto"
    store: str = "dense"
    enable_progress_bar: bool = True
    checkpoint_every: int = 0
    cpu_threads: int | None = None
    dropout: float = 0.0
    deadline: float | None = None
    resume_allow: Sequence[str] = ()
    diagnostics: bool | str = "auto"
    diag_every: int = 1
    batched_clients: bool = False
    batched_group_size: int | None = None
    tasks_per_receive: int | None = None
    memory_format: str = "auto"
    matmul_precision: str = "auto"
    benchmark: bool | None = None
    cuda_graphs: bool = False
    tune_allocator: bool = True
    overwrite: bool = False

    def __post_init__(self) -> None:
        def normalise(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        check_int("rounds", self.rounds, 1)
        if self.local_steps is not None and self.local_epochs is not None:
            raise ValueError(f"local_steps={self.local_steps!r} and local_epochs={self.local_epochs!r} are both set: a "
                             "round runs either local_steps steps or local_epochs epochs; set the other to None (null)")
        normalise("local_epochs", 5 if self.local_epochs is None else check_int("local_epochs", self.local_epochs, 0))
        if self.local_steps is not None:
            check_int("local_steps (None: local_epochs epochs)", self.local_steps, 1)
        check_int("eval_every", self.eval_every, 1)
        check_int("seed", self.seed, 0, MAX_SEED)
        if not isinstance(self.default_root_dir, (str, os.PathLike)):
            raise ValueError(f"default_root_dir must be a folder's path (a str or os.PathLike), got "
                             f"{self.default_root_dir!r}")
        check_output_path("default_root_dir", self.default_root_dir)
        devices, num_nodes, strategy = check_processes(self.devices, self.num_nodes, self.strategy)
        normalise("devices", devices)
        normalise("num_nodes", num_nodes)
        normalise("strategy", strategy)
        normalise("rendezvous_timeout", check_rendezvous_timeout(self.rendezvous_timeout))
        check_store_device(self.store_device)
        check_store_kind(self.store)
        check_int("checkpoint_every (0: never)", self.checkpoint_every, 0)
        if self.cpu_threads is not None:
            check_int(f"cpu_threads (at most the {usable_cpus()} CPUs this process may use)", self.cpu_threads, 1,
                      usable_cpus())
        dropout, deadline = check_faults(self.dropout, self.deadline)
        normalise("dropout", dropout)
        normalise("deadline", deadline)
        normalise("resume_allow", tuple(self.resume_allow))
        if check_bool("batched_clients", self.batched_clients) and self.world_size > 1:
            raise ValueError("batched_clients trains a level's clients together in one process; it cannot be "
                             f"combined with {self.world_size} processes yet: use devices=1, or batched_clients=False")
        if self.batched_group_size is not None:
            check_int("batched_group_size (None: sized from memory)", self.batched_group_size, 1)
            if not self.batched_clients:
                raise ValueError(f"batched_group_size={self.batched_group_size!r} sizes the groups of batched clients, "
                                 "but batched_clients is false: set batched_clients=True, or leave batched_group_size "
                                 "None (null)")
        if self.tasks_per_receive is not None:
            check_int("tasks_per_receive (None: a whole plan level's sources at once)", self.tasks_per_receive, 1)
            if self.world_size == 1:
                raise ValueError(f"tasks_per_receive={self.tasks_per_receive!r} bounds what each of several processes "
                                 "receives at a time, but this run has one process (devices x num_nodes = 1): leave "
                                 "it None (null), or run on several processes")
        check_bool("tune_allocator", self.tune_allocator)
        check_bool("overwrite", self.overwrite)
        check_memory_format(self.memory_format)
        check_matmul_precision(self.matmul_precision)
        check_benchmark(self.benchmark)
        if check_bool("cuda_graphs", self.cuda_graphs) and self.batched_clients:
            raise ValueError("cuda_graphs: batched_clients trains clients with its own batched step, which is not "
                             "captured; set one of them false")
        normalise("diagnostics", check_diagnostics(self.diagnostics))
        check_int("diag_every", self.diag_every, 1)
        check_accelerator(self.accelerator)
        with warnings.catch_warnings(), _quiet(rank_zero.log):  # Fabric, built for the run, says all it says
            warnings.simplefilter("ignore")  # once more, when the run builds it
            connector = _Connector(**self.fabric_kwargs())  # Lightning's own checks of accelerator, devices, precision
        if str(self.precision) in ("16", "16-mixed") and isinstance(connector.accelerator, CPUAccelerator):
            raise ValueError(f"precision={self.precision!r} is float16 autocast, which runs on a GPU only (on a CPU "
                             "Lightning would switch to bf16-mixed): give --trainer.precision=bf16-mixed or 32-true "
                             "on a CPU")

    @property
    def world_size(self) -> int:
        """Processes in all (``devices x num_nodes``)."""
        return self.devices * self.num_nodes

    def fabric_kwargs(self) -> dict[str, Any]:
        """What Fabric is built with (besides its callbacks)."""
        return {"accelerator": self.accelerator, "devices": self.devices, "num_nodes": self.num_nodes,
                "precision": self.precision, "strategy": self.strategy}

    def evaluates(self, round_idx: int) -> bool:
        """Whether ``round_idx`` is an evaluated round: every ``eval_every``-th, and the last."""
        return every_and_last(round_idx, self.eval_every, self.rounds)

    def diagnoses(self, num_clients: int) -> bool:
        """Whether the run's diagnostics are on for ``num_clients`` clients (``"auto"``: K <= 100)."""
        return self.diagnostics is True or (self.diagnostics == "auto" and num_clients <= AUTO_MAX_K)

    def result_settings(self, device: torch.device) -> dict[str, Any]:
        """The settings that change results beyond the algorithm's and the module's (a checkpoint's identity)."""
        return {"dropout": self.dropout, "deadline": self.deadline, "batched_clients": self.batched_clients,
                **({"batched_group_size": self.batched_group_size} if self.batched_clients else {}),
                "memory_format": self.memory_format, "matmul_precision": self.matmul_precision,
                **({"benchmark": self.benchmark} if self.benchmark is not None else {}),
                "accelerator": device.type,
                # a CPU run's kernels split their reductions by thread: another count rounds differently
                **({"cpu_threads": torch.get_num_threads()} if device.type == "cpu" else {})}


class _quiet:
    """Within this block ``logger`` shows nothing below a warning (Lightning's "Using ... Precision")."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def __enter__(self) -> None:
        self.level = self.logger.level
        self.logger.setLevel(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        self.logger.setLevel(self.level)
