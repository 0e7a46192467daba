"""How well ``batched.client_step_bytes`` (what the automatic ``batched_group_size`` divides the free memory by)
predicts the memory of a batched step: for each model, the estimate times G clients against the measured peak
of one ``vmap(grad_and_value(loss))`` step over G stacked clients and its SGD update, as the batched executor
takes it (batch 128, 32 x 32 x 3 inputs, 10 classes).

Measured in a fresh process per model: on a CPU the growth of the peak resident set (``VmHWM`` after
``/proc/self/clear_refs``; Linux), on a GPU ``torch.cuda.max_memory_allocated`` over what was allocated before.

    python benchmarks/batched_memory.py [--device cuda] [--clients 4] [--out DIR]

``--out`` (default ``benchmarks/results``) is the folder of ``batched_memory_{cpu,gpu}.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from lightning_dfl.federation.loop.batched import client_step_bytes
from lightning_dfl.models import build_model

RESULTS = Path(__file__).resolve().parent / "results"
ARCHS = ("cnn_cifar", "resnet18", "vgg11")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(arch: str, clients: int, device: str, batch: int = 128) -> dict:
    """The estimate and the measured peak of one batched step of ``clients`` ``arch`` clients (this process)."""
    torch.manual_seed(0)
    model = build_model(arch, num_classes=10, in_channels=3, image_size=32).to(device)
    x = torch.randn(clients, batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (clients, batch), device=device)
    estimate = client_step_bytes(model, x[0])
    params = {n: torch.stack([p.detach()] * clients) for n, p in model.named_parameters()}
    buffers = {n: torch.stack([b] * clients) for n, b in model.named_buffers()}

    def loss(p, b, xs, ys):
        return F.cross_entropy(functional_call(model, (p, b), (xs,)), ys)

    step = vmap(grad_and_value(loss))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from the current one
        before = _status("VmRSS")
    grads, _ = step(params, buffers, x, y)
    names = list(params)
    updated = torch._foreach_sub([params[n] for n in names], torch._foreach_mul([grads[n] for n in names], 0.1))
    del grads, updated
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _status("VmHWM") - before
    return {"arch": arch, "clients": clients, "estimate_per_client": estimate, "estimate": clients * estimate,
            "measured": peak}


def run(arch: str, clients: int, device: str) -> dict:
    """:func:`measure` in a fresh process (a heap that held another model's buffers would hide the growth)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import batched_memory; "
            "print(json.dumps(batched_memory.measure(sys.argv[2], int(sys.argv[3]), sys.argv[4])))")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent), arch, str(clients),
                           device], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS), help="folder of batched_memory_{cpu,gpu}.{md,json} "
                                                            "(default: benchmarks/results, the committed ones)")
    args = parser.parse_args(argv)
    rows = [run(arch, args.clients, args.device) for arch in ARCHS]
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} CPU"
    mib = 2**20
    lines = ["# A batched step's memory: the estimate against the measured peak", "",
             f"{datetime.date.today()}; {device}, torch {torch.__version__}; {args.clients} clients, batch 128, "
             "32 x 32 x 3.", "",
             "| model | estimate per client MiB | estimate x clients MiB | measured MiB | estimate / measured |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arch']} | {r['estimate_per_client'] / mib:.0f} | {r['estimate'] / mib:.0f} | "
                     f"{r['measured'] / mib:.0f} | {r['estimate'] / max(1, r['measured']):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "gpu" if args.device == "cuda" else "cpu"
    (out / f"batched_memory_{suffix}.md").write_text(text)
    (out / f"batched_memory_{suffix}.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / f'batched_memory_{suffix}.md'} and {out / f'batched_memory_{suffix}.json'}")


if __name__ == "__main__":
    main()
