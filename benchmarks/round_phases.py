"""Where a round's time goes: a ``lightning-dfl fit`` config run in this process with its phases timed.

Any config and overrides, as on the command line (``--rounds`` rounds, default 2: the first warms up).
Each round's wall time is split by timing, around every call, the algorithm's hooks and the engine's
steps a task or a round goes through (the device is synchronised at each boundary, so a GPU's queued
work is charged to the phase that queued it):

* ``messages`` (:meth:`Algorithm.message`), ``aggregate``, ``evaluate`` (both the aggregated and the
  trained model), ``local_train`` (the SGD steps), ``callbacks`` (the callbacks' task hooks: RigL's
  regrowth gradient and mask search, voting, PQI), ``publish`` (the store's writes);
* ``round end``: the shared model's evaluation and the algorithm's own (``evaluate_round``);
* ``other``: what is left of the round (planning, the clock, accounting, logging, diagnostics).

``--count-ops`` also counts each phase's kernels and host reads of values (:class:`OpCounter`): on a GPU each
kernel is a launch and each read a wait, so the counts show a launch-bound or stalling phase on any device;
``--device-paths`` takes the accelerators' code paths on the CPU, so a CPU counts what a GPU would do (the
engine's, and the optimizer's multi-tensor ``foreach`` step, torch's default on a GPU).
``--profile-top N`` also runs ``torch.profiler`` over the last round and prints its N most expensive
operators (by self device time on a GPU, self CPU time otherwise). It records every kernel: keep it to small
rounds (on an H200 the papers' 100-client ResNet18 round, ~2,200 steps, had not finished after 160 s with it).

    python benchmarks/round_phases.py --config configs/dispfl_digits.yaml
    python benchmarks/round_phases.py --config configs/dispfl_cifar10_dir.yaml --device cuda --profile-top 25 -- \\
        --data.dataset image_folder --data.root ~/.cache/lightning-dfl/cifar10-jpg --trainer.store compact
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dfl.cli.fit import FederatedCLI
from lightning_dfl.deferred import device_paths_on_cpu

PHASES = ("messages", "aggregate", "evaluate", "local_train", "callbacks", "publish", "round end", "other")
#: the callbacks' hooks that run inside a client's task
TASK_HOOKS = ("on_client_before_aggregation", "on_client_train_end", "on_client_end")


class PhaseTimer:
    """Seconds per phase, summed over the calls of the current round (nested phases are charged once, to the
    outermost)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: collections.Counter[str] = collections.Counter()
        self.ops: collections.Counter[str] = collections.Counter()  # kernels run, with --count-ops
        self.reads: collections.Counter[str] = collections.Counter()  # host reads of values, with --count-ops
        self.current = "other"
        self._depth = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        if self._depth:  # inside another phase: charged to that one
            yield
            return
        self._depth += 1
        self._sync()
        self.current = name
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start
            self.current = "other"
            self._depth -= 1

    def wrap(self, owner: Any, method: str, name: str) -> None:
        """Time every call of ``owner.method`` as phase ``name`` (an instance attribute shadows the method)."""
        original = getattr(owner, method)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, method, timed)


#: operators that read a value on the host: on a GPU each waits for the device's queue to drain
HOST_READS = ("aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero")
#: operators that only allocate (on a GPU the caching allocator hands out memory: no kernel is launched)
ALLOCATIONS = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh")
#: operator namespaces that launch nothing on any device (``torch.optim``'s ``record_function`` markers)
MARKERS = ("profiler::",)


class OpCounter(TorchDispatchMode):
    """Counts, per phase of the timer, the operators that run a kernel (forward, backward, optimizer, copies;
    not views, not allocations, not profiler markers) and the host reads of tensor values (``item``, ``bool``, ``int``, ``tolist``, ``torch.equal``):
    on a GPU each kernel is a launch and each read a wait for the device, so the counts measure a phase's launch
    overhead and stalls on any device (with ``--device-paths``, the paths an accelerator takes)."""

    def __init__(self, timer: PhaseTimer) -> None:
        super().__init__()
        self.timer = timer
        self._inside_tolist = False
        self._tolist = torch.Tensor.tolist

    #: storages that live on the host whatever the device (the store's slot and value-count bookkeeping): reading
    #: them waits for nothing
    host_storages: set[int] = set()

    def _on_host(self, args: Any) -> bool:
        tensor = args[0] if args else None
        return isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() in self.host_storages

    def __enter__(self) -> OpCounter:
        counter, tolist = self, self._tolist

        def counted_tolist(tensor: torch.Tensor) -> Any:  # one read, whatever the number of elements
            counter.timer.reads[counter.timer.current] += 1
            counter._inside_tolist = True
            try:
                return tolist(tensor)
            finally:
                counter._inside_tolist = False

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.name()
        if name in HOST_READS:
            if not self._inside_tolist and not self._on_host(args):
                self.timer.reads[self.timer.current] += 1
        elif not func.is_view and name.split(".")[0] not in ALLOCATIONS and not name.startswith(MARKERS):
            self.timer.ops[self.timer.current] += 1
        return func(*args, **(kwargs or {}))


def instrument(trainer: Any, timer: PhaseTimer, device_paths: bool = False) -> None:
    """Wrap the algorithm's hooks, the callbacks' task hooks, the store's writes, the round's end and the batched
    executor's training (``local_train``). ``device_paths``: the optimizer takes its multi-tensor (``foreach``)
    path, as ``torch.optim`` chooses by default for tensors on a GPU."""
    algorithm = trainer.algorithm
    for method, name in (("message", "messages"), ("aggregate", "aggregate"), ("evaluate", "evaluate"),
                         ("local_train", "local_train"), ("evaluate_round", "round end")):
        timer.wrap(algorithm, method, name)
    for callback in trainer.callbacks:
        for hook in TASK_HOOKS:
            if callable(getattr(callback, hook, None)):
                timer.wrap(callback, hook, "callbacks")
    original_setup = trainer._setup

    def setup(*args: Any, **kwargs: Any) -> None:
        original_setup(*args, **kwargs)
        for method in ("publish", "set_mask", "write"):
            timer.wrap(trainer.store, method, "publish")
        timer.wrap(trainer.federation, "consensus_metrics", "round end")
        if callable(getattr(trainer.executor, "_train_together", None)):  # batched clients: their SGD steps
            timer.wrap(trainer.executor, "_train_together", "local_train")
        if device_paths:
            for group in trainer.optimizer.param_groups:
                if group.get("foreach") is None:
                    group["foreach"] = True
        OpCounter.host_storages = {t.untyped_storage().data_ptr() for t in (
            trainer.store.slot, getattr(trainer.store, "active", trainer.store.slot))}

    trainer._setup = setup


def main() -> list[tuple[int, float, dict[str, float], dict[str, int], dict[str, int]]]:
    """Run, print (and write) the tables; return the rows unrounded: ``(round, wall s, seconds by phase, kernels
    by phase, host reads by phase)``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--rounds", type=int, default=2, help="rounds to run (the first is a warm-up)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--profile-top", type=int, default=0, help="torch.profiler's top N operators of the last round")
    parser.add_argument("--count-ops", action="store_true",
                        help="also count the operators each phase dispatches (slows the round down)")
    parser.add_argument("--device-paths", action="store_true",
                        help="take the accelerators' code paths on the CPU (lightning_dfl.deferred."
                             "device_paths_on_cpu): with --count-ops, what a GPU would launch and wait for")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("overrides", nargs="*", help="more fit options, after --")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="round_phases_"))  # the run's folder, removed at the end
    cli = FederatedCLI(args=["--config", args.config, *args.overrides, "--trainer.rounds", str(args.rounds),
                             "--trainer.accelerator", "gpu" if args.device == "cuda" else "cpu",
                             "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root)],
                       run=False)
    trainer = cli.trainer
    timer = PhaseTimer(torch.device(args.device))
    instrument(trainer, timer, args.device_paths)
    rows: list[tuple[int, float, dict[str, float], dict[str, int], dict[str, int]]] = []
    profiler_table = ""
    original_round = trainer.run_round

    def run_round(round_idx: int) -> dict[str, float]:
        nonlocal profiler_table
        timer.seconds.clear()
        timer.ops.clear()
        timer.reads.clear()
        last = round_idx == args.rounds - 1
        profiling = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])) \
            if last and args.profile_top else contextlib.nullcontext()
        start = time.perf_counter()
        counting = OpCounter(timer) if args.count_ops else contextlib.nullcontext()
        paths = device_paths_on_cpu() if args.device_paths else contextlib.nullcontext()
        with paths, profiling as prof, counting:
            metrics = original_round(round_idx)
        wall = time.perf_counter() - start
        if prof is not None:
            key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
            profiler_table = prof.key_averages().table(sort_by=key, row_limit=args.profile_top)
        rows.append((round_idx, wall, dict(timer.seconds), dict(timer.ops), dict(timer.reads)))
        return metrics

    trainer.run_round = run_round
    try:
        trainer.fit(cli.model, cli.datamodule)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    lines = [f"# Round phases: {args.config} {' '.join(args.overrides)}", "",
             f"- {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; device: {device}; torch "
             f"{torch.__version__}; threads {torch.get_num_threads()}; command: `{' '.join(sys.argv)}`", "",
             "| round | wall s | " + " | ".join(PHASES) + " |", "|---|---|" + "---|" * len(PHASES)]
    for round_idx, wall, seconds, _, _ in rows:
        other = wall - sum(seconds.values())
        cells = [f"{seconds.get(p, 0.0):.2f}" for p in PHASES[:-1]] + [f"{other:.2f}"]
        lines.append(f"| {round_idx + 1} | {wall:.2f} | " + " | ".join(cells) + " |")
    if args.count_ops:
        paths = "the accelerators' code paths" if args.device_paths else "this device's code paths"
        lines += ["", f"Kernels run / host reads of values ({paths}; on a GPU each kernel is a launch and each read "
                  "a wait for the device):", "",
                  "| round | all | " + " | ".join(PHASES) + " |", "|---|---|" + "---|" * len(PHASES)]
        for round_idx, _, _, ops, reads in rows:
            lines.append(f"| {round_idx + 1} | {sum(ops.values()):,} / {sum(reads.values()):,} | "
                         + " | ".join(f"{ops.get(p, 0):,} / {reads.get(p, 0):,}" for p in PHASES) + " |")
    text = "\n".join(lines) + "\n" + (f"\n```\n{profiler_table}\n```\n" if profiler_table else "")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
