"""The diagnostics' share of a round's wall time (issue 17: at most 5%).

Two settings, DisPFL under ``FederatedTrainer`` on one CPU thread, diagnostics on (every round):

* ``digits``: K = 100 clients on the embedded digits set (the README's main job's settings: cnn_digits,
  density 0.5, M = 4, E = 2, batch 16; ``dirichlet_equal`` Dir(0.3), since 1,347 images leave about 13
  per client and the plain Dirichlet split cannot give every client 10);
* ``cifar``: K = 10 clients of ``cnn_cifar`` on CIFAR-10 (the image-folder copy,
  ``--cifar-root .../cifar10-jpg``), a stratified 10,000-image subset, Dir(0.3), M = 4, E = 1, batch 32.

Every diagnosed round times its diagnostics (``RunDiagnostics.wall_s``: mixing matrix, spectral gap,
consensus distances, mask Jaccard and flips, files) inside ``time/wall_round_s``; the share is
``diag / (time/wall_round_s - diag)``, the diagnostics' cost relative to the round without them, median over the rounds after the
first (a warm-up) and before the last (reported on its own: it also writes the final K x K matrices).
Measuring inside one run keeps the comparison paired on a machine whose speed drifts.
``--plot-dir`` also writes the CIFAR run's diagnostics figures (the README's figure).

    python benchmarks/diagnostics_cost.py --cifar-root ~/.cache/lightning-dfl/cifar10-jpg
    python benchmarks/diagnostics_cost.py --settings digits --rounds 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DisPFL
from lightning_dfl.module import SparseClassifier

RESULTS = Path(__file__).parent / "results"


def setting(name: str, cifar_root: str | None) -> tuple[FederatedDataModule, SparseClassifier, dict[str, Any]]:
    if name == "digits":
        dm = FederatedDataModule(dataset="digits", num_clients=100, partition="dirichlet_equal", alpha=0.3,
                                 batch_size=16, test_samples_per_client=45, seed=0)
        model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05, weight_decay=5e-4, seed=0)
        return dm, model, {"algorithm": DisPFL(num_neighbors=4), "local_epochs": 2}
    if name == "cifar":
        if cifar_root is None:
            raise SystemExit("the cifar setting needs --cifar-root (the unpacked cifar10-jpg folder)")
        dm = FederatedDataModule(dataset="image_folder", root=cifar_root, num_clients=10, partition="dirichlet",
                                 alpha=0.3, batch_size=32, test_samples_per_client=100, max_train_samples=10_000,
                                 seed=0)
        model = SparseClassifier(arch="cnn_cifar", density=0.5, lr=0.05, weight_decay=5e-4, seed=0)
        return dm, model, {"algorithm": DisPFL(num_neighbors=4), "local_epochs": 1}
    raise SystemExit(f"unknown setting {name!r}; allowed: digits, cifar")


def measure(name: str, rounds: int, root: str, cifar_root: str | None) -> dict[str, Any]:
    dm, model, options = setting(name, cifar_root)
    trainer = FederatedTrainer(rounds=rounds, accelerator="cpu", cpu_threads=1, enable_progress_bar=False, seed=0,
                               default_root_dir=root, diagnostics=True, **options)
    trainer.fit(model, dm)
    rows = [(m["time/wall_round_s"], trainer.diag.wall_s[r]) for r, m in enumerate(trainer.history)]
    last = rows[-1]  # the last round also writes the final K x K mask-Jaccard and bytes matrices
    rows = rows[1:-1] or rows
    shares = [diag / (round_s - diag) for round_s, diag in rows]
    return {
        "setting": name, "num_clients": trainer.num_clients, "rounds": rounds,
        "parameters": sum(p.numel() for p in model.model.parameters()),
        "round_s_median": statistics.median(round_s for round_s, _ in rows),
        "diag_s_median": statistics.median(diag for _, diag in rows),
        "share_median": statistics.median(shares), "share_max": max(shares),
        "share_last_round": last[1] / (last[0] - last[1]),
        "last": {k: v for k, v in trainer.history[-1].items() if k.startswith(("diag/", "acc/"))},
        "log_dir": trainer.log_dir,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=["digits", "cifar"], choices=["digits", "cifar"])
    parser.add_argument("--rounds", type=int, default=None, help="rounds per setting (default: digits 4, cifar 20)")
    parser.add_argument("--cifar-root", default=None)
    parser.add_argument("--root", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--plot-dir", default=None, help="write the cifar run's diagnostics figures here")
    parser.add_argument("--out", default=str(RESULTS / "diagnostics_cost.json"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")
    root = args.root or tempfile.mkdtemp(prefix="diag-cost-")
    results = []
    for name in args.settings:
        rounds = args.rounds or {"digits": 4, "cifar": 20}[name]
        result = measure(name, rounds, root, args.cifar_root)
        results.append(result)
        print(f"{name}: K={result['num_clients']}, round {result['round_s_median']:.2f} s, diagnostics "
              f"{1e3 * result['diag_s_median']:.1f} ms = {100 * result['share_median']:.2f}% of the round without them "
              f"(max {100 * result['share_max']:.2f}%, last round {100 * result['share_last_round']:.2f}%)",
              file=sys.stderr)
        if name == "cifar" and args.plot_dir:
            from lightning_dfl.plots import plot_diagnostics

            for path in plot_diagnostics(result["log_dir"], args.plot_dir):
                print(f"figure: {path}", file=sys.stderr)
    record = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}",
              "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    lines = ["| setting | K | parameters | round (s, median) | diagnostics (ms, median) | share (median) | share (max) "
             "| share (last round) |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['num_clients']} | {r['parameters']:,} | {r['round_s_median']:.2f} | "
              f"{1e3 * r['diag_s_median']:.1f} | {100 * r['share_median']:.2f}% | {100 * r['share_max']:.2f}% | "
              f"{100 * r['share_last_round']:.2f}% |"
              for r in results]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
