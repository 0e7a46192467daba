"""Batched clients: the tasks of one plan level trained together with ``torch.func``.

:class:`BatchedExecutor` starts every task of a level as the serial executor does (messages,
aggregation, the "aggregated" evaluation, the batches), captures each client's weights, buffers, mask
and batches, then trains them together (a group at a time, see "Memory" below): the clients' parameters are
stacked along a new leading
dimension and every step runs ``vmap(grad_and_value(loss))`` over ``functional_call`` of the one model
architecture. Masked SGD is applied functionally, exactly as the serial path does it: gradients
times the mask, ``torch.optim.SGD``'s update (:func:`~lightning_dfl.federation.loop.functional_sgd.sgd_step`: weight
decay, momentum, dampening, Nesterov), the weights times the mask. Clients with fewer or smaller batches are padded: a padded sample has
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

Memory: a batched step holds every one of its clients' activations, parameters, gradients and momenta
at once (the papers' ResNet18 at batch 128: about 1.4 GiB per client), so a level is trained in groups of
at most ``group_size`` clients (the trainer's ``batched_group_size``): each group's tasks are started,
trained together and finished before the next group starts, as the serial executor interleaves them.
``None`` sizes the groups from memory (:func:`auto_group_size`): one client's share of a step
(:func:`client_step_bytes`, measured on the first task's data at a whole batch) into a fraction of the
memory free on the worker's device (a GPU's free and cached memory, the host's available memory on a CPU).

It applies to the default local loop only: an algorithm with its own ``local_train``, ``loss``,
``optimizer_step`` or kept optimizer state, a module with its own ``loss``, a model with dropout,
other buffers or BatchNorm without momentum (a cumulative average over the worker's batch count),
a precision other than 32-true and 64-true, or a callback with batch hooks is refused with the
reason, before training.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from lightning_dfl.deferred import accumulator_dtype
from lightning_dfl.federation.algorithms.context import TaskContext
from lightning_dfl.federation.algorithms.training import task_batches
from lightning_dfl.federation.exchange.plan import RoundPlan
from lightning_dfl.federation.loop.callback_hooks import federated_batch_hooks
from lightning_dfl.federation.loop.executor import PlanRun, SerialExecutor
from lightning_dfl.federation.loop.functional_sgd import sgd_step
from lightning_dfl.federation.metrics.accounting import ClientRecord, RoundAccounting
from lightning_dfl.hooks import is_overridden
from lightning_dfl.host_memory import available_bytes, format_bytes
from lightning_dfl.sparse.masks import zero_inactive_all_
from lightning_dfl.transfers import copy_all_, to_device

if TYPE_CHECKING:
    from lightning_dfl.federation.loop.state import FederationState

__all__ = ["BatchedExecutor", "auto_group_size", "check_batchable", "client_step_bytes", "memory_budget",
           "weighted_cross_entropy"]

_BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
                "on_before_optimizer_step")

#: the share of the free memory that the automatic group size lets one batched step take (the rest: the data,
#: the store's reads and writes, the allocator's slack)
MEMORY_FRACTION = 0.6
#: one client's share of a batched step, in copies of one forward's saved activations (those and the backward's
#: gradients of them) and of its parameters (the captured start, the stacked weights, masks, gradients,
#: momentum and the updated weights)
ACTIVATION_COPIES = 2
PARAMETER_COPIES = 6


def client_step_bytes(model: nn.Module, inputs: Tensor, autocast: Any = None) -> int:
    """One client's share of a batched training step on ``inputs`` (a batch as the step receives it):
    :data:`ACTIVATION_COPIES` times the bytes the forward saves for the backward (each storage counted once,
    the parameters' own not at all) plus :data:`PARAMETER_COPIES` times the parameters' bytes.

    The forward runs in training mode (the model's mode is restored) on copies of the model's buffers (BatchNorm's
    running statistics are left as they were) under ``autocast`` (a context manager factory, e.g.
    ``fabric.autocast``), and draws no random numbers for a model that :func:`check_batchable` accepts."""
    params = dict(model.named_parameters())
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    owned = {p.untyped_storage().data_ptr() for p in params.values()}
    seen: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in owned:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    training = model.training
    model.train()  # as a training step runs it (BatchNorm saves batch statistics)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
                (autocast() if autocast is not None else contextlib.nullcontext()):
            functional_call(model, (params, buffers), (inputs,))
    finally:
        model.train(training)
    parameter_bytes = sum(p.numel() * p.element_size() for p in params.values())
    return ACTIVATION_COPIES * sum(seen.values()) + PARAMETER_COPIES * parameter_bytes


def memory_budget(device: torch.device) -> int | None:
    """The bytes a batched step may take on ``device``: :data:`MEMORY_FRACTION` of a CUDA GPU's free memory
    (``torch.cuda.mem_get_info``) plus what its caching allocator holds unused; on any other device, of the
    host's available memory (``None`` where that is unknown: no limit)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
            - torch.cuda.memory_allocated(device)
    else:
        free = available_bytes()
        if free is None:
            return None
    return int(MEMORY_FRACTION * free)


def auto_group_size(per_client: int, budget: int | None) -> int | None:
    """The most clients a batched step takes when each needs ``per_client`` bytes of ``budget``: at least one;
    ``None`` (no limit) when the budget is unknown."""
    if budget is None:
        return None
    return max(1, budget // max(1, per_client))


def check_batchable(algorithm: Any, module: Any, optimizer: Any, precision: Any, callbacks: list[Any]) -> None:
    """Raise ``ValueError`` (naming the reason) unless a run of ``algorithm`` on the worker ``module`` with this
    optimizer, precision and callbacks can train its clients batched."""
    from lightning_dfl.module import SparseClassifier

    name = type(algorithm).__name__
    for hook in ("local_train", "loss", "optimizer_step"):
        if algorithm.overrides(hook):
            raise ValueError(f"batched_clients: {name} has its own {hook}; only the default local loop is batched")
    if algorithm.keep_optimizer_state:
        raise ValueError(f"batched_clients: {name} keeps optimizer state across rounds; not batched")
    if is_overridden("loss", module, SparseClassifier):
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
    for callback in callbacks:
        hooks = federated_batch_hooks(callback, _BATCH_HOOKS)  # those it declares idle in a federation aside
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
    """Runs each plan level's training tasks together, in groups of at most ``group_size`` clients (``None``:
    sized from memory on the first task's data; see the module docstring)."""

    @classmethod
    def check_worker(cls, algorithm: Any, callbacks: list[Any], module: Any, optimizer: Any, precision: Any) -> None:
        """:func:`check_batchable`."""
        check_batchable(algorithm, module, optimizer, precision, callbacks)

    @classmethod
    def create(cls, state: FederationState, settings: Any) -> BatchedExecutor:
        """The batched executor with the settings' ``batched_group_size``."""
        return cls(state, settings.batched_group_size)

    def __init__(self, state: FederationState, group_size: int | None = None) -> None:
        super().__init__(state)
        self.group_size = group_size
        self._sized = group_size is not None

    def run(self, plan: RoundPlan, evaluate: bool, accounting: RoundAccounting | None = None,
            exchange: int = 0) -> RoundAccounting:
        run = self.plan_run(plan, evaluate, accounting, exchange)
        self.begin_round(plan)
        for level in plan.levels():
            group: list[_Started] = []
            for task in level:
                begun = self.start_task(task, run)
                self.sources_read(task)
                if begun is None:  # a server's task: done
                    self.task_ended(task)
                    continue
                group.append(self._capture(*begun))
                if not self._sized:
                    self._size_groups(group[-1])
                if self.group_size is not None and len(group) == self.group_size:
                    self._train_and_finish(group, run)
                    group = []
            if group:
                self._train_and_finish(group, run)
        self.state.progress.end_tasks()
        return run.accounting

    def _size_groups(self, item: _Started) -> None:
        """Choose :attr:`group_size` from memory with the first captured task that has a batch (its largest,
        repeated up to the data's batch size when shorter, at the worker's current weights) and say so once."""
        if not item.batches:  # no batch to measure with: the next task measures
            return
        self._sized = True
        t = self.state
        inputs = max((x for x, _ in item.batches), key=len)
        full = int(getattr(t.worker.datamodule, "batch_size", 0) or 0)
        if full > len(inputs):  # a client with less than a batch: measured at a whole one, as larger clients take
            inputs = inputs.repeat(-(-full // len(inputs)), *[1] * (inputs.dim() - 1))[:full]
        device = inputs.device
        per_client = client_step_bytes(t.worker.module.model, inputs, t.worker.fabric.autocast)
        budget = memory_budget(device)
        self.group_size = auto_group_size(per_client, budget)
        limit = "every client of a level" if self.group_size is None else f"at most {self.group_size} clients"
        room = "no memory limit known" if budget is None else f"{format_bytes(budget)} may be used"
        rank_zero_info(f"Batched clients: {limit} per step (one client's step takes about "
                       f"{format_bytes(per_client)}; {room} on {device})")

    def _train_and_finish(self, group: list[_Started], run: PlanRun) -> None:
        """Train ``group`` together, then finish each of its tasks as the serial executor does."""
        t = self.state
        losses, weights = self._train_together(group)
        for item, loss, trained in zip(group, losses, weights):
            t.progress.start_task(item.ctx)
            t.worker.load({**t.worker.tensors, **trained})
            t.worker.module.mask.load_(item.masks, apply=False)
            item.record.loss = loss
            self.finish_task(item.ctx, item.record, run)
            self.task_ended(item.ctx.task)

    def _capture(self, ctx: TaskContext, record: ClientRecord) -> _Started:
        """The task's start state and its batches, drawn as the serial loop would draw them."""
        model = ctx.module.model
        weights, buffers, masks = (_copies(dict(tensors)) for tensors in (
            model.named_parameters(), model.named_buffers(), ctx.module.mask.masks.items()))
        batches = [batch for _, _, batch in task_batches(ctx)]
        return _Started(ctx, record, weights, masks, batches, buffers)

    def _train_together(self, items: list[_Started]) -> tuple[list[Tensor | float], list[dict[str, Tensor]]]:
        """Train ``items`` together; their mean losses and trained weights (parameters and floating
        buffers, by name)."""
        model, optimizer = self.state.worker.module.model, self.state.worker.optimizer
        group = getattr(optimizer, "optimizer", optimizer).param_groups[0]
        lr, wd, momentum = float(group["lr"]), float(group["weight_decay"]), float(group["momentum"])
        dampening, nesterov = float(group["dampening"]), bool(group["nesterov"])
        names = list(items[0].weights)
        params = {n: torch.stack([it.weights[n] for it in items]) for n in names}
        masks = {n: torch.stack([it.masks[n] for it in items]).to(params[n].dtype)
                 for n in names if n in items[0].masks}
        masked = [n for n in names if n in masks]
        # BatchNorm's running statistics, one per client, updated in place by each batched forward
        stats = {n: torch.stack([it.buffers[n] for it in items]) for n in items[0].buffers}
        counters = {n: t.clone() for n, t in stats.items() if not t.is_floating_point()}  # num_batches_tracked
        batch_stats = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        momenta: dict[str, Tensor] = {}

        def loss_of(p: dict[str, Tensor], b: dict[str, Tensor], x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            return weighted_cross_entropy(functional_call(model, (p, b), (x,)), y, w)

        step_fn = vmap(grad_and_value(loss_of))
        device = params[names[0]].device
        loss_sums = torch.zeros(len(items), dtype=accumulator_dtype(device), device=device)
        count = [0] * len(items)

        model.train()
        # the steps' calls: the clients with a batch at each step (those that ran out keep their state); with
        # batch statistics one call per batch size (padding would enter the statistics), else one call with a
        # shorter batch padded with zero-weight samples
        calls: list[tuple[int, list[int], int | None]] = []  # (step, rows, where the rows' index starts)
        flat: list[int] = []
        for s in range(max(len(it.batches) for it in items)):
            by_size: dict[int, list[int]] = {}
            for i, it in enumerate(items):
                if s < len(it.batches):
                    by_size.setdefault(int(it.batches[s][1].shape[0]) if batch_stats else 0, []).append(i)
            for rows in by_size.values():
                start = None  # all clients: no index
                if len(rows) < len(items):
                    start = len(flat)
                    flat += rows
                calls.append((s, rows, start))
        # the row indices of the calls that take some of the clients, uploaded at once (one upload per group, not
        # waited for)
        indices = to_device(torch.tensor(flat, dtype=torch.long), device) if flat else None

        def step(s: int, rows: list[int], start: int | None) -> None:
            """Step ``s`` of the clients ``rows`` (the others keep their weights, statistics and momentum); the
            update is multi-tensor (``torch._foreach_*``: a few kernels per step on a GPU, not a few per layer),
            each operation as the per-layer form rounds it."""
            batches = [items[i].batches[s] for i in rows]
            sizes = [int(y.shape[0]) for _, y in batches]
            xs, ys, ws = _stacked(batches, sizes)
            whole = start is None
            index = None if whole else indices[start:start + len(rows)]

            def select(tensors: dict[str, Tensor], keys: list[str]) -> list[Tensor]:
                return [tensors[n] if whole else tensors[n].index_select(0, index) for n in keys]

            def write(tensors: dict[str, Tensor], keys: list[str], values: list[Tensor]) -> None:
                if whole:
                    tensors.update(zip(keys, values))
                else:
                    for n, value in zip(keys, values):
                        tensors[n][index] = value

            weights = select(params, names)
            sub_stats = dict(zip(stats, select(stats, list(stats))))
            with self.state.worker.fabric.autocast():  # as the serial closure (64-true: float64 by default)
                grads, losses = step_fn(dict(zip(names, weights)), sub_stats, xs, ys, ws)
            # summed on the device, read at the round's end (the real samples per client: exact in any float)
            weighted = losses.detach().to(loss_sums.dtype) * ws.sum(1).to(loss_sums.dtype)
            if whole:
                loss_sums.add_(weighted)
            else:
                loss_sums.index_add_(0, index, weighted)
            for i, size in zip(rows, sizes):
                count[i] += size
            with torch.no_grad():
                if not whole:  # the statistics the forward updated in the copies, written back
                    write(stats, list(stats), list(sub_stats.values()))
                layer_masks = select(masks, masked)
                d_p = dict(grads)  # the mask's gradient hooks, as serially
                d_p.update(zip(masked, torch._foreach_mul([grads[n] for n in masked], layer_masks)))
                # every client with data takes its first step at step 0: its momentum starts there
                previous = select(momenta, names) if momentum and s else None
                updated, kept = sgd_step(weights, [d_p[n] for n in names], previous, lr=lr, weight_decay=wd,
                                         momentum=momentum, dampening=dampening, nesterov=nesterov)
                if kept is not None:
                    if not momenta and not whole:  # the clients without data (or of another batch size) keep theirs
                        momenta.update((n, torch.zeros_like(params[n])) for n in names)
                    write(momenta, names, kept)
                # re-masked as the module's apply_ does (plain +0.0 outside)
                zero_inactive_all_([t for n, t in zip(names, updated) if n in masks], layer_masks)
                write(params, names, updated)

        for s, rows, start in calls:
            step(s, rows, start)
        with torch.no_grad():  # the worker's batch counters advance by every client's steps, as serially
            for n, start in counters.items():
                model.get_buffer(n).add_((stats[n] - start).sum(0))
        losses_out = [loss_sums[i] / count[i] if count[i] else float("nan") for i in range(len(items))]
        kept = [n for n, t in stats.items() if t.is_floating_point()]
        return losses_out, [{**{n: params[n][i] for n in names}, **{n: stats[n][i] for n in kept}}
                            for i in range(len(items))]


def weighted_cross_entropy(logits: Tensor, labels: Tensor, weights: Tensor) -> Tensor:
    """The mean cross-entropy (PyTorch's) over the samples of weight 1; a padded sample (weight 0) counts for
    nothing (a batch of real samples only: ``F.cross_entropy(logits, labels)``)."""
    return (F.cross_entropy(logits, labels, reduction="none") * weights).sum() / weights.sum().clamp_min(1.0)


def _copies(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Detached copies of ``tensors`` (as ``clone``: same layout), in one multi-tensor copy per device."""
    out = {n: torch.empty_like(t) for n, t in tensors.items()}
    copy_all_((out[n], t.detach()) for n, t in tensors.items())
    return out


def _stacked(batches: list[tuple[Tensor, Tensor]], sizes: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """One step's inputs, labels and sample weights, stacked along a new first dimension: a batch shorter than
    the longest padded with zero-weight samples (zeros)."""
    x0 = batches[0][0]
    width = max(sizes)
    if min(sizes) == width:  # one stack each, no padding
        return (torch.stack([x for x, _ in batches]), torch.stack([y for _, y in batches]),
                torch.ones((len(batches), width), dtype=x0.dtype, device=x0.device))
    xs = torch.zeros((len(batches), width, *x0.shape[1:]), dtype=x0.dtype, device=x0.device)
    ys = torch.zeros((len(batches), width), dtype=torch.long, device=x0.device)
    ws = torch.zeros((len(batches), width), dtype=x0.dtype, device=x0.device)
    # every real sample's row among the padded ones, written at once (a few kernels, not three per client)
    rows = to_device(torch.cat([torch.arange(size) + j * width for j, size in enumerate(sizes)]), x0.device)
    xs.view(-1, *x0.shape[1:]).index_copy_(0, rows, torch.cat([x for x, _ in batches]))
    ys.view(-1).index_copy_(0, rows, torch.cat([y for _, y in batches]).to(ys.dtype))
    ws.view(-1).index_fill_(0, rows, 1.0)
    return xs, ys, ws


