"""One command that checks the GPU code paths and measures them, in at most about 8 minutes on one GPU.

Runs, each in its own process and most important first, and prints one table row by row (also written,
row by row, to ``benchmarks/results/gpu_check.md`` or ``--out``); checks that would start after
``--budget-s`` seconds are listed as skipped:

1. the README's main job (DisPFL on digits) on the GPU, then ``step_time.py``: a ResNet18 step (NCHW and
   channels-last, ordinary and replayed from a CUDA graph, fp32 and bf16: without the launches, does bf16 pay?)
   against the batched executor's step of 8 and 32 clients, per client step;
1a. ``cuda_graphs: true`` (``graphs``): K = 10 ``cnn_cifar``, 3 rounds, with and without graphs (the accuracies
   must be equal), then two rounds of the papers' ResNet18 setting with graphs and the config's dense store, whose
   tasks read nothing from the device (the second round is what later rounds cost: the first warms every batch
   shape up);
2. one round of ``configs/dispfl_cifar10_dir.yaml`` (100 ResNet18 clients, E = 5) with the compact store (as the
   earlier GPU figures were measured), the same
   with ``batched_clients: true`` (groups sized from the GPU's memory), then ``round_phases.py`` over two such
   rounds (where a warm round's time goes);
3. ``round_time.py --device cuda``: our round against the independent hand loop at K = 10 and K = 100;
4. K = 100 ``cnn_cifar`` at E = 5 with ``batched_clients: true`` vs serial;
5. K = 10 with ``bf16-mixed`` vs ``32-true``;
6. ``store_device: worker`` (dense and compact store; the other runs use the default, ``auto``);
7. a run interrupted after round 2 (SIGINT, as Ctrl-C) and resumed from its checkpoint on the GPU: must equal
   the uninterrupted run (run twice, to tell the device's own repeatability apart);
8. the ResNet18 round in ``bf16-mixed``.

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


#: where each run's whole output is kept (``--logs``; none by default)
LOGS: Path | None = None


def keep_log(name: str, text: str) -> None:
    """Write a run's whole output to ``LOGS/<name>.log`` (when ``--logs`` names a folder)."""
    if LOGS is not None:
        LOGS.mkdir(parents=True, exist_ok=True)
        (LOGS / ("".join(c if c.isalnum() or c in "-_." else "_" for c in name) + ".log")).write_text(text)


def fit(out: Path, name: str, config: str, *options: str, timeout: float = 300, interrupted: bool = False) -> dict:
    """Run ``lightning-dfl fit`` into ``out/name``; return its wall time, rounds' wall times and summary
    (``interrupted``: the run must stop with exit code 130, as after Ctrl-C, and writes no summary)."""
    root = out / name
    cmd = [sys.executable, "-m", "lightning_dfl", "fit", "--config", config, "--trainer.default_root_dir",
           str(root), "--trainer.enable_progress_bar", "false", *options]
    tic = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as stopped:
        keep_log(name, " ".join(cmd) + "\n" + _text(stopped.stdout) + _text(stopped.stderr))
        return {"name": name, "ok": False, "wall_s": time.perf_counter() - tic,
                "error": f"stopped after {timeout:.0f} s (its share of --budget-s)"}
    wall = time.perf_counter() - tic
    keep_log(name, " ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != (130 if interrupted else 0):
        return {"name": name, "ok": False, "wall_s": wall, "error": (proc.stderr or proc.stdout)[-1500:]}
    run = max(root.glob("*/version_*"), key=lambda p: p.stat().st_mtime)
    if interrupted:
        return {"name": name, "ok": True, "wall_s": wall, "run": str(run)}
    with (run / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("time/wall_round_s")]
    summary = json.loads((run / "summary.json").read_text())
    return {"name": name, "ok": True, "wall_s": wall, "run": str(run),
            "round_s": [float(r["time/wall_round_s"]) for r in rows], "summary": summary,
            "metrics": rows, "log": proc.stdout + proc.stderr}


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def logged(result: dict, prefix: str) -> str:
    """The first line of the run's output that starts with ``prefix`` (empty when none, or the run failed)."""
    return next((line.strip() for line in result.get("log", "").splitlines() if line.startswith(prefix)), "")


def per_round(result: dict) -> float:
    """Median wall time of the rounds after the first (the first one's when there is one)."""
    times = result.get("round_s") or [math.nan]
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def accuracies(result: dict) -> list[str]:
    """The logged mean personal accuracy of each round, as written (exact comparison)."""
    return [r.get("acc/personal_mean") for r in result["metrics"]]


def repeatability(first: dict, second: dict) -> str:
    """Whether two runs of one setting logged the same accuracies."""
    if not (first["ok"] and second["ok"]):
        return ""
    return ("equals the first run" if accuracies(first) == accuracies(second) else
            "DIFFERS from the first run: ordinary GPU runs are not bit-repeatable here")


def graphs_equal(graphed: dict, *ordinary: dict) -> str:
    """Whether the graphed run logged the accuracies of an ordinary run (of either, when those differ)."""
    if not graphed["ok"] or not all(run["ok"] for run in ordinary):
        return ""
    runs = [accuracies(run) for run in ordinary]
    if any(accuracies(graphed) == run for run in runs):
        return "accuracies equal an ordinary run's"
    if all(run == runs[0] for run in runs):
        return "accuracies DIFFER from the ordinary runs' (which agree)"
    return "accuracies differ from both ordinary runs, which differ between themselves (not repeatable)"


def row(result: dict, note: str = "") -> str:
    if not result["ok"]:
        return f"| {result['name']} | FAILED | | | {result['error'].strip().splitlines()[-1][:160]} |"
    accuracy = result["summary"].get("final_accuracy", math.nan)
    return (f"| {result['name']} | {per_round(result):.2f} | {result['wall_s']:.1f} | {100 * accuracy:.2f} | "
            f"{note} |")


NOT_RUN = "(not run: not among --checks, or the time budget ran out)"


def script_table(report: Report, script: str, options: list[str], marker: str, most_s: float) -> str:
    """Run ``benchmarks/<script>`` with ``options`` for at most ``most_s`` seconds (and what is left of the budget,
    at least 60); its output from the line that starts with ``marker`` (the end of its errors if it failed)."""
    try:
        proc = subprocess.run([sys.executable, str(HERE / script), *options], capture_output=True, text=True,
                              cwd=REPO, timeout=max(60, min(most_s, report.deadline - time.monotonic())))
    except subprocess.TimeoutExpired as stopped:
        keep_log(script, _text(stopped.stdout) + _text(stopped.stderr))
        return f"({script} ran past the time budget)"
    keep_log(script, proc.stdout + proc.stderr)
    table = proc.stdout[proc.stdout.find(marker):] if proc.returncode == 0 else proc.stderr[-1500:]
    print(table, flush=True)
    return table


CHECKS = ("main", "steps", "graphs", "resnet18", "resnet18-batched", "phases", "loop", "batched", "precision", "store", "resume", "resnet18-bf16")


class Report:
    """The table, printed and written row by row (a run cut short by its time limit keeps its rows)."""

    def __init__(self, path: Path, header: list[str], deadline: float) -> None:
        self.path, self.lines, self.deadline = path, list(header), deadline
        self.path.parent.mkdir(exist_ok=True)
        self._flush()

    def add(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
        self.lines += lines
        self._flush()

    def time_left(self, needed: float, name: str) -> bool:
        """Whether ``needed`` seconds remain before the deadline; else record ``name`` as skipped."""
        if time.monotonic() + needed <= self.deadline:
            return True
        self.add(f"| {name} | skipped: the time budget (--budget-s) ran out | | | |")
        return False

    def _flush(self) -> None:
        self.path.write_text("\n".join(self.lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="unpacked cifar10-jpg folder")
    parser.add_argument("--archive", help="cifar10-jpg.tar.xz, unpacked to a temporary folder")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test of the script itself)")
    parser.add_argument("--budget-s", type=float, default=480,
                        help="skip the remaining checks (most important first) once this many seconds are spent")
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS),
                        help="run only these checks (default: all, in this order)")
    parser.add_argument("--out", help="the table's file (default benchmarks/results/gpu_check.md)")
    parser.add_argument("--logs", help="keep each run's whole output in this folder (<run>.log)")
    args = parser.parse_args()
    global LOGS
    LOGS = Path(args.logs) if args.logs else None
    begin = time.monotonic()
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    out = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    root = args.root
    if root is None and args.archive:
        with tarfile.open(args.archive) as tar:
            tar.extractall(out / "data", filter="data")
        root = str(out / "data" / "cifar10-jpg")
    device_name = "cpu"
    if args.device == "cuda":
        import torch
        device_name = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    date = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"
    target = Path(args.out) if args.out else RESULTS / ("gpu_check.md" if args.device == "cuda"
                                                         else "gpu_check_cpu_smoke.md")
    report = Report(target, [
        "# GPU check", "", f"- date: {date}; device: {device_name}; command: `{' '.join(sys.argv)}`", "",
        "| run | s/round (median after the first) | process wall s | final accuracy % | note |",
        "|---|---|---|---|---|"], deadline=begin + args.budget_s)
    quick = ["--trainer.rounds", "2"] if args.quick else []

    if "main" in args.checks:
        report.add(row(fit(out, "main job (dispfl_digits.yaml)", "configs/dispfl_digits.yaml", "--trainer.accelerator",
                           accelerator, *quick)))
    # 0. a ResNet18 step, serial against the batched executor's (per client step): random batches, no data needed
    steps = NOT_RUN
    if "steps" in args.checks and report.time_left(60, "step_time.py"):
        steps = script_table(report, "step_time.py", [
            "--device", args.device, "--settings", "nchw-fp32", "cl-fp32", "cl-fp32-heuristics", "nchw-fp32-graphed",
            "cl-fp32-graphed", "cl-fp32-heuristics-graphed", "cl-bf16-graphed", "--batched",
            *(["2", "--steps", "2", "--warmup", "1", "--batch", "16"] if args.quick else
              ["8", "32", "--steps", "10", "--warmup", "3"])], "| setting", 180)
    if root is None:
        report.add("", "(no CIFAR-10 given: --root or --archive)", "", "## A ResNet18 step (step_time.py)", "", steps)
        return
    config = "configs/dispfl_cifar10_dir.yaml"
    cifar = ["--data.dataset", "image_folder", "--data.root", root, "--trainer.accelerator", accelerator,
             "--model.arch", "cnn_cifar", "--trainer.local_epochs", "1", "--trainer.diagnostics", "false"]
    size = ["--data.max_train_samples", "2000" if args.quick else "10000"]
    rounds = ["--trainer.rounds", "2" if args.quick else "3"]
    k10 = [*cifar, *size, *rounds, "--data.num_clients", "10", "--trainer.algorithm.num_neighbors", "3"]
    k100 = [*cifar, *size, *rounds, "--data.num_clients", "20" if args.quick else "100",
            "--trainer.algorithm.num_neighbors", "4" if args.quick else "10"]
    # 1. the papers' ResNet18 round as configured (fp32, TF32 matrix products); bf16-mixed comes last
    papers = ["--data.dataset", "image_folder", "--data.root", root]  # the config's own store: dense
    if args.quick:
        papers += ["--data.num_clients", "4", "--trainer.algorithm.num_neighbors", "2",
                   "--data.max_train_samples", "400", "--trainer.local_epochs", "1"]
    resnet_setting = [*papers, "--trainer.store", "compact"]  # as the earlier GPU figures were measured
    resnet = [*resnet_setting, "--trainer.accelerator", accelerator, "--trainer.rounds", "2" if args.quick else "1"]
    resnet_name = "ResNet18, 4 clients, E=1" if args.quick else "ResNet18, 100 clients, E=5, one round"
    # 0a. CUDA graphs: the same results as ordinary steps (on a CUDA GPU only), then the papers' round with them
    if "graphs" in args.checks and report.time_left(60, "K=10 with / without cuda_graphs"):
        # the ordinary run twice: a GPU run is not always bit-repeatable (on an H200 on 2026-11-28 two ordinary runs
        # differed from round 2 on), so the graphed run is compared with both
        plain = fit(out, "K=10, ordinary steps", config, *k10, timeout=120)
        again = fit(out, "K=10, ordinary steps, again", config, *k10, timeout=120)
        graphed = fit(out, "K=10, cuda_graphs", config, *k10, "--trainer.cuda_graphs", "true", timeout=120)
        speed = f"{per_round(plain) / per_round(graphed):.2f} x ordinary; " if plain["ok"] and graphed["ok"] else ""
        report.add(row(plain), row(again, repeatability(plain, again)),
                   row(graphed, speed + graphs_equal(graphed, plain, again) + "; " + logged(graphed, "CUDA graphs:")))
        # two rounds: the first warms every shape up (two ordinary steps each, then a capture), the second is what
        # later rounds cost (replays only). The config's dense store: a task reads nothing from the device
        two = ("ResNet18, 4 clients, E=1, 2 rounds" if args.quick else "ResNet18, 100 clients, E=5, 2 rounds") + \
            ", dense store"
        if report.time_left(90, two + ", cuda_graphs"):
            resnet_graphed = fit(out, two + ", cuda_graphs", config, *papers, "--trainer.accelerator",
                                 accelerator, "--trainer.rounds", "2", "--trainer.cuda_graphs", "true",
                                 timeout=max(60, min(200, report.deadline - time.monotonic())))  # leaves the rest time
            first = f"first round {resnet_graphed['round_s'][0]:.1f} s; " if resnet_graphed.get("round_s") else ""
            report.add(row(resnet_graphed, first + logged(resnet_graphed, "CUDA graphs:")))
    if "resnet18" in args.checks and report.time_left(60, resnet_name):
        report.add(row(fit(out, resnet_name, config, *resnet, timeout=max(60, min(300, report.deadline - time.monotonic())))))
    # 1a. the same round with batched clients (groups sized from the GPU's free memory; the log names the size)
    if "resnet18-batched" in args.checks and report.time_left(60, resnet_name + ", batched_clients"):
        grouped = fit(out, resnet_name + ", batched_clients", config, *resnet, "--trainer.batched_clients", "true",
                      timeout=max(60, min(300, report.deadline - time.monotonic())))
        report.add(row(grouped, logged(grouped, "Batched clients:")))
    # 1b. where the ResNet18 round's time goes: round_phases.py, 2 rounds (the second warm)
    phases = NOT_RUN
    if "phases" in args.checks and report.time_left(150, "ResNet18 round phases"):
        phases = script_table(report, "round_phases.py", ["--config", config, "--device", args.device, "--rounds",
                                                          "2", "--", *resnet_setting], "| round", 360)
    # 2. against the independent loop
    table = NOT_RUN
    if "loop" in args.checks and report.time_left(120, "round_time.py"):
        table = script_table(report, "round_time.py", [
            "--root", root, "--device", args.device, "--settings", *(["k10"] if args.quick else ["k10", "k100"]),
            "--rounds", "2" if args.quick else "3", "--max-train-samples", "2000" if args.quick else "10000",
            "--out", str(out / "round_time")], "| K, M", math.inf)  # its table goes into this report
    # 3-4. batched clients, precision
    many = "K=20" if args.quick else "K=100"
    if "batched" in args.checks and report.time_left(90, f"{many} E=5 serial / batched_clients"):
        # E = 5 (the papers'): at E = 1 a client of 100 images takes one step, and the messages, aggregation and
        # evaluations that batching leaves serial are most of the round
        epochs = ["--trainer.local_epochs", "5"]
        serial = fit(out, f"{many} E=5 serial", config, *k100, *epochs)
        batched = fit(out, f"{many} E=5 batched_clients", config, *k100, *epochs, "--trainer.batched_clients", "true")
        speedup = per_round(serial) / per_round(batched) if serial["ok"] and batched["ok"] else math.nan
        report.add(row(serial), row(batched, f"{speedup:.2f} x serial; {logged(batched, 'Batched clients:')}"))
    if "precision" in args.checks and report.time_left(40, "K=10 32-true / bf16-mixed"):
        fp32 = fit(out, "K=10 32-true", config, *k10)
        bf16 = fit(out, "K=10 bf16-mixed", config, *k10, "--trainer.precision", "bf16-mixed")
        report.add(row(fp32), row(bf16, f"{per_round(fp32) / per_round(bf16):.2f} x fp32"
                                  if bf16["ok"] and fp32["ok"] else ""))
    # 5. where the store lives
    for store in ("dense", "compact"):
        for where in ("worker",):
            name = f"K=10 store {store} on {where}"
            if "store" in args.checks and report.time_left(20, name):
                report.add(row(fit(out, name, config, *k10, "--trainer.store", store, "--trainer.store_device",
                                   where)))
    # 6. resume: 3 rounds straight (twice: is the device repeatable?), then the same run interrupted after
    #    round 2 (benchmarks/interrupt.py: SIGINT, as a user's Ctrl-C) and resumed from its checkpoint
    if "resume" in args.checks and report.time_left(60, "resume"):
        full = fit(out, "resume: 3 rounds straight", config, *k10, "--trainer.checkpoint_every", "1")
        again = fit(out, "resume: 3 rounds straight, again", config, *k10, "--trainer.checkpoint_every", "1")
        first = fit(out, "resume: interrupted after round 2", config, *k10, "--trainer.checkpoint_every", "1",
                    "--trainer.callbacks+=" + json.dumps({"class_path": "benchmarks.interrupt.InterruptAfterRound",
                                                          "init_args": {"round": 2}}), interrupted=True)
        if full["ok"] and again["ok"]:
            repeatable = accuracies(full) == accuracies(again)
            report.add(row(again, "equals the first straight run" if repeatable else
                           "DIFFERS from the first straight run: the GPU run is not bit-for-bit repeatable"))
        if first["ok"]:
            resumed = fit(out, "resume: round 3 from the checkpoint", config, *k10, "--trainer.checkpoint_every",
                          "1", "--ckpt_path", str(Path(first["run"]) / "checkpoints" / "last.ckpt"))
            note = ""
            if resumed["ok"] and full["ok"]:
                same = accuracies(resumed)[-1:] == accuracies(full)[-1:]
                note = ("round 3 equals the straight run's" if same else "round 3 DIFFERS from the straight run's")
            report.add(row(resumed, note))
        else:
            report.add(row(first))
    # 7. the ResNet18 round in bf16-mixed
    if "resnet18-bf16" in args.checks and report.time_left(90, resnet_name + ", bf16-mixed"):
        report.add(row(fit(out, resnet_name + ", bf16-mixed", config, *resnet, "--trainer.precision", "bf16-mixed",
                           timeout=max(60, min(300, report.deadline - time.monotonic())))))
    report.add("", "## A ResNet18 step, serial and batched (step_time.py)", "", steps)
    report.add("", "## Our round against the independent hand loop", "", table)
    report.add("", "## The ResNet18 round's phases (round_phases.py)", "", phases)
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
