"""Who takes part in a round, and its plan: the algorithm's participants, less the clients that dropped
out (``dropout``, DisPFL App. B.6) and, under a ``deadline``, the stragglers whose task would end after it.

The round asks :class:`RoundPlanner` for its exchanges; the algorithm plans
(:meth:`~lightning_dfl.federation.algorithms.base.Algorithm.plan_round`) from the
:class:`~lightning_dfl.federation.algorithms.context.RoundContext` built here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from lightning_dfl.checks import is_number
from lightning_dfl.federation.algorithms.context import RoundContext
from lightning_dfl.federation.loop.clock import Clock
from lightning_dfl.seeding import derive_seed

__all__ = ["RoundPlanner", "check_faults"]


def check_faults(dropout: Any, deadline: Any) -> tuple[float, float | None]:
    """``(dropout, deadline)`` checked: a probability in [0, 1), and a time > 0 or ``None`` (no deadline)."""
    if not is_number(dropout) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    if deadline is not None and (not is_number(deadline) or deadline <= 0):
        raise ValueError(f"deadline must be a time > 0 (or None: no deadline), got {deadline!r}")
    return float(dropout), None if deadline is None else float(deadline)


@dataclasses.dataclass(frozen=True)
class RoundPlanner:
    """Plans rounds for ``algorithm`` over ``num_clients`` clients (see the module docstring)."""

    algorithm: Any
    clock: Clock
    num_clients: int
    rounds: int
    sample_counts: tuple[int, ...]
    store: Any
    seed: int
    dropout: float = 0.0
    deadline: float | None = None

    def context(self, round_idx: int, excluded: frozenset[int] = frozenset(),
                durations: tuple[float, ...] | None = None) -> RoundContext:
        """What the algorithm reads when it plans ``round_idx``: sizes, the plan stream, the clock's
        compute times (``durations`` per node, drawn when not given) and the participants (the
        algorithm's choice, less the clients that dropped out and ``excluded`` ones: stragglers)."""
        durations = self.clock.compute_times(round_idx) if durations is None else durations
        k = self.num_clients
        ctx = RoundContext(round_idx, self.rounds, k, self.sample_counts,
                           np.random.default_rng(derive_seed(self.seed, "plan", round_idx)),
                           durations[:k], store=self.store, seed=self.seed)
        participants = self.algorithm.participants(ctx)
        if participants is not None:
            chosen = [int(c) for c in participants]
            bad = [c for c in chosen if not 0 <= c < k]
            if bad or len(set(chosen)) != len(chosen):
                raise ValueError(f"{type(self.algorithm).__name__}.participants returned {list(participants)}: "
                                 f"expected distinct client ids in 0..{k - 1}")
        if participants is None and not self.dropout and not excluded:
            return ctx
        active = set(range(k)) if participants is None else set(chosen)
        if self.dropout:
            draws = np.random.default_rng(derive_seed(self.seed, "dropout", round_idx)).random(k)
            active &= {c for c in range(k) if draws[c] >= self.dropout}
        return dataclasses.replace(ctx, participants=tuple(sorted(active - excluded)))

    def exchanges(self, round_idx: int, durations: tuple[float, ...]) -> Iterator[tuple[RoundContext, Any, int]]:
        """The round's exchanges, planned one at a time (a later one after the earlier ran): the first from
        :meth:`_plan_meeting_deadline`, each later one by the algorithm with its own stream. Yields the context, the plan
        and the stragglers the deadline dropped (the first exchange's for every one)."""
        ctx, plan, stragglers = self._plan_meeting_deadline(round_idx, durations)
        yield ctx, plan, stragglers
        for exchange in range(1, self.algorithm.exchanges_per_round):
            rng = np.random.default_rng(derive_seed(self.seed, "plan", round_idx, exchange))
            ctx = dataclasses.replace(ctx, exchange=exchange, rng=rng)
            yield ctx, self.algorithm.plan_round(ctx), stragglers

    def _plan_meeting_deadline(self, round_idx: int, durations: tuple[float, ...]) -> tuple[RoundContext, Any, int]:
        """Plan the round's first exchange; with a deadline, drop the clients whose task would finish
        after it and plan again until every task meets it. Returns the context, the plan and the
        number of stragglers dropped."""
        excluded: frozenset[int] = frozenset()
        while True:
            ctx = self.context(round_idx, excluded, durations)
            plan = self.algorithm.plan_round(ctx)
            if self.deadline is None:
                return ctx, plan, 0
            times = self.clock.schedule(plan, durations)
            late = {t.node for t in plan.tasks if t.train and t.node < self.num_clients
                    and times[t.node][1] > self.deadline + 1e-12}
            if not late:
                return ctx, plan, len(excluded)
            excluded |= late
