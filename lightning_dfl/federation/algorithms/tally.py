"""A round's tally of what its tasks add up (extra FLOPs, counts), kept so that sharded processes agree.

An algorithm that counts inside its tasks (FedFomo's validation FLOPs, FedDST's readjustment FLOPs,
Sub-FedAvg's accepted prunings) keeps the counts in a :class:`RoundTally` and mixes in
:class:`TalliedTasks`: in a sharded run (:mod:`~lightning_dfl.federation.loop.sharded`) each task's
additions travel to every process and are replayed there in task order, so every process ends the round
with the sums one process reaches, bit for bit (floats added in the same order from the same start).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RoundTally", "TalliedTasks"]

Number = int | float


class RoundTally:
    """Named sums over a round's tasks: ``add(flops=..., tasks=1)`` in a task, :meth:`take` at the round's end.

    Each :meth:`add` is also kept (one small dict per task) until :meth:`take`, which is what a sharded
    run moves between processes (the sharding protocol, :data:`~lightning_dfl.federation.loop.callback_hooks.
    SHARD_PROTOCOL`)."""

    def __init__(self, **zeros: Number) -> None:
        if not zeros:
            raise ValueError("a RoundTally needs at least one named sum, e.g. RoundTally(flops=0.0)")
        self._zeros = dict(zeros)
        self.totals: dict[str, Number] = dict(zeros)
        self._added: list[dict[str, Number]] = []

    def add(self, **amounts: Number) -> None:
        """Add ``amounts`` to the named sums (each name one of the tally's)."""
        unknown = sorted(set(amounts) - set(self.totals))
        if unknown:
            raise KeyError(f"unknown sum(s) {', '.join(unknown)}; this tally keeps: {', '.join(self.totals)}")
        for name, amount in amounts.items():
            self.totals[name] += amount
        self._added.append(amounts)

    def __getitem__(self, name: str) -> Number:
        return self.totals[name]

    def take(self) -> dict[str, Number]:
        """The round's sums; the tally starts again from zero."""
        out, self.totals, self._added = self.totals, dict(self._zeros), []
        return out

    # -- the sharding protocol ------------------------------------------------------------------------
    def shard_snapshot(self) -> tuple[int, dict[str, Number]]:
        return len(self._added), dict(self.totals)

    def shard_delta(self, snapshot: tuple[int, dict[str, Number]]) -> list[dict[str, Number]]:
        return self._added[snapshot[0]:]

    def shard_rollback(self, snapshot: tuple[int, dict[str, Number]]) -> None:
        count, totals = snapshot
        del self._added[count:]
        self.totals = dict(totals)

    def shard_apply(self, delta: list[dict[str, Number]]) -> None:
        for amounts in delta:
            self.add(**amounts)


class TalliedTasks:
    """Mixin: an algorithm whose task state is its :attr:`tally` alone speaks the sharding protocol through it."""

    tally: RoundTally

    def shard_snapshot(self) -> Any:
        return self.tally.shard_snapshot()

    def shard_delta(self, snapshot: Any) -> Any:
        return self.tally.shard_delta(snapshot)

    def shard_rollback(self, snapshot: Any) -> None:
        self.tally.shard_rollback(snapshot)

    def shard_apply(self, delta: Any) -> None:
        self.tally.shard_apply(delta)
