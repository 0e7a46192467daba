"""BEER (Zhao et al., 2022, "BEER: Fast O(1/T) rate for decentralized nonconvex optimization with
communication compression", Alg. 1; liboyue/beer ``optim/BEER.py``): compressed gradient tracking.

Per client i (agents as rows, W the fixed mixing matrix with W_ij = 1/(deg_i + 1) on the graph and
the diagonal), one iteration per minibatch xi, in the code's order (baselines notes section 7):

- V^t     = V^{t-1} + gamma (W G^{t-1} - G^{t-1}) + grad F(X^t; xi) - grad F(X^{t-1}; xi)   (same xi)
- G^t     = G^{t-1} + C(V^t - G^{t-1})
- X^{t+1} = X^t + gamma (W H^t - H^t) - eta V^t
- H^{t+1} = H^t + C(X^{t+1} - H^t)

Init: H = G = 0, V^0 = grad F(X^0; xi^0), X^1 = X^0 - eta V^0, H^1 = C(X^1).

On the engine one round is ONE BEER iteration (``trainer.local_epochs``/``local_steps`` are not
used): the round's task reads its neighbours' start-of-round H^t and G^{t-1} (their replicas, which
a receiver rebuilds by adding the compressed C(X - H) and C(V - G) they sent at the end of the
previous round: a message counts those two compressed vectors' bytes), draws one minibatch, takes
the two gradients on it, applies the four lines and publishes X^{t+1}, H^{t+1}, G^t. Both messages
an iteration needs were produced in the previous one, so one exchange per round suffices, with no
in-round dependency. X is the model's parameters; buffers (norm statistics) stay local. FLOPs count
both gradients (the minibatch is counted twice in ``samples/train``).

``gradient_difference="fresh"`` is the authors' numerical code (``nda``'s BEER): grad F(X^t; xi^t) -
grad F(X^{t-1}; xi^{t-1}), each on its own minibatch (one gradient per step; the previous gradient is
kept instead of X^{t-1}), i.e. plain stochastic gradient tracking. The default same-minibatch
difference is a recursive (SARAH-like) estimator whose error is never reset: with eta = 0.05 on the
digits it drifts (see ``configs/beer_digits.yaml``).

The compressor C is the paper's gsgd_b random dithering (default b = 9) on the whole flattened model,
``top_k`` / ``random_k`` (per tensor) or ``identity``. The DA-DPFL authors' variant (one BEER step
per round after 5 epochs of plain SGD) is not implemented.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_dfl.checks import is_number
from lightning_dfl.federation.algorithms.base import RoundContext, TaskContext, TopologyAlgorithm, parallel_plan
from lightning_dfl.federation.exchange.messages import (  # noqa: F401 (gsgd, its codec: BEER's default C, re-exported)
    Codec,
    GSGDCodec,
    Message,
    choose_codec,
    gsgd,
)
from lightning_dfl.federation.exchange.plan import RoundPlan, Source
from lightning_dfl.federation.store import StateField

#: BEER's compressors C (codecs of :data:`~lightning_dfl.federation.exchange.messages.CODECS`; ``"identity"``: dense)
COMPRESSORS = ("gsgd", "top_k", "random_k", "identity")
FIXED_TOPOLOGIES = ("ring", "full")
#: grad F(X^t) - grad F(X^{t-1}) on the same minibatch (optim/BEER.py) or on each one's own (nda's BEER)
DIFFERENCES = ("same_batch", "fresh")


# -- the update, on tensors (one agent's, or agents stacked as rows) ---------------------------------
def track_gradient(v: Tensor, g: Tensor, wg: Tensor, grad: Tensor, grad_prev: Tensor, gamma: float) -> Tensor:
    """V^t = V^{t-1} + gamma (W G^{t-1} - G^{t-1}) + grad F(X^t) - grad F(X^{t-1})."""
    return v + gamma * (wg - g) + grad - grad_prev


def descend(x: Tensor, h: Tensor, wh: Tensor, v: Tensor, gamma: float, eta: float) -> Tensor:
    """X^{t+1} = X^t + gamma (W H^t - H^t) - eta V^t."""
    return x + gamma * (wh - h) - eta * v


def build_compressor(compressor: str, bits: int = 9, ratio: float = 0.1, noise: str = "uniform") -> Codec:
    """BEER's C by name (see :data:`COMPRESSORS`), from the codec registry (:func:`choose_codec`)."""
    return choose_codec(compressor, COMPRESSORS, "compressor", bits=bits, ratio=ratio, noise=noise)


def compress(codec: Codec, values: Mapping[str, Tensor], generator: torch.Generator) -> tuple[dict, int, int]:
    """C(values) as the receiver decodes it (zeros where nothing was sent), with its value and index bytes."""
    message = codec.encode(values, None, sender=-1, masked_names=(), generator=generator)
    return message.weights, message.value_bytes, message.index_bytes


class BEER(TopologyAlgorithm):
    """BEER (module docstring) on a fixed graph: ``ring`` (M even: M/2 on each side) or ``full``.

    Args:
        num_neighbors: M of the ring.
        topology: ``"ring"`` or ``"full"`` (a fixed graph: the replicas of H and G need the same
            neighbours every iteration).
        gamma: the consensus step size gamma, in (0, 1].
        eta: the step size eta (``None``: the module's ``lr``, constant: BEER's eta does not decay).
        compressor: ``"gsgd"`` (default, ``bits`` b), ``"top_k"``, ``"random_k"`` (``ratio`` of each
            tensor, values and 4-byte indices), or ``"identity"`` (dense, 4 B per value).
        bits: b of gsgd, 2 to 32.
        ratio: the share kept by top-k / random-k, in (0, 1].
        noise: gsgd's dither, ``"uniform"`` (the paper) or ``"normal"`` (the authors' code).
        gradient_difference: ``"same_batch"`` (``optim/BEER.py``: both gradients on the step's minibatch)
            or ``"fresh"`` (each gradient on its own minibatch; module docstring).

    Gradients include the module's weight decay (the L2 term of f_i), as every other baseline's SGD.
    Headline: each client's model on its own test set; ``acc/consensus_mean`` is the mean model's
    (what the authors' code evaluates).
    """

    name = "beer"
    shardable = True
    title = "BEER"
    settings = ("gamma", "eta")  # the step sizes, tuned per task (the paper's grid)
    #: the original (optim/BEER.py) takes both gradients on one minibatch: "BEER (fresh minibatch)"
    phrases = {"gradient_difference": "{value} minibatch"}
    reads_only_sources = True  # and its tasks' replicas
    partitionable = True  # a dropped-out neighbour's replica travels as its task's replica

    def __init__(self, num_neighbors: int = 2, topology: str = "ring", gamma: float = 0.01,
                 eta: float | None = None, compressor: str = "gsgd", bits: int = 9, ratio: float = 0.1,
                 noise: str = "uniform", gradient_difference: str = "same_batch") -> None:
        if topology not in FIXED_TOPOLOGIES:
            raise ValueError(f"BEER needs a fixed graph: topology must be one of {', '.join(FIXED_TOPOLOGIES)}, "
                             f"got {topology!r}")
        super().__init__(num_neighbors, topology)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
            raise ValueError(f"gamma must be a number in (0, 1], got {gamma!r}")
        if eta is not None and not (is_number(eta) and eta > 0):  # 1e400 is read as inf
            raise ValueError(f"eta must be a positive number or None (the module's lr), got {eta!r}"
                             + (" (not finite)" if is_number(eta, finite=False) and not is_number(eta) else ""))
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r} (the share top_k and random_k send; "
                             "checked whatever the compressor)")
        self._codec = build_compressor(compressor, bits, ratio, noise)
        self.gamma, self.eta = float(gamma), eta
        if gradient_difference not in DIFFERENCES:
            raise ValueError(f"unknown gradient_difference {gradient_difference!r}; allowed: {', '.join(DIFFERENCES)}")
        self.compressor, self.bits, self.ratio, self.noise = compressor, bits, ratio, noise
        self.gradient_difference = gradient_difference
        self._previous = "beer/x_prev" if gradient_difference == "same_batch" else "beer/grad_prev"

    def inert_options(self) -> tuple[str, ...]:
        """gsgd's ``bits`` and ``noise`` under another compressor, top-k's and random-k's ``ratio`` under others."""
        inert = () if self.compressor == "gsgd" else ("bits", "noise")
        return inert + (() if self.compressor in ("top_k", "random_k") else ("ratio",))

    def state_fields(self) -> list[StateField]:
        weights = [StateField("beer/v", like="weights", dtype=None),
                   StateField(self._previous, like="weights", dtype=None, fill=float("nan")),
                   StateField("beer/h", like="weights", dtype=None, published=True),
                   StateField("beer/g", like="weights", dtype=None, published=True)]
        sent = [StateField(f"beer/{n}", dtype=torch.int64, published=True, fill=-1 if n == "sent_round" else 0)
                for n in ("value_bytes", "index_bytes", "sent_round")]
        return weights + sent

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        """Every participant reads its participating neighbours' messages, and holds the replicas of those that
        dropped out (the task's ``replicas``: :meth:`aggregate` mixes them in)."""
        neighbors = self.neighbors(ctx)
        taking_part = set(ctx.active_clients)
        plan = parallel_plan(ctx, neighbors)
        return RoundPlan(ctx.round_idx, [dataclasses.replace(task, replicas=tuple(
            j for j in neighbors[task.node] if j not in taking_part)) for task in plan.tasks])

    def message(self, ctx: TaskContext, source: Source) -> Message:
        """The sender's H and G as the receiver's replicas hold them; its bytes are those of the two
        compressed vectors it sent at the end of the previous round (none if it did not step then)."""
        store, node = ctx.store, source.node
        h, g = store.read(node, "beer/h", source.fresh), store.read(node, "beer/g", source.fresh)
        sent_round = int(store.read(node, "beer/sent_round", source.fresh))
        sent = sent_round >= 0 and sent_round == ctx.round_idx - 1
        value_bytes = int(store.read(node, "beer/value_bytes", source.fresh)) if sent else 0
        index_bytes = int(store.read(node, "beer/index_bytes", source.fresh)) if sent else 0
        weights = {**{f"h/{n}": t for n, t in h.items()}, **{f"g/{n}": t for n, t in g.items()}}
        return Message(node, weights, None, value_bytes, index_bytes)

    def aggregate(self, ctx: TaskContext, messages: list[Message]) -> None:
        """(W H^t)_i and (W G^{t-1})_i from the fixed graph, W_ij = 1/(deg_i + 1); a neighbour that
        sent nothing this round (dropped out) counts with the replica the receiver holds."""
        received = {m.sender: m.weights for m in messages}
        neighbors = self._topology.neighbors(ctx.num_clients, ctx.round_idx, None)[ctx.node]
        group = [ctx.node, *neighbors]
        wh, wg = {}, {}
        for j in group:
            h, g = ((ctx.store.read(j, "beer/h"), ctx.store.read(j, "beer/g")) if j not in received
                    else ({n: received[j][f"h/{n}"] for n in ctx.store.names if f"h/{n}" in received[j]},
                          {n: received[j][f"g/{n}"] for n in ctx.store.names if f"g/{n}" in received[j]}))
            for total, part in ((wh, h), (wg, g)):
                for n, t in part.items():
                    total[n] = total[n] + t if n in total else t.clone()
        ctx.scratch["beer/wh"] = {n: t / len(group) for n, t in wh.items()}
        ctx.scratch["beer/wg"] = {n: t / len(group) for n, t in wg.items()}
        return None

    def _gradient(self, ctx: TaskContext, batch, names: list[str]) -> tuple[dict[str, Tensor], float]:
        """grad F_i at the worker's parameters on ``batch`` (loss plus the L2 term), and the loss."""
        ctx.optimizer.zero_grad(set_to_none=True)
        with ctx.fabric.autocast():
            loss = self.loss(ctx, batch)
        ctx.fabric.backward(loss)
        decay = float(ctx.module.hparams.weight_decay)
        params = dict(ctx.module.model.named_parameters())
        grads = {n: (params[n].grad.detach().clone() if params[n].grad is not None
                     else torch.zeros_like(params[n])) + decay * params[n].detach() for n in names}
        ctx.optimizer.zero_grad(set_to_none=True)
        return grads, float(loss.detach())

    @torch.no_grad()
    def local_train(self, ctx: TaskContext) -> float:
        """One BEER iteration (module docstring) on one minibatch."""
        batch = next(iter(ctx.train_batches), None)
        if batch is None:
            return float("nan")
        ctx.module.train()
        store, node, gamma = ctx.store, ctx.node, self.gamma
        eta = self.eta if self.eta is not None else float(ctx.module.hparams.lr)
        names = [n for n, _ in ctx.module.model.named_parameters()]
        generator = ctx.generator("beer/compress")
        x = {n: t.detach().clone() for n, t in ctx.module.model.named_parameters()}
        v, h, g = store.read(node, "beer/v"), store.read(node, "beer/h"), store.read(node, "beer/g")
        previous = store.read(node, self._previous)  # X^{t-1}, or grad F(X^{t-1}; xi^{t-1})
        first = bool(torch.isnan(previous[names[0]]).any())
        with torch.enable_grad():
            grad, loss = self._gradient(ctx, batch, names)
            current = ctx.worker_weights()  # X^t, with the norm statistics of this pass
            if first:  # V^0 = grad F(X^0)
                grad_prev = {n: torch.zeros_like(t) for n, t in grad.items()}
            elif self.gradient_difference == "fresh":  # the previous iteration's gradient, on its minibatch
                grad_prev = {n: previous[n].to(grad[n].device) for n in names}
            else:  # the same minibatch at X^{t-1} (its samples count again: a second gradient)
                ctx.load_weights({**current, **{n: previous[n] for n in names}})
                grad_prev, _ = self._gradient(ctx, batch, names)
                ctx.train_batches.samples += int(batch[1].shape[0])
        device = x[names[0]].device  # the store may live elsewhere
        v, h, g, wg, wh = ({n: t[n].to(device) for n in names}
                           for t in (v, h, g, ctx.scratch.pop("beer/wg"), ctx.scratch.pop("beer/wh")))
        v_new = {n: track_gradient(v[n], g[n], wg[n], grad[n], grad_prev[n], gamma) for n in names}
        value_bytes = index_bytes = 0
        if first:  # G^0 = 0: nothing to send yet
            g_new = g
        else:
            q, value_bytes, index_bytes = compress(self._codec, {n: v_new[n] - g[n] for n in names}, generator)
            g_new = {n: g[n] + q[n] for n in names}
        x_new = {n: descend(x[n], h[n], wh[n], v_new[n], gamma, eta) for n in names}
        q, vb, ib = compress(self._codec, {n: x_new[n] - h[n] for n in names}, generator)
        h_new = {n: h[n] + q[n] for n in names}
        ctx.load_weights({**current, **x_new})
        ctx.module.mask.apply_()
        # staged: a non-finite step is contained whole, the node's state kept
        kept = x if self.gradient_difference == "same_batch" else grad
        ctx.write("beer/v", _full(store.read(node, "beer/v"), v_new))
        ctx.write(self._previous, _full(store.read(node, self._previous), kept))
        ctx.scratch["beer/published"] = {"beer/h": h_new, "beer/g": g_new, "beer/value_bytes": value_bytes + vb,
                                         "beer/index_bytes": index_bytes + ib, "beer/sent_round": ctx.round_idx}
        return loss

    def publish_fields(self, ctx: TaskContext) -> dict:
        published = ctx.scratch.pop("beer/published", {})
        for name in ("beer/h", "beer/g"):
            if name in published:
                published[name] = _full(ctx.store.read(ctx.node, name), published[name])
        return published

    def consensus_sources(self, num_clients: int) -> list[Source]:
        return [Source(k) for k in range(num_clients)]


def _full(field: Mapping[str, Tensor], values: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A like-weights field's value: ``values`` where given, the field's own entries (buffers) elsewhere."""
    return {n: values[n] if n in values else t for n, t in field.items()}

