"""One command that checks the GPU code paths and measures them, in at most about 8 minutes on one GPU.

Runs, each in its own process, and prints one table (also written to ``benchmarks/results/gpu_check.md``):

1. the README's main job (DisPFL on digits) on the GPU;
2. ``round_time.py --device cuda``: our round against the independent hand loop at K = 10 and K = 100;
3. K = 100 ``cnn_cifar`` with ``batched_clients: true`` vs serial;
4. K = 10 with ``bf16-mixed`` vs ``32-true``;
5. ``store_device: worker`` and ``auto`` (dense and compact store);
6. a run stopped after round 1 and resumed from its checkpoint on the GPU (must equal the uninterrupted run);
7. one round of ``configs/dispfl_cifar10_dir.yaml`` (100 ResNet18 clients, E = 5).

CIFAR-10 as image folders: ``--root`` (the unpacked ``cifar10-jpg``) or ``--archive`` (the ``.tar.xz``,
unpacked to a temporary folder). Steps 2-7 need it; without it only step 1 runs.

    python benchmarks/gpu_check.py --archive data/cifar10-jpg.tar.xz
    python benchmarks/gpu_check.py --device cpu --quick --root ~/.cache/lightning-dfl/cifar10-jpg   # a smoke test
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"


def fit(out: Path, name: str, config: str, *options: str, timeout: float = 300) -> dict:
    """Run ``lightning-dfl fit`` into ``out/name``; return its wall time, rounds' wall times and summary."""
    root = out / name
    cmd = [sys.executable, "-m", "lightning_dfl", "fit", "--config", config, "--trainer.default_root_dir",
           str(root), "--trainer.enable_progress_bar", "false", *options]
    tic = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    wall = time.perf_counter() - tic
    if proc.returncode:
        return {"name": name, "ok": False, "wall_s": wall, "error": (proc.stderr or proc.stdout)[-1500:]}
    run = max(root.glob("*/version_*"), key=lambda p: p.stat().st_mtime)
    with (run / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("time/wall_round_s")]
    summary = json.loads((run / "summary.json").read_text())
    return {"name": name, "ok": True, "wall_s": wall, "run": str(run),
            "round_s": [float(r["time/wall_round_s"]) for r in rows], "summary": summary,
            "metrics": rows}


def per_round(result: dict) -> float:
    """Median wall time of the rounds after the first (the first one's when there is one)."""
    times = result.get("round_s") or [math.nan]
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def row(result: dict, note: str = "") -> str:
    if not result["ok"]:
        return f"| {result['name']} | FAILED | | | {result['error'].strip().splitlines()[-1][:160]} |"
    accuracy = result["summary"].get("final_accuracy", math.nan)
    return (f"| {result['name']} | {per_round(result):.2f} | {result['wall_s']:.1f} | {100 * accuracy:.2f} | "
            f"{note} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="unpacked cifar10-jpg folder")
    parser.add_argument("--archive", help="cifar10-jpg.tar.xz, unpacked to a temporary folder")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test of the script itself)")
    args = parser.parse_args()
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    out = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    root = args.root
    if root is None and args.archive:
        with tarfile.open(args.archive) as tar:
            tar.extractall(out / "data", filter="data")
        root = str(out / "data" / "cifar10-jpg")
    results: list[str] = []
    device_name = "cpu"
    if args.device == "cuda":
        import torch
        device_name = torch.cuda.get_device_name()
    quick = ["--trainer.rounds", "2"] if args.quick else []

    main_job = fit(out, "main job (dispfl_digits.yaml)", "configs/dispfl_digits.yaml", "--trainer.accelerator",
                   accelerator, *quick)
    results.append(row(main_job))
    if root is not None:
        cifar = ["--data.dataset", "image_folder", "--data.root", root, "--trainer.accelerator", accelerator,
                 "--model.arch", "cnn_cifar", "--trainer.local_epochs", "1", "--trainer.diagnostics", "false"]
        size = ["--data.max_train_samples", "2000" if args.quick else "10000"]
        rounds = ["--trainer.rounds", "2" if args.quick else "3"]
        k10 = [*cifar, *size, *rounds, "--data.num_clients", "10", "--trainer.algorithm.num_neighbors", "3"]
        k100 = [*cifar, *size, *rounds, "--data.num_clients", "20" if args.quick else "100",
                "--trainer.algorithm.num_neighbors", "4" if args.quick else "10"]
        config = "configs/dispfl_cifar10_dir.yaml"
        # 2. against the independent loop
        settings = ["k10"] if args.quick else ["k10", "k100"]
        proc = subprocess.run([sys.executable, str(HERE / "round_time.py"), "--root", root, "--device", args.device,
                               "--settings", *settings, "--rounds", "2" if args.quick else "3",
                               "--max-train-samples", "2000" if args.quick else "10000"],
                              capture_output=True, text=True, timeout=420, cwd=REPO)
        table = proc.stdout[proc.stdout.find("| K, M"):] if proc.returncode == 0 else proc.stderr[-1500:]
        # 3-4. batched clients, precision
        many = "K=20" if args.quick else "K=100"
        serial = fit(out, f"{many} serial", config, *k100)
        batched = fit(out, f"{many} batched_clients", config, *k100, "--trainer.batched_clients", "true")
        fp32 = fit(out, "K=10 32-true", config, *k10)
        bf16 = fit(out, "K=10 bf16-mixed", config, *k10, "--trainer.precision", "bf16-mixed")
        speedup = per_round(serial) / per_round(batched) if serial["ok"] and batched["ok"] else math.nan
        results += [row(serial), row(batched, f"{speedup:.2f} x serial"), row(fp32),
                    row(bf16, f"{per_round(fp32) / per_round(bf16):.2f} x fp32" if bf16["ok"] and fp32["ok"] else "")]
        # 5. where the store lives
        for store in ("dense", "compact"):
            for where in ("worker", "auto", "cpu"):
                results.append(row(fit(out, f"K=10 store {store} on {where}", config, *k10,
                                       "--trainer.store", store, "--trainer.store_device", where)))
        # 6. resume: 2 rounds with a checkpoint after each, then the same run stopped and resumed
        full = fit(out, "resume: 3 rounds straight", config, *k10, "--trainer.checkpoint_every", "1")
        first = fit(out, "resume: first 2 rounds", config, *k10, "--trainer.rounds", "2",
                    "--trainer.checkpoint_every", "1")
        note = ""
        if first["ok"]:
            resumed = fit(out, "resume: round 3 from the checkpoint", config, *k10, "--trainer.checkpoint_every", "1",
                          "--ckpt_path", str(Path(first["run"]) / "checkpoints" / "last.ckpt"))
            if resumed["ok"] and full["ok"]:
                same = resumed["metrics"][-1].get("acc/personal_mean") == full["metrics"][-1].get("acc/personal_mean")
                note = "final accuracy equals the straight run's" if same else "DIFFERS from the straight run"
            results.append(row(resumed, note))
        # 7. the papers' ResNet18 round
        resnet = ["--data.dataset", "image_folder", "--data.root", root, "--trainer.accelerator", accelerator,
                  "--trainer.rounds", "1", "--trainer.store", "compact"]
        if args.quick:
            resnet += ["--data.num_clients", "4", "--trainer.algorithm.num_neighbors", "2",
                       "--data.max_train_samples", "400", "--trainer.local_epochs", "1"]
        name = "ResNet18, 4 clients, E=1, one round" if args.quick else "ResNet18, 100 clients, E=5, one round"
        results.append(row(fit(out, name, config, *resnet, timeout=420)))
    else:
        table = "(no CIFAR-10 given: --root or --archive)"
    date = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"
    text = "\n".join([
        "# GPU check", "", f"- date: {date}; device: {device_name}; command: `{' '.join(sys.argv)}`", "",
        "| run | s/round (median after the first) | process wall s | final accuracy % | note |",
        "|---|---|---|---|---|", *results, "", "## Our round against the independent hand loop", "", table])
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / ("gpu_check.md" if args.device == "cuda" else "gpu_check_cpu_smoke.md")).write_text(text + "\n")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
