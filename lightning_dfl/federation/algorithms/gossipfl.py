"""GossipFL (Tang et al., 2022; wizard1203/GossipFL ``SAPS_FL``): sparsified gossip over a random
perfect matching.

The original's iteration (``decentralized_worker_manager.run_sync``, baselines notes section 6):

1. the topology is a maximum matching on the links above a bandwidth threshold; with uniform
   bandwidth, a random perfect matching, W_ii = W_i,pi(i) = 1/2;
2. each client sparsifies its model (random-k; top-k as an option) and sends the selected values (and
   their indices) to its one peer: ``max(1, int(n (1 - compress_ratio)))`` of each tensor's n entries,
   99% with its default ``compress_ratio`` 0.01 (our ``compress_ratio`` is the share sent: 0.99);
3. the receiver forms 1/2 x_i + 1/2 (the peer's values at the peer's indices, zeros elsewhere) and
   overwrites only its OWN selected coordinates with it (``uncompress`` then ``uncompress_direct``);
   every other coordinate is unchanged;
4. then local SGD.

With random-k drawn from a seed the pair shares, both sides select the same set S and step 3 is the
symmetric pairwise average x_i[S] = x_pi(i)[S] = (x_i[S] + x_pi(i)[S]) / 2 (the pair's sum is kept);
the indices need not be sent (:class:`RandomKCodec` with ``bytes_per_index=0``). With top-k the two
sets differ and the rule is applied as the original applies it (indices counted, 4 B each).

Here a round is one matching and one gossip step, then the trainer's local work:
``trainer.local_steps: 1`` is the original cadence (one SGD step per gossip), ``local_epochs`` E the
papers' round. With an odd number of active clients, one client, drawn uniformly each round, has no
peer: it neither sends nor receives and only trains (a maximum matching).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dfl.federation.algorithms.base import Algorithm, RoundContext, TaskContext
from lightning_dfl.federation.exchange.messages import Message, check_codec_choice, choose_codec
from lightning_dfl.federation.exchange.plan import RoundPlan, Source, Task
from lightning_dfl.seeding import derive_seed

#: the sparsifiers GossipFL offers (codecs of :data:`~lightning_dfl.federation.exchange.messages.CODECS`), with the
#: settings it fixes: random-k's coordinates come from the pair's shared seed, so no index is sent
COMPRESSORS = {"random_k": {"bytes_per_index": 0}, "top_k": {}}


def random_matching(clients: list[int], rng) -> list[tuple[int, int]]:
    """A uniformly random perfect matching of ``clients`` (a maximum one when their number is odd: the
    last client of a random order is left out)."""
    order = [clients[i] for i in rng.permutation(len(clients))]
    return [(order[i], order[i + 1]) for i in range(0, len(order) - 1, 2)]


def pair_seed(seed: int, round_idx: int, exchange: int, a: int, b: int) -> int:
    """The seed both peers of the pair {a, b} draw their random-k coordinates from (symmetric in a, b)."""
    return derive_seed(seed, "gossipfl/pair", round_idx, exchange, min(a, b), max(a, b))


class GossipFL(Algorithm):
    """GossipFL / SAPS-FL: per round a random perfect matching; each pair exchanges a sparsified model
    and each side overwrites its selected coordinates with the pair's mix (module docstring), then
    trains. Headline: each client's model on its own test set; ``acc/consensus_mean`` is the mean
    model's.

    Args:
        compress_ratio: the share of each tensor's entries a client sends, in (0, 1]. SAPS_FL's own
            ``compress_ratio`` is the share it drops (``compression/compressors_simple.py`` keeps
            ``max(1, int(n * (1 - ratio)))`` entries for random-k and top-k), and its default 0.01
            (``experiments/configs_algorithm/SAPS_FL.conf``) sends 99%: 0.99 here, the default (until
            2026-12-02 the default was 0.01, 1% sent, called SAPS_FL's default). Another value is labelled,
            e.g. "GossipFL (ratio 0.01)".
        compressor: ``"random_k"`` (default: coordinates drawn from the pair's shared seed, values only)
            or ``"top_k"`` (each side's largest entries, values plus 4-byte indices).
    """

    name = "gossipfl"
    shardable = True
    partitionable = True  # its hooks read other nodes as sources only
    title = "GossipFL"
    reads_only_sources = True
    #: SAPS_FL's defaults: 99% of each tensor sent (its compress_ratio 0.01 is the share dropped) and one SGD
    #: step per gossip (``trainer.local_steps: 1``)
    phrases = {"compress_ratio": "ratio {value}"}

    def __init__(self, compress_ratio: float = 0.99, compressor: str = "random_k") -> None:
        check_codec_choice(compressor, COMPRESSORS, "compressor")
        if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, (int, float)) \
                or not 0 < compress_ratio <= 1:
            raise ValueError(f"compress_ratio must be a number in (0, 1], got {compress_ratio!r}")
        self.compress_ratio = float(compress_ratio)
        self.compressor = compressor
        self._codec = choose_codec(compressor, COMPRESSORS, "compressor", ratio=self.compress_ratio)
        self._cadence: tuple[int, int | None] | None = None  # the trainer's (local_epochs, local_steps), once seen

    def deviations(self) -> list[str]:
        """What departs from SAPS_FL's rule (its default sends 99% of each tensor, ``compress_ratio`` 0.99 here;
        one SGD step per gossip), for the reports' label."""
        out = super().deviations()
        if self._cadence is not None:
            epochs, steps = self._cadence
            if steps is None:
                out.append(f"{epochs} local epoch{'s' if epochs != 1 else ''} per gossip")
            elif steps != 1:
                out.append(f"{steps} local steps per gossip")
        return out

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        peers = {}
        for a, b in random_matching(ctx.active_clients, ctx.rng):
            peers[a], peers[b] = b, a
        tasks = [Task(node=k, sources=(Source(k), Source(peers[k])) if k in peers else ())
                 for k in ctx.active_clients]
        return RoundPlan(ctx.round_idx, tasks, meta={"pairs": sorted((a, b) for a, b in peers.items() if a < b)})

    def selection_generator(self, ctx: TaskContext, peer: int) -> torch.Generator:
        """The generator of the pair {ctx.node, peer}: both sides draw the same coordinates."""
        return torch.Generator().manual_seed(pair_seed(ctx.seed, ctx.round_idx, ctx.exchange, ctx.node, peer))

    def message(self, ctx: TaskContext, source: Source) -> Message:
        """The sender's sparsified model; the receiver's own one (not sent) carries its own selection."""
        peer = next(s.node for s in ctx.task.sources if s.node != ctx.node)
        weights, mask = ctx.store.published(source.node, source.fresh)
        return self._codec.encode(weights, mask, sender=source.node, masked_names=ctx.store.masked_names,
                                  generator=self.selection_generator(ctx, peer))

    def aggregate(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor] | None:
        """SAPS_FL's rule: x_i[S_i] <- 1/2 x_i[S_i] + 1/2 (peer's sent values)[S_i]; the rest unchanged."""
        self._cadence = (ctx.local_epochs, ctx.local_steps)  # how much local work follows each gossip (label)
        if len(messages) < 2:
            return None  # unmatched this round: keep the own model
        own_message, peer_message = messages
        own, _ = ctx.store.published(ctx.node)
        out = {}
        for name, x in own.items():
            selected = own_message.mask.get(name) if own_message.mask is not None else None
            if selected is None:  # a non-floating entry: not gossiped
                out[name] = x.clone()
                continue
            mixed = 0.5 * x + 0.5 * peer_message.weights[name]
            out[name] = x.where(~selected, mixed)
        return out

    def consensus_sources(self, num_clients: int) -> list[Source]:
        return [Source(k) for k in range(num_clients)]

    # -- sharded federations (lightning_dfl.federation.loop.sharded): the cadence a task saw reaches every process
    def shard_snapshot(self) -> tuple[int, int | None] | None:
        return self._cadence

    def shard_delta(self, snapshot: tuple[int, int | None] | None) -> tuple[int, int | None] | None:
        return self._cadence

    def shard_rollback(self, snapshot: tuple[int, int | None] | None) -> None:
        self._cadence = snapshot

    def shard_apply(self, delta: tuple[int, int | None] | None) -> None:
        if delta is not None:
            self._cadence = delta
