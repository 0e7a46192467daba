"""Peak memory of a 100-client CIFAR ResNet18 federation's client store.

Builds the store the way ``FederatedTrainer`` does (``DenseClientStore`` with the worker's float
``state_dict`` as template and the module's masked names; two weight slots and two published
masks per node, plus each node's current mask), initializes every node with its own ERK mask at
density 0.5 through ``store.initialize``, and reports ``store.nbytes()`` and the process's peak
RSS (``resource.getrusage``) before and after, in GiB (2^30 bytes).

It needs about 12 GiB for K = 100: run it once, alone. It refuses to start, before allocating,
when ``/proc/meminfo`` shows too little available memory.

``--store compact`` measures :class:`~lightning_dfl.federation.store.compact.CompactClientStore`
(``FederatedTrainer(store="compact")``) instead, and then plays rounds the way DisPFL's tasks use the
store, in the serial executor's order: each task reads its sources (itself and its M in-neighbours of
the topology), publishes the model it trained (zero outside its mask, as the module leaves it) and sets a next mask that differs from the published one
(RigL: 10% of each layer's active weights moved). The store is measured after every task (the
round's peak) and after ``end_round``: a round that keeps every start-of-round record to its end,
then rounds whose records are freed after their last reader (what the executor does for DisPFL,
:class:`~lightning_dfl.federation.loop.start_reads.StartReads`) on DisPFL's time-varying topology (M = 10) and on a
ring (M = 2); then one round in which every node prunes half of its active weights (DA-DPFL's PQI), to
show the memory falling.

    python benchmarks/store_memory.py                 # K = 100, resnet18, density 0.5 (~1 min)
    python benchmarks/store_memory.py --clients 10    # a quick check
    python benchmarks/store_memory.py --store compact                                # ~5 GB, ~5 min
    python benchmarks/store_memory.py --store compact --arch cnn_cifar --clients 1000
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from lightning_dfl.federation import RoundPlan, Source, Task
from lightning_dfl.federation.exchange.topology import build_topology
from lightning_dfl.federation.loop.start_reads import StartReads
from lightning_dfl.federation.store import ClientStore, CompactClientStore, DenseClientStore
from lightning_dfl.federation.store.memory import available_bytes
from lightning_dfl.module import SparseClassifier
from lightning_dfl.seeding import derive_seed
from lightning_dfl.sparse.masks import density, zero_inactive_

GIB = 2**30
GB = 10**9


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


def snapshot(label: str) -> dict[str, float | str | None]:
    cur = current_rss_bytes()
    return {"label": label, "peak_rss_gib": peak_rss_bytes() / GIB,
            "rss_gib": cur / GIB if cur is not None else None}


def expected_store_bytes(template: dict[str, torch.Tensor], masked: list[str], nodes: int) -> dict[str, int]:
    """The store's layout, computed: 2 weight slots, 2 published-mask slots, 1 current mask per node."""
    weights = sum(2 * nodes * t.numel() * t.element_size() for t in template.values())
    masked_entries = sum(template[n].numel() for n in masked)
    return {"weights": weights, "published_masks": 2 * nodes * masked_entries, "masks": nodes * masked_entries}


def expected_compact_bytes(template: dict[str, torch.Tensor], masked: list[str], nodes: int,
                           density: float) -> dict[str, int]:
    """The compact store's size, estimated: per node the active values, the mask bits, the signs of the
    pruned zeros and a current mask, once between rounds and twice at a round's peak."""
    masked_entries = sum(template[n].numel() for n in masked)
    itemsize = next(iter(template.values())).element_size()
    unmasked = sum(t.numel() * t.element_size() for n, t in template.items() if n not in masked)
    record = int(density * masked_entries * itemsize) + unmasked + masked_entries // 8 + masked_entries // 8
    return {"records": nodes * record, "current_masks": nodes * masked_entries // 8, "round_peak": nodes * record}


def _rigl_like(mask: dict[str, torch.Tensor], fraction: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``mask`` with ``fraction`` of each layer's active entries moved to inactive ones (RigL's drop and grow)."""
    out = {}
    for name, m in mask.items():
        flat = m.reshape(-1).clone()
        active, inactive = flat.nonzero().view(-1), (~flat).nonzero().view(-1)
        k = min(int(fraction * active.numel()), inactive.numel())
        if k:
            flat[active[torch.randperm(active.numel(), generator=generator)[:k]]] = False
            flat[inactive[torch.randperm(inactive.numel(), generator=generator)[:k]]] = True
        out[name] = flat.view(m.shape)
    return out


def initialize_nodes(store: ClientStore, module: SparseClassifier, template: dict[str, torch.Tensor], clients: int,
                     seed: int) -> list[float]:
    """Initialize every node with its own ERK mask (seeded as the trainer seeds them); their densities."""
    densities = []
    for node in range(clients):
        mask = module.draw_initial_masks(torch.Generator().manual_seed(derive_seed(seed, "mask", node)))
        store.initialize(node, template, mask)
        densities.append(density(mask))
    return densities


def dispfl_plan(clients: int, topology: str, neighbors: int, seed: int, round_idx: int) -> RoundPlan:
    """DisPFL's plan of a round: every node aggregates itself and its in-neighbours' start-of-round models."""
    rng = np.random.default_rng(derive_seed(seed, "plan", round_idx))
    heard = build_topology(topology, neighbors).neighbors(clients, round_idx, rng)
    return RoundPlan(round_idx, [Task(k, sources=(Source(k), *(Source(j) for j in heard[k])))
                                 for k in range(clients)])


def play_round(store: ClientStore, plan: RoundPlan, seed: int, prune: float = 0.0, move: float = 0.1,
               release: bool = True) -> dict[str, float]:
    """One round as DisPFL's tasks use the store (see the module docstring); ``prune``: the share of each
    node's active weights it prunes (its new published mask); ``release``: free start-of-round records
    after their last reader. Returns the nbytes at the peak (after any task) and after the round."""
    densities, peak = [], store.nbytes()
    reads = StartReads(plan, store.release_start) if release else None
    for task in plan.order():
        node = task.node
        for source in task.sources:  # the messages: each source rebuilt dense, as the executor reads it
            store.published(source.node, source.fresh)
        if reads is not None:
            reads.started(task)
        weights, mask = store.published(node)
        mask = store.mask(node)
        generator = torch.Generator().manual_seed(derive_seed(seed, "round", plan.round_idx, node))
        if prune:
            mask = {n: m & (torch.rand(m.shape, generator=generator) >= prune) for n, m in mask.items()}
        trained = {n: w + 0.01 for n, w in weights.items()}
        for n, m in mask.items():  # pruned entries are plain zeros, as the module's mask leaves them
            zero_inactive_(trained[n], m)
        store.publish(node, trained, mask)
        store.set_mask(node, _rigl_like(mask, move, generator))
        peak = max(peak, store.nbytes())
        if reads is not None:
            reads.finished(task)
        densities.append(density(mask))
        del weights, mask, trained
    store.end_round()
    return {"peak_nbytes": peak, "after_nbytes": store.nbytes(), "mean_density": sum(densities) / len(densities)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", type=int, default=100, help="nodes in the store")
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--density", type=float, default=0.5, help="ERK density of every node's mask")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--margin-gib", type=float, default=2.0, help="free memory to keep beyond the store")
    p.add_argument("--store", choices=("dense", "compact"), default="dense", help="the store backend")
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
    dense_fp32 = args.clients * sum(t.numel() * 4 for t in template.values())  # one float32 model per node
    if args.store == "compact":
        return compact_main(args, module, template, masked, params, dense_fp32, expected, snaps)
    need = sum(expected.values())
    if short_of_memory(need, "the store needs", args.margin_gib):
        return 2
    snaps.append(snapshot("model built"))

    start = time.perf_counter()
    store = DenseClientStore(template, masked, args.clients)
    alloc_s = time.perf_counter() - start
    snaps.append(snapshot("store allocated"))
    start = time.perf_counter()
    densities = initialize_nodes(store, module, template, args.clients, args.seed)
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


def short_of_memory(need: int, what: str, margin_gib: float) -> bool:
    """Whether ``need`` bytes plus the margin exceed the available memory (then say so on stderr)."""
    avail = available_bytes()
    if avail is not None and need + margin_gib * GIB > avail:
        print(f"refusing: {what} {need / GIB:.2f} GiB plus a {margin_gib} GiB margin, "
              f"only {avail / GIB:.2f} GiB are available; lower --clients", file=sys.stderr)
        return True
    return False


def compact_main(args: argparse.Namespace, module: SparseClassifier, template: dict[str, torch.Tensor],
                 masked: list[str], params: int, dense_fp32: int, expected_dense: dict[str, int],
                 snaps: list[dict[str, float | str | None]]) -> int:
    """``--store compact``: initialize, one DisPFL-like round, one pruning round; written to
    ``store_memory_compact_<arch>_<clients>.{json,md}``."""
    expected = expected_compact_bytes(template, masked, args.clients, args.density)
    if short_of_memory(sum(expected.values()), "the round's peak needs about", args.margin_gib):
        return 2
    snaps.append(snapshot("model built"))
    start = time.perf_counter()
    store = CompactClientStore(template, masked, args.clients)
    densities = initialize_nodes(store, module, template, args.clients, args.seed)
    init_s = time.perf_counter() - start
    initialized = store.nbytes()
    breakdown = store.breakdown()
    snaps.append(snapshot(f"{args.clients} nodes initialized"))
    m = min(10, args.clients - 1)
    start = time.perf_counter()
    kept = play_round(store, dispfl_plan(args.clients, "time_varying", m, args.seed, 0), args.seed, release=False)
    round_s = time.perf_counter() - start
    snaps.append(snapshot("after a DisPFL round keeping every start-of-round record (two per node at its end)"))
    after_breakdown = store.breakdown()
    dispfl = play_round(store, dispfl_plan(args.clients, "time_varying", m, args.seed, 1), args.seed)
    snaps.append(snapshot(f"after a DisPFL round freeing read records (time-varying, M = {m})"))
    ring = play_round(store, dispfl_plan(args.clients, "ring", 2, args.seed, 2), args.seed)
    snaps.append(snapshot("after a ring round freeing read records (M = 2)"))
    pruned = play_round(store, dispfl_plan(args.clients, "time_varying", m, args.seed, 3), args.seed, prune=0.5)
    snaps.append(snapshot("after a pruning round (half the active weights)"))
    start = time.perf_counter()
    for node in range(min(args.clients, 10)):
        store.published(node)
    rebuild_ms = (time.perf_counter() - start) / min(args.clients, 10) * 1e3
    dense_nbytes = sum(expected_dense.values())
    result = {
        "store": "compact", "arch": args.arch, "clients": args.clients, "density": args.density,
        "parameters_and_float_buffers": params, "masked_entries": sum(template[n].numel() for n in masked),
        "mean_mask_density": sum(densities) / len(densities),
        "dense_fp32_weights_bytes": dense_fp32, "dense_store_nbytes": dense_nbytes,
        "initialized_nbytes": initialized, "initialized_breakdown": breakdown,
        "initialized_ratio_to_dense_fp32": initialized / dense_fp32,
        "neighbors": m, "round_keeping_records": kept, "dispfl_round": dispfl, "ring_round": ring,
        "after_dispfl_round_breakdown": after_breakdown,
        "after_dispfl_round_ratio_to_dense_fp32": dispfl["after_nbytes"] / dense_fp32,
        "pruning_round": pruned, "after_pruning_ratio_to_dense_fp32": pruned["after_nbytes"] / dense_fp32,
        "snapshots": snaps,
        "peak_rss_increase_gib": snaps[-1]["peak_rss_gib"] - snaps[0]["peak_rss_gib"],
        "initialize_s": init_s, "dispfl_round_s": round_s, "published_rebuild_ms": rebuild_ms,
        "machine": f"{platform.machine()}, torch {torch.__version__}",
    }
    del store
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"store_memory_compact_{args.arch}_{args.clients}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))

    def size(n: int) -> str:
        return f"{n / GB:.2f} GB ({n / GIB:.2f} GiB)"

    lines = [
        f"# Compact client store memory: {args.clients} x CIFAR {args.arch}, ERK density {args.density}", "",
        f"Generated by `benchmarks/store_memory.py --store compact --arch {args.arch} --clients {args.clients}`. "
        f"{params:,} float parameters and buffers per model, {result['masked_entries']:,} of them masked; "
        f"mean mask density {result['mean_mask_density']:.4f}. Dense float32 weights, one model per node: "
        f"{size(dense_fp32)}; the dense store (two slots and bool masks): {size(dense_nbytes)}.", "",
        "| point | `store.nbytes()` | x dense fp32 weights |", "|---|---|---|",
        f"| {args.clients} nodes initialized | {size(initialized)} | {initialized / dense_fp32:.3f} |",
        f"| DisPFL round keeping every start-of-round record, peak | {size(kept['peak_nbytes'])} | "
        f"{kept['peak_nbytes'] / dense_fp32:.3f} |",
        f"| DisPFL round freeing records after their last reader (time-varying, M = {m}), peak | "
        f"{size(dispfl['peak_nbytes'])} | {dispfl['peak_nbytes'] / dense_fp32:.3f} |",
        f"| ring round (M = 2) freeing records, peak | {size(ring['peak_nbytes'])} | "
        f"{ring['peak_nbytes'] / dense_fp32:.3f} |",
        f"| after a round (next masks differ from the published ones) | {size(dispfl['after_nbytes'])} | "
        f"{dispfl['after_nbytes'] / dense_fp32:.3f} |",
        f"| after a pruning round (density {pruned['mean_density']:.3f}) | {size(pruned['after_nbytes'])} | "
        f"{pruned['after_nbytes'] / dense_fp32:.3f} |", "",
        "Initialized, by kind: " + ", ".join(f"{k} {v / GB:.3f} GB" for k, v in breakdown.items()) + ".",
        f"Peak RSS increase: **{result['peak_rss_increase_gib']:.2f} GiB**; initialization {init_s:.1f} s, "
        f"a DisPFL round's store work {round_s:.1f} s, one `published()` rebuild {rebuild_ms:.1f} ms.", "",
        "| point | peak RSS (GiB) | RSS (GiB) |", "|---|---|---|",
    ]
    for snap in snaps:
        rss = "-" if snap["rss_gib"] is None else f"{snap['rss_gib']:.2f}"
        lines.append(f"| {snap['label']} | {snap['peak_rss_gib']:.2f} | {rss} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
