"""``bf16-mixed`` against ``32-true`` on this CPU: training images per second and final accuracy.

DisPFL with ``cnn_cifar`` on a CIFAR-10 subset (image folders, ``--root``), the same
seed, rounds and data for both precisions. Images per second = training samples of the run /
the rounds' wall time (evaluations included, as a user sees it). The CPU's bf16 support is read
from ``/proc/cpuinfo`` (``avx512_bf16`` or ``amx_bf16``).

    python benchmarks/precision.py --root ~/.cache/lightning-dfl/cifar10-jpg [--out DIR]

``--out`` (default ``benchmarks/results``) is the folder of ``precision.md`` and ``precision.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DisPFL
from lightning_dfl.module import SparseClassifier

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_bf16_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if "bf16" in f)


def run(args, precision: str) -> dict:
    torch.manual_seed(0)
    dm = FederatedDataModule(dataset="image_folder", root=args.root, num_clients=args.clients, partition="dirichlet",
                             alpha=0.3, batch_size=64, test_samples_per_client=50, max_train_samples=args.samples,
                             seed=0)
    options = {"diagnostics": False} if "diagnostics" in FederatedTrainer.__init__.__code__.co_varnames else {}
    trainer = FederatedTrainer(DisPFL(num_neighbors=3), rounds=args.rounds, local_epochs=1, accelerator="cpu",
                               precision=precision, logger=False, seed=0, enable_progress_bar=False,
                               cpu_threads=args.threads, **options)
    trainer.fit(SparseClassifier("cnn_cifar", density=0.5, lr=0.05, seed=0), dm)
    wall = sum(m["time/wall_round_s"] for m in trainer.history)
    samples = sum(m["samples/train"] for m in trainer.history)
    return {"precision": precision, "images_per_s": samples / wall, "wall_s": wall,
            "final_accuracy": trainer.history[-1]["acc/personal_mean"],
            "best_accuracy": max(m.get("acc/personal_mean", 0.0) for m in trainer.history)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS),
                        help="folder of precision.md and precision.json (default: benchmarks/results, the committed ones)")
    args = parser.parse_args(argv)
    rows = [run(args, p) for p in ("32-true", "bf16-mixed")]
    flags = cpu_bf16_flags()
    lines = ["# bf16-mixed against 32-true on the CPU", "",
             f"{platform.processor() or platform.machine()}; bf16 CPU flags: {', '.join(flags) or 'none'}; "
             f"{args.threads} threads; DisPFL, cnn_cifar, {args.clients} clients, {args.samples} CIFAR-10 training "
             f"images, {args.rounds} rounds, batch 64.", "",
             "| precision | images / s | wall (s) | final accuracy | best accuracy |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['images_per_s']:.0f} | {r['wall_s']:.1f} | {r['final_accuracy']:.4f} | "
                     f"{r['best_accuracy']:.4f} |")
    lines.append("")
    lines.append(f"bf16-mixed / 32-true speed: {rows[1]['images_per_s'] / rows[0]['images_per_s']:.2f} x")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.md").write_text(text)
    (out / "precision.json").write_text(json.dumps({"cpu_bf16_flags": flags, "runs": rows}, indent=1))
    print(f"wrote {out / 'precision.md'} and {out / 'precision.json'}")


if __name__ == "__main__":
    main()
