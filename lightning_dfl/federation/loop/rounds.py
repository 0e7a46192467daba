"""One round's exchanges run in order, and what they produce (:class:`RoundOutcome`).

:func:`run_exchanges` asks the planner for each exchange's plan (:meth:`RoundPlanner.exchanges`), has the
executor run it, ends the store's round, and lets the clock time the exchange's own messages; then the executor
finishes the round (the device's values read at once). The outcome turns into the round's first metrics
(bytes, FLOPs, accuracies, participation, simulated time); the trainer adds the evaluations, the callbacks'
and the algorithm's metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lightning_dfl.errors import RunDiverged
from lightning_dfl.federation.loop.clock import Clock
from lightning_dfl.federation.loop.planner import RoundPlanner
from lightning_dfl.federation.metrics.accounting import RoundAccounting
from lightning_dfl.federation.metrics.spread import personal_spread

__all__ = ["RoundOutcome", "run_exchanges"]


@dataclasses.dataclass
class RoundOutcome:
    """What a round's exchanges produced: the accounting (records and bytes), the clock's timing of the round
    (``duration`` summed over its exchanges), the clients taking part and the stragglers dropped."""

    round_idx: int
    accounting: RoundAccounting
    timing: dict[str, float]
    active: int
    stragglers: int

    def check_finite(self, rounds: int, checkpoint_left: str) -> None:
        """``RunDiverged`` when every client that trained ended non-finite; ``checkpoint_left`` says what the run
        leaves to resume from."""
        failed = sorted(r.client for r in self.accounting.records if r.contained)
        if failed and len(failed) == len(self.accounting.records):
            raise RunDiverged(
                f"round {self.round_idx + 1} of {rounds}: every client that trained ({len(failed)}: {failed}) ended "
                "with non-finite (or above 1e30) weights or loss; the learning rate is probably too high for this "
                f"model and data (or the data hold NaN/inf values). {checkpoint_left}")

    def metrics(self, num_clients: int, clock: Clock) -> dict[str, float]:
        """The round's accounting, participation and simulated time (the clock advanced by the round)."""
        metrics = self.accounting.metrics()
        metrics["clients/active_share"] = self.active / num_clients
        metrics["faults/stragglers"] = float(self.stragglers)
        metrics.update({f"time/{k}": v for k, v in self.timing.items()})
        metrics["time/elapsed"] = clock.advance(self.timing["duration"])
        return metrics

    def spread(self) -> dict[str, float]:
        """The spread of the trained clients' personal accuracies (:func:`personal_spread`)."""
        return personal_spread([r.acc_trained for r in self.accounting.records if r.acc_trained is not None])


def run_exchanges(round_idx: int, evaluate: bool, planner: RoundPlanner, executor: Any, store: Any, clock: Clock,
                  diag: Any, round_start: Callable[[], None]) -> RoundOutcome:
    """Run ``round_idx``'s exchanges (module docstring); ``round_start()`` runs once the first is planned."""
    durations = clock.compute_times(round_idx)  # one draw per round: planning and timing share it
    accounting = RoundAccounting(round_idx, observer=diag)  # the diagnostics hear every transfer
    timings = []
    active = stragglers = 0
    for exchange, (ctx, plan, dropped) in enumerate(planner.exchanges(round_idx, durations)):
        if not exchange:
            round_start()
            active = planner.num_clients if ctx.participants is None else len(ctx.participants)
            stragglers = dropped
        accounting.edge_bytes.clear()  # the clock times each exchange's own messages
        for sender, receiver, nbytes in plan.side_transfers:
            accounting.transfer(sender, receiver, 0, nbytes)
        executor.run(plan, evaluate, accounting, exchange)
        store.end_round()
        if diag is not None:
            diag.observe(plan)
        timings.append((clock.round_metrics(plan, durations, accounting.edge_bytes), any(t.train for t in plan.tasks)))
    executor.finish_round(accounting)
    timing = dict(next((m for m, trains in timings if trains), timings[0][0]))
    timing["duration"] = sum(m["duration"] for m, _ in timings)  # exchanges run one after another
    return RoundOutcome(round_idx, accounting, timing, active, stragglers)
