"""PSFL vs FedAvg vs SFL on MNIST: simulated time to a target accuracy, the (S, W) sweep, the samplers.

Issue 12's evidence (PSFL Sec. VI: Figs. 5-7, Table I), scaled to a CPU. N = 500 clients on MNIST,
ExDir(2, 10) (psfl-notes 16), discrete client times {0.5, 1, 2, 4, 5} with 20% per-round noise
(notes 15), N0 = 20 clients per round, the paper's CIFAR CNN (``cnn_cifar``, 1x28x28 input),
5 local SGD steps of batch 20 per client (momentum 0, weight decay 1e-4, notes 9) and one constant
lr shared by every method (notes 10). The headline is the global model's accuracy on the official
MNIST test split (notes 17); the time to target is the cumulative simulated time at the first
evaluation at or above ``--target`` (PSFL: its warm-up included).

1. **Time to target**: PSFL (W solved after a ``--warmup-rounds`` warm-up, time-based sampler),
   FedAvg (W = N0 = 20, S = 1, uniform) and SFL (W = 1, S = 20, uniform), same seed, each with a
   round budget; a run stops at its first evaluation at or above the target.
2. **(S, W) sweep** (Fig. 7 / Table I): PSFL's pipeline (the same warm-up, time estimates and
   time-based sampler, restart from x^0) with W forced to each of ``--sweep`` (S = N0 // W), next
   to the W* the solver chose (under both kappa^2 estimators). W = 20 is the FedAvg run (with S = 1
   the time-based sampler is the uniform one) and W = 1 the SFL run, unless the solver chose them.
3. **Samplers** (Fig. 6): mean simulated round time of the time-based, uniform and weighted
   samplers for every swept structure, from ``--sampler-rounds`` rounds planned by ``PSFL`` itself
   on the same clock, after the same warm-up observations (no training: the round time does not
   depend on the weights). Reported, not asserted (notes 14). ``--sampler-runs uniform,weighted``
   adds trained runs of the solved structure with those samplers.

The warm-up (every client's full gradient, 5 rounds) is the costly part on a CPU, so it runs once
and is saved as a checkpoint; every PSFL-pipeline run resumes from it (the library resumes bit for
bit; the algorithm's repr, which names the sampler, may differ: ``resume_allow=["algorithm"]``).
The results go to ``<out>/compare_psfl.{json,md}`` and two plots, ``compare_psfl_time.png`` and
``compare_psfl_sweep.png``.

    python benchmarks/compare_psfl.py                    # ~15 min on 2 shared CPU cores
    python benchmarks/compare_psfl.py --train-samples 0  # all 60,000 training images (warm-up ~3x longer)

``--dataset image_folder --root <folder>/cifar10-jpg`` runs the paper's own CIFAR-10 setting on the JPEG
copy (3x32x32); ``--name`` sets the output files' stem (e.g. ``compare_psfl_cifar10``) so the MNIST
results stay, and ``--thresholds`` adds the time to several accuracies read from the curves
(benchmarks/README.md gives the CIFAR-10 command).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import Clock, FederatedTrainer, RoundContext
from lightning_dfl.federation.algorithms import PSFL
from lightning_dfl.module import SparseClassifier
from lightning_dfl.seeding import derive_seed

SAMPLER_NAMES = ("time", "uniform", "weighted")
LABELS = {"psfl": "PSFL", "fedavg": "FedAvg", "sfl": "SFL"}


# --------------------------------------------------------------------------- pieces

class TargetReached(Exception):
    """Raised by :class:`StopAtTarget` to end a run early (the benchmark's own, harmless)."""


class StopAtTarget(FederatedCallback):
    """Ends a run ``after`` evaluations past the first one at or above ``target``, or once its
    simulated time reaches ``time_budget``.

    The trainer has no early stop: at the start of the next round this raises
    :class:`TargetReached`, which :func:`run_one` catches; ``trainer.history`` then holds every
    finished round."""

    def __init__(self, target: float, after: int = 0, time_budget: float = math.inf) -> None:
        self.target, self.after, self.time_budget = target, after, time_budget

    def on_federated_round_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.history:
            return
        evals = [m["acc/global"] for m in trainer.history if "acc/global" in m]
        hit = next((i for i, a in enumerate(evals) if a >= self.target), None)
        out_of_time = trainer.history[-1]["time/elapsed"] >= self.time_budget
        if (hit is not None and len(evals) - 1 - hit >= self.after) or out_of_time:
            raise TargetReached


class ForcedWidthPSFL(PSFL):
    """PSFL's pipeline (warm-up estimates, W* solved and logged, time estimates, sampler, restart
    from x^0) with the structure forced to ``W = width``, ``S = N0 // width`` after the warm-up:
    the sweep's runs. Benchmark-only; it overrides PSFL's private ``_solve_structure``."""

    def __init__(self, width: int, **kwargs: Any) -> None:
        super().__init__(sequences=None, **kwargs)
        if not 1 <= width <= self.clients_per_round:
            raise ValueError(f"width must be in [1, {self.clients_per_round}], got {width}")
        self.width = width

    def _solve_structure(self) -> None:
        super()._solve_structure()
        self._structure = (self.width, self.clients_per_round // self.width)


def make_clock() -> Clock:
    return Clock(distribution="discrete", noise=0.2)


def build_datamodule(args: argparse.Namespace) -> FederatedDataModule:
    return FederatedDataModule(
        dataset=args.dataset, root=args.root, num_clients=args.clients, partition="exdir", classes_per_client=2,
        alpha=10.0, min_size=10, batch_size=args.batch_size, test_samples_per_client=args.test_samples,
        augment=False, seed=args.seed, max_train_samples=args.train_samples or None,
    )


def build_model(args: argparse.Namespace) -> SparseClassifier:
    return SparseClassifier(args.arch, density=1.0, lr=args.lr, lr_decay=1.0, momentum=0.0,
                            weight_decay=1e-4, seed=args.seed)


def psfl_kwargs(args: argparse.Namespace, sampler: str) -> dict[str, Any]:
    return dict(clients_per_round=args.n0, sampler=sampler, warmup_rounds=args.warmup_rounds,
                kappa2_estimator=args.kappa2_estimator, target_accuracy=args.target)


def trainer_for(algorithm: PSFL, args: argparse.Namespace, rounds: int, eval_every: int, root: str,
                callbacks: list | None = None, checkpoint_every: int = 0, resuming: bool = False) -> FederatedTrainer:
    """``resuming``: the run resumes from the warm-up's checkpoint (``resume_allow=["algorithm"]``; the trainer
    refuses ``resume_allow`` on a fresh start)."""
    return FederatedTrainer(
        algorithm, rounds=rounds, local_steps=args.local_steps, eval_every=eval_every, clock=make_clock(),
        accelerator="cpu", logger=False, default_root_dir=root, seed=args.seed, enable_progress_bar=False,
        cpu_threads=args.threads, callbacks=callbacks, checkpoint_every=checkpoint_every,
        resume_allow=["algorithm"] if resuming else (),
    )


# --------------------------------------------------------------------------- runs

def run_warmup(args: argparse.Namespace, datamodule: FederatedDataModule, root: str) -> tuple[Path, float]:
    """The warm-up rounds once, checkpointed after the last; returns the checkpoint and the wall time."""
    start = time.perf_counter()
    trainer = trainer_for(PSFL(**psfl_kwargs(args, "time")), args, rounds=args.warmup_rounds,
                          eval_every=args.warmup_rounds, root=root, checkpoint_every=args.warmup_rounds)
    trainer.fit(build_model(args), datamodule)
    return trainer.checkpoint_path, time.perf_counter() - start


def summarize(history: list[dict[str, float]], target: float, warmup_rounds: int) -> dict[str, Any]:
    """Time and rounds to target, the last and best accuracy, the mean training round time."""
    evals = [(i, m) for i, m in enumerate(history) if "acc/global" in m and i >= warmup_rounds]
    hit = next(((i, m) for i, m in evals if m["acc/global"] >= target), None)
    train_durations = [m["time/duration"] for m in history[warmup_rounds:]]
    last = history[-1]
    warm = last.get("time/warmup", 0.0) if warmup_rounds else 0.0
    out = {
        "reached": hit is not None,
        "time_to_target": hit[1]["time/elapsed"] if hit else None,
        "train_time_to_target": hit[1]["time/elapsed"] - warm if hit else None,
        "rounds_to_target": hit[0] + 1 - warmup_rounds if hit else None,
        "rounds_run": len(history) - warmup_rounds,
        "elapsed": last["time/elapsed"],
        "warmup_time": warm,
        "final_accuracy": evals[-1][1]["acc/global"] if evals else None,
        "best_accuracy": max(m["acc/global"] for _, m in evals) if evals else None,
        "mean_round_time": float(np.mean(train_durations)) if train_durations else None,
        "W": last.get("psfl/W"), "S": last.get("psfl/S"),
    }
    for key in ("w_star_mean", "w_star_max", "sigma2", "sigma2_minibatch", "B", "t_mean", "kappa2_mean", "kappa2_max"):
        if f"psfl/{key}" in last:
            out[key] = last[f"psfl/{key}"]
    return out


def run_one(label: str, algorithm: PSFL, args: argparse.Namespace, datamodule: FederatedDataModule,
            rounds: int, eval_every: int, root: str, ckpt: Path | None = None) -> dict[str, Any]:
    """One run (resumed from the warm-up checkpoint ``ckpt`` for PSFL's pipeline) until the target
    or ``rounds`` training rounds."""
    warm = args.warmup_rounds if ckpt is not None else 0
    trainer = trainer_for(algorithm, args, rounds=warm + rounds, eval_every=eval_every, root=root,
                          callbacks=[StopAtTarget(args.target, args.after_target, args.time_budget)],
                          resuming=ckpt is not None)
    start = time.perf_counter()
    try:
        trainer.fit(build_model(args), datamodule, ckpt_path=str(ckpt) if ckpt is not None else None)
    except TargetReached:
        pass
    wall = time.perf_counter() - start
    history = [{k: float(v) for k, v in m.items()} for m in trainer.history]
    record = {"label": label, "algorithm": repr(algorithm), "eval_every": eval_every, "round_budget": rounds, "warmup_rounds": warm,
              "wall_time_s": wall, **summarize(history, args.target, warm), "history": history}
    tt = record["time_to_target"]
    missed = (f"target not reached in {record['rounds_run']} rounds (time {record['elapsed']:.1f}, "
              f"best {record['best_accuracy']:.4f})")
    print(f"  {label}: " + (f"target {args.target:.2f} at time {tt:.1f} (round {record['rounds_to_target']})"
                            if tt is not None else missed)
          + f", W = {record['W']:.0f}, S = {record['S']:.0f}, {wall:.0f} s wall", flush=True)
    return record


def simulate_samplers(args: argparse.Namespace, structures: list[tuple[int, int]], rounds: int) -> dict[str, Any]:
    """Mean simulated round time per sampler and structure: ``PSFL.plan_round`` on the run's clock, after
    the same warm-up observations (every client, ``warmup_rounds`` rounds), the structure set through
    ``load_state_dict``; a round lasts as long as its slowest sequence (Eq. 4, ``Clock.round_metrics``)."""
    n = args.clients
    clock = make_clock()
    clock.setup(n, PSFL.num_servers, args.seed)
    total = args.warmup_rounds + rounds
    times = [clock.compute_times(r) for r in range(total)]
    counts = (1,) * n

    def ctx(r: int) -> RoundContext:
        return RoundContext(r, total, n, counts, np.random.default_rng(derive_seed(args.seed, "plan", r)),
                            times[r][:n])

    out: dict[str, Any] = {"rounds": rounds, "structures": {}}
    for width, length in structures:
        row = {}
        for sampler in SAMPLER_NAMES:
            alg = PSFL(**psfl_kwargs(args, sampler))
            for r in range(args.warmup_rounds):
                alg.plan_round(ctx(r))
                alg.round_metrics({})  # PSFL records a round's observed times once the round ran
            state = alg.state_dict()
            state["structure"] = [width, length]
            alg.load_state_dict(state)
            durations = []
            for r in range(args.warmup_rounds, total):
                durations.append(clock.round_metrics(alg.plan_round(ctx(r)), times[r])["duration"])
                alg.round_metrics({})
            row[sampler] = {"mean": float(np.mean(durations)), "std": float(np.std(durations))}
        out["structures"][f"{width}x{length}"] = {"W": width, "S": length, **row}
    out["base_times"] = {str(v): int(sum(1 for t in clock.base_times if t == v)) for v in sorted(set(clock.base_times))}
    return out


# --------------------------------------------------------------------------- report

def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _time_cell(rec: dict[str, Any]) -> str:
    if rec["reached"]:
        return _num(rec["time_to_target"])
    return f"not reached (> {rec['elapsed']:.1f})"


def _data_name(cfg: dict[str, Any]) -> str:
    """The data set's name in the report: MNIST, or the image folder's name (``cifar10-jpg``: CIFAR-10)."""
    if cfg.get("dataset", "mnist") == "mnist":
        return "MNIST"
    return {"cifar10-jpg": "CIFAR-10"}.get(Path(cfg.get("root", "")).name, Path(cfg.get("root", "")).name)


def time_to(rec: dict[str, Any], accuracy: float) -> float | None:
    """Simulated time at a run's first evaluation at or above ``accuracy`` (warm-up evaluations excluded)."""
    warm = rec.get("warmup_rounds", 0)
    return next((m["time/elapsed"] for i, m in enumerate(rec["history"])
                 if i >= warm and m.get("acc/global", -1.0) >= accuracy), None)


def late_mean(rec: dict[str, Any], start: float) -> float | None:
    """Mean accuracy (%) of a run's evaluations at simulated time >= ``start`` (warm-up excluded)."""
    warm = rec.get("warmup_rounds", 0)
    accs = [m["acc/global"] for i, m in enumerate(rec["history"])
            if i >= warm and "acc/global" in m and m["time/elapsed"] >= start]
    return 100 * float(np.mean(accs)) if accs else None


def render_markdown(data: dict[str, Any]) -> str:
    cfg, runs = data["config"], data["runs"]
    psfl = runs["psfl"]
    name = _data_name(cfg)
    shape = "1x28x28" if name == "MNIST" else "3x32x32"
    lines = [
        f"# PSFL vs FedAvg vs SFL on {name}",
        "",
        f"Generated by `benchmarks/compare_psfl.py` (seed {cfg['seed']}"
        + (f"; `{cfg['command']}`" if cfg.get("command") else "") + (f", {cfg['date']}" if cfg.get("date") else "")
        + f"). N = {cfg['clients']} clients, ExDir(2, 10), "
        f"N0 = {cfg['n0']}, discrete client times {{0.5, 1, 2, 4, 5}} with 20% per-round noise, `{cfg['arch']}` "
        f"({shape}), {cfg['local_steps']} local SGD steps of batch {cfg['batch_size']}, lr {cfg['lr']} (constant, "
        f"shared), momentum 0, weight decay 1e-4, "
        + (f"a stratified {cfg['train_samples']}-image subset of {name}'s training split"
           if cfg["train_samples"] else f"all of {name}'s training images")
        + f", accuracy of the global model on the official {'10,000-image ' if name in ('MNIST', 'CIFAR-10') else ''}"
        f"test split; target {cfg['target']:.2f}. "
        f"PSFL: {cfg['warmup_rounds']}-round warm-up, kappa^2 estimator `{cfg['kappa2_estimator']}`, c0 = 0.1. "
        f"Machine: {cfg['machine']}.",
        "",
        "## 1. Time to target",
        "",
        "| method | (S, W) | sampler | time to target (incl. warm-up) | of which warm-up | rounds to target | "
        "mean round time | best acc % | rounds run | eval every | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in ("psfl", "fedavg", "sfl"):
        rec = runs[key]
        sampler = "time" if key == "psfl" else "uniform"
        lines.append(
            f"| {LABELS[key]} | ({rec['S']:.0f}, {rec['W']:.0f}) | {sampler} | {_time_cell(rec)} | "
            f"{_num(rec['warmup_time']) if key == 'psfl' else '-'} | "
            f"{_num(rec['rounds_to_target'], 'd') if rec['reached'] else '-'} | "
            f"{_num(rec['mean_round_time'], '.2f')} | {_num(100 * rec['best_accuracy'], '.2f')} | "
            f"{rec['rounds_run']} | "
            f"{rec['eval_every']} | {rec['wall_time_s']:.0f} |")
    base = [runs[k]["time_to_target"] for k in ("fedavg", "sfl") if runs[k]["reached"]]
    if psfl["reached"] and base:
        rel = ", ".join(f"{LABELS[k]} {100 * (psfl['time_to_target'] / runs[k]['time_to_target'] - 1):+.0f}%"
                        for k in ("fedavg", "sfl") if runs[k]["reached"])
        lines += ["", f"PSFL's time to target relative to the baselines: {rel} (negative: PSFL is faster)."]
    thresholds = cfg.get("threshold_list") or []
    half = cfg["time_budget"] / 2
    if thresholds:
        keys = ["psfl", "fedavg", "sfl"] + [r["run"] for r in data.get("sweep", []) if r["run"] not in LABELS]
        lines += ["", "Simulated time to each accuracy, read from the recorded curves (first evaluation at or above it; "
                      "PSFL's pipeline includes its warm-up; '-': not reached within the run):", "",
                  "| run | (S, W) | " + " | ".join(f"{100 * t:.0f}%" for t in thresholds)
                  + f" | best acc % | mean acc % over t >= {half:.0f} | time run |",
                  "|---|---|" + "---|" * len(thresholds) + "---|---|---|"]
        for key in keys:
            rec = runs[key]
            name = LABELS.get(key, rec["label"]) + (" (solved W*)" if key == "psfl" else "")
            cells = [_num(time_to(rec, t)) for t in thresholds]
            lines.append(f"| {name} | ({rec['S']:.0f}, {rec['W']:.0f}) | " + " | ".join(cells)
                         + f" | {_num(100 * rec['best_accuracy'], '.2f')} | {_num(late_mean(rec, half), '.2f')} | "
                         f"{rec['elapsed']:.1f} |")
        lines += ["", f"Mean acc over t >= {half:.0f}: the mean of a run's evaluations in the second half of the time "
                      "budget, less sensitive to the curves' swings between evaluations than a first crossing."]
    lines += [
        "",
        f"Solver (after the warm-up): sigma^2 = {_num(psfl.get('sigma2'), '.4g')} (per sample, Eq. 24; per training "
        f"mini-batch it would be {_num(psfl.get('sigma2_minibatch'), '.4g')}), B = {_num(psfl.get('B'), '.4g')}, "
        f"tbar = {_num(psfl.get('t_mean'), '.4g')}, kappa^2 = {_num(psfl.get('kappa2_mean'), '.4g')} (mean, Eq. 26) / "
        f"{_num(psfl.get('kappa2_max'), '.4g')} (max); W* = {_num(psfl.get('w_star_mean'), '.3f')} (mean) / "
        f"{_num(psfl.get('w_star_max'), '.3f')} (max); chosen (S, W) = ({psfl['S']:.0f}, {psfl['W']:.0f}). "
        f"Warm-up: {_num((data.get('warmup') or {}).get('wall_time_s'), '.0f')} s wall.",
        "",
        "## 2. (S, W) sweep",
        "",
        "PSFL's pipeline (same warm-up, time estimates, time-based sampler) with W forced; W = 20 is the FedAvg run "
        "and W = 1 the SFL run (no warm-up, uniform sampler) unless marked as PSFL's own choice.",
        "",
        "| W | S | run | time to target | training time to target (excl. warm-up) | rounds to target | "
        "mean round time | best acc % | rounds run | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["sweep"]:
        rec = runs[row["run"]]
        mark = " (solver's choice)" if row["run"] == "psfl" else ""
        lines.append(
            f"| {row['W']} | {row['S']} | {rec['label']}{mark} | {_time_cell(rec)} | "
            f"{_num(rec['train_time_to_target'])} | {_num(rec['rounds_to_target'], 'd') if rec['reached'] else '-'} | "
            f"{_num(rec['mean_round_time'], '.2f')} | {_num(100 * rec['best_accuracy'], '.2f')} | "
            f"{rec['rounds_run']} | {rec['wall_time_s']:.0f} |")
    reached = [r for r in data["sweep"] if runs[r["run"]]["reached"]]
    if reached:
        best = min(reached, key=lambda r: runs[r["run"]]["time_to_target"])
        best_train = min(reached, key=lambda r: runs[r["run"]]["train_time_to_target"])
        lines += ["", f"Best swept structure: (S, W) = ({best['S']}, {best['W']}) by time to target as run, "
                      f"({best_train['S']}, {best_train['W']}) by training time (warm-up excluded); "
                      f"the solver chose ({psfl['S']:.0f}, {psfl['W']:.0f}) from "
                      f"W* = {_num(psfl.get('w_star_mean'), '.3f')} "
                      f"(kappa^2 max: W* = {_num(psfl.get('w_star_max'), '.3f')})."]
    sim = data["samplers"]
    lines += [
        "",
        f"## 3. Samplers: mean simulated round time ({sim['rounds']} planned rounds after the warm-up, no training"
        + (f"; redone {sim['redone']} with `--samplers-only`" if sim.get("redone") else "") + ")",
        "",
        "| (S, W) | time-based | uniform | weighted | time-based vs uniform | time-based vs weighted |",
        "|---|---|---|---|---|---|",
    ]
    for row in sim["structures"].values():
        t, u, w = (row[s]["mean"] for s in SAMPLER_NAMES)
        lines.append(f"| ({row['S']}, {row['W']}) | {t:.2f} | {u:.2f} | {w:.2f} | {100 * (t / u - 1):+.1f}% | "
                     f"{100 * (t / w - 1):+.1f}% |")
    lines += ["", "Base times drawn (clients per value): "
              + ", ".join(f"{k}: {v}" for k, v in sim["base_times"].items()) + "."]
    extra = [k for k in runs if k.startswith("sampler_")]
    if extra:
        lines += ["", "Trained runs of the solved structure with other samplers:", "",
                  "| sampler | time to target | mean round time | best acc % | rounds run | wall s |",
                  "|---|---|---|---|---|---|",
                  f"| time (PSFL) | {_time_cell(psfl)} | {_num(psfl['mean_round_time'], '.2f')} | "
                  f"{_num(100 * psfl['best_accuracy'], '.2f')} | {psfl['rounds_run']} | {psfl['wall_time_s']:.0f} |"]
        for k in extra:
            rec = runs[k]
            lines.append(f"| {k.removeprefix('sampler_')} | {_time_cell(rec)} | "
                         f"{_num(rec['mean_round_time'], '.2f')} | {_num(100 * rec['best_accuracy'], '.2f')} | "
                         f"{rec['rounds_run']} | {rec['wall_time_s']:.0f} |")
    lines += [
        "",
        "Times are the simulated clock's dimensionless units (a round lasts as long as its slowest sequence, Eq. 4; "
        "PSFL's warm-up rounds last as long as the slowest of all clients). A run stops at its first evaluation at or "
        f"above the target, after its round budget, or once its simulated time reaches {cfg['time_budget']:.0f} (an "
        "evaluation is forced at a run's last round only when it ends by its round budget); \"not reached\" gives "
        "the simulated time it ran. Mean round time: training rounds only. "
        f"Wall time: {data['compute_wall_time_s']:.0f} s for the warm-up and the trained runs; this invocation "
        f"{data['wall_time_s']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def _figure(width: float, height: float) -> Any:
    from lightning_dfl.plots import agg_figure

    return agg_figure(width, height)


def _curve(rec: dict[str, Any]) -> tuple[list[float], list[float]]:
    pts = [(m["time/elapsed"], m["acc/global"]) for m in rec["history"] if "acc/global" in m]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_results(data: dict[str, Any], out: Path) -> list[Path]:
    runs, target = data["runs"], data["config"]["target"]
    paths = []
    swept = [r for r in data.get("sweep", []) if r["run"] not in LABELS]
    fig = _figure(9.5 if swept else 7.0, 4.5)
    ax = fig.subplots()
    for key, colour in (("psfl", "C3"), ("fedavg", "C0"), ("sfl", "C2")):
        rec = runs[key]
        x, y = _curve(rec)
        ax.plot(x, y, "-o", ms=3, color=colour, label=f"{LABELS[key]} (S={rec['S']:.0f}, W={rec['W']:.0f})")
        if rec["reached"]:
            ax.axvline(rec["time_to_target"], color=colour, ls=":", lw=1)
    for i, row in enumerate(swept):
        x, y = _curve(runs[row["run"]])
        ax.plot(x, y, "-", lw=1, alpha=0.7, color=("C1", "C4", "C5", "C6", "C8", "C9")[i % 6],
                label=f"PSFL W={row['W']} forced (S={row['S']})")
    if runs["psfl"]["warmup_time"]:
        ax.axvspan(0, runs["psfl"]["warmup_time"], color="C3", alpha=0.1, label="PSFL warm-up")
    ax.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target:.2f}")
    cfg = data["config"]
    top = max([target] + [m["acc/global"] for r in runs.values() for m in r["history"] if "acc/global" in m])
    ax.set(xlabel="simulated time", ylabel="global test accuracy",
           title=f"{_data_name(cfg)}, N={cfg['clients']}, N0={cfg['n0']}, ExDir(2, 10)",
           ylim=(0, 1 if top > 0.7 else min(1.0, top + 0.1)))
    ax.grid(alpha=0.3)
    if swept:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # the layout engine makes room
    else:
        ax.legend(fontsize="small", loc="lower right")
    paths.append(out / f"{cfg.get('name', 'compare_psfl')}_time.png")
    fig.savefig(paths[-1])

    fig = _figure(12.0, 4.5)
    left, right = fig.subplots(1, 2)
    sweep = data["sweep"]
    ws = [r["W"] for r in sweep]
    for key, marker, name in (("time_to_target", "o", "incl. warm-up"), ("train_time_to_target", "s", "excl. warm-up")):
        xs = [r["W"] for r in sweep if runs[r["run"]]["reached"]]
        ys = [runs[r["run"]][key] for r in sweep if runs[r["run"]]["reached"]]
        left.plot(xs, ys, f"-{marker}", label=f"time to target ({name})")
    missed = [r["W"] for r in sweep if not runs[r["run"]]["reached"]]
    thresholds = data["config"].get("threshold_list") or []
    for i, acc in enumerate(thresholds):  # the time to each threshold reached by some swept run (incl. warm-up)
        pts = [(r["W"], time_to(runs[r["run"]], acc)) for r in sweep]
        pts = [(w, t) for w, t in pts if t is not None]
        if pts:
            left.plot(*zip(*pts), "-^", color=f"C{5 + i}", alpha=0.8, label=f"time to {100 * acc:.0f}%")
    for w in missed:
        left.axvline(w, color="grey", ls=":", lw=1)
    psfl = runs["psfl"]
    for key, colour in (("w_star_mean", "C3"), ("w_star_max", "C4")):
        if psfl.get(key) is not None:
            left.axvline(psfl[key], color=colour, ls="--", lw=1, label=f"W* ({key.removeprefix('w_star_')} kappa^2) "
                                                                        f"= {psfl[key]:.2f}")
    baselines = [str(w) for w in (1, data["config"]["n0"]) if any(r["W"] == w and r["run"] != "psfl" for r in sweep)]
    left.set(xscale="log", xlabel="W (S = N0 // W)", ylabel="simulated time to target",
             title="(S, W) sweep" + (f" (W = {', '.join(baselines)}: SFL/FedAvg, no warm-up)" if baselines else "")
             + (f"\ndotted: target {target:.2f} not reached (W = {', '.join(map(str, missed))})" if missed else ""))
    left.set_xticks(ws, [str(w) for w in ws])
    left.grid(alpha=0.3)
    left.legend(fontsize="small")
    colours = dict(zip(ws, [f"C{i}" for i in range(len(ws))]))
    for row in sweep:
        x, y = _curve(runs[row["run"]])
        right.plot(x, y, "-", color=colours[row["W"]], label=f"S={row['S']}, W={row['W']}")
    right.axhline(target, color="k", ls="--", lw=0.8)
    top = max([target] + [m["acc/global"] for r in sweep for m in runs[r["run"]]["history"] if "acc/global" in m])
    right.set(xlabel="simulated time", ylabel="global test accuracy", title="accuracy per structure",
              ylim=(0, 1 if top > 0.7 else min(1.0, top + 0.1)))
    right.grid(alpha=0.3)
    right.legend(fontsize="small", loc="lower right")
    paths.append(out / f"{cfg.get('name', 'compare_psfl')}_sweep.png")
    fig.savefig(paths[-1])
    return paths


def machine() -> str:
    return (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}, shared with another job), "
            f"no GPU, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")


# --------------------------------------------------------------------------- main

def _int_list(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=("mnist", "image_folder"), default="mnist",
                   help="mnist (torchvision layout under --root) or image_folder (--root/{train,test}/<class>/, "
                        "e.g. the CIFAR-10 JPEG copy ~/.cache/lightning-dfl/cifar10-jpg)")
    p.add_argument("--root", default=os.path.expanduser(os.environ.get("LIGHTNING_DFL_DATA", "~/.cache/lightning-dfl")),
                   help="data root (torchvision layout MNIST/raw); default: $LIGHTNING_DFL_DATA or ~/.cache/lightning-dfl; "
                        "torchvision.datasets.MNIST(ROOT, download=True) fetches the official copy where a network exists")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    p.add_argument("--name", default="compare_psfl",
                   help="stem of the output files: <out>/<name>.{md,json}, <name>_time.png, <name>_sweep.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=500, help="N")
    p.add_argument("--n0", type=int, default=20, help="N0, clients per round")
    p.add_argument("--train-samples", type=int, default=20000,
                   help="stratified MNIST training subset (0: all 60,000); sets the warm-up's cost")
    p.add_argument("--test-samples", type=int, default=10,
                   help="personal test samples per client (not the headline: that is the official test split)")
    p.add_argument("--arch", default="cnn_cifar")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--target", type=float, default=0.9, help="target accuracy of the global model")
    p.add_argument("--after-target", type=int, default=0, help="evaluations to run past the first one at target")
    p.add_argument("--warmup-rounds", type=int, default=5)
    p.add_argument("--kappa2-estimator", choices=("mean", "max"), default="mean")
    p.add_argument("--rounds-psfl", type=int, default=40, help="round budget of each PSFL-pipeline run (after warm-up)")
    p.add_argument("--rounds-fedavg", type=int, default=120, help="round budget of FedAvg")
    p.add_argument("--rounds-sfl", type=int, default=30, help="round budget of SFL")
    p.add_argument("--time-budget", type=float, default=1200.0,
                   help="stop a run that has not reached the target once its simulated time reaches this")
    p.add_argument("--eval-every-wide", type=int, default=2,
                   help="evaluate every this many rounds when W >= 10 (short rounds); else every round")
    p.add_argument("--eval-every-mid", type=int, default=1,
                   help="evaluate every this many rounds when 4 <= W < 10")
    p.add_argument("--thresholds", default="",
                   help="also report the simulated time to each of these accuracies (comma-separated), read from "
                        "the recorded curves (runs still stop at --target or --time-budget)")
    p.add_argument("--sweep", default="1,2,4,5,10,20", help="W values of the (S, W) sweep (S = N0 // W)")
    p.add_argument("--sampler-rounds", type=int, default=1000, help="planned rounds per sampler and structure")
    p.add_argument("--sampler-runs", default="", help="trained runs of the solved structure with these samplers "
                                                      "(comma-separated subset of uniform,weighted)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--reuse", action="store_true",
                   help="reuse the runs of an interrupted invocation of the same setting "
                        "(<out>/compare_psfl.partial.json)")
    p.add_argument("--samplers-only", action="store_true",
                   help="redo the samplers' section (planning only) of <out>/<name>.json with its own setting, "
                        "then the .md and the plots, without training")
    p.add_argument("--render-only", action="store_true",
                   help="redo <out>/compare_psfl.md and the plots from <out>/compare_psfl.json, without running")
    args = p.parse_args(argv)
    args.sweep_list = sorted(set(_int_list(args.sweep)))
    args.threshold_list = sorted({float(t) for t in args.thresholds.split(",") if t.strip()})
    args.sampler_list = [s.strip() for s in args.sampler_runs.split(",") if s.strip()]
    if any(not 1 <= w <= args.n0 for w in args.sweep_list):
        p.error(f"--sweep values must be in [1, N0={args.n0}], got {args.sweep_list}")
    if any(s not in ("uniform", "weighted") for s in args.sampler_list):
        p.error(f"--sampler-runs: allowed uniform, weighted; got {args.sampler_list}")
    if not 0 < args.target <= 1:
        p.error(f"--target must be in (0, 1], got {args.target}")
    for key in ("rounds_psfl", "rounds_fedavg", "rounds_sfl", "time_budget", "eval_every_wide", "eval_every_mid",
                "sampler_rounds", "threads", "local_steps", "batch_size", "test_samples"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup_rounds < 2:
        p.error("--warmup-rounds must be >= 2 (psfl-notes 12)")
    args.root = os.path.expanduser(args.root)
    training = not (args.render_only or args.samplers_only)  # these two read no data
    if training and args.dataset == "mnist" and not (Path(args.root) / "MNIST" / "raw").is_dir():
        p.error(f"--root {args.root!r} has no MNIST/raw folder (torchvision layout)")
    if training and args.dataset == "image_folder" and not all((Path(args.root) / h).is_dir() for h in ("train", "test")):
        p.error(f"--root {args.root!r} has no train/ and test/ folders (--dataset image_folder)")
    return args


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("dataset", "name", "seed", "clients", "n0", "train_samples", "test_samples", "arch", "lr", "batch_size", "local_steps",
            "target", "after_target", "warmup_rounds", "kappa2_estimator", "rounds_psfl", "rounds_fedavg",
            "rounds_sfl", "time_budget", "eval_every_wide", "eval_every_mid", "sweep_list", "threshold_list", "sampler_rounds", "sampler_list",
            "threads")
    return {k: getattr(args, k) for k in keys} | {"machine": machine(), "lr_decay": 1.0, "momentum": 0.0,
                                                  "weight_decay": 1e-4, "partition": "ExDir(2, 10)",
                                                  "clock": "discrete {0.5, 1, 2, 4, 5}, noise 0.2"} | (
        {} if args.dataset == "mnist" else {"root": args.root})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.samplers_only:
        json_path = out / f"{args.name}.json"
        data = json.loads(json_path.read_text())
        cfg = data["config"]
        setting = argparse.Namespace(**{**vars(args), **{k: cfg[k] for k in (
            "clients", "n0", "seed", "warmup_rounds", "kappa2_estimator", "target", "sampler_rounds")}})
        psfl = data["runs"]["psfl"]
        structures = sorted({(r["W"], r["S"]) for r in data["sweep"]} | {(int(psfl["W"]), int(psfl["S"]))})
        data["samplers"] = simulate_samplers(setting, structures, setting.sampler_rounds)
        data["samplers"]["redone"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        json_path.write_text(json.dumps(data, indent=1, default=float))
        (out / f"{args.name}.md").write_text(render_markdown(data))
        plot_results(data, out)
        print(f"redid the samplers of {json_path} and rendered {out / f'{args.name}.md'}")
        return 0
    if args.render_only:
        json_path = out / f"{args.name}.json"
        data = json.loads(json_path.read_text())
        (out / f"{args.name}.md").write_text(render_markdown(data))
        plots = plot_results(data, out)
        print(f"rendered {out / f'{args.name}.md'}, {', '.join(str(p) for p in plots)} from {json_path}")
        return 0
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*personal test sets deviate.*")
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"{args.name}.partial.json"
    t0 = time.perf_counter()
    datamodule = build_datamodule(args)
    datamodule.setup("fit")
    sizes = [datamodule.client_train_size(k) for k in range(args.clients)]
    print(f"data: {sum(sizes)} training images over {args.clients} clients ({min(sizes)}-{max(sizes)} each), "
          f"set up in {time.perf_counter() - t0:.0f} s", flush=True)
    data: dict[str, Any] = {"config": config_of(args), "runs": {}}
    data["config"]["command"] = " ".join(["python benchmarks/compare_psfl.py", *(sys.argv[1:] if argv is None else argv)])
    data["config"]["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = data["runs"]
    cached: dict[str, Any] = {}
    if args.reuse and partial.exists():
        old = json.loads(partial.read_text())
        free = {"machine", "sweep_list", "sampler_list", "sampler_rounds", "command", "date"}  # do not change any run
        if {k: v for k, v in old["config"].items() if k not in free} == \
                {k: v for k, v in data["config"].items() if k not in free}:
            cached = old
            print(f"reusing {sorted(old['runs'])} from {partial}", flush=True)
        else:
            print(f"note: {partial} holds another setting; not reused", file=sys.stderr)
    n0 = args.n0
    root = tempfile.mkdtemp(prefix="compare_psfl_")
    warm: dict[str, Any] = {}

    def eval_every(width: int) -> int:
        return args.eval_every_wide if width >= 10 else args.eval_every_mid if width >= 4 else 1

    def checkpoint() -> Path:
        """The warm-up's checkpoint, run on first use."""
        if "ckpt" not in warm:
            print(f"warm-up ({args.warmup_rounds} rounds, all {args.clients} clients) ...", flush=True)
            warm["ckpt"], wall = run_warmup(args, datamodule, root)
            data["warmup"] = {"wall_time_s": wall}
            gc.collect()
            print(f"  warm-up done in {wall:.0f} s", flush=True)
        return warm["ckpt"]

    def get(key: str, label: str, make: Any, rounds: int, every: int, resume: bool) -> dict[str, Any]:
        if key in cached.get("runs", {}):
            runs[key] = cached["runs"][key]
            data.setdefault("warmup", cached.get("warmup"))
            print(f"  {label}: reused", flush=True)
            return runs[key]
        ckpt = checkpoint() if resume else None
        runs[key] = run_one(label, make(), args, datamodule, rounds, every, root, ckpt)
        # a finished FederatedTrainer sits in reference cycles (trainer <-> executor): its client store
        # (~3 GB at N = 500) is freed only by the cycle collector, so collect before the next run
        gc.collect()
        partial.write_text(json.dumps(data, default=float))
        return runs[key]

    try:
        print("1. time to target", flush=True)
        get("psfl", "PSFL", lambda: PSFL(**psfl_kwargs(args, "time")), args.rounds_psfl, 1, True)
        width = int(runs["psfl"]["W"])
        get("fedavg", "FedAvg", lambda: PSFL(clients_per_round=n0, sequences=n0, sampler="uniform"),
            args.rounds_fedavg, eval_every(n0), False)
        get("sfl", "SFL", lambda: PSFL(clients_per_round=n0, sequences=1, sampler="uniform"),
            args.rounds_sfl, eval_every(1), False)

        print("2. (S, W) sweep", flush=True)
        data["sweep"] = []
        for w in args.sweep_list:
            key = {width: "psfl", n0: "fedavg", 1: "sfl"}.get(w, f"sweep_w{w}")
            if key.startswith("sweep_"):
                get(key, f"PSFL W={w}", lambda w=w: ForcedWidthPSFL(w, **psfl_kwargs(args, "time")),
                    args.rounds_psfl, eval_every(w), True)
            data["sweep"].append({"W": w, "S": n0 // w, "run": key})

        for sampler in args.sampler_list:
            get(f"sampler_{sampler}", f"PSFL {sampler} sampler", lambda s=sampler: PSFL(**psfl_kwargs(args, s)),
                args.rounds_psfl, 1, True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print("3. samplers (planning only)", flush=True)
    structures = sorted({(w, n0 // w) for w in args.sweep_list} | {(width, n0 // width)})
    data["samplers"] = simulate_samplers(args, structures, args.sampler_rounds)
    data["wall_time_s"] = time.perf_counter() - t0
    data["compute_wall_time_s"] = (data.get("warmup") or {}).get("wall_time_s", 0.0) + sum(
        r["wall_time_s"] for r in runs.values())
    json_path, md_path = out / f"{args.name}.json", out / f"{args.name}.md"
    json_path.write_text(json.dumps(data, indent=1, default=float))
    md_path.write_text(render_markdown(data))
    plots = plot_results(data, out)
    partial.unlink(missing_ok=True)
    print(f"wrote {md_path}, {json_path}, {', '.join(str(p) for p in plots)} ({data['wall_time_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
