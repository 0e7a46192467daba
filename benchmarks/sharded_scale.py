"""Clients sharded across processes: memory per process, bytes moved between processes, wall time.

Each setting runs ``FederatedTrainer(devices=N, accelerator="cpu")`` in a child process (Fabric's launcher
starts the other N - 1, as for any sharded run) on MNIST from ``--data-root`` (the shared offline copy),
DisPFL with M = 10 time-varying neighbours, one local step per client and round, and writes per process:

* ``peak_rss_gib``: the process's peak resident set size (``ru_maxrss``), at the run's end;
* ``store_gib``: its client store's tensors (``store.nbytes()``);
* ``local_nodes``: the nodes its store holds (DisPFL is partitionable: its own, K/N);
* ``received_bytes``: the published records it received from the owners before the plan levels (the
  partitioned store's count: a record in its owner's store format, dense or compact, with its value count
  and published fields);
* ``peak_inbox_gib``: the most memory its received records held at once (after each receive);
* ``broadcast_bytes``: the store state it broadcast as a task's owner (the replicated design's count: 0 for a
  partitioned run); the round's figure counts each broadcast once per receiving process (N - 1);
* ``routed_bytes``: each source a task's process does not own, once per receiving process
  (``lightning_dfl.federation.exchange.routing``), times one published model (weights and mask, dense
  format): what the routes predict; the same for every process, so reported once.

``--tasks-per-receive 0 10`` runs each setting with the trainer's ``tasks_per_receive`` None (0: a whole level's
sources at once) and 10 (each process receives the sources of 10 of its tasks at a time).

    python benchmarks/sharded_scale.py --data-root ../shared/data --clients 1000 --arch cnn_cifar \\
        --image-size 32 --processes 1 2 4 --stores compact dense --tasks-per-receive 0 10 --tag partitioned
    python benchmarks/sharded_scale.py --data-root ../shared/data --clients 10000 --arch cnn_digits \\
        --image-size 8 --processes 4 --stores compact --tasks-per-receive 10 --tag partitioned
    python benchmarks/sharded_scale.py --data-root ../shared/data --clients 100 --arch cnn_cifar \\
        --image-size 32 --processes 2 4 --rounds 3 --stores dense     # the traffic comparison

Results go to ``benchmarks/results/sharded_scale-<clients>-<arch>[-<tag>].json`` with the CPU's flags.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2 ** 30


def cpu_facts() -> dict[str, object]:
    """The CPU's model name, flags of interest and count (recorded with every figure)."""
    model, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma"))]
                break
    except OSError:
        pass
    return {"cpu": model, "cpu_flags": sorted(flags), "cpus": os.cpu_count()}


def child(args: argparse.Namespace) -> None:
    """One run (this process is one of Fabric's N)."""
    from lightning_dfl.datamodules import FederatedDataModule
    from lightning_dfl.federation import FederatedTrainer
    from lightning_dfl.federation.algorithms import DisPFL
    from lightning_dfl.federation.exchange.routing import plan_routes
    from lightning_dfl.federation.loop.ownership import owner_of
    from lightning_dfl.federation.loop.sharded import ShardedExecutor
    from lightning_dfl.module import SparseClassifier

    plans, processes, inbox = [], args.processes[0], [0]

    class Recording(ShardedExecutor):
        def run(self, plan, evaluate, accounting=None, exchange=0):
            plans.append(plan)
            return super().run(plan, evaluate, accounting, exchange)

        def _receive(self, tasks):
            super()._receive(tasks)
            store = self.state.store
            inbox[0] = max(inbox[0], store.nbytes() - store.local.nbytes())

    data = FederatedDataModule(dataset="mnist", root=args.data_root, num_clients=args.clients, partition="iid",
                               batch_size=16, test_samples_per_client=args.test_samples, image_size=args.image_size,
                               cache=False)
    model = SparseClassifier(arch=args.arch, density=0.5)
    trainer = FederatedTrainer(algorithm=DisPFL(num_neighbors=10), rounds=args.rounds, local_epochs=None,
                               local_steps=1, accelerator="cpu", devices=processes, store=args.store,
                               cpu_threads=1, logger=False, enable_progress_bar=False, diagnostics=False,
                               default_root_dir=args.out, tasks_per_receive=args.tasks_per_receive[0] or None)
    if processes > 1:
        trainer.executor_factory = lambda state: Recording(state, trainer.settings.tasks_per_receive)
    start = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - start
    rank = trainer.global_rank
    store = trainer.federation.store
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    published = sum(t.numel() * t.element_size() for t in trainer.federation.worker.tensors.values())
    published += sum(int(m.numel()) for m in trainer.federation.worker.module.mask.masks.values()) + 8
    routed = sum(len(level) for plan in plans
                 for level in plan_routes(plan, lambda node: owner_of(node, processes))) * published
    row = {"rank": rank, "peak_rss_gib": peak / GIB, "store_gib": store.nbytes() / GIB, "wall_s": wall,
           "store_type": type(store).__name__, "local_nodes": getattr(store, "local", store).num_nodes,
           "received_bytes": getattr(store, "received_bytes", 0), "peak_inbox_gib": inbox[0] / GIB,
           "broadcast_bytes": getattr(trainer.executor, "broadcast_bytes", 0), "routed_bytes": routed,
           "published_model_bytes": published}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True, help="a folder with MNIST/raw (the shared offline copy)")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--arch", default="cnn_cifar")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--test-samples", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stores", nargs="+", default=["dense", "compact"], choices=("dense", "compact"))
    parser.add_argument("--tasks-per-receive", type=int, nargs="+", default=[0],
                        help="the trainer's tasks_per_receive for the runs on several processes (0: None)")
    parser.add_argument("--tag", default="", help="appended to the results file's name")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="dense", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    settings = [(store, n, chunk) for store in args.stores for n in args.processes
                for chunk in (args.tasks_per_receive if n > 1 else [0])]
    for store, n, chunk in settings:
        out = Path(f"/tmp/sharded_scale-{os.getpid()}-{store}-{n}-{chunk}")
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "--child", "--data-root", args.data_root, "--clients", str(args.clients),
               "--arch", args.arch, "--image-size", str(args.image_size), "--test-samples", str(args.test_samples),
               "--rounds", str(args.rounds), "--processes", str(n), "--store", store, "--out", str(out),
               "--tasks-per-receive", str(chunk)]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:  # e.g. the store refused: too large for the memory with n processes
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            rows.append({"store": store, "processes": n, "tasks_per_receive": chunk or None,
                         "error": lines[-1] if lines else f"rc {done.returncode}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        per_rank = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
        row = {"store": store, "processes": n, "tasks_per_receive": chunk or None,
               "wall_s": time.perf_counter() - start, "per_process": per_rank,
               # each broadcast reaches the N - 1 other processes: bytes received, as the routes count them
               "broadcast_bytes_per_round": sum(r["broadcast_bytes"] for r in per_rank) * (n - 1) / args.rounds,
               "routed_bytes_per_round": per_rank[0]["routed_bytes"] / args.rounds,
               "received_bytes_per_round": sum(r["received_bytes"] for r in per_rank) / args.rounds}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "per_process"}),
              [round(r["peak_rss_gib"], 3) for r in per_rank], flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"sharded_scale-{args.clients}-{args.arch}{'-' + args.tag if args.tag else ''}.json"
    header = {"date": time.strftime("%Y-%m-%d"), **cpu_facts(), "clients": args.clients, "arch": args.arch,
              "image_size": args.image_size, "rounds": args.rounds, "algorithm": "dispfl M=10, 1 local step"}
    path.write_text(json.dumps({**header, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
