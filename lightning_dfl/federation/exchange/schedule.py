"""When each task of a round starts and ends: the one timing rule every plan is timed by.

A task starts when the inputs it waits for have arrived and lasts its duration (DA-DPFL Sec. IV-B
states it for dynamic aggregation; every plan follows it). The federation's clock
(:mod:`lightning_dfl.federation.loop.clock`) and DA-DPFL's Monte Carlo of the waits
(:mod:`lightning_dfl.federation.algorithms.dadpfl_waits`) build on it. Pure computation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

__all__ = ["Arrivals", "ComputeTimes", "Durations", "finish_times"]



class ComputeTimes(Protocol):
    """What :func:`simulate_dynamic_aggregation` needs of a clock
    (:class:`lightning_dfl.federation.loop.clock.Clock` is one): set up, then per-round compute times."""

    def setup(self, num_clients: int, num_servers: int = 0, seed: int = 0) -> None: ...

    def compute_times(self, round_idx: int) -> Sequence[float]: ...


#: per node, the times its inputs become available, given the finish times of the nodes before it
Arrivals = Callable[[int, Mapping[int, float]], Iterable[float]]
Durations = Sequence[float] | Mapping[int, float]


def finish_times(order: Iterable[int], arrivals: Arrivals, durations: Durations) -> dict[int, tuple[float, float]]:
    """``(start, finish)`` per node, visiting ``order`` (a topological order): node k starts at the
    latest of ``arrivals(k, finish)`` (0 when there is none) and finishes ``durations[k]`` later
    (DA-DPFL Sec. IV-B; ``finish`` holds the nodes already visited)."""
    finish: dict[int, float] = {}
    times: dict[int, tuple[float, float]] = {}
    for node in order:
        start = max(arrivals(node, finish), default=0.0)
        finish[node] = start + durations[node]
        times[node] = (start, finish[node])
    return times
