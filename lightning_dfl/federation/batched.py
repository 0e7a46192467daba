"""Batched clients: the tasks of one plan level trained together with ``torch.func``.

:class:`BatchedExecutor` starts every task of a level as the serial executor does (messages,
aggregation, the "aggregated" evaluation, the batches), captures each client's weights, buffers, mask
and batches, then trains them all at once: the clients' parameters are stacked along a new leading
dimension and every step runs ``vmap(grad_and_value(loss))`` over ``functional_call`` of the one model
architecture. Masked SGD is applied functionally, exactly as the serial path does it: gradients
times the mask, ``torch.optim.SGD``'s update (weight decay, momentum, dampening, Nesterov), the
weights times the mask. Clients with fewer or smaller batches are padded: a padded sample has
weight 0 in the loss (the mean is over real samples) and a client with no batch left at a step
keeps its weights and momentum. Then every task is finished one by one (callbacks, the "trained"
evaluation, publishing).

Models: any model without dropout and without buffers other than BatchNorm's, e.g. the papers'
ResNet18 and VGG11 as their configs build them (GroupNorm(32): no buffers) and ``cnn_digits`` /
``cnn_cifar``. BatchNorm (``resnet20``, ``vgg11`` with ``model_options: {norm: batch}``) is batched
too: each client's running statistics are stacked and passed to ``functional_call`` beside its
parameters, the batched forward updates them in place per client, and they are published with the
weights as serially; clients whose batches differ in size at a step run in separate calls (a padded
sample would enter the batch statistics), and the worker's ``num_batches_tracked`` advances by all
clients' steps, as serially. Dropout with ``p > 0`` is refused: its draws cannot follow the serial
path's (a dropout of ``p = 0``, an identity, is accepted).

Results equal the serial path's up to float rounding (``tests/test_batched.py``): in 64-true to
about 1e-10 for all these models. In float32 the ``vmap``ped kernels round differently; SGD amplifies
that over long runs in any model, and a badly conditioned run amplifies it within a round: on a few
upscaled digits the float32 serial path itself differs from the float64 one by up to ~1e-3 on some
ResNet18 / VGG11 weights, as much as the batched path does; a BatchNorm ``resnet20`` trained there
for twenty steps at lr 0.05 ends visibly apart from the serial run (two float32 serial runs on 1 and 2
threads already differ by ~1e-3 after five steps). The batched step runs NCHW kernels whatever the
trainer's ``memory_format`` (the serial path's channels-last kernels round differently again).

It applies to the default local loop only: an algorithm with its own ``local_train``, ``loss``,
``optimizer_step`` or kept optimizer state, a module with its own ``loss``, a model with dropout,
other buffers or BatchNorm without momentum (a cumulative average over the worker's batch count),
a precision other than 32-true and 64-true, or a callback with batch hooks is refused with the
reason, before training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from lightning_dfl.callbacks.base import defined_hooks
from lightning_dfl.deferred import accumulator_dtype
from lightning_dfl.federation.accounting import ClientRecord, RoundAccounting
from lightning_dfl.federation.context import TaskContext
from lightning_dfl.federation.executor import SerialExecutor
from lightning_dfl.federation.local import _batches
from lightning_dfl.federation.plan import RoundPlan
from lightning_dfl.sparse.masks import zero_inactive_

if TYPE_CHECKING:
    from lightning_dfl.federation.federation_state import FederationState

__all__ = ["BatchedExecutor", "check_batchable"]

_BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
                "on_before_optimizer_step")


def check_batchable(algorithm: Any, module: Any, optimizer: Any, precision: Any, callbacks: list[Any]) -> None:
    """Raise ``ValueError`` (naming the reason) unless a run of ``algorithm`` on the worker ``module`` with this
    optimizer, precision and callbacks can train its clients batched."""
    from lightning_dfl.callbacks import PQIPruning, PruningTimeVoting, RigL
    from lightning_dfl.federation.algorithms.base import Algorithm
    from lightning_dfl.module import SparseClassifier

    name = type(algorithm).__name__
    for hook in ("local_train", "loss", "optimizer_step"):
        if getattr(type(algorithm), hook) is not getattr(Algorithm, hook):
            raise ValueError(f"batched_clients: {name} has its own {hook}; only the default local loop is batched")
    if algorithm.keep_optimizer_state:
        raise ValueError(f"batched_clients: {name} keeps optimizer state across rounds; not batched")
    if type(module).loss is not SparseClassifier.loss:
        raise ValueError(f"batched_clients: {type(module).__name__} overrides loss; not batched")
    norm_buffers = set()
    for layer_name, layer in module.model.named_modules():
        if isinstance(layer, nn.modules.dropout._DropoutNd) and layer.p > 0:
            raise ValueError(f"batched_clients: the model's {layer_name} ({type(layer).__name__}) draws random "
                             "numbers that a batched step cannot draw as the serial one does; use a model "
                             "without dropout (e.g. resnet18, vgg11, cnn_cifar)")
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            if layer.track_running_stats and layer.momentum is None:
                raise ValueError(f"batched_clients: the model's {layer_name} ({type(layer).__name__}) has "
                                 "momentum=None (a cumulative average over the worker's batch count); not batched")
            prefix = f"{layer_name}." if layer_name else ""
            norm_buffers.update(prefix + name for name, _ in layer.named_buffers(recurse=False))
        elif isinstance(layer, nn.modules.batchnorm._NormBase) and layer.track_running_stats:
            raise ValueError(f"batched_clients: the model's {layer_name} ({type(layer).__name__}) keeps "
                             "running statistics; only BatchNorm's are batched")
    others = [name for name, _ in module.model.named_buffers() if name not in norm_buffers]
    if others:
        raise ValueError(f"batched_clients: the model has buffers ({', '.join(others)}); only BatchNorm's "
                         "running statistics are batched")
    if precision not in (None, "32-true", "32", 32, "64-true", "64", 64):
        raise ValueError(f"batched_clients: precision {precision!r}; only 32-true and 64-true are batched")
    optimizer = getattr(optimizer, "optimizer", optimizer)
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        raise ValueError(f"batched_clients: the optimizer is {type(optimizer).__name__}; only one-group SGD is batched")
    harmless = (RigL, PQIPruning, PruningTimeVoting)  # their batch hooks do nothing in a federation
    for callback in callbacks:
        if isinstance(callback, harmless):
            continue
        hooks = defined_hooks(callback, _BATCH_HOOKS)
        if hooks:
            raise ValueError(f"batched_clients: callback {type(callback).__name__} has batch hooks "
                             f"({', '.join(hooks)}), which a batched step cannot call per client")


@dataclass
class _Started:
    """A started task waiting for its batched training."""

    ctx: TaskContext
    record: ClientRecord
    weights: dict[str, Tensor]
    masks: dict[str, Tensor]
    batches: list[tuple[Tensor, Tensor]]
    buffers: dict[str, Tensor]


class BatchedExecutor(SerialExecutor):
    """Runs each plan level's training tasks together (see the module docstring)."""

    def run(self, plan: RoundPlan, evaluate: bool, accounting: RoundAccounting | None = None,
            exchange: int = 0) -> RoundAccounting:
        accounting = accounting if accounting is not None else RoundAccounting(
            plan.round_idx, observer=self.state.diag)
        t = self.state
        self.begin_round(plan)
        store = t.store
        for level in plan.levels():
            started = []
            for task in level:
                begun = self.start_task(task, accounting, evaluate, exchange)
                store.task_started(task)
                if begun is not None:
                    started.append(self._capture(*begun))
                else:  # a server's task: done
                    store.task_finished(task)
            losses, weights = self._train_together(started) if started else ([], [])
            for item, loss, trained in zip(started, losses, weights):
                t.current_client = item.ctx.node
                self.load({**self.state.worker, **trained})
                t.module.mask.load_(item.masks, apply=False)
                t.train_dataloader = item.ctx.train_batches
                item.record.loss = loss
                self.finish_task(item.ctx, item.record, accounting, evaluate)
                store.task_finished(item.ctx.task)
        t.current_client = None
        return accounting

    def _capture(self, ctx: TaskContext, record: ClientRecord) -> _Started:
        """The task's start state and its batches, drawn as the serial loop would draw them."""
        model = ctx.module.model
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        masks = {n: m.clone() for n, m in ctx.module.mask.masks.items()}
        batches = [batch for _, _, batch in _batches(ctx)]
        return _Started(ctx, record, weights, masks, batches, buffers)

    def _train_together(self, items: list[_Started]) -> tuple[list[Tensor | float], list[dict[str, Tensor]]]:
        """Train ``items`` together; their mean losses and trained weights (parameters and floating
        buffers, by name)."""
        model = self.state.module.model
        group = getattr(self.state.optimizer, "optimizer", self.state.optimizer).param_groups[0]
        lr, wd, momentum = float(group["lr"]), float(group["weight_decay"]), float(group["momentum"])
        dampening, nesterov = float(group["dampening"]), bool(group["nesterov"])
        names = list(items[0].weights)
        params = {n: torch.stack([it.weights[n] for it in items]) for n in names}
        masks = {n: torch.stack([it.masks[n] for it in items]).to(params[n].dtype)
                 for n in names if n in items[0].masks}
        # BatchNorm's running statistics, one per client, updated in place by each batched forward
        stats = {n: torch.stack([it.buffers[n] for it in items]) for n in items[0].buffers}
        counters = {n: t.clone() for n, t in stats.items() if not t.is_floating_point()}  # num_batches_tracked
        batch_stats = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        momenta: dict[str, Tensor] = {}

        def loss_of(p: dict[str, Tensor], b: dict[str, Tensor], x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            logits = functional_call(model, (p, b), (x,))
            return (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum().clamp_min(1.0)

        step_fn = vmap(grad_and_value(loss_of))
        loss_sum: list[Tensor | float] = [0.0] * len(items)
        count = [0] * len(items)

        def step(s: int, rows: list[int]) -> None:
            """Step ``s`` of the clients ``rows`` (the others keep their weights, statistics and momentum)."""
            sizes = [int(items[i].batches[s][1].shape[0]) for i in rows]
            width = max(sizes)
            x0 = items[rows[0]].batches[s][0]
            xs = torch.zeros((len(rows), width, *x0.shape[1:]), dtype=x0.dtype, device=x0.device)
            ys = torch.zeros((len(rows), width), dtype=torch.long, device=x0.device)
            ws = torch.zeros((len(rows), width), dtype=x0.dtype, device=x0.device)
            for j, (i, size) in enumerate(zip(rows, sizes)):
                xs[j, :size], ys[j, :size], ws[j, :size] = items[i].batches[s][0], items[i].batches[s][1], 1.0
            whole = len(rows) == len(items)
            index = None if whole else torch.tensor(rows, device=x0.device)
            sub = params if whole else {n: params[n].index_select(0, index) for n in names}
            sub_stats = stats if whole else {n: t.index_select(0, index) for n, t in stats.items()}
            with self.state.fabric.autocast():  # as the serial closure (64-true: float64 by default)
                grads, losses = step_fn(sub, sub_stats, xs, ys, ws)
            weighted = losses.detach().to(accumulator_dtype(losses.device))  # summed on the device, read at round end
            for j, (i, size) in enumerate(zip(rows, sizes)):
                loss_sum[i] = loss_sum[i] + weighted[j] * size
                count[i] += size
            with torch.no_grad():
                if not whole:  # the statistics the forward updated, written back
                    for n, t in sub_stats.items():
                        stats[n][index] = t
                for n in names:
                    mask = None if n not in masks else (masks[n] if whole else masks[n].index_select(0, index))
                    d_p = grads[n] * mask if mask is not None else grads[n]
                    if wd:
                        d_p = d_p + wd * sub[n]
                    if momentum:
                        if s == 0:  # every client with data takes its first step at step 0: buf = d_p
                            momenta.setdefault(n, torch.zeros_like(params[n]))
                            momenta[n][index if index is not None else slice(None)] = d_p
                        elif whole:
                            momenta[n] = momentum * momenta[n] + (1 - dampening) * d_p
                        else:
                            momenta[n][index] = momentum * momenta[n].index_select(0, index) + (1 - dampening) * d_p
                        kept = momenta[n] if whole else momenta[n].index_select(0, index)
                        d_p = d_p + momentum * kept if nesterov else kept
                    updated = sub[n] - lr * d_p
                    if mask is not None:  # re-masked as the module's apply_ does (plain +0.0 outside)
                        updated = zero_inactive_(updated, mask)
                    if whole:
                        params[n] = updated
                    else:
                        params[n][index] = updated

        model.train()
        for s in range(max(len(it.batches) for it in items)):
            # the clients with a batch at this step (those that ran out keep their state)
            rows = [i for i, it in enumerate(items) if s < len(it.batches)]
            if not batch_stats:  # one call; a shorter batch padded with zero-weight samples
                step(s, rows)
                continue
            by_size: dict[int, list[int]] = {}  # batch statistics: no padding, one call per batch size
            for i in rows:
                by_size.setdefault(int(items[i].batches[s][1].shape[0]), []).append(i)
            for same in by_size.values():
                step(s, same)
        with torch.no_grad():  # the worker's batch counters advance by every client's steps, as serially
            for n, start in counters.items():
                model.get_buffer(n).add_((stats[n] - start).sum(0))
        losses_out = [loss_sum[i] / count[i] if count[i] else float("nan") for i in range(len(items))]
        kept = [n for n, t in stats.items() if t.is_floating_point()]
        return losses_out, [{**{n: params[n][i] for n in names}, **{n: stats[n][i] for n in kept}}
                            for i in range(len(items))]


def batched_executor(state: FederationState) -> BatchedExecutor:
    """The batched executor after :func:`check_batchable`."""
    check_batchable(state.algorithm, state.module, state.optimizer, state.precision, state.callbacks)
    return BatchedExecutor(state)
