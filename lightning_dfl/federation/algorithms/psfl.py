"""PSFL (Zhou et al.): parallel-sequential federated learning with an optimal training structure.

A round (Sec. III, L74-80): the server samples N0 = W S clients and arranges them into W
sequences of length S; each client starts from its predecessor's model (the first from the
server's), runs its local SGD and passes its model on; the server averages the W sequence-end
models uniformly, Eq. 3: ``x^(r+1) = (1/W) sum_w x_(w,S)``. The round lasts as long as the slowest
sequence (Eq. 4) on the federation's clock. FedAvg (``sequences = N0``, S = 1) and SFL
(``sequences = 1``, S = N0) are configurations of the same algorithm (psfl-notes 11).

With ``sequences=None`` the structure is chosen as Alg. 1 does: ``warmup_rounds`` rounds with all
clients estimate sigma^2, B, tbar and kappa^2 (Eq. 24-26), W* solves Eq. 21
(:func:`~lightning_dfl.federation.algorithms.psfl_structure.optimal_parallel_width`), (W, S) follow psfl-notes 8, and
training restarts from x^0 (Alg. 1 line 13). Clients are drawn by a sampler of
:mod:`lightning_dfl.sampling` from running-mean time estimates (notes 13-14).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.checks import check_int, is_int, is_number
from lightning_dfl.federation.algorithms.base import Algorithm, RoundContext, TaskContext, average_messages
from lightning_dfl.federation.algorithms.psfl_structure import optimal_parallel_width, training_structure
from lightning_dfl.federation.exchange.messages import Message
from lightning_dfl.federation.exchange.plan import RoundPlan, Source, Task
from lightning_dfl.gradient_noise import batch_dependent_layers, minibatch_moments, per_sample_moments
from lightning_dfl.sampling import SAMPLERS, build_sampler

KAPPA2_ESTIMATORS = ("mean", "max")
SIGMA2_ESTIMATORS = ("per_sample", "minibatch")


class PSFL(Algorithm):
    """PSFL, FedAvg (W = N0) and SFL (W = 1) on the engine: chains of clients, a uniform server step.

    Args:
        clients_per_round: N0, the clients sampled each round.
        sequences: W, the parallel sequences (S = N0 // W); ``None``: solved after the warm-up.
        sampler: ``"time"`` (time-based partitioning, Sec. V-C), ``"uniform"`` or ``"weighted"``.
        warmup_rounds: rounds of the warm-up when ``sequences`` is None (>= 2; notes 12).
        kappa2_estimator: ``"mean"`` (Eq. 26) or ``"max"`` (the slowest client's variance, notes 5);
            W* is logged under both.
        c0: the step-size constant of Eq. 8, in (0, 1/5) (notes 18).
        sigma2_estimator: ``"per_sample"`` (Eq. 24 and Assumption 3: the variance of one sample's
            gradient, from exact per-sample gradients; default) or ``"minibatch"`` (the spread of the
            training mini-batches' gradients, about b times smaller: a departure, labelled).
        continue_from_warmup: start training from the warm-up's x^K instead of x^0.
        target_accuracy: if set, ``time/to_target`` logs the simulated time (warm-up included) at the
            first evaluation whose ``acc/global`` reaches it (notes 17), and every round after.

    Nodes: the clients, then the server's global model (node K) and the warm-up model (node K + 1).
    Logged: ``psfl/W``, ``psfl/S``, after the warm-up ``psfl/w_star_mean`` and ``psfl/w_star_max`` (W* under
    either kappa^2) with the estimates ``psfl/sigma2`` (Eq. 24, or the mini-batch departure), ``psfl/sigma2_minibatch``
    (the mini-batch convention's value, for comparison), ``psfl/B``, ``psfl/t_mean``, ``psfl/kappa2_mean``,
    ``psfl/kappa2_max``; ``psfl/warmup`` (1 in warm-up rounds), ``time/warmup`` (their simulated time).
    """

    name = "psfl"
    #: N0 and the reported target set the experiment; the structure and sampler are named by deviations()
    settings = ("clients_per_round", "target_accuracy", "sequences", "sampler")
    phrases = {"sigma2_estimator": "sigma^2 per minibatch"}
    shardable = True
    partitionable = True  # its hooks read other nodes as sources only
    title = "PSFL"
    reads_only_sources = True
    num_servers = 2
    headline = "global"

    def __init__(self, clients_per_round: int = 20, sequences: int | None = None, sampler: str = "time",
                 warmup_rounds: int = 5, kappa2_estimator: str = "mean", c0: float = 0.1,
                 continue_from_warmup: bool = False, target_accuracy: float | None = None,
                 sigma2_estimator: str = "per_sample") -> None:
        self.clients_per_round = check_int("clients_per_round (N0)", clients_per_round, 1)
        if sequences is not None:
            check_int("sequences (W)", sequences, 1)
            if sequences > clients_per_round:
                raise ValueError(f"sequences (W) must be <= clients_per_round (N0={clients_per_round}), "
                                 f"got {sequences}")
        self.sequences = sequences
        SAMPLERS.get(sampler)  # names the allowed samplers for an unknown one
        self.sampler = sampler
        if sequences is None:
            self.warmup_rounds = check_int("warmup_rounds", warmup_rounds, 2)
        else:  # no warm-up with a fixed structure (0, as its repr says); a value that could never be one is refused
            if not (is_int(warmup_rounds) and (warmup_rounds == 0 or warmup_rounds >= 2)):
                raise ValueError(f"warmup_rounds must be an integer >= 2 (or 0: none, with sequences set), got "
                                 f"{warmup_rounds!r}")
            self.warmup_rounds = 0
        if kappa2_estimator not in KAPPA2_ESTIMATORS:
            raise ValueError(f"unknown kappa2_estimator {kappa2_estimator!r}; allowed: {', '.join(KAPPA2_ESTIMATORS)}")
        self.kappa2_estimator = kappa2_estimator
        if not is_number(c0) or not 0 < c0 < 0.2:
            raise ValueError(f"c0 must be in (0, 1/5) (PSFL Eq. 8), got {c0!r}")
        self.c0 = float(c0)
        if sigma2_estimator not in SIGMA2_ESTIMATORS:
            raise ValueError(f"unknown sigma2_estimator {sigma2_estimator!r}; allowed: {', '.join(SIGMA2_ESTIMATORS)}")
        self.sigma2_estimator = sigma2_estimator
        self.continue_from_warmup = bool(continue_from_warmup)
        if target_accuracy is not None and (not is_number(target_accuracy) or not 0 < target_accuracy <= 1):
            raise ValueError(f"target_accuracy must be in (0, 1] (or None), got {target_accuracy!r}")
        self.target_accuracy = target_accuracy
        self._sampler = build_sampler(sampler)
        self._reset()

    def _reset(self) -> None:
        self._num_clients = 0
        self._time_sum: np.ndarray = np.zeros(0)
        self._time_sq: np.ndarray = np.zeros(0)
        self._time_count: np.ndarray = np.zeros(0)
        # every warm-up record is keyed by client id (warm-up rounds may see different client sets:
        # dropout, a deadline, participants), never paired by list position
        self._warm_times: list[dict[int, float]] = []  # per warm-up round: {client: t_n^k}
        self._sigma2: list[dict[int, float]] = []  # per warm-up round: {client: sigma^2_(n,k)} (Eq. 24)
        self._sigma2_minibatch: list[dict[int, float]] = []  # the same under the mini-batch convention (logged)
        self._b: list[float] = []  # per warm-up round
        self._grad_norms: dict[int, float] = {}  # this warm-up round: {client: ||grad F_n(x^k)||^2}
        self._structure: tuple[int, int] | None = (None if self.sequences is None
                                                    else (self.sequences, self.clients_per_round // self.sequences))
        self._w_star: dict[str, float] = {}
        self._round_metrics: dict[str, float] = {}
        self._grad_sum: dict[str, Tensor] | None = None
        # what this round's tasks did, in order (the sharding protocol replays it on every process); cleared per round
        self._task_events: list[tuple[Any, ...]] = []
        self._last_gradient: dict[str, Tensor] | None = None  # the last warm-up task's full gradient
        self._warmup_time = 0.0
        self._time_to_target: float | None = None
        self._pending: tuple[list[int], tuple[float, ...] | None, bool] | None = None

    def setup(self, module: Any, datamodule: Any) -> None:
        coupled = batch_dependent_layers(module.model)
        if self.warmup_rounds and self.sigma2_estimator == "per_sample" and coupled:
            raise ValueError(f"PSFL's per-sample sigma^2 (Eq. 24) needs a model whose batch loss is a mean of per-sample "
                             f"losses; {module.hparams.arch} has BatchNorm layers ({coupled[0]}, ...), which couple the "
                             "samples of a batch: use a model without BatchNorm, fix the structure with `sequences`, "
                             "or set sigma2_estimator: minibatch (a departure, docs/psfl.md)")

    def deviations(self) -> list[str]:
        """A fixed structure (no warm-up) is named with its sampler, and "= FedAvg" (S = 1) or "= SFL" (W = 1)
        when it is that baseline (psfl-notes 11); a solved one with another sampler than Sec. V-C's time-based
        one names it; then the rule options (the mini-batch sigma^2 departs from Eq. 24)."""
        if self.sequences is not None:
            structure = [f"W = {self.sequences}, S = {self.clients_per_round // self.sequences}, {self.sampler}"]
        else:
            structure = [] if self.sampler == "time" else [f"{self.sampler} sampler"]
        return structure + super().deviations()

    def inert_options(self) -> tuple[str, ...]:
        """With a fixed structure there is no warm-up: its options do nothing."""
        if self.sequences is None:
            return ()
        return ("warmup_rounds", "kappa2_estimator", "c0", "sigma2_estimator", "continue_from_warmup")

    def baseline(self) -> str | None:
        """``"FedAvg"`` when the fixed structure is W = N0 sequences of one client, ``"SFL"`` when it is one
        sequence of N0 (psfl-notes 11); else ``None``."""
        if self.sequences == self.clients_per_round:
            return "FedAvg"
        return "SFL" if self.sequences == 1 and self.clients_per_round > 1 else None

    def label(self) -> str:
        """E.g. "PSFL", "PSFL (W = 20, S = 1, uniform) = FedAvg", "PSFL (W = 4, S = 5, time)"."""
        baseline = self.baseline()
        return super().label() + (f" = {baseline}" if baseline else "")

    def run_name(self) -> str:
        """``psfl``, or ``psfl_fedavg`` / ``psfl_sfl`` / ``psfl_w4`` for a fixed structure."""
        if self.sequences is None:
            return self.name
        baseline = self.baseline()
        return f"{self.name}_{baseline.lower() if baseline else f'w{self.sequences}'}"

    def validate(self, num_clients: int) -> None:
        super().validate(num_clients)
        if self.clients_per_round > num_clients:
            raise ValueError(f"clients_per_round (N0) must be <= the number of clients ({num_clients}), "
                             f"got {self.clients_per_round}")

    # -- nodes ----------------------------------------------------------------------------
    @staticmethod
    def server(num_clients: int) -> int:
        return num_clients

    @staticmethod
    def warm_node(num_clients: int) -> int:
        return num_clients + 1

    def consensus_sources(self, num_clients: int) -> list[Source]:
        return [Source(self.server(num_clients))]

    # -- planning -------------------------------------------------------------------------
    def estimates(self) -> np.ndarray:
        """Each client's estimated time: the running mean of its observed times (notes 13); clients
        never observed take the mean of the others (1 when none is known)."""
        known = self._time_count > 0
        means = np.divide(self._time_sum, np.maximum(self._time_count, 1))
        fill = float(means[known].mean()) if known.any() else 1.0
        return np.where(known, means, fill)

    def _observe(self, clients: list[int], durations: tuple[float, ...] | None) -> None:
        for k in clients:
            t = 1.0 if durations is None else float(durations[k])
            self._time_sum[k] += t
            self._time_sq[k] += t * t
            self._time_count[k] += 1

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        if self._num_clients != ctx.num_clients:
            self._num_clients = ctx.num_clients
            self._time_sum, self._time_sq, self._time_count = (np.zeros(ctx.num_clients) for _ in range(3))
        self._round_metrics = {"psfl/warmup": float(ctx.round_idx < self.warmup_rounds)}
        if ctx.round_idx < self.warmup_rounds:
            return self._warmup_plan(ctx)
        if self._structure is None:
            self._solve_structure()
        width, length = self._structure
        active = ctx.active_clients
        server = self.server(ctx.num_clients)
        if len(active) < width * length:  # dropout left fewer clients: as many full sequences as they fill
            if not active:
                return RoundPlan(ctx.round_idx, [Task(node=server, sources=(Source(server),), train=False)])
            width = min(width, len(active))
            length = len(active) // width
        estimates = self.estimates()[active]
        sequences = [[active[i] for i in seq] for seq in self._sampler.sample(estimates, width, length, ctx.rng)]
        first = Source(self.warm_node(ctx.num_clients)) if (
            self.continue_from_warmup and ctx.round_idx == self.warmup_rounds and self.warmup_rounds) else Source(server)
        tasks = []
        for seq in sequences:
            tasks.append(Task(node=seq[0], sources=(first,)))
            tasks += [Task(node=k, sources=(Source(prev, fresh=True),)) for prev, k in zip(seq, seq[1:])]
        tasks.append(Task(node=server, sources=tuple(Source(seq[-1], fresh=True) for seq in sequences), train=False))
        self._pending = ([k for seq in sequences for k in seq], ctx.durations, False)
        self._round_metrics.update({"psfl/W": float(len(sequences)), "psfl/S": float(length)})
        self._round_metrics.update({f"psfl/{k}": v for k, v in self._w_star.items()})
        return RoundPlan(ctx.round_idx, tasks, meta={"sequences": sequences})

    def _warmup_plan(self, ctx: RoundContext) -> RoundPlan:
        """Alg. 1 lines 2-12: every client computes its full gradient at x^k; the server steps."""
        warm = self.warm_node(ctx.num_clients)
        clients = ctx.active_clients
        tasks = [Task(node=k, sources=(Source(warm),)) for k in clients]
        tasks.append(Task(node=warm, sources=tuple(Source(k, fresh=True) for k in clients), train=False))
        self._pending = (clients, ctx.durations, True)
        return RoundPlan(ctx.round_idx, tasks, meta={"warmup": True})

    def warmup_estimates(self) -> dict[str, float]:
        """The warm-up's estimates (Eq. 24-26), every record paired by client id.

        tbar and sigma^2 are means over all (round, client) records; B the mean of the rounds' B_k.
        kappa^2 (Eq. 26) = (1/N') sum_n var_k(t_n^k): each client's population variance over the
        warm-up rounds it took part in, averaged over the N' clients seen in at least two of them (a
        variance needs two times; a client seen once says nothing about its spread); ``kappa2_max``
        is the largest of those variances (notes 5). 0 when no client was seen twice."""
        per_client: dict[int, list[float]] = {}
        for row in self._warm_times:
            for k, t in row.items():
                per_client.setdefault(int(k), []).append(float(t))
        all_times = [t for ts in per_client.values() for t in ts]
        variances = [float(np.var(ts)) for _, ts in sorted(per_client.items()) if len(ts) >= 2]
        sigma2 = [v for row in self._sigma2 for v in row.values()]
        minibatch = [v for row in self._sigma2_minibatch for v in row.values()]
        return {"t_mean": float(np.mean(all_times)) if all_times else 1.0,
                "kappa2_mean": float(np.mean(variances)) if variances else 0.0,
                "kappa2_max": float(np.max(variances)) if variances else 0.0,
                "sigma2": float(np.mean(sigma2)) if sigma2 else 0.0,
                "sigma2_minibatch": float(np.mean(minibatch)) if minibatch else 0.0,
                "B": float(np.mean(self._b)) if self._b else 0.0}

    def _solve_structure(self) -> None:
        """Eq. 24-26 estimates, then W* of Eq. 21 under both kappa^2 estimators and (W, S) (notes 8)."""
        est = self.warmup_estimates()
        t_mean, sigma2, b = est["t_mean"], est["sigma2"], est["B"]
        kappa2 = {"mean": est["kappa2_mean"], "max": est["kappa2_max"]}
        for name, k2 in kappa2.items():
            self._w_star[f"w_star_{name}"] = float(optimal_parallel_width(self.clients_per_round, sigma2, b, t_mean,
                                                                          max(k2, 1e-12), self.c0))
        self._w_star.update({"sigma2": sigma2, "sigma2_minibatch": est["sigma2_minibatch"], "B": b, "t_mean": t_mean,
                             "kappa2_mean": kappa2["mean"], "kappa2_max": kappa2["max"]})
        self._structure = training_structure(self.clients_per_round, self._w_star[f"w_star_{self.kappa2_estimator}"])

    # -- one task -------------------------------------------------------------------------
    def local_train(self, ctx: TaskContext) -> float:
        if ctx.round_idx >= self.warmup_rounds:
            return super().local_train(ctx)
        return self._gradient_statistics(ctx)

    def _gradient_statistics(self, ctx: TaskContext) -> float:
        """Eq. 24-25 for one client at x^k: its full local gradient grad F_n(x^k) (the mean gradient over its
        samples) and sigma^2_(n,k) = E_xi ||grad f(x^k; xi) - grad F_n(x^k)||^2, xi one sample drawn
        uniformly from its data (Assumption 3), from exact per-sample gradients; with
        ``sigma2_estimator="minibatch"`` the spread of its training mini-batches' gradients instead (a
        departure: about b times smaller). The weights do not move."""
        module = ctx.module
        module.train()
        if self.sigma2_estimator == "per_sample":
            masks = module.mask.masks if module.mask is not None else None
            moments = per_sample_moments(module.model, ctx.train_batches, masks, autocast=ctx.fabric.autocast)
        else:
            def loss(batch: Any) -> Tensor:
                with ctx.fabric.autocast():
                    return self.loss(ctx, batch)
            moments = minibatch_moments(module.model, ctx.train_batches, loss, backward=ctx.fabric.backward)
        if not moments.count:
            return float("nan")
        full = moments.full_gradient()
        self._add_gradient(ctx.round_idx, int(ctx.node), moments.variance(), moments.minibatch_variance(),
                           sum(float(v.square().sum()) for v in full.values()), full)
        return moments.loss_sum / moments.count

    def _add_gradient(self, round_idx: int, node: int, sigma2: float, sigma2_minibatch: float, norm: float,
                      full: dict[str, Tensor]) -> None:
        """One warm-up client's statistics and full gradient into the round's sums (its task's one effect)."""
        while len(self._sigma2) <= round_idx:
            self._sigma2.append({})
        while len(self._sigma2_minibatch) <= round_idx:
            self._sigma2_minibatch.append({})
        if node in self._grad_norms:
            raise RuntimeError(f"PSFL warm-up: client {node} computed its gradient twice in round {round_idx}")
        self._sigma2_minibatch[round_idx][node] = sigma2_minibatch
        self._sigma2[round_idx][node] = sigma2
        total = self._grad_sum if self._grad_sum is not None else {k: torch.zeros_like(v) for k, v in full.items()}
        self._grad_sum = {k: total[k] + v for k, v in full.items()}  # a new sum: a snapshot keeps the old one
        self._grad_norms[node] = norm
        self._task_events.append(("gradient", round_idx, node, sigma2, sigma2_minibatch, norm))
        self._last_gradient = full

    def server_step(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor]:
        if ctx.round_idx >= self.warmup_rounds:
            return average_messages(messages, ctx.store.mask(ctx.node), None)  # Eq. 3: uniform 1/W
        # the warm-up server: B_k = mean_n ||g_n - g||^2, x^(k+1) = x^k - eta g (Alg. 1 lines 9-11)
        own, _ = ctx.store.published(ctx.node)
        new = {n: t.clone() for n, t in own.items()}
        count = len(self._grad_norms)  # the clients whose gradients this round holds, by id
        b = None
        if count:
            mean = {k: v / count for k, v in self._grad_sum.items()}
            b = sum(self._grad_norms.values()) / count - sum(float(v.square().sum()) for v in mean.values())
            lr = ctx.module.lr_at(ctx.round_idx)
            for k, g in mean.items():
                new[k].sub_(g.to(new[k].device, new[k].dtype), alpha=lr)  # the store may be on another device
        self._end_warm_step(b)
        return new

    def _end_warm_step(self, b: float | None) -> None:
        """The warm-up server's step done: its B_k (``None``: no gradient arrived) kept, the round's sums emptied."""
        if b is not None:
            self._b.append(b)
        self._task_events.append(("step", b, self._grad_norms))
        self._grad_sum, self._grad_norms, self._last_gradient = None, {}, None

    # -- reporting and checkpoints ----------------------------------------------------------
    def round_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Logs the structure and the warm-up's estimates, and records the round's observed times (here,
        once the round ran: a plan may be drawn again, e.g. without stragglers, and only the last counts)."""
        if self._pending is not None:
            clients, durations, warmup = self._pending
            self._observe(clients, durations)
            if warmup:
                self._warm_times.append({int(k): 1.0 if durations is None else float(durations[k]) for k in clients})
            self._pending = None
        self._task_events, self._last_gradient = [], None
        if metrics.get("psfl/warmup", self._round_metrics.get("psfl/warmup")):
            self._warmup_time += metrics.get("time/duration", 0.0)
        out = {**self._round_metrics, "time/warmup": self._warmup_time}
        reached = self.target_accuracy is not None and metrics.get("acc/global", -1.0) >= self.target_accuracy
        if self._time_to_target is None and reached:
            self._time_to_target = metrics["time/elapsed"]
        if self._time_to_target is not None:
            out["time/to_target"] = self._time_to_target
        return out

    # -- sharded federations (lightning_dfl.federation.loop.sharded) --------------------------------
    # A warm-up client's task adds its statistics and gradient to the round's sums; the warm server's task
    # steps and empties them. Each process undoes its own tasks' effects and replays every task's, in task
    # order, so the sums (floats added in the same order) are the ones one process reaches.
    def shard_snapshot(self) -> tuple[int, dict[str, Tensor] | None]:
        return len(self._task_events), self._grad_sum  # a sum is replaced, never changed in place

    def shard_delta(self, snapshot: tuple[int, dict[str, Tensor] | None]) -> list[tuple[Any, ...]]:
        events = self._task_events[snapshot[0]:]
        gradients = [e for e in events if e[0] == "gradient"]
        if len(gradients) > 1:
            raise RuntimeError("PSFL's sharding delta covers one task; it was asked for several")
        out = []
        for event in events:
            if event[0] == "gradient":  # numbers, and the gradient on the CPU, travel between processes
                out.append((*event, {k: v.cpu() for k, v in self._last_gradient.items()}))
            else:
                out.append(event[:2])
        return out

    def shard_rollback(self, snapshot: tuple[int, dict[str, Tensor] | None]) -> None:
        count, self._grad_sum = snapshot
        for event in reversed(self._task_events[count:]):
            if event[0] == "gradient":
                _, round_idx, node = event[:3]
                del self._sigma2[round_idx][node], self._sigma2_minibatch[round_idx][node], self._grad_norms[node]
            else:
                _, b, self._grad_norms = event
                if b is not None:
                    self._b.pop()
        del self._task_events[count:]

    def shard_apply(self, delta: list[tuple[Any, ...]]) -> None:
        for event in delta:
            if event[0] == "gradient":
                self._add_gradient(*event[1:])
            else:
                self._end_warm_step(event[1])

    def state_dict(self) -> dict[str, Any]:
        return {"time_sum": torch.from_numpy(self._time_sum.copy()), "time_sq": torch.from_numpy(self._time_sq.copy()),
                "time_count": torch.from_numpy(self._time_count.copy()), "warm_times": self._warm_times,
                "sigma2": self._sigma2, "sigma2_minibatch": self._sigma2_minibatch, "b": self._b, "w_star": {k: float(v) for k, v in self._w_star.items()}, "warmup_time": self._warmup_time,
                "time_to_target": self._time_to_target,
                "structure": list(self._structure) if self._structure is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._time_sum = state["time_sum"].numpy().copy()
        self._time_sq = state["time_sq"].numpy().copy()
        self._time_count = state["time_count"].numpy().copy()
        self._num_clients = len(self._time_sum)
        # rows keyed by client id; a list row (older checkpoints) held the clients 0..n-1 in id order
        keyed = lambda row: ({int(k): float(v) for k, v in row.items()} if isinstance(row, dict)  # noqa: E731
                             else {k: float(v) for k, v in enumerate(row)})
        self._warm_times = [keyed(row) for row in state["warm_times"]]
        sigma2 = state["sigma2"]
        self._sigma2 = ([keyed(row) for row in sigma2] if all(isinstance(row, dict) for row in sigma2)
                        else [{k: float(v) for k, v in enumerate(sigma2)}])  # older: a flat list
        self._sigma2_minibatch = [keyed(row) for row in state.get("sigma2_minibatch", [])]  # older: not recorded
        self._b = list(map(float, state["b"]))
        self._w_star = {k: float(v) for k, v in state["w_star"].items()}
        self._warmup_time = float(state["warmup_time"])
        self._time_to_target = state["time_to_target"]
        self._structure = tuple(state["structure"]) if state["structure"] is not None else None
