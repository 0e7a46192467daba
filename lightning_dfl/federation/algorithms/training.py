"""A client's local training: epochs (or a number of steps) of closure-based optimizer steps.

The default loop of :meth:`Algorithm.local_train`. Each step calls the algorithm's
:meth:`~Algorithm.optimizer_step` with a closure that zeroes the gradients, computes
:meth:`~Algorithm.loss` under the precision's autocast and back-propagates; the default step runs
the closure once and steps the optimizer (SAM-like algorithms run it twice). Callbacks receive
Lightning's epoch and batch hooks. The mask's hooks zero the gradients of inactive weights, and
Fabric calls the module's ``on_after_optimizer_step``, which re-masks the weights. With the trainer's
``cuda_graphs`` a step is replayed from a CUDA graph of its batch shape
(:class:`~lightning_dfl.federation.loop.step_graphs.StepGraphs`): the closure is replayed, the optimizer steps as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_dfl.deferred import accumulator_dtype

if TYPE_CHECKING:
    from lightning_dfl.federation.algorithms.base import Algorithm
    from lightning_dfl.federation.algorithms.context import TaskContext


def task_batches(ctx: TaskContext, epochs: int | None = None) -> Iterator[tuple[int, int, Any]]:
    """``(epoch, batch_idx, batch)``: the task's ``local_epochs`` passes, or exactly its ``local_steps`` batches
    (passes restart as needed: each pass is one epoch for the callbacks); ``epochs`` given: that many passes
    instead (e.g. Ditto's personal epochs)."""
    assert ctx.train_batches is not None
    steps_left = ctx.local_steps if epochs is None else None
    passes = ctx.local_epochs if epochs is None else epochs
    epoch = 0
    while (epoch < passes) if steps_left is None else steps_left > 0:
        ctx.call("on_train_epoch_start")
        drawn = 0
        for batch_idx, batch in enumerate(ctx.train_batches):
            yield epoch, batch_idx, batch
            drawn += 1
            if steps_left is not None:
                steps_left -= 1
                if steps_left == 0:
                    break
        ctx.call("on_train_epoch_end")
        if drawn == 0:
            return  # no data: nothing more to draw
        epoch += 1


def train_locally(algorithm: Algorithm, ctx: TaskContext, epochs: int | None = None) -> Tensor | float:
    """Run the local loop (the task's local work, or ``epochs`` passes: :func:`task_batches`); return the mean
    training loss per sample as a 0-dim tensor on the worker's device, not waited for
    (:mod:`lightning_dfl.deferred`; NaN when no sample; not finite when training diverged: the executor then
    discards the update)."""
    module, optimizer, graphs = ctx.module, ctx.optimizer, getattr(ctx, "step_graphs", None)  # None: a bare context
    module.train()
    if graphs is not None:
        graphs.begin()
    loss_sum: Tensor | None = None
    count = 0

    def backward(batch: Any) -> Tensor:  # with graphs (the algorithm's optimizer_step is the default: closure, step)
        return _closure(algorithm, ctx, batch)()

    for _, batch_idx, batch in task_batches(ctx, epochs):
        ctx.call("on_train_batch_start", batch, batch_idx)
        if graphs is None:
            loss = algorithm.optimizer_step(ctx, _closure(algorithm, ctx, batch))  # the closure zeroes the gradients
        else:
            loss = graphs.step(batch, backward, optimizer.step)
        ctx.call("on_train_batch_end", loss.detach(), batch, batch_idx)
        n = int(batch[1].shape[0])
        weighted = loss.detach().to(accumulator_dtype(loss.device)) * n
        loss_sum = weighted if loss_sum is None else loss_sum + weighted
        count += n
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / count if loss_sum is not None and count else float("nan")


def _closure(algorithm: Algorithm, ctx: TaskContext, batch: Any) -> Callable[[], Tensor]:
    """Zero the gradients, compute the algorithm's loss under autocast and back-propagate."""

    def closure() -> Tensor:
        ctx.optimizer.zero_grad(set_to_none=True)
        with ctx.fabric.autocast():
            loss = algorithm.loss(ctx, batch)
        ctx.call("on_before_backward", loss)
        ctx.fabric.backward(loss)
        ctx.call("on_after_backward")
        ctx.call("on_before_optimizer_step", ctx.optimizer)
        return loss

    return closure
