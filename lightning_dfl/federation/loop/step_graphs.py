"""Local SGD steps replayed from CUDA graphs (``trainer.cuda_graphs``): one launch per step, not ~800.

A masked ResNet18 step of batch 128 launches ~775 kernels; on an H200 it took 10-12 ms in every precision and
layout (docs/performance.md): the host's dispatch of the kernels, not the GPU's arithmetic, set the pace. A CUDA
graph (:class:`torch.cuda.CUDAGraph`) records the kernels of a step's closure (the zeroing, forward, loss and
backward with the mask's gradient hooks) and replays them with one launch; the optimizer's update and the
re-masking after it (a few multi-tensor kernels) run as usual after the replay, so the learning rate (which the
papers' schedule changes every round), the optimizer's settings and its state (momentum buffers, made by a task's
first step) are read afresh at every step, and any ``torch.optim`` optimizer can be used.

How a step runs (:meth:`StepGraphs.step`), per batch *shape* (a client's last batch is shorter):

1. the first :data:`WARMUP_STEPS` steps of a shape in the run are ordinary steps, on a side stream as PyTorch's
   CUDA-graph notes ask (cuDNN's algorithm search and lazy initialisation happen there, not in a capture);
2. the next closure is captured, reading its batch from static input buffers, and replayed at once (a capture
   records, it does not run), then the optimizer steps;
3. every later step of that shape copies its batch into the buffers, replays and steps.

A graph reads and writes tensors by address. The worker's parameters, buffers and masks (and their float casts)
stay at their addresses across tasks and rounds (a client's weights and mask are copied in, in place), so one
graph serves every client of its shape for the whole run: ~100 captures for the papers' partition, once. Those
addresses and the worker's mode are the *signature*, taken when a task's local training begins
(:meth:`StepGraphs.begin`) and again before a capture; when it differs from the last step's, every graph is
dropped and that step runs as an ordinary one, and the shapes are captured again from the next step on. So results
are those of ordinary steps: the same kernels on the same values, bit for bit (checked on the CPU by replaying
recorded operator calls, ``tests/_graph_sim.py``). After a replay each parameter's ``.grad`` is the gradient its
graph wrote, as after an ordinary step.

Memory: the graphs share one pool, where a capture reuses what earlier captures freed (their activations);
each graph keeps its own gradients (the model's size: ~45 MB for ResNet18, so ~4.5 GB for the ~100 shapes of
the papers' partition) until the graphs are dropped.

What a graph cannot hold is refused when the run starts (:func:`check_graphable`): an algorithm or a module
with its own ``loss``, an algorithm with its own ``optimizer_step`` (their Python may read per-task values, or
run the closure twice), callbacks or a module with hooks inside the step (``on_before_backward``,
``on_after_backward``, ``on_before_optimizer_step``), ``16-mixed`` (its gradient scaler's state is not checked
here), batched clients, and a device other than a CUDA GPU. A capture that fails all the same (a model whose
forward reads the device, say) is reported in a warning, and the run goes on with ordinary steps. An algorithm
whose ``local_train`` takes no step through :func:`~lightning_dfl.federation.algorithms.training.train_locally` (BEER's one
gradient-tracking iteration) gets a warning at the end of the run: nothing was captured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

#: ordinary steps of a batch shape before it is captured (the first in the run: cuDNN's search, lazy set-up)
WARMUP_STEPS = 2
#: hooks that run inside a step, so inside a graph's capture only (then never again)
STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


class CudaGraphs:
    """Captures on one CUDA device: a side stream for warm-up and capture, one memory pool for all graphs (they
    never run at the same time; each writes what it reads before reading it, except the worker's own tensors)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    @contextmanager
    def side_stream(self) -> Iterator[None]:
        """Run the block on the side stream, ordered after and before the current stream's work."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    def synchronize(self) -> None:
        """Wait for the device (before graphs are destroyed: their memory must not be reused while they run)."""
        torch.cuda.synchronize(self.device)

    def capture(self, run: Callable[[], None]) -> Callable[[], None]:
        """Record ``run``'s kernels (nothing runs) and return what replays them on the current stream.

        ``torch.cuda.graph`` would also collect Python's garbage and empty the cache before every capture; a round
        captures each of its ~100 shapes, so the capture is begun and ended directly."""
        graph = torch.cuda.CUDAGraph()
        self.synchronize()
        with self.side_stream():
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                run()
            finally:
                graph.capture_end()
        return graph.replay


def graph_backend(device: torch.device) -> Any:
    """What captures steps on ``device`` (:class:`CudaGraphs` on a CUDA GPU), or ``None`` where nothing can."""
    return CudaGraphs(device) if device.type == "cuda" else None


def check_graphable(algorithm: Any, module: Any, precision: Any, callbacks: list[Any]) -> None:
    """Raise ``ValueError`` naming the reason unless the run's local steps can be captured (module docstring)."""
    from lightning.pytorch import LightningModule

    from lightning_dfl.federation.loop.callback_hooks import defined_hooks
    from lightning_dfl.hooks import is_overridden
    from lightning_dfl.module import SparseClassifier

    name = type(algorithm).__name__
    for hook in ("loss", "optimizer_step"):
        if algorithm.overrides(hook):
            raise ValueError(f"cuda_graphs: {name} has its own {hook}, whose Python a graph would run once; only the "
                             "default step is captured (set cuda_graphs false)")
    if is_overridden("loss", module, SparseClassifier):
        raise ValueError(f"cuda_graphs: {type(module).__name__} has its own loss, whose Python a graph would run once; "
                         "only the default step is captured (set cuda_graphs false)")
    overridden = [hook for hook in STEP_HOOKS if is_overridden(hook, module, LightningModule)]
    if overridden:
        raise ValueError(f"cuda_graphs: {type(module).__name__} defines {', '.join(overridden)}, which run inside a "
                         "step; a graph would run them once (set cuda_graphs false)")
    for callback in callbacks:  # the project's own (RigL, PQI, voting) define none of them
        hooks = defined_hooks(callback, STEP_HOOKS)
        if hooks:
            raise ValueError(f"cuda_graphs: callback {type(callback).__name__} defines {', '.join(hooks)}, which run "
                             "inside a step; a graph would run them once (set cuda_graphs false)")
    if precision in ("16-mixed", "16", 16):
        raise ValueError(f"cuda_graphs: precision {precision!r} scales the loss with a gradient scaler, which is not "
                         "supported with graphs; use 32-true or bf16-mixed")


class StepGraphs:
    """The worker's captured local steps, by batch shape (module docstring); ``backend`` captures and replays
    (:func:`graph_backend`)."""

    def __init__(self, backend: Any, module: Any, optimizer: Any) -> None:
        self.backend = backend
        self.module = module
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self._signature: tuple | None = None  # the worker's, when the graphs were made
        self._worker: tuple = ()  # the worker's, when the task began
        self._seen: dict[tuple, int] = {}  # ordinary steps per shape, whole run
        #: by shape: (static inputs, replay, static loss, each parameter with the gradient tensor its graph writes)
        self._graphs: dict[tuple, tuple[list[Tensor], Callable[[], None], Tensor, list[tuple[Tensor, Any]]]] = {}
        #: why capturing stopped (a capture failed: every later step is an ordinary one), or ``None``
        self.failed: str | None = None
        #: steps replayed, captured and run as ordinary steps (for benchmarks and tests)
        self.counts = {"replayed": 0, "captured": 0, "ordinary": 0}

    def begin(self) -> None:
        """A task's local training begins: take the worker's signature (:meth:`worker_signature`)."""
        self._worker = self.worker_signature()

    def worker_signature(self) -> tuple:
        """The worker's parameters, buffers and mask tensors (addresses) and its mode (~0.2 ms for ResNet18: taken
        per task, not per step)."""
        tensors = list(self.module.model.state_dict(keep_vars=True).values())
        tensors += self.module.mask.tensors() if self.module.mask is not None else []
        return (self.module.training, _addresses(tensors))

    def report(self, algorithm: str) -> None:
        """At the run's end: log the steps replayed, captured and run as usual; warn when ``algorithm`` took no
        step through the default local loop (it trains with its own: nothing was captured)."""
        counts = self.counts
        rank_zero_info(f"CUDA graphs: {counts['replayed']} local steps replayed, {counts['captured']} captured, "
                       f"{counts['ordinary']} ordinary (warm-up, or the first after the worker's tensors moved)")
        if not any(counts.values()):
            rank_zero_warn(f"cuda_graphs: {algorithm} took no step through the default local loop (train_locally), "
                           "so no step was captured: it trains with its own loop")

    def reset(self) -> None:
        """Drop every graph once the device has run them (their memory returns to the pool)."""
        if self._graphs:
            self.backend.synchronize()
        self._graphs.clear()

    def step(self, batch: Any, backward: Callable[[Any], Tensor], update: Callable[[], Any]) -> Tensor:
        """One local step on ``batch``: ``backward(batch)`` (the closure: zero the gradients, compute and
        back-propagate the loss, return it) as an ordinary step or replayed from its shape's graph, then
        ``update()`` (the optimizer's step); returns the loss (a tensor of its own)."""
        if self.failed is not None:
            self.counts["ordinary"] += 1
            loss = backward(batch).detach()
            update()
            return loss
        if self._worker != self._signature:  # new addresses or mode: no graph is valid, nor is capturing now
            self.reset()
            self._signature = self._worker
            return self._ordinary(batch, backward, update, _shape(batch))
        shape = _shape(batch)
        graph = self._graphs.get(shape)
        if graph is None:
            if self._seen.get(shape, 0) < WARMUP_STEPS:
                return self._ordinary(batch, backward, update, shape)
            worker = self.worker_signature()
            if worker != self._worker:  # changed since the task began (a mask cast made by its first step, say)
                self._worker = self._signature = worker
                self.reset()
                return self._ordinary(batch, backward, update, shape)
            graph = self._capture(batch, backward, shape)
            if graph is None:  # the capture failed: this step runs as an ordinary one, as every later one
                return self.step(batch, backward, update)
        inputs, replay, loss, grads = graph
        for static, value in zip(inputs, _tensors(batch)):
            static.copy_(value)
        replay()
        for param, grad in grads:  # as after an ordinary closure: .grad holds this step's gradients (~20 us)
            param.grad = grad
        update()
        self.counts["replayed"] += 1
        return loss.clone()

    def _ordinary(self, batch: Any, backward: Callable[[Any], Tensor], update: Callable[[], Any],
                  shape: tuple) -> Tensor:
        with self.backend.side_stream():
            loss = backward(batch).detach()
            update()
        self._seen[shape] = self._seen.get(shape, 0) + 1
        self.counts["ordinary"] += 1
        return loss

    def _capture(self, batch: Any, backward: Callable[[Any], Tensor], shape: tuple) -> tuple | None:
        """Capture ``backward`` for ``shape`` (``None`` when capturing failed: :attr:`failed` says why, in a
        warning)."""
        values = _tensors(batch)
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).copy_(v) for v in values]
        static_batch = _replace_tensors(batch, iter(inputs))
        losses: list[Tensor] = []
        self.optimizer.zero_grad(set_to_none=True)
        try:
            replay = self.backend.capture(lambda: losses.append(backward(static_batch).detach()))
        except RuntimeError as error:  # nothing ran: the step is still to be taken
            self.failed = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            self.reset()
            self.optimizer.zero_grad(set_to_none=True)  # no gradient of the capture's memory is left behind
            rank_zero_warn(f"cuda_graphs: capturing a local step failed ({self.failed}); the run goes on with "
                           "ordinary steps")
            return None
        if self.worker_signature() != self._worker:  # e.g. a tensor made or replaced inside the step
            raise RuntimeError("cuda_graphs: capturing a step changed the worker's tensors; the step cannot be "
                               "replayed")
        grads = [(p, p.grad) for group in self.optimizer.param_groups for p in group["params"]]
        graph = self._graphs[shape] = (inputs, replay, losses[0], grads)
        self.counts["captured"] += 1
        return graph


def _addresses(tensors: list[Tensor]) -> tuple:
    return tuple((t.data_ptr(), t.dtype, t.shape) for t in tensors)


def _tensors(batch: Any) -> list[Tensor]:
    """The tensors of a batch ``(x, y, ...)`` in order."""
    return [v for v in (batch if isinstance(batch, (tuple, list)) else (batch,)) if isinstance(v, Tensor)]


def _replace_tensors(batch: Any, replacements: Iterator[Tensor]) -> Any:
    """``batch`` with its tensors replaced, in order, by ``replacements``."""
    if isinstance(batch, Tensor):
        return next(replacements)
    return type(batch)(next(replacements) if isinstance(v, Tensor) else v for v in batch)


def _shape(batch: Any) -> tuple:
    """What a graph is captured for: every tensor's shape, strides, dtype and device, and the other values."""
    parts = batch if isinstance(batch, (tuple, list)) else (batch,)
    return tuple((tuple(v.shape), v.stride(), v.dtype, v.device) if isinstance(v, Tensor) else v for v in parts)
