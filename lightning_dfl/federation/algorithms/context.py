"""What an algorithm sees: a round's context when it plans, a task's context while a node's task runs, and an
evaluation context at a round's end; the latter two refer to the run's fixed values (:class:`RunSpec`) and the
worker (what :class:`WorkerAccess` names of :class:`~lightning_dfl.federation.loop.worker.Worker`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.federation.exchange.plan import Task
from lightning_dfl.federation.metrics.evaluation import accuracy
from lightning_dfl.federation.store.protocol import ClientStore
from lightning_dfl.seeding import derive_seed


@dataclass(frozen=True)
class RunSpec:
    """A run's fixed values: what tasks, evaluations and a checkpoint's identity read. Frozen: they do not change
    while the run runs (a resumed run may change ``rounds``, ``eval_every`` and ``checkpoint_every``)."""

    seed: int
    rounds: int
    num_clients: int
    local_epochs: int
    local_steps: int | None
    eval_every: int
    checkpoint_every: int
    precision: Any
    #: the trainer's other settings that change results (a checkpoint's identity): dropout, deadline, ...
    result_settings: dict[str, Any] = field(default_factory=dict)


class WorkerAccess(Protocol):
    """What a context reads of the worker (the loop's :class:`~lightning_dfl.federation.loop.worker.Worker`)."""

    module: Any
    optimizer: Any
    fabric: Any
    #: the module's floating parameters and buffers by the store's names
    tensors: dict[str, Tensor]

    def load(self, weights: dict[str, Tensor]) -> None: ...

    def weights(self) -> dict[str, Tensor]: ...

    def train_batches(self, client: int, generator: torch.Generator) -> CountingBatches: ...

    def test_batches(self, client: int) -> CountingBatches: ...


@dataclass(frozen=True)
class RoundContext:
    """What an algorithm may read when it plans a round."""

    round_idx: int
    num_rounds: int
    num_clients: int
    sample_counts: tuple[int, ...]
    rng: np.random.Generator
    #: simulated task durations per client from the clock (``None``: all 1)
    durations: tuple[float, ...] | None = None
    #: the clients taking part this round (``None``: all), from :meth:`Algorithm.participants`
    participants: tuple[int, ...] | None = None
    #: which of the round's ``Algorithm.exchanges_per_round`` exchanges is planned (0 first)
    exchange: int = 0
    #: the client store, to read published models and fields while planning (never written here)
    store: Any = None
    #: the run's seed (derive per-round streams from it with ``seeding.derive_seed``)
    seed: int = 0

    @property
    def active_clients(self) -> list[int]:
        """The clients taking part this round, in id order."""
        return list(range(self.num_clients)) if self.participants is None else sorted(self.participants)


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

    @property
    def batch_size(self) -> int | None:
        """The batch size of the batches drawn (``None`` when the source does not say)."""
        return getattr(self._batches, "batch_size", None)


class _OnWorker:
    """What a task's and an evaluation's contexts share: the run's fixed values (``spec``) and the worker."""

    spec: RunSpec
    worker: WorkerAccess

    @property
    def num_rounds(self) -> int:
        return self.spec.rounds

    @property
    def num_clients(self) -> int:
        return self.spec.num_clients

    @property
    def seed(self) -> int:
        return self.spec.seed

    @property
    def module(self) -> Any:
        """The worker's LightningModule (model and mask)."""
        return self.worker.module

    @property
    def optimizer(self) -> Any:
        """The worker's (Fabric-wrapped) optimizer."""
        return self.worker.optimizer

    @property
    def fabric(self) -> Any:
        return self.worker.fabric

    def draw_train_batches(self, client: int, generator: torch.Generator) -> CountingBatches:
        """Any client's training batches drawn with ``generator`` (on the worker's device, in the precision's
        input dtype), for algorithms with their own data split."""
        return self.worker.train_batches(client, generator)

    def worker_weights(self) -> dict[str, Tensor]:
        """A copy of the worker's floating parameters and buffers (the store's names)."""
        return self.worker.weights()

    def load_weights(self, weights: dict[str, Tensor]) -> None:
        """Copy ``weights`` (the store's names) into the worker."""
        self.worker.load(weights)


@dataclass
class TaskContext(_OnWorker):
    """One node's task as its algorithm's hooks see it.

    The worker (``module``, its Fabric-wrapped ``optimizer``, ``fabric``) holds the node's state (its weights
    and current mask) while the task runs; ``store`` holds every node's published models and declared fields;
    ``call(hook, *args)`` runs the callbacks' hook; the run's fixed values (``seed``, ``num_rounds``,
    ``num_clients``) come from ``spec``.
    """

    task: Task
    round_idx: int
    exchange: int
    #: the run's fixed values (:class:`RunSpec`)
    spec: RunSpec
    #: the worker (:class:`~lightning_dfl.federation.loop.worker.Worker`): module, optimizer, Fabric, tensors, batches
    worker: WorkerAccess
    store: ClientStore
    call: Callable[..., None]
    local_epochs: int
    local_steps: int | None
    train_batches: CountingBatches | None = None
    #: set by the hooks: anything the task wants to report in ``clients.csv`` (name -> number)
    report: dict[str, float] = field(default_factory=dict)
    #: values the hooks of one task share (e.g. a proximal anchor)
    scratch: dict[str, Any] = field(default_factory=dict)
    #: the worker's captured local steps (:class:`~lightning_dfl.federation.loop.step_graphs.StepGraphs`), or ``None``:
    #: :func:`~lightning_dfl.federation.algorithms.training.train_locally` replays its steps from them
    step_graphs: Any = None
    #: the task's writes of its node's private fields (:meth:`write`), committed by the executor when the
    #: node publishes, and discarded with the rest of the update when the task is contained
    staged: dict[str, Any] = field(default_factory=dict)
    #: the names :meth:`write` staged, in order (a name once per write): what a hook wrote is what it appended
    writes: list[str] = field(default_factory=list)

    @property
    def node(self) -> int:
        return self.task.node

    def write(self, name: str, value: Any) -> None:
        """Stage a write of the node's field ``name`` (a tensor, a number, or for ``like="weights"``/``"mask"``
        fields a dict by parameter): the store gets it only if the task's update is finite."""
        self.staged[name] = value
        self.writes.append(name)

    def written_since(self, mark: int) -> dict[str, Any]:
        """The staged values of the fields written after ``len(self.writes)`` was ``mark`` (e.g. in one hook)."""
        return {name: self.staged[name] for name in dict.fromkeys(self.writes[mark:]) if name in self.staged}

    def read(self, name: str) -> Any:
        """The node's field ``name`` as this task sees it: its staged write, else the store's value."""
        return self.staged[name] if name in self.staged else self.store.read(self.node, name)

    def test_batches(self) -> CountingBatches:
        """The node's test batches on the worker's device, in the precision's input dtype."""
        return self.worker.test_batches(self.node)

    def seed_of(self, stream: str) -> int:
        """The seed of ``stream`` for this task: from ``(seed, stream, round, node)`` (and the exchange
        after the round's first), so it does not depend on which tasks ran before."""
        keys = (self.round_idx, self.node) + ((self.exchange,) if self.exchange else ())
        return derive_seed(self.seed, stream, *keys)

    def generator(self, stream: str) -> torch.Generator:
        """A CPU generator for ``stream`` seeded by :meth:`seed_of`."""
        return torch.Generator().manual_seed(self.seed_of(stream))


@dataclass
class EvaluationContext(_OnWorker):
    """What an algorithm's round-level hook (:meth:`~Algorithm.evaluate_round`) may do at a round's end:
    read the store, load any model into the worker, test the worker on a client's test set, and run a
    task that publishes nothing (:meth:`task`: fine-tuning). The worker is the round's: whatever is
    loaded is overwritten by the next task, which loads its own node.
    """

    round_idx: int
    #: whether this round is an evaluated one (``eval_every``, and the last)
    evaluates: bool
    spec: RunSpec
    worker: WorkerAccess
    store: ClientStore
    #: ``() -> (weights, mask) | None``: the algorithm's shared model (its consensus sources, averaged)
    shared_model: Callable[[], tuple[dict[str, Tensor], dict[str, Tensor]] | None]
    #: which process owns each node (:class:`~lightning_dfl.federation.loop.ownership.Ownership`); ``None``: one
    owners: Any = None

    @property
    def clients(self) -> list[int]:
        """The clients this process evaluates: those it owns (all of them with one process), in id order. A
        per-client evaluation runs over these and :meth:`gather` s the values."""
        everyone = range(self.spec.num_clients)
        return list(everyone) if self.owners is None else self.owners.owned(everyone)

    def gather(self, mine: Mapping[int, Any]) -> list[Any]:
        """Every client's value, in id order, from the values each process computed for its :attr:`clients`
        (``mine``, keyed by client; picklable). Every process calls it (a collective with several)."""
        everyone = range(self.spec.num_clients)
        return [mine[k] for k in everyone] if self.owners is None else self.owners.gather(mine, everyone)

    @property
    def local_epochs(self) -> int:
        return self.spec.local_epochs

    @property
    def local_steps(self) -> int | None:
        return self.spec.local_steps

    def test_batches(self, client: int) -> CountingBatches:
        """``client``'s test batches on the worker's device."""
        return self.worker.test_batches(client)

    def load(self, weights: dict[str, Tensor], mask: dict[str, Tensor], apply: bool = True) -> None:
        """Put a model with its mask into the worker (``apply``: zero the weights the mask excludes)."""
        self.module.mask.load_(mask, apply=False)
        self.load_weights(weights)
        if apply:
            self.module.mask.apply_()

    def test(self, client: int) -> float:
        """The worker's accuracy on ``client``'s test set."""
        return accuracy(self.module, self.fabric, self.test_batches(client))

    def task(self, client: int, round_idx: int, local_epochs: int, local_steps: int | None,
             train_batches: CountingBatches) -> TaskContext:
        """A task context for ``client`` on the worker as it is, which publishes nothing and calls no
        callbacks (evaluation is not training: mask search and pruning do not see it)."""
        return TaskContext(task=Task(node=client), round_idx=round_idx, exchange=0, spec=self.spec,
                           worker=self.worker, store=self.store, call=_no_callbacks, local_epochs=local_epochs,
                           local_steps=local_steps, train_batches=train_batches)


def _no_callbacks(*args: Any) -> None:
    """The callbacks of a task run by an evaluation: none."""


class TaskFields:
    """The running task's node's fields as a mapping, like :class:`~lightning_dfl.federation.store.fields.ClientFields`,
    but through the task: reads see its staged writes, writes are staged (:meth:`TaskContext.write`)."""

    def __init__(self, ctx: TaskContext) -> None:
        self.ctx = ctx

    def __getitem__(self, name: str) -> Any:
        return self.ctx.read(name)

    def __setitem__(self, name: str, value: Any) -> None:
        spec = getattr(self.ctx.store, "field_specs", {}).get(name)
        if spec is not None and not isinstance(value, Mapping) and spec.dtype is not None:
            value = torch.as_tensor(value, dtype=spec.dtype)  # read back as the store would hold it
        self.ctx.write(name, value)

    def __contains__(self, name: object) -> bool:
        return name in self.ctx.store.fields
