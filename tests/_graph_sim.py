"""A CPU stand-in for CUDA graphs: what ``lightning_dfl.federation.loop.step_graphs`` captures, replayed as a GPU would.

A CUDA graph records the kernels a block launches, each bound to the addresses of the tensors it reads and writes
and to the Python values (scalars) it was called with, without running them; a replay runs those kernels again on
whatever those addresses hold then. :class:`RecordedGraph` does the same with PyTorch's operator calls on the CPU
(a ``TorchDispatchMode`` sees every ``aten`` call, autograd's backward included):

* capturing records each call with its arguments (the tensor objects, so their memory; the Python values as they
  were) and runs it, then restores every tensor that existed before the capture and was written by it (and the
  random generator), so a capture has no effect, as on a GPU, and fills the tensors it made with NaN (-1, True):
  on a GPU they hold nothing until a replay; reading the device's values on the host (``.item()``,
  ``bool(tensor)``) raises, as it does during a CUDA capture;
* replaying runs the recorded calls again on the recorded tensors: in-place calls write their tensors, other calls'
  results are copied into the tensors the capture produced (the graph's own memory), views are already bound.

So a step that reads a tensor the code has since replaced by another object, or a Python number that has since
changed, gives other results than an ordinary step: what would go wrong on a GPU goes wrong here.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


#: calls that write arguments their schema does not declare mutable: (positions of them)
_UNDECLARED_WRITES = {torch.ops.aten.native_batch_norm.default: (3, 4)}  # training: the running statistics


def _writes(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors a call writes (its schema's mutable arguments, and :data:`_UNDECLARED_WRITES`)."""
    written = [t for i in _UNDECLARED_WRITES.get(func, ()) for t in _tensors(args[i])]
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        written += _tensors(value)
    return written


class RecordedGraph(TorchDispatchMode):
    """One captured block (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, list[list[Tensor] | None]]] = []
        self._born: set[int] = set()
        self._before: dict[int, tuple[Tensor, Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace != "aten":  # the profiler's record_function markers
            return func(*args, **kwargs)
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            raise RuntimeError(f"{func} reads the device on the host during a capture (a CUDA capture fails here)")
        for tensor in _writes(func, args, kwargs):
            if tensor.untyped_storage().data_ptr() not in self._born:
                self._before.setdefault(id(tensor), (tensor, tensor.detach().clone()))
        out = func(*args, **kwargs)
        fresh: list[list[Tensor] | None] = []
        for ret, value in zip(func._schema.returns, out if isinstance(out, tuple) else (out,)):
            if ret.alias_info is None:  # a new tensor (or list of them): the graph's own memory
                made = _tensors(value)
                self._born.update(t.untyped_storage().data_ptr() for t in made)
                fresh.append(made)
            else:  # written in place, or a view: bound to its tensor already
                fresh.append(None)
        self.calls.append((func, args, kwargs, fresh))
        return out

    def capture(self, run: Any) -> None:
        rng = torch.get_rng_state()
        try:
            with self:
                run()
        finally:  # a capture that fails has run nothing either
            with torch.no_grad():
                for tensor, before in self._before.values():
                    tensor.copy_(before)
                for _, _, _, fresh in self.calls:
                    for made in filter(None, fresh):
                        for tensor in made:
                            tensor.fill_(True if tensor.dtype == torch.bool else
                                         float("nan") if tensor.is_floating_point() else -1)
            torch.set_rng_state(rng)
            self._before.clear()

    @torch.no_grad()
    def replay(self) -> None:
        for func, args, kwargs, fresh in self.calls:
            if all(f is None for f in fresh) and not _writes(func, args, kwargs):
                continue  # a view: nothing to compute
            out = func(*args, **kwargs)
            for made, value in zip(fresh, out if isinstance(out, tuple) else (out,)):
                if made is not None:
                    for old, new in zip(made, _tensors(value)):
                        old.copy_(new)


class SimulatedGraphs:
    """The CPU stand-in for :class:`~lightning_dfl.federation.loop.step_graphs.CudaGraphs` (one stream: no side stream)."""

    def __init__(self) -> None:
        self.graphs: list[RecordedGraph] = []
        self.synchronizations = 0  # before graphs are dropped

    def side_stream(self) -> Any:
        return nullcontext()

    def synchronize(self) -> None:
        self.synchronizations += 1

    def capture(self, run: Any) -> Any:
        graph = RecordedGraph()
        graph.capture(run)
        self.graphs.append(graph)
        return graph.replay
