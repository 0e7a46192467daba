"""Batched clients (``trainer.batched_clients``, torch.func vmap over a level's clients) against
one client at a time: median round time on this machine's device.

Two settings: D-PSGD on the embedded digits set (``cnn_digits``, K = 20, M = 4, E = 1, batch 16),
and on a CIFAR-10 subset (``cnn_cifar``, K = 20, M = 4, E = 1, batch 64) when ``--root`` names
the unpacked jpg folders. Same seed and data for both paths; the final accuracies are printed
beside the times (equal up to float rounding).

    python benchmarks/batched_clients.py [--root ~/.cache/lightning-dfl/cifar10-jpg] [--accelerator gpu] [--out DIR]

``--out`` (default ``benchmarks/results``) is the folder of ``batched_clients_{cpu,gpu}.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DPSGD
from lightning_dfl.module import SparseClassifier

RESULTS = Path(__file__).resolve().parent / "results"


def run(setting: dict, batched: bool, args) -> dict:
    dm = FederatedDataModule(**setting["data"])
    options = {"diagnostics": False} if "diagnostics" in FederatedTrainer.__init__.__code__.co_varnames else {}
    trainer = FederatedTrainer(DPSGD(num_neighbors=4), rounds=args.rounds, local_epochs=1, accelerator=args.accelerator,
                               logger=False, seed=0, enable_progress_bar=False, batched_clients=batched,
                               cpu_threads=args.threads if args.accelerator == "cpu" else None, **options)
    trainer.fit(SparseClassifier(setting["arch"], density=1.0, lr=0.05, seed=0), dm)
    walls = [m["time/wall_round_s"] for m in trainer.history]
    return {"round_s": statistics.median(walls[1:]), "accuracy": trainer.history[-1]["acc/personal_mean"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="unpacked cifar10-jpg folder (adds the CIFAR setting)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--out", default=str(RESULTS), help="folder of batched_clients_{cpu,gpu}.{md,json} "
                                                            "(default: benchmarks/results, the committed ones)")
    args = parser.parse_args(argv)
    settings = {"digits / cnn_digits": {"arch": "cnn_digits", "data": dict(
        dataset="digits", num_clients=20, batch_size=16, test_samples_per_client=45, seed=0)}}
    if args.root:
        settings["CIFAR-10 (5,000) / cnn_cifar"] = {"arch": "cnn_cifar", "data": dict(
            dataset="image_folder", root=args.root, num_clients=20, batch_size=64, test_samples_per_client=50,
            max_train_samples=5000, augment=False, seed=0)}
    rows = []
    for name, setting in settings.items():
        serial, batched = run(setting, False, args), run(setting, True, args)
        rows.append({"setting": name, "serial": serial, "batched": batched})
        print(name, serial, batched, flush=True)
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else f"{platform.machine()} CPU, {args.threads} threads"
    lines = ["# Batched clients against one client at a time", "", f"{device}; D-PSGD, K = 20, M = 4, E = 1; "
             f"median round time over rounds 2..{args.rounds}.", "",
             "| setting | one at a time (s) | batched (s) | speed-up | accuracy (one / batched) |", "|---|---|---|---|---|"]
    for r in rows:
        s, b = r["serial"], r["batched"]
        lines.append(f"| {r['setting']} | {s['round_s']:.2f} | {b['round_s']:.2f} | {s['round_s'] / b['round_s']:.2f} x | "
                     f"{s['accuracy']:.4f} / {b['accuracy']:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "gpu" if args.accelerator == "gpu" else "cpu"
    (out / f"batched_clients_{suffix}.md").write_text(text)
    (out / f"batched_clients_{suffix}.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / f'batched_clients_{suffix}.md'} and {out / f'batched_clients_{suffix}.json'}")


if __name__ == "__main__":
    main()
