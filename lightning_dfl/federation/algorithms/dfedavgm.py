"""DFedAvgM (Sun, Li & Wang, "Decentralized Federated Averaging", arXiv 2104.11375 / TPAMI 2023, Alg. 1),
as the baselines notes (section 4) state it.

One round t of the paper, for every client i::

    z^0 = z^-1 = x_i^t;   z^{k+1} = z^k - eta g(z^k; xi_k) + theta (z^k - z^{k-1}),  k = 0..K-1   (heavy ball)
    x_i^{t+1} = sum_j W_ij z_j^K,   W_ij = 1/(M+1) for j in N_i^t (its in-neighbours) and j = i      (mixing)

The local steps are PyTorch's ``SGD(momentum=theta)`` (buf = theta buf + g; z -= eta buf, which is the
recurrence above with z^-1 = z^0) at a constant lr inside the round (lr x lr_decay^t across rounds)
and a fresh optimizer state every round: the momentum restarts, nothing but x_i crosses rounds. It is
built by :meth:`DFedAvgM.make_optimizer` with ``momentum`` (theta, 0.9 per 000:202) whatever the
module's ``momentum``; the module's weight decay applies (the papers' 5e-4). On the ``time_varying``
topology every client receives from exactly M and sends to exactly M others, so the uniform W is
doubly stochastic (``time_varying_in_degree`` gives a row-stochastic W only).

**Order of operations.** The engine's task aggregates first, then trains. The task of round t
mixes the models its neighbours trained (published) in round t - 1, then runs the K local steps:
the paper's sequence (train, mix, train, mix, ...) shifted by one. Round 0 has nothing to mix: its
tasks have no sources, train from x_i^0 and send nothing. The run ends with the last local training
(those models are evaluated, "right after local training", 000:198); the paper's final mix is not run.

**Options.** ``message_dtype="float16"``: the model a neighbour receives is rounded to fp16 and
back, counted 2 bytes per value (the notes' "fp16 as an optional Q", applied to the model; the
paper's Alg. 2 quantizes the difference z_j - x_j, which is not implemented). ``rule="da"``: the
DA-DPFL authors' copy (notes section 4, "DA copy"), a compatibility mode, never the default: each
client keeps Delta_i = fp16(z_i - x_i) as a published field; x_i <- x_i + sum_{j in N_i u i} W_ij
Delta_j^{t-1} (W by sample count, below; models are never averaged), then x_i <- z_i = SGD_E(x_i); its messages are the fp16
deltas (2 bytes per value). The DA scripts also clip gradients at norm 10 (``clip_grad_norm``).

**Weighting.** ``weighting="uniform"`` is the paper's W_ij = 1/(M+1); ``"samples"`` weighs each source by its
training sample count, W_ij = n_j / sum_{l in N_i u i} n_l: the DA copy's ``_aggregate`` of the neighbours'
deltas (``dfedavgm_api.py`` lines 122-129 and 190-202, self appended at line 117), hence the default under
``rule="da"`` (``None``: ``"samples"`` there, ``"uniform"`` under the original rule). Sample weights make W
row-stochastic only (not doubly stochastic), so the consensus drifts toward the larger clients.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.checks import is_number
from lightning_dfl.federation.algorithms.base import RoundContext, TaskContext, TopologyAlgorithm, parallel_plan
from lightning_dfl.federation.exchange.messages import Message, build_codec, dtype_bound
from lightning_dfl.federation.exchange.plan import RoundPlan, Source, Task
from lightning_dfl.federation.store import StateField

#: ``"original"``: Sun et al.'s mixing of the trained models; ``"da"``: the DA-DPFL authors' delta rule
RULES = ("original", "da")
#: message dtypes and the bytes each floating value costs
MESSAGE_DTYPES = {"float32": 4, "float16": 2}
#: ``"uniform"``: W_ij = 1/(M+1) (the paper); ``"samples"``: W_ij by the sources' sample counts (the DA copy)
WEIGHTINGS = ("uniform", "samples")
DELTA_FIELD = "dfedavgm/delta"
_START = "dfedavgm/start"


def fp16_roundtrip(tensor: Tensor) -> Tensor:
    """``tensor`` rounded to float16 and back to its dtype, as a receiver of an fp16 payload holds it."""
    return tensor.to(torch.float16).to(tensor.dtype) if tensor.is_floating_point() else tensor


class DFedAvgM(TopologyAlgorithm):
    """DFedAvgM: K local heavy-ball steps, then uniform mixing over in-neighbours and self (module doc).

    Args:
        num_neighbors: M, the in-neighbours of each client per round (papers: 10).
        topology: see :data:`lightning_dfl.federation.exchange.topology.TOPOLOGIES` (``time_varying``: W doubly stochastic).
        momentum: theta of the heavy-ball steps, in [0, 1) (000:202: 0.9).
        message_dtype: ``"float32"`` or ``"float16"`` (payload rounded to fp16, 2 bytes per value);
            ``None``: float32, or float16 for ``rule="da"`` (the only dtype that rule allows).
        rule: ``"original"`` (default) or ``"da"`` (the DA authors' delta rule, compatibility only).
        clip_grad_norm: clip each step's gradient to this global norm (``None``: no clipping; DA: 10).
        weighting: the sources' weights W_ij: ``"uniform"`` (1/(M+1), the paper) or ``"samples"`` (by sample
            count, the DA copy); ``None``: ``"samples"`` for ``rule="da"``, else ``"uniform"``.
    """

    name = "dfedavgm"
    reference = {"message_dtype": "float32", "weighting": "uniform"}  # the defaults None depend on the rule
    shardable = True
    partitionable = True  # its hooks read other nodes as sources only
    reads_only_sources = True

    def __init__(self, num_neighbors: int = 10, topology: str = "time_varying", momentum: float = 0.9,
                 message_dtype: str | None = None, rule: str = "original",
                 clip_grad_norm: float | None = None, weighting: str | None = None) -> None:
        super().__init__(num_neighbors, topology)
        if not is_number(momentum) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum (theta) must be a number in [0, 1), got {momentum!r}")
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; allowed: {', '.join(RULES)}")
        if message_dtype is None:
            message_dtype = "float16" if rule == "da" else "float32"
        if message_dtype not in MESSAGE_DTYPES:
            raise ValueError(f"unknown message_dtype {message_dtype!r}; allowed: {', '.join(MESSAGE_DTYPES)}")
        if rule == "da" and message_dtype != "float16":
            raise ValueError(f"rule='da' sends fp16 deltas: message_dtype must be 'float16' or None, "
                             f"got {message_dtype!r}")
        if weighting is None:
            weighting = "samples" if rule == "da" else "uniform"
        if weighting not in WEIGHTINGS:
            raise ValueError(f"unknown weighting {weighting!r}; allowed: {', '.join(WEIGHTINGS)} (or None: by the rule)")
        if clip_grad_norm is not None and (not is_number(clip_grad_norm) or clip_grad_norm <= 0):
            raise ValueError(f"clip_grad_norm must be a number > 0 or None, got {clip_grad_norm!r}")
        self.momentum = float(momentum)
        self.message_dtype = message_dtype
        self.rule = rule
        self.weighting = weighting
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self._codec = build_codec("masked", send_mask=False, bytes_per_value=MESSAGE_DTYPES[message_dtype])

    # -- set-up ---------------------------------------------------------------------------------
    def make_optimizer(self, module: Any) -> torch.optim.Optimizer:
        """SGD with momentum theta (heavy ball), the module's lr and weight decay."""
        hp = module.hparams
        return torch.optim.SGD(module.parameters(), lr=hp.lr, momentum=self.momentum, weight_decay=hp.weight_decay)

    def message_bound(self) -> float:
        """float16 messages carry weights up to 65504: a larger one would reach its neighbours as inf."""
        return dtype_bound(torch.float16) if self.message_dtype == "float16" else super().message_bound()

    def state_fields(self) -> list[StateField]:
        if self.rule != "da":
            return []
        return [StateField(DELTA_FIELD, like="weights", dtype=torch.float16, fill=0.0, published=True)]

    # -- planning -------------------------------------------------------------------------------
    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        """Exchange 0: mix the neighbours' previous models, then train (round 0: train only). Further
        exchanges (DFedSAM-MGS): gossip steps (aggregation only) on the models published just before."""
        neighbors = self.neighbors(ctx)
        if ctx.exchange == 0 and ctx.round_idx == 0:
            return RoundPlan(ctx.round_idx, [Task(node=k) for k in ctx.active_clients])
        plan = parallel_plan(ctx, neighbors)
        if ctx.exchange > 0:
            plan = RoundPlan(ctx.round_idx, [Task(t.node, t.sources, train=False) for t in plan.tasks])
        if self.weighting == "samples":  # W_ij = n_j / sum_l n_l over the task's sources (the DA copy)
            plan = RoundPlan(ctx.round_idx, [replace(t, coefficients=tuple(float(ctx.sample_counts[s.node])
                                                                           for s in t.sources)) for t in plan.tasks])
        return plan

    # -- one task -------------------------------------------------------------------------------
    def message(self, ctx: TaskContext, source: Source) -> Message:
        store = ctx.store
        if self.rule == "da":
            delta = store.read(source.node, DELTA_FIELD, source.fresh)
            value_bytes = sum(t.numel() * MESSAGE_DTYPES["float16"] for t in delta.values())
            return Message(source.node, dict(delta), None, value_bytes, 0)
        weights, mask = store.published(source.node, source.fresh)
        message = self._codec.encode(weights, mask, sender=source.node, masked_names=store.masked_names,
                                     active_values=store.active_values(source.node, source.fresh))
        if self.message_dtype == "float16" and source.node != ctx.node:  # the own model is not sent
            message.weights = {n: fp16_roundtrip(t) for n, t in message.weights.items()}
        return message

    @torch.no_grad()
    def aggregate(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor] | None:
        if self.rule != "da":
            return super().aggregate(ctx, messages)
        start = ctx.worker_weights()  # the node's own published model (z_i^{t-1})
        coefficients = ctx.task.coefficients  # None: uniform, 1/(M+1)
        if messages and coefficients is not None:
            shares = [c / sum(coefficients) for c in coefficients]  # n_j / sum_l n_l (_aggregate)
            for name, tensor in start.items():
                total = torch.zeros_like(tensor)
                for m, share in zip(messages, shares):
                    total.add_(m.weights[name].to(tensor.dtype), alpha=share)
                tensor.add_(total)
        elif messages:
            for name, tensor in start.items():
                total = torch.zeros_like(tensor)
                for m in messages:
                    total.add_(m.weights[name].to(tensor.dtype))
                tensor.add_(total.div_(len(messages)))
        ctx.scratch[_START] = start
        return start

    def optimizer_step(self, ctx: TaskContext, closure: Any) -> Tensor:
        loss = closure()
        if self.clip_grad_norm is not None:
            ctx.fabric.clip_gradients(ctx.module, ctx.optimizer, max_norm=self.clip_grad_norm,
                                      error_if_nonfinite=False)  # a diverged step is the executor's to contain
        ctx.optimizer.step()
        return loss

    def publish_fields(self, ctx: TaskContext) -> dict[str, Any]:
        if self.rule != "da":
            return {}
        start = ctx.scratch[_START]
        return {DELTA_FIELD: {n: t.detach() - start[n] for n, t in ctx.worker.tensors.items()}}  # stored as fp16
