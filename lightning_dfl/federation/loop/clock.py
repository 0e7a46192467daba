"""Simulated time: client compute times, transfer times and when each task of a round runs.

* Compute times (PSFL Sec. VI-A3): each client's base time ``t_k`` is ``1 / speed`` or drawn once
  from U(low, high), Exp(mean), N(mean, std) (resampled until positive) or uniformly from
  ``values``; each round ``t_k^(r) = t_k (1 + noise z)``, ``z ~ N(0, 1)``, floored at ``min_time``.
* Transfer times: ``latency + bytes / bandwidth`` per message.
* Schedule (DA-DPFL Sec. IV-B): a task starts once every model it reads has arrived and the tasks
  it runs after have ended, and lasts its compute time (:func:`lightning_dfl.federation.exchange.schedule.finish_times`,
  the pure layer below the federation, re-exported here).

Every draw has its own stream ``derive_seed(seed, "clock/...", ...)``, so a client's times depend
neither on the number of clients nor on the order in which they are drawn.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from lightning_dfl.checks import check_int, is_number
from lightning_dfl.federation.exchange.plan import RoundPlan
from lightning_dfl.federation.exchange.schedule import Arrivals, Durations, finish_times  # noqa: F401 (re-exported)
from lightning_dfl.seeding import derive_seed

DISTRIBUTIONS = ("fixed", "uniform", "exponential", "normal", "discrete")
#: the settings of the base-time distributions, with the distributions that read them (any other ignores them)
DISTRIBUTION_SETTINGS = {"low": ("uniform",), "high": ("uniform",), "mean": ("exponential", "normal"),
                         "std": ("normal",), "values": ("discrete",)}


def default_durations(plan: RoundPlan) -> dict[int, float]:
    """One time unit per training task, 0 for the others (a server's aggregation)."""
    return {t.node: 1.0 if t.train else 0.0 for t in plan.tasks}


#: the range of a client's relative speed (``Clock(speeds=...)``, ``client_speeds``): beyond it the simulated
#: times (1 / speed) reach 1e300 and overflow the run's elapsed time and cost
MIN_SPEED, MAX_SPEED = 1e-6, 1e6


def _number(name: str, value: object, low: float, *, strict: bool, allow_inf: bool = False) -> float:
    """``value`` as a float ``> low`` (``strict``) or ``>= low``; else a ValueError naming it."""
    if not (is_number(value, finite=not allow_inf) and not math.isnan(value)
            and (value > low if strict else value >= low)):
        finite = "" if allow_inf else "finite "
        raise ValueError(f"{name} must be a {finite}number {'>' if strict else '>='} {low}, got {value!r}")
    return float(value)


class Clock:
    """The simulated clock of a federation (PSFL Sec. VI-A3 times, DA-DPFL Sec. IV-B schedules).

    Args:
        speeds: per client relative speed for ``"fixed"`` (time ``1 / speed``; default all 1).
        distribution: ``"fixed"``, ``"uniform"`` (U(low, high)), ``"exponential"`` (mean),
            ``"normal"`` (N(mean, std) resampled until positive) or ``"discrete"`` (uniform over
            ``values``): how each client's base time is drawn, once.
        low: the least base time of ``"uniform"``.
        high: the largest base time of ``"uniform"``.
        mean: the mean base time of ``"exponential"`` and ``"normal"``.
        std: the standard deviation of ``"normal"``'s base times.
        values: the base times ``"discrete"`` draws from, each equally likely.
        noise: per-round relative noise ``t_k (1 + noise z)`` (PSFL: 0.2; 0: the base times).
        min_time: floor of every drawn time.
        bandwidth: bytes per time unit on each link (``None``: bytes take no time, only ``latency``).
        latency: time units per message.
    """

    def __init__(self, speeds: Sequence[float] | None = None, distribution: str = "fixed", low: float = 0.5,
                 high: float = 4.5, mean: float = 2.5, std: float = 1.0,
                 values: Sequence[float] = (0.5, 1, 2, 4, 5), noise: float = 0.0, min_time: float = 1e-3,
                 bandwidth: float | None = None, latency: float = 0.0) -> None:
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"unknown distribution {distribution!r}; allowed: {', '.join(DISTRIBUTIONS)}")
        if speeds is not None:
            if distribution != "fixed":
                raise ValueError(f"speeds apply to distribution 'fixed' only, got distribution {distribution!r}")
            speeds = [_number("speeds", s, 0.0, strict=True) for s in speeds]
            extreme = next((s for s in speeds if not MIN_SPEED <= s <= MAX_SPEED), None)
            if extreme is not None:
                raise ValueError(f"client speeds must be in [{MIN_SPEED:g}, {MAX_SPEED:g}] (relative speeds; a task takes "
                                 f"1 / speed time units), got {extreme!r}")
        self.speeds = speeds
        self.distribution = distribution
        self.low = _number("low", low, 0.0, strict=True)
        self.high = _number("high", high, self.low, strict=False)
        self.mean = _number("mean", mean, 0.0, strict=True)
        self.std = _number("std", std, 0.0, strict=False)
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
            raise ValueError(f"values must be a non-empty sequence of numbers > 0, got {values!r}")
        self.values = tuple(_number("values", v, 0.0, strict=True) for v in values)
        self.noise = _number("noise", noise, 0.0, strict=False)
        self.min_time = _number("min_time", min_time, 0.0, strict=True)
        self.bandwidth = None if bandwidth is None else _number("bandwidth", bandwidth, 0.0, strict=True,
                                                                allow_inf=True)
        self.latency = _number("latency", latency, 0.0, strict=False)
        self._check_used(distribution)
        self.num_clients = 0
        self.num_servers = 0
        self.seed = 0
        self.base_times: tuple[float, ...] = ()
        self._elapsed = 0.0

    def _check_used(self, distribution: str) -> None:
        """Refuse a distribution's setting given another value than its default under a distribution that does not
        read it (``low=3`` with ``"fixed"`` would be ignored), as ``speeds`` under any but ``"fixed"``."""
        import inspect

        defaults = inspect.signature(Clock.__init__).parameters
        for name, users in DISTRIBUTION_SETTINGS.items():
            value, default = getattr(self, name), defaults[name].default
            changed = tuple(map(float, value)) != tuple(map(float, default)) if name == "values" else value != default
            if changed and distribution not in users:
                raise ValueError(f"{name}={value!r} applies to distribution {' or '.join(map(repr, users))} only, got "
                                 f"distribution {distribution!r}: remove {name}, or set the distribution that reads it")

    def setup(self, num_clients: int, num_servers: int = 0, seed: int = 0) -> None:
        """Fix the federation's size and seed and draw each client's base time."""
        self.num_clients = check_int("num_clients", num_clients, 1)
        self.num_servers = check_int("num_servers", num_servers, 0)
        self.seed = int(seed)
        if self.speeds is not None and len(self.speeds) != num_clients:
            raise ValueError(f"client_speeds has {len(self.speeds)} entries for {num_clients} clients")
        self.base_times = tuple(self._base_time(k) for k in range(num_clients))

    def _base_time(self, client: int) -> float:
        if self.distribution == "fixed":
            return 1.0 if self.speeds is None else 1.0 / self.speeds[client]
        rng = np.random.default_rng(derive_seed(self.seed, "clock/base", client))
        if self.distribution == "uniform":
            t = rng.uniform(self.low, self.high)
        elif self.distribution == "exponential":
            t = rng.exponential(self.mean)
        elif self.distribution == "normal":
            t = rng.normal(self.mean, self.std)
            while t <= 0:
                t = rng.normal(self.mean, self.std)
        else:
            t = self.values[int(rng.integers(len(self.values)))]
        return max(float(t), self.min_time)

    def compute_times(self, round_idx: int) -> tuple[float, ...]:
        """Per node (clients, then servers at 0) its task time in round ``round_idx`` (PSFL item 15)."""
        if not self.base_times:
            raise RuntimeError("call Clock.setup(num_clients, ...) before compute_times")
        check_int("round_idx", round_idx, 0)
        if self.noise == 0:
            times = self.base_times
        else:
            times = tuple(
                max(t * (1.0 + self.noise * np.random.default_rng(
                    derive_seed(self.seed, "clock/round", round_idx, k)).standard_normal()), self.min_time)
                for k, t in enumerate(self.base_times))
        return tuple(float(t) for t in times) + (0.0,) * self.num_servers

    def transfer_time(self, nbytes: float) -> float:
        """``latency + nbytes / bandwidth`` (no time when ``bandwidth`` is None and latency 0)."""
        nbytes = _number("nbytes", nbytes, 0.0, strict=False)
        return self.latency if self.bandwidth is None else self.latency + nbytes / self.bandwidth

    def schedule(self, plan: RoundPlan, durations: Durations | None = None,
                 edge_bytes: Mapping[tuple[int, int], float] | None = None) -> dict[int, tuple[float, float]]:
        """``(start, finish)`` per node of ``plan`` (DA-DPFL Sec. IV-B).

        A task starts when every model it reads has arrived (a fresh source j at ``finish_j +
        transfer``, a start-of-round one at ``transfer``, the node's own at 0) and its ``after``
        tasks have ended. ``durations`` are per node (default :func:`default_durations`);
        ``edge_bytes[(sender, receiver)]`` are the bytes sent (missing: 0).
        """
        durations = default_durations(plan) if durations is None else durations
        edge_bytes = edge_bytes or {}
        by_node = {t.node: t for t in plan.tasks}

        def arrivals(node: int, finish: Mapping[int, float]) -> list[float]:
            task = by_node[node]
            ready = [finish[a] for a in task.after]
            for s in task.receives_from():
                transfer = self.transfer_time(edge_bytes.get((s.node, node), 0))
                ready.append(finish[s.node] + transfer if s.fresh else transfer)
            return ready

        return finish_times((t.node for t in plan.order()), arrivals, durations)

    def round_metrics(self, plan: RoundPlan, durations: Durations | None = None,
                      edge_bytes: Mapping[tuple[int, int], float] | None = None) -> dict[str, float]:
        """Parallelism (share of training tasks starting at 0), the largest share starting at one time,
        delay (latest start of a training task) and the round's simulated duration (DA-DPFL Sec. VI-E)."""
        times = self.schedule(plan, durations, edge_bytes)
        starts = [times[t.node][0] for t in plan.tasks if t.train]
        if not starts:
            return {"parallelism": 0.0, "max_parallelism": 0.0, "delay": 0.0, "duration": 0.0}
        counts: dict[float, int] = {}
        for s in starts:
            counts[round(s, 9)] = counts.get(round(s, 9), 0) + 1
        return {
            "parallelism": counts.get(0.0, 0) / len(starts),
            "max_parallelism": max(counts.values()) / len(starts),
            "delay": max(starts),
            "duration": max(f for _, f in times.values()),
        }

    @property
    def elapsed(self) -> float:
        """Cumulative simulated time of the rounds passed to :meth:`advance`."""
        return self._elapsed

    def advance(self, duration: float) -> float:
        """Add a round's ``duration`` to :attr:`elapsed` and return the new total."""
        self._elapsed += _number("duration", duration, 0.0, strict=False)
        return self._elapsed

    def state_dict(self) -> dict[str, float]:
        return {"elapsed": self._elapsed}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self._elapsed = _number("elapsed", state["elapsed"], 0.0, strict=False)


__all__ = ["DISTRIBUTIONS", "Clock", "default_durations", "finish_times"]


def build_clock(client_speeds: Sequence[float] | None, clock: Clock | None) -> Clock:
    """The run's clock: ``clock``, or one of unit times scaled by ``client_speeds`` (a task takes ``1 / speed``);
    not both."""
    if client_speeds is not None and clock is not None:
        raise ValueError("give client_speeds or a clock, not both (client_speeds is Clock(speeds=...))")
    if client_speeds is not None and (isinstance(client_speeds, (str, bytes)) or not isinstance(client_speeds, Sequence)
                                      or not all(is_number(s) for s in client_speeds)):
        shown = client_speeds if isinstance(client_speeds, (str, bytes)) or not isinstance(client_speeds, Sequence) \
            else list(client_speeds)
        raise ValueError(f"client_speeds must be a list of numbers > 0 (one per client), got {shown!r}")
    if client_speeds is not None and any(s <= 0 for s in client_speeds):
        raise ValueError(f"client_speeds must all be > 0, got {list(client_speeds)}")
    if clock is not None and not isinstance(clock, Clock):
        raise ValueError(f"clock must be a lightning_dfl.federation.loop.clock.Clock, got {type(clock).__name__}")
    return clock if clock is not None else Clock(speeds=client_speeds)
