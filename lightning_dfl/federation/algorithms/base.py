"""The ``Algorithm`` interface: how a federation plans its rounds and how a client trains,
aggregates, communicates and is evaluated. Every hook has a default that gives DisPFL-shaped rounds;
a new algorithm overrides the few it changes (see the README, "Writing an algorithm")."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import Tensor

from lightning_dfl.checks import check_int
from lightning_dfl.federation.algorithms.context import EvaluationContext, RoundContext, TaskContext
from lightning_dfl.federation.algorithms.departures import departures
from lightning_dfl.federation.algorithms.training import train_locally
from lightning_dfl.federation.exchange.aggregation import masked_average
from lightning_dfl.federation.exchange.messages import PUBLISH_BOUND, Message, gather_messages, masked_codec
from lightning_dfl.federation.exchange.plan import RoundPlan, Source, Task
from lightning_dfl.federation.exchange.topology import FullTopology, Topology, build_topology
from lightning_dfl.federation.metrics.evaluation import deferred_accuracy
from lightning_dfl.federation.store import ClientStore, StateField
from lightning_dfl.hooks import is_overridden

__all__ = ["Algorithm", "FlagsLostWarning", "TopologyAlgorithm", "RoundContext", "TaskContext", "check_plans", "parallel_plan"]

#: class flags the engine trusts, read with :meth:`Algorithm.declares`
DECLARED_FLAGS = ("shardable", "reads_only_sources", "partitionable")
#: methods a subclass may define and still inherit :data:`DECLARED_FLAGS`: they set it up or name it,
#: they change nothing a task does (any other method, a hook or a helper, is a change of behaviour)
NEUTRAL_METHODS = ("__init__", "validate", "deviations", "inert_options", "label", "run_name", "message_bound",
                   "__repr__")
#: class attributes that change what a task does: setting one is a change of behaviour too
BEHAVIOUR_ATTRIBUTES = ("keep_optimizer_state",)


class FlagsLostWarning(UserWarning):
    """A subclass changed behaviour and so lost flags its parent declares (:meth:`Algorithm.declares`)."""


def _behaviour_changes(namespace: dict[str, Any]) -> list[str]:
    """What a class body (``vars(cls)``) changes of what its parent's tasks do (see :meth:`Algorithm.declares`):
    the names of its methods outside :data:`NEUTRAL_METHODS` and of the :data:`BEHAVIOUR_ATTRIBUTES` it sets."""
    changes = []
    for key, value in namespace.items():
        method = inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod))
        if key in BEHAVIOUR_ATTRIBUTES or (method and key not in NEUTRAL_METHODS):
            changes.append(key)
    return changes


def _changes_behaviour(namespace: dict[str, Any]) -> bool:
    """Whether a class body (``vars(cls)``) changes what its parent's tasks do (see :meth:`Algorithm.declares`)."""
    return bool(_behaviour_changes(namespace))


class Algorithm:
    """Base class of federated algorithms.

    Class attributes: :attr:`name`, :attr:`personal_masks` (each client draws its own initial
    mask), :attr:`num_servers` (server nodes appended after the clients), :attr:`headline`
    (``"personal"`` or ``"consensus"``), :attr:`sends_masks` (models travel with their masks),
    :attr:`keep_optimizer_state` (per-parameter optimizer state kept per client across rounds,
    e.g. ``("momentum_buffer",)`` for SGD momentum; empty: a fresh optimizer each round).

    Hooks, in the order a round calls them:

    - :meth:`participants` -> :meth:`plan_round` (once per round, or once per exchange when
      :attr:`exchanges_per_round` > 1);
    - per task (a node's work, in the plan's dependency order): :meth:`message` for every source
      it reads, then for a server task :meth:`server_step`, else :meth:`aggregate` ->
      :meth:`evaluate` (``"aggregated"``) -> :meth:`configure_optimizer` -> :meth:`local_train`
      (the loop: :meth:`loss`, :meth:`optimizer_step`) -> callbacks' ``on_client_train_end`` ->
      :meth:`evaluate` (``"trained"``) -> :meth:`publish_fields` -> publish -> callbacks'
      ``on_client_end``;
    - at the round's end: :meth:`consensus_sources` (a shared model tested on every client), then
      :meth:`evaluate_round` (the algorithm's own evaluations), then :meth:`round_metrics`.

    :meth:`init_state` runs once, when the store holds the initial models.

    Per-client state the algorithm needs lives in the client store as :meth:`state_fields`; its
    own state across rounds in :meth:`state_dict`.

    Flags the engine trusts, :data:`DECLARED_FLAGS` (:attr:`shardable`, :attr:`reads_only_sources`,
    :attr:`partitionable`),
    are read with :meth:`declares`: a subclass inherits them as ordinary class attributes as long as it
    keeps its parent's behaviour: a plain subclass (new defaults or arguments in ``__init__``, a
    ``name`` or ``title``, :meth:`deviations`, :data:`NEUTRAL_METHODS`) keeps them. A subclass that
    defines any other method (a hook such as :meth:`plan_round` or :meth:`aggregate`, or a helper its
    parent calls) or sets :data:`BEHAVIOUR_ATTRIBUTES` loses them unless it declares them again in its
    own body (``shardable = True``), and is told so when the class is defined, in one
    :class:`FlagsLostWarning` naming the flags and the methods; a plain subclass opts out with
    ``shardable = False``.
    """

    #: short name used in logs and run folders
    name = "base"
    #: the name results report (``summary.json``'s ``label``, tables); ``None``: :attr:`name`
    title: str | None = None
    #: each client draws its own initial mask (else all share the module's mask)
    personal_masks = False
    #: server nodes appended after the clients (node ids K, K+1, ...)
    num_servers = 0
    #: the headline accuracy: "personal" (each client's model on its test set), "consensus" (the shared
    #: model of :meth:`consensus_sources` on every client's test set), "global" (that model on the
    #: official test split) or "subnetwork" (``acc/subnetwork_mean``: SubFedAvg's w * m_i on every client)
    headline = "personal"
    #: whether models travel with their masks (the mask bits are counted as communication)
    sends_masks = False
    #: per-parameter optimizer state kept per client across rounds (empty: fresh each round)
    keep_optimizer_state: tuple[str, ...] = ()
    #: whether its clients may be sharded across processes (``trainer.devices`` > 1): true when no hook
    #: run inside a task changes the algorithm's own Python state, or when it implements the sharding
    #: protocol of :mod:`~lightning_dfl.federation.loop.sharded`; read with :meth:`declares`
    shardable = False
    #: whether the only start-of-round models its tasks read (in any hook) are their plan's sources and
    #: their own node's: the executor then tells the store when a model's last reader has run, and the
    #: compact store frees it (a round then holds fewer than two models per node at its peak). A subclass
    #: that changes behaviour declares it again (see :meth:`declares`)
    reads_only_sources = False
    #: whether a sharded run may keep on each process only the nodes it owns
    #: (:mod:`~lightning_dfl.federation.store.partitioned`): true when its hooks read other nodes' models and
    #: fields only as their tasks' sources (in :meth:`message`), and its evaluations only the shared model
    #: (:meth:`consensus_sources`) and the evaluated clients' own state; else every process holds every node.
    #: Read with :meth:`declares`
    partitionable = False
    #: exchanges (plans) per round: :meth:`plan_round` is called once per exchange with
    #: ``ctx.exchange``; each exchange's published models are what the next one reads (gossip steps)
    exchanges_per_round = 1
    #: ``__init__`` arguments that set up the experiment (clients per round, neighbours, the graph) rather
    #: than change the rule: never named in the label; every other argument is a rule option, labelled when
    #: it departs from its reference (:mod:`~lightning_dfl.federation.algorithms.departures`; merged along
    #: the bases)
    settings: tuple[str, ...] = ()
    #: the original method's value of each rule option whose default is not it (else the default is)
    reference: dict[str, Any] = {}
    #: how the label names a departing rule option: a format of ``value`` (default ``"{name} {value}"``)
    phrases: dict[str, str] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        parent = cls.__mro__[1]
        lost = [flag for flag in DECLARED_FLAGS
                if getattr(parent, "declares", None) is not None and parent.declares(flag) and not cls.declares(flag)
                and flag not in vars(cls)]
        if lost:
            changed = sorted(_behaviour_changes(vars(cls)))
            them = "them" if len(lost) > 1 else "it"
            warnings.warn(FlagsLostWarning(
                f"{cls.__qualname__} changes {', '.join(changed)} of {parent.__qualname__}, so it does not inherit "
                f"{' and '.join(f'{flag} = True' for flag in lost)}: the engine cannot know the new code keeps "
                f"what {them} promise{'' if len(lost) > 1 else 's'}. If it does, declare {them} in "
                f"{cls.__qualname__}'s body ({'; '.join(f'{flag} = True' for flag in lost)}); to silence this, set "
                f"{them} to False"), stacklevel=2)

    @classmethod
    def overrides(cls, hook: str) -> bool:
        """Whether the class defines ``hook`` itself rather than inheriting :class:`Algorithm`'s (the engine asks
        this instead of importing the base class)."""
        return is_overridden(hook, cls, Algorithm)

    @classmethod
    def declares(cls, flag: str) -> bool:
        """The class's ``flag`` (one of :data:`DECLARED_FLAGS`) as the engine reads it: the nearest
        class in the MRO that sets it decides, unless a class before it changes behaviour (defines a
        method not in :data:`NEUTRAL_METHODS`, or sets :data:`BEHAVIOUR_ATTRIBUTES`) without setting
        the flag again: then ``False``."""
        if flag not in DECLARED_FLAGS:
            raise ValueError(f"unknown flag {flag!r}; allowed: {', '.join(DECLARED_FLAGS)}")
        for klass in cls.__mro__:
            own = vars(klass)
            if flag in own:
                return bool(own[flag])
            if _changes_behaviour(own):
                return False  # a changed behaviour keeps a flag only by declaring it again
        return False

    # -- set-up -------------------------------------------------------------------------
    def validate(self, num_clients: int) -> None:
        """Raise ``ValueError`` if this algorithm cannot run with ``num_clients`` clients."""
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        check_int("exchanges_per_round", self.exchanges_per_round, 1)

    def setup(self, module: Any, datamodule: Any) -> None:
        """Read what the algorithm needs from the built model and the data (e.g. the model's channel
        groups, the partition's true client groups) once, before the client store is allocated
        (:meth:`state_fields` is called after it). Raise ``ValueError`` for a model or data it
        cannot use."""

    def callbacks(self) -> list[Callback]:
        """Callbacks the algorithm needs; a user callback of the same class replaces its default."""
        return []

    def init_state(self, store: ClientStore, num_clients: int) -> None:
        """Called once the store holds every node's initial model and mask (clients ``0..num_clients-1``, then
        the servers), before a checkpoint (if any) is loaded: give declared fields initial values that depend
        on those models (default: nothing)."""

    def evaluate_round(self, ctx: EvaluationContext) -> dict[str, float]:
        """Called at every round's end (``ctx.evaluates``: an evaluated round), after the shared model's
        evaluation and before the callbacks' ``on_federated_round_end``: evaluations of the algorithm's
        own (its clients' personal models, a fine-tuned shared model, ...) through ``ctx`` (load any model
        into the worker, test it on a client, run a task that publishes nothing). Returns metrics for the
        round's row (default: none)."""
        return {}

    def make_optimizer(self, module: Any) -> torch.optim.Optimizer:
        """The worker's optimizer, built once (default: the module's SGD from its settings)."""
        return module.make_optimizer()

    def state_fields(self) -> list[StateField]:
        """Per-client values the algorithm keeps in the client store (checkpointed with it)."""
        return []

    # -- planning -----------------------------------------------------------------------
    def participants(self, ctx: RoundContext) -> Sequence[int] | None:
        """The clients that take part in round ``ctx.round_idx`` (``None``: all)."""
        return None

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        """The round's tasks (every algorithm defines it: :func:`check_plans` refuses one that does not)."""
        raise NotImplementedError(f"{type(self).__name__} does not define plan_round")

    # -- one task -----------------------------------------------------------------------
    def message(self, ctx: TaskContext, source: Source) -> Message:
        """What ``source.node`` sends to ``ctx.node``: by default its published model with the mask it
        was trained with (views of the store, no copy); values x 4 bytes, plus one bit per masked
        entry when :attr:`sends_masks`. Called for every source, the node's own included (that one
        does not cross the network and is not counted)."""
        store = ctx.store
        weights, mask = store.published(source.node, source.fresh)
        codec = masked_codec(self.sends_masks)
        return codec.encode(weights, mask, sender=source.node, masked_names=store.masked_names,
                            active_values=store.active_values(source.node, source.fresh))

    def aggregate(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor] | None:
        """The model the node starts its training from (``None``: keep its own). Default: DisPFL
        Alg. 1 line 7 / DA-DPFL Eq. 7, the masked average of the messages (in the plan's source
        order, weighted by the task's ``coefficients``) times the node's current mask."""
        if not messages:
            return None
        return average_messages(messages, ctx.store.mask(ctx.node), ctx.task.coefficients)

    def server_step(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor]:
        """The new model of an aggregation-only task (``train=False``): a server's (FedAvg: the
        coefficient-weighted average of the clients'), or a client's gossip step."""
        return average_messages(messages, ctx.store.mask(ctx.node), ctx.task.coefficients)

    def configure_optimizer(self, ctx: TaskContext) -> None:
        """Prepare the worker's optimizer for the local epochs: lr x lr_decay^t (the papers'
        schedule); a fresh state unless :attr:`keep_optimizer_state` (then the executor restores it)."""
        if not self.keep_optimizer_state:
            ctx.optimizer.state.clear()
        for group in ctx.optimizer.param_groups:
            group["lr"] = ctx.module.lr_at(ctx.round_idx)

    def local_train(self, ctx: TaskContext) -> float:
        """Train the worker on ``ctx.train_batches``; return the mean loss per sample."""
        return train_locally(self, ctx)

    def loss(self, ctx: TaskContext, batch: Any) -> Tensor:
        """The training loss of one batch (add proximal or penalty terms here)."""
        return ctx.module.loss(batch)

    def optimizer_step(self, ctx: TaskContext, closure: Any) -> Tensor:
        """One step: run ``closure`` (zero grads, loss, backward) and step; return the loss.
        SAM-like optimizers call the closure twice."""
        loss = closure()
        ctx.optimizer.step()
        return loss

    def evaluate(self, ctx: TaskContext, stage: str) -> float | Tensor | None:
        """The accuracy logged for the node at ``stage`` (``"aggregated"``: before training, after
        aggregation; ``"trained"``: the model it publishes). Default: the worker on its test set, as a
        0-dim device tensor that the round reads with the others at its end (a float works too)."""
        return deferred_accuracy(ctx.module, ctx.fabric, ctx.test_batches())

    def publish_fields(self, ctx: TaskContext) -> dict[str, Any]:
        """Values of published state fields the node sends with its model this round."""
        return {}

    # -- round end ----------------------------------------------------------------------
    def round_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics the algorithm adds to the round's row (``metrics``: the row so far)."""
        return {}

    def consensus_sources(self, num_clients: int) -> list[Source] | None:
        """The shared model tested on every client's test set at a round's end (``None``: none)."""
        return None

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The algorithm's own state across rounds (tensors and plain containers only). Keep such state
        in private (``_``) attributes: public ones are settings, part of the checkpoint's identity."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""

    def deviations(self) -> list[str]:
        """What of this instance departs from the original method's rule (empty: none), named wherever results
        are reported, through :meth:`label`: each rule option whose value is not its reference
        (:func:`~lightning_dfl.federation.algorithms.departures.departures`); a subclass adds what no option
        says."""
        return departures(self)

    def inert_options(self) -> tuple[str, ...]:
        """Rule options that do nothing with this instance's other options (so not labelled: e.g. top-k's
        ratio under another compressor)."""
        return ()

    def label(self) -> str:
        """How results name this run's method: its title, with its non-original settings in brackets
        (e.g. "BEER (fresh minibatch)")."""
        deviations = self.deviations()
        title = self.title or self.name
        return f"{title} ({', '.join(deviations)})" if deviations else title

    def message_bound(self) -> float:
        """The largest weight magnitude its messages carry: a trained model with a larger one is contained at its
        sender (default :data:`~lightning_dfl.federation.exchange.messages.PUBLISH_BOUND`; one that sends float16 returns
        65504, so that no receiver gets an overflowed inf)."""
        return PUBLISH_BOUND

    def run_name(self) -> str:
        """The run folder's name under ``default_root_dir`` (default :attr:`name`)."""
        return self.name

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def average_messages(messages: list[Message], receiver_mask: dict[str, Tensor] | None,
                     coefficients: Sequence[float] | None) -> dict[str, Tensor]:
    """Eq. 7 over messages: their weights and masks, accumulated message by message (no stacking)."""
    weights, masks = gather_messages(messages)
    with torch.no_grad():
        return masked_average(weights, masks, receiver_mask=receiver_mask, coefficients=coefficients)


class TopologyAlgorithm(Algorithm):
    """Base of the algorithms with a topology (DisPFL, D-PSGD, DA-DPFL, Local, ...): it gives each client M
    in-neighbours (``num_neighbors``; with the ``full`` topology every client hears the K - 1 others)."""

    settings = ("num_neighbors", "topology")

    def __init__(self, num_neighbors: int = 10, topology: str = "time_varying") -> None:
        self.num_neighbors = check_int("num_neighbors", num_neighbors, 0)  # the full topology ignores it: checked here
        self.topology = topology
        self._topology: Topology = build_topology(topology, num_neighbors)
        if num_neighbors == 0 and not isinstance(self._topology, FullTopology):
            raise ValueError(f"num_neighbors must be >= 1 with topology {topology!r} (0 would exchange nothing: use "
                             "the Local algorithm for training without neighbours), got 0")

    def validate(self, num_clients: int) -> None:
        super().validate(num_clients)
        self._topology.validate(num_clients)

    def neighbors(self, ctx: RoundContext) -> list[list[int]]:
        return self._topology.neighbors(ctx.num_clients, ctx.round_idx, ctx.rng)


def parallel_plan(ctx: RoundContext, neighbors: list[list[int]]) -> RoundPlan:
    """Every participating client aggregates itself and its participating neighbours' start-of-round
    models, all in parallel."""
    active = ctx.active_clients
    taking_part = set(active)
    tasks = [Task(node=k, sources=(Source(k), *(Source(j) for j in neighbors[k] if j in taking_part)))
             for k in active]
    return RoundPlan(ctx.round_idx, tasks)


def check_plans(algorithm: Algorithm) -> None:
    """Refuse an algorithm that cannot plan a round (``Algorithm`` itself, or a subclass without
    :meth:`~Algorithm.plan_round`) before anything is built, naming what to use instead."""
    if type(algorithm).plan_round is Algorithm.plan_round:
        from lightning_dfl.federation.algorithms import ALGORITHMS

        what = ("the base class every algorithm extends" if type(algorithm) is Algorithm
                else "a subclass of Algorithm that does not define plan_round")
        raise ValueError(f"algorithm {type(algorithm).__name__} is {what}: it cannot plan a round; use one of "
                         f"{', '.join(ALGORITHMS.names())}, or define plan_round (docs/writing-algorithms.md)")
