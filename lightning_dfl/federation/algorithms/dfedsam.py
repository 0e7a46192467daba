"""DFedSAM and DFedSAM-MGS (Shi et al., "Improving the Model Consistency of Decentralized Federated
Learning", ICML 2023, Alg. 1), as the baselines notes (section 5) state them.

DFedAvgM's round (:mod:`~lightning_dfl.federation.algorithms.dfedavgm`: heavy-ball local steps with a
fresh momentum each round, uniform mixing over in-neighbours and self, round 0 trains from x_i^0)
with every local step a SAM step on one minibatch xi (:func:`sam_step`)::

    g = grad l(z; xi),   z_hat = z + rho g / ||g||_2          (the norm over all parameters)
    z <- SGD-momentum step at z with the gradient grad l(z_hat; xi)

and, for DFedSAM-MGS, Q gossip steps x_i <- sum_j W_ij x_j per round instead of one
(``gossip_steps``): exchange 0 of a round mixes the previous round's models and trains, exchanges
1..Q-1 are aggregation-only gossip steps on the models just published (each on a fresh graph), so
the paper's train-then-Q-mixes sequence is shifted by one as in DFedAvgM. Q = 1 is DFedSAM.

rho is grid-searched in {0.01, 0.02, 0.05, 0.1, 0.2, 0.5} (000:202); the DA scripts use 0.01 for CIFAR
(the default here) and 0.2 for HAM10000. Weight decay is the module's (the DA copy runs SAM without
it: set ``model.weight_decay: 0`` for that); the DA copy's sample-weighted averaging is not
reproduced.

**FLOPs.** A SAM step runs forward and backward twice on the same batch, which the engine's
counter (3 x forward x samples drawn) does not see: each step adds its batch size to the task's
sample counter once more (``ctx.train_batches.samples``), so ``flops/train_*`` report exactly 2x
DFedAvgM's (Table II of 000 counts 2x), and ``samples/train`` counts forward-backward passes (2 per
sample and step). ``clients.csv`` shows the added samples as ``dfedsam/second_pass_samples``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dfl.checks import check_int, is_number
from lightning_dfl.federation.algorithms.context import TaskContext
from lightning_dfl.federation.algorithms.dfedavgm import DFedAvgM

#: the rho grid of 000:202
RHO_GRID = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
_BATCH = "dfedsam/batch_size"
REPORT = "dfedsam/second_pass_samples"


def sam_step(optimizer: Any, closure: Callable[[], Tensor], rho: float, module: nn.Module | None = None) -> Tensor:
    """One SAM step (Foret et al. 2021; DFedSAM Alg. 1): ``closure`` (zero grads, loss, backward) at z,
    ascend to z_hat = z + rho g / (||g||_2 + 1e-12) over all parameters, ``closure`` again at z_hat,
    restore z exactly and let ``optimizer`` step with the gradient of z_hat. Returns the loss at z.

    The first pass runs on a forked RNG, so both passes draw the same random numbers (dropout) and the
    RNG afterwards is where a single pass leaves it. ``module``'s buffers (BatchNorm statistics) are
    restored after the second pass: only the pass at z updates them. So rho = 0 reproduces a plain
    step bit for bit.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        loss = closure()
    with torch.no_grad():
        held = [p for p in params if p.grad is not None]
        saved = [p.detach().clone() for p in held]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in held])) if held \
            else torch.zeros(())
        scale = rho / (float(norm) + 1e-12)
        for p in held:
            p.add_(p.grad, alpha=scale)
        buffers = [(b, b.detach().clone()) for b in module.buffers()] if module is not None else []
    closure()
    with torch.no_grad():
        for p, old in zip(held, saved):
            p.copy_(old)
        for b, old in buffers:
            b.copy_(old)
    optimizer.step()
    return loss


class DFedSAM(DFedAvgM):
    """DFedSAM (module doc): DFedAvgM with SAM local steps; ``gossip_steps`` Q > 1 is DFedSAM-MGS.

    Args:
        num_neighbors: M, the in-neighbours of each client per round (papers: 10).
        topology: see :data:`lightning_dfl.federation.exchange.topology.TOPOLOGIES`.
        momentum: theta of the base SGD, in [0, 1) (0.9).
        rho: the SAM radius, >= 0 (grid :data:`RHO_GRID`; 0.01 for CIFAR in the DA scripts).
        gossip_steps: Q, mixing steps per round (1: DFedSAM).
        message_dtype: ``"float32"`` or ``"float16"`` (payload rounded to fp16, 2 bytes per value).
    """

    name = "dfedsam"
    settings = ("rho", "gossip_steps")  # rho is grid-searched (DA-DPFL Sec. V-A), Q the paper varies
    shardable = True
    partitionable = True  # its hooks read other nodes as sources only
    reads_only_sources = True

    def __init__(self, num_neighbors: int = 10, topology: str = "time_varying", momentum: float = 0.9,
                 rho: float = 0.01, gossip_steps: int = 1, message_dtype: str = "float32") -> None:
        super().__init__(num_neighbors, topology, momentum, message_dtype)
        if not is_number(rho) or rho < 0:
            raise ValueError(f"rho must be a finite number >= 0 (grid {list(RHO_GRID)}), got {rho!r}")
        self.rho = float(rho)
        self.gossip_steps = check_int("gossip_steps (Q)", gossip_steps, 1)
        self.exchanges_per_round = self.gossip_steps

    def loss(self, ctx: TaskContext, batch: Any) -> Tensor:
        ctx.scratch[_BATCH] = int(batch[1].shape[0])
        return super().loss(ctx, batch)

    def optimizer_step(self, ctx: TaskContext, closure: Any) -> Tensor:
        loss = sam_step(ctx.optimizer, closure, self.rho, ctx.module)
        if ctx.train_batches is not None:  # the second pass: count its FLOPs (module doc)
            ctx.train_batches.samples += ctx.scratch[_BATCH]
            ctx.report[REPORT] = ctx.report.get(REPORT, 0) + ctx.scratch[_BATCH]
        return loss
