"""Time one local training step of a package model under each speed setting, on one device.

What the floor of a round is made of: a DisPFL round of ``configs/dispfl_cifar10_dir.yaml`` runs
100 clients x 5 epochs x 4 batches of 128 = 2,000 such ResNet18 steps. Each setting builds the
model the way ``SparseClassifier`` does (ERK mask at density 0.5, gradient hooks, re-masking after
the step) and times ``--steps`` SGD steps (lr 0.1, weight decay 5e-4) on random batches after
``--warmup`` steps, synchronising the device at both ends:

* memory format: ``contiguous`` (NCHW) or ``channels_last`` (weights and batches);
* precision: ``fp32`` (with ``torch.set_float32_matmul_precision("high")``: TF32 on tensor cores)
  or ``bf16`` (``torch.autocast`` to bfloat16, as ``precision: bf16-mixed``);
* the model's normalisation: GroupNorm (the papers') or BatchNorm;
* ``torch.compile`` of the model (default mode), once;
* cuDNN's algorithm search (``torch.backends.cudnn.benchmark``, the trainer's ``benchmark: true``): on in every
  setting but ``-heuristics``, which takes cuDNN's heuristics (PyTorch's default, and a run's unless set);
* ``-graphed``: the step replayed from a CUDA graph, as the trainer's ``cuda_graphs: true`` does
  (:class:`~lightning_dfl.federation.loop.step_graphs.StepGraphs`; a CUDA GPU only);
* ``--batched G ...``: the batched executor's own training (``BatchedExecutor._train_together``: ``vmap`` over G
  stacked clients, then the multi-tensor masked SGD update), fp32, per batched step and per client step
  (what ``batched_clients: true`` would make of the 2,000 steps).

    python benchmarks/step_time.py --device cuda
    python benchmarks/step_time.py --device cuda --batched 8 32 55
    python benchmarks/step_time.py --device cpu --steps 3 --warmup 1 --settings cl-fp32   # a smoke test
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from lightning_dfl.federation.loop import step_graphs
from lightning_dfl.module import SparseClassifier

SETTINGS = {  # name: (memory format, precision, norm, compile, cuDNN benchmark, CUDA graph)
    "nchw-fp32": ("contiguous", "fp32", "group", False, True, False),
    "cl-fp32": ("channels_last", "fp32", "group", False, True, False),
    "cl-fp32-heuristics": ("channels_last", "fp32", "group", False, False, False),
    "nchw-fp32-graphed": ("contiguous", "fp32", "group", False, True, True),
    "cl-fp32-graphed": ("channels_last", "fp32", "group", False, True, True),
    "cl-fp32-heuristics-graphed": ("channels_last", "fp32", "group", False, False, True),
    "nchw-bf16": ("contiguous", "bf16", "group", False, True, False),
    "cl-bf16": ("channels_last", "bf16", "group", False, True, False),
    "cl-bf16-graphed": ("channels_last", "bf16", "group", False, True, True),
    "cl-fp32-batchnorm": ("channels_last", "fp32", "batch", False, True, False),
    "cl-bf16-batchnorm": ("channels_last", "bf16", "batch", False, True, False),
    "cl-bf16-compile": ("channels_last", "bf16", "group", True, True, False),
}


def time_setting(name: str, arch: str, device: torch.device, batch: int, steps: int, warmup: int) -> float:
    """Seconds per training step (median of ``steps`` timed one by one after ``warmup``)."""
    memory_format, precision, norm, compiled, benchmark, graphed = SETTINGS[name]
    torch.backends.cudnn.benchmark = benchmark
    module = SparseClassifier(arch=arch, density=0.5, model_options={"norm": norm})
    module.build(num_classes=10, in_channels=3, image_size=32)
    model = module.model.to(device)
    module.mask.to(device)
    fmt = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format
    model = model.to(memory_format=fmt)
    runner = torch.compile(model) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=5e-4)
    images = torch.randn(batch, 3, 32, 32, device=device).contiguous(memory_format=fmt)
    labels = torch.randint(0, 10, (batch,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def backward(batch: tuple) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = F.cross_entropy(runner(batch[0]), batch[1])
        loss.backward()
        return loss

    def update() -> None:
        optimizer.step()
        module.mask.apply_()

    graphs = None
    if graphed:
        backend = step_graphs.graph_backend(device)
        if backend is None:
            raise ValueError(f"a CUDA graph needs a CUDA GPU, not {device}")
        graphs = step_graphs.StepGraphs(backend, module, optimizer)
        graphs.begin()
        # timed steps are replays: the warm-up, one more as the mask's casts made by the first step move the worker's
        # addresses, then the capture
        warmup = max(warmup, step_graphs.WARMUP_STEPS + 2)

    def step() -> None:
        if graphs is None:
            backward((images, labels))
            update()
        else:
            graphs.step((images, labels), backward, update)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        tic = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - tic)
    times.sort()
    return times[len(times) // 2]


def time_batched(clients: int, arch: str, device: torch.device, batch: int, steps: int, warmup: int) -> float:
    """Seconds per batched step of ``clients`` clients, through the batched executor's own training code (each
    client with its own ERK mask; ``warmup`` steps first, then ``steps`` timed together)."""
    from lightning_dfl.federation.loop.batched import BatchedExecutor, _Started

    module = SparseClassifier(arch=arch, density=0.5)
    module.build(num_classes=10, in_channels=3, image_size=32)
    model = module.model.to(device)
    module.mask.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=5e-4)
    fabric = SimpleNamespace(autocast=lambda: torch.autocast(device.type, enabled=False))
    state = SimpleNamespace(worker=SimpleNamespace(module=module, optimizer=optimizer, fabric=fabric))
    executor = BatchedExecutor.__new__(BatchedExecutor)  # only its training: no federation around it
    executor.state = state
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    masks = {n: m.clone() for n, m in module.mask.masks.items()}

    def items(count: int) -> list:
        batches = [(torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device))
                   for _ in range(count)]
        return [_Started(None, None, weights, masks, batches, {}) for _ in range(clients)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    executor._train_together(items(warmup))
    sync()
    timed = items(steps)
    tic = time.perf_counter()
    executor._train_together(timed)
    sync()
    return (time.perf_counter() - tic) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=[*SETTINGS, "none"],
                        help="the serial settings to time ('none': only --batched)")
    parser.add_argument("--batched", nargs="*", type=int, default=[],
                        help="also time the batched executor's training of this many clients at once (each a row)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("high")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {args.arch} training step, batch {args.batch}, density 0.5, on {name}, torch {torch.__version__}")
    print("\n| setting | ms/step | x nchw-fp32 | 2,000 steps s |\n|---|---|---|---|", flush=True)
    base = None
    for setting in [s for s in args.settings if s != "none"]:
        try:
            seconds = time_setting(setting, args.arch, device, args.batch, args.steps, args.warmup)
        except Exception as error:  # a benchmark row, not a crash: report and go on
            print(f"| {setting} | failed: {type(error).__name__}: {str(error).splitlines()[0][:120]} | | |",
                  flush=True)
            continue
        base = base or (seconds if setting == "nchw-fp32" else None)
        ratio = f"{base / seconds:.2f}" if base else ""
        print(f"| {setting} | {1000 * seconds:.1f} | {ratio} | {2000 * seconds:.1f} |", flush=True)
    torch.backends.cudnn.benchmark = True  # the batched rows (each serial setting set its own)
    for clients in args.batched:
        try:
            seconds = time_batched(clients, args.arch, device, args.batch, args.steps, args.warmup) / clients
        except Exception as error:  # e.g. out of memory: a row, not a crash
            print(f"| batched, {clients} clients | failed: {type(error).__name__}: "
                  f"{str(error).splitlines()[0][:120]} | | |", flush=True)
            continue
        ratio = f"{base / seconds:.2f}" if base else ""
        print(f"| batched, {clients} clients (per client step; nchw-fp32) | {1000 * seconds:.1f} | {ratio} | "
              f"{2000 * seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
