"""Peak memory of a 100-client CIFAR ResNet18 federation's client store.

Builds the store the way ``FederatedTrainer`` does (``ClientStore`` with the worker's float
``state_dict`` as template and the module's masked names; two weight slots and two published
masks per node, plus each node's current mask), initializes every node with its own ERK mask at
density 0.5 through ``store.initialize``, and reports ``store.nbytes()`` and the process's peak
RSS (``resource.getrusage``) before and after, in GiB (2^30 bytes).

It needs about 12 GiB for K = 100: run it once, alone. It refuses to start, before allocating,
when ``/proc/meminfo`` shows too little available memory.

    python benchmarks/store_memory.py                 # K = 100, resnet18, density 0.5 (~1 min)
    python benchmarks/store_memory.py --clients 10    # a quick check
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from lightning_dfl.federation.state import ClientStore
from lightning_dfl.module import SparseClassifier
from lightning_dfl.seeding import derive_seed

GIB = 2**30


def peak_rss_bytes() -> int:
    """The process's peak resident set size (``ru_maxrss`` is in KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def current_rss_bytes() -> int | None:
    """The current resident set size from ``/proc/self/status`` (None where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def snapshot(label: str) -> dict[str, float | str | None]:
    cur = current_rss_bytes()
    return {"label": label, "peak_rss_gib": peak_rss_bytes() / GIB,
            "rss_gib": cur / GIB if cur is not None else None}


def expected_store_bytes(template: dict[str, torch.Tensor], masked: list[str], nodes: int) -> dict[str, int]:
    """The store's layout, computed: 2 weight slots, 2 published-mask slots, 1 current mask per node."""
    weights = sum(2 * nodes * t.numel() * t.element_size() for t in template.values())
    masked_entries = sum(template[n].numel() for n in masked)
    return {"weights": weights, "published_masks": 2 * nodes * masked_entries, "masks": nodes * masked_entries}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", type=int, default=100, help="nodes in the store")
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--density", type=float, default=0.5, help="ERK density of every node's mask")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--margin-gib", type=float, default=2.0, help="free memory to keep beyond the store")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.clients < 1:
        p.error(f"--clients must be >= 1, got {args.clients}")
    if not 0 < args.density <= 1:
        p.error(f"--density must be in (0, 1], got {args.density}")
    torch.set_num_threads(1)

    snaps = [snapshot("start (after imports)")]
    module = SparseClassifier(args.arch, num_classes=10, in_channels=3, image_size=32, density=args.density,
                              distribution="erk", seed=args.seed)
    template = {n: t for n, t in module.model.state_dict(keep_vars=False).items() if t.is_floating_point()}
    masked = list(module.mask.masks)
    params = sum(t.numel() for t in template.values())
    expected = expected_store_bytes(template, masked, args.clients)
    need = sum(expected.values())
    avail = available_bytes()
    if avail is not None and need + args.margin_gib * GIB > avail:
        print(f"refusing: the store needs {need / GIB:.2f} GiB plus a {args.margin_gib} GiB margin, "
              f"only {avail / GIB:.2f} GiB are available; lower --clients", file=sys.stderr)
        return 2
    snaps.append(snapshot("model built"))

    start = time.perf_counter()
    store = ClientStore(template, masked, args.clients)
    alloc_s = time.perf_counter() - start
    snaps.append(snapshot("store allocated"))
    start = time.perf_counter()
    densities = []
    for node in range(args.clients):
        generator = torch.Generator().manual_seed(derive_seed(args.seed, "mask", node))
        mask = module.initial_masks(generator)
        store.initialize(node, template, mask)
        densities.append(sum(int(m.sum()) for m in mask.values()) / sum(m.numel() for m in mask.values()))
        del mask
    init_s = time.perf_counter() - start
    snaps.append(snapshot(f"{args.clients} nodes initialized"))
    nbytes = store.nbytes()

    result = {
        "arch": args.arch, "clients": args.clients, "density": args.density,
        "parameters_and_float_buffers": params,
        "masked_entries": sum(template[n].numel() for n in masked),
        "store_nbytes": nbytes, "store_gib": nbytes / GIB,
        "expected_bytes": expected, "expected_gib": need / GIB,
        "bytes_per_node": nbytes / args.clients,
        "mean_mask_density": sum(densities) / len(densities),
        "snapshots": snaps,
        "peak_rss_increase_gib": snaps[-1]["peak_rss_gib"] - snaps[0]["peak_rss_gib"],
        "allocate_s": alloc_s, "initialize_s": init_s,
        "machine": f"{platform.machine()}, torch {torch.__version__}",
    }
    del store

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "store_memory.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Client store memory: {args.clients} x CIFAR {args.arch}, ERK density {args.density}", "",
        f"Generated by `benchmarks/store_memory.py`. {params:,} float parameters and buffers per model, "
        f"{result['masked_entries']:,} of them masked; mean mask density {result['mean_mask_density']:.4f}.", "",
        f"- `store.nbytes()`: {nbytes:,} bytes = **{nbytes / GIB:.2f} GiB** "
        f"({nbytes / args.clients / 2**20:.1f} MiB per node; layout: 2 float32 weight slots "
        f"{expected['weights'] / GIB:.2f} GiB, 2 bool published-mask slots {expected['published_masks'] / GIB:.2f} GiB, "
        f"1 bool current mask {expected['masks'] / GIB:.2f} GiB)",
        f"- peak RSS increase: **{result['peak_rss_increase_gib']:.2f} GiB**; allocation {alloc_s:.1f} s, "
        f"initialization of {args.clients} nodes {init_s:.1f} s", "",
        "| point | peak RSS (GiB) | RSS (GiB) |", "|---|---|---|",
    ]
    for s in snaps:
        rss = "-" if s["rss_gib"] is None else f"{s['rss_gib']:.2f}"
        lines.append(f"| {s['label']} | {s['peak_rss_gib']:.2f} | {rss} |")
    (out / "store_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
