"""DA-DPFL vs DisPFL vs D-PSGD on one data set, same seed and budget (DA-DPFL Tables I-II, scaled down).

Every method runs with the same clients, partition, model, seed, rounds and local epochs on a
Dirichlet(0.3) and a Pathological(2) partition. The results go to
``<out>/compare_<dataset>.md`` (accuracy table as Table I, cost table as Table II) and
``<out>/compare_<dataset>.json`` (raw numbers and every round's metrics). Runs split by
partition (``--partitions pathological``) are merged into the same files when their settings
agree.

DA-DPFL's pruning threshold ``delta_pr`` (Eq. 5) must put the pruning time t* at about 30-40%
of T; the detection score's scale depends on the run, so ``--delta-pr`` takes a number or
``auto``: calibrate from the detection scores that the DisPFL run of the same partition
produces (a passive recorder; DisPFL runs first), aiming t* at ``--target-tstar`` x T.

    python benchmarks/compare_dadpfl.py --dataset digits                       # ~4 min on 2 cores
    python benchmarks/compare_dadpfl.py --dataset mnist --partitions dirichlet  # ~9.5 min
    python benchmarks/compare_dadpfl.py --dataset mnist --partitions pathological
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_dfl.callbacks.voting import PruningTimeVoting
from lightning_dfl.cost import CostModel, Workload
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.datamodules.datasets import DATASETS, EMBEDDED
from lightning_dfl.datamodules.images import ImageData, Split
from lightning_dfl.datamodules.readers import load_mnist
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DADPFL, DPSGD, DisPFL
from lightning_dfl.module import SparseClassifier

ALGORITHMS = ("dispfl", "dadpfl", "dpsgd")  # DisPFL first: `--delta-pr auto` reads its scores
LABELS = {"dadpfl": "DA-DPFL", "dispfl": "DisPFL", "dpsgd": "D-PSGD"}
PARTITIONS = {"dirichlet": "Dir(0.3)", "pathological": "Pat(2)"}
MB = 1e6

#: per data set: model, batch size, lr, local epochs, rounds, test samples per client, delta_pr.
DEFAULTS: dict[str, dict[str, Any]] = {
    # configs/dadpfl_digits.yaml's fixed 5.0 puts t* at 30% of T = 40 on Dir(0.3) but at 15% on Pat(2)
    "digits": dict(arch="cnn_digits", batch_size=16, lr=0.05, local_epochs=2, rounds=40,
                   test_samples=45, train_samples=None, delta_pr="auto"),
    # PSFL's CIFAR CNN on 28x28 one-channel images, on a stratified subset of the train split
    "mnist": dict(arch="cnn_cifar", batch_size=32, lr=0.05, local_epochs=2, rounds=20,
                  test_samples=100, train_samples=4000, delta_pr="auto"),
}


# --------------------------------------------------------------------------- data

def register_mnist_subset(root: str, train_samples: int, seed: int) -> str:
    """Register ``mnist_subset``: a stratified ``train_samples`` subset of MNIST's train split
    (the full test split), so a CPU run sees a few hundred images per client. Returns its name."""
    from sklearn.model_selection import train_test_split

    def load_mnist_subset(root: str, download: bool = False) -> Split:
        full = load_mnist(root, download=download)
        labels = full.train.labels.numpy()
        if not 0 < train_samples < len(labels):
            raise ValueError(f"--train-samples must be in (0, {len(labels)}), got {train_samples}")
        keep, _ = train_test_split(np.arange(len(labels)), train_size=train_samples, stratify=labels,
                                   random_state=seed)
        keep = torch.from_numpy(np.sort(keep))
        train = ImageData(full.train.images[keep].contiguous(), full.train.labels[keep].contiguous(),
                          full.train.classes)
        return Split(train, full.test)

    DATASETS["mnist_subset"] = load_mnist_subset
    return "mnist_subset"


def build_datamodule(args: argparse.Namespace, partition: str) -> FederatedDataModule:
    dataset = args.dataset
    if dataset == "mnist" and args.train_samples:
        dataset = register_mnist_subset(args.root, args.train_samples, args.seed)
    return FederatedDataModule(
        dataset=dataset, root=None if dataset in EMBEDDED else args.root, num_clients=args.clients, partition=partition, alpha=0.3,
        classes_per_client=2, test_samples_per_client=args.test_samples, batch_size=args.batch_size,
        augment=False, seed=args.seed,
    )


# --------------------------------------------------------------------------- delta_pr

class ScoreRecorder(PruningTimeVoting):
    """A passive Eq. 4 recorder for a DisPFL run: every client's detection score, per round.

    Without PQI nothing is pruned; the vote it also computes is ignored."""

    def __init__(self, delta_v: float) -> None:
        super().__init__(delta_pr=1.0, delta_v=delta_v)
        self.per_round: list[dict[int, float]] = []

    def on_federated_round_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_federated_round_end(trainer, pl_module)
        self.per_round.append(self.latest_scores(trainer))  # every client trains every round in DisPFL


def calibrate_delta_pr(per_round: list[dict[int, float]], rounds: int, target: float, delta_v: float) -> dict:
    """A ``delta_pr`` whose vote share first reaches ``delta_v`` near round ``target x T``.

    Per round r, ``q_r`` is the smallest threshold whose share of stable votes (score < delta_pr)
    reaches delta_v. t* is the first round with ``q_r < delta_pr``; so take the latest round
    r <= target x T whose ``q_r`` is below every earlier one, and the geometric mean of ``q_r``
    and that earlier minimum (a margin on both sides).
    """
    quantiles: list[float] = []
    for scores in per_round:
        values = sorted(scores.values())
        quantiles.append(values[math.ceil(delta_v * len(values)) - 1] if values else math.inf)
    target_idx = max(1, min(len(quantiles) - 1, round(target * rounds) - 1))
    best = None
    for r in range(1, target_idx + 1):
        earlier = min(quantiles[:r], default=math.inf)
        if quantiles[r] < earlier:
            best = (r, quantiles[r], earlier)
    if best is None:
        raise RuntimeError("no round lowered the detection score's quantile; cannot calibrate delta_pr")
    r, q, earlier = best
    delta_pr = math.sqrt(q * earlier) if math.isfinite(earlier) else 1.5 * q
    return {"delta_pr": delta_pr, "expected_t_star": r + 1,
            "quantiles": [q if math.isfinite(q) else None for q in quantiles]}


# --------------------------------------------------------------------------- one run

def build_algorithm(name: str, args: argparse.Namespace, delta_pr: float | None):
    if name == "dispfl":
        return DisPFL(num_neighbors=args.neighbors, drop_fraction=0.5, regrowth="gradient")
    if name == "dadpfl":
        return DADPFL(num_neighbors=args.neighbors, max_wait=args.max_wait, drop_fraction=0.3,
                      regrowth="gradient", delta_pr=delta_pr, delta_v=args.delta_v, target_sparsity=0.8)
    return DPSGD(num_neighbors=args.neighbors)


def run_one(name: str, args: argparse.Namespace, partition: str, delta_pr: float | None = None,
            recorder: ScoreRecorder | None = None) -> dict[str, Any]:
    datamodule = build_datamodule(args, partition)
    model = SparseClassifier(args.arch, density=1.0 if name == "dpsgd" else args.density, distribution="erk",
                             lr=args.lr, lr_decay=0.998, weight_decay=5e-4, seed=args.seed)
    trainer = FederatedTrainer(
        build_algorithm(name, args, delta_pr), rounds=args.rounds, local_epochs=args.local_epochs,
        accelerator="cpu", logger=False, seed=args.seed, enable_progress_bar=False, cpu_threads=args.threads,
        callbacks=[recorder] if recorder is not None else None,
    )
    summary = trainer.fit(model, datamodule)
    history = [{k: v for k, v in m.items() if not (recorder is not None and k.startswith("voting/"))}
               for m in trainer.history]
    last = history[-1]
    personal = [m["acc/personal_mean"] for m in history if "acc/personal_mean" in m]
    consensus = [m["acc/consensus_mean"] for m in history if "acc/consensus_mean" in m]
    # papers README: consensus baselines (D-PSGD) are scored by their shared model
    table = consensus if name == "dpsgd" and consensus else personal
    nan = float("nan")
    record: dict[str, Any] = {
        **asdict(summary),
        "engine_headline": trainer.algorithm.headline,
        "table_metric": "acc/consensus_mean" if table is consensus else "acc/personal_mean",
        "table_final_accuracy": table[-1] if table else nan,
        "table_best_accuracy": max(table) if table else nan,
        "personal_final_accuracy": personal[-1] if personal else nan,
        "personal_best_accuracy": max(personal) if personal else nan,
        "consensus_final_accuracy": consensus[-1] if consensus else None,
        "consensus_best_accuracy": max(consensus) if consensus else None,
        "final_sparsity": 1.0 - summary.final_density,
        "final_busiest_bytes": last.get("comm/busiest_bytes", 0.0),
        "history": history,
    }
    if name == "dadpfl":
        voting = next(c for c in trainer.callbacks if isinstance(c, PruningTimeVoting))
        record.update({
            "delta_pr": delta_pr, "t_star": voting.t_star,
            "t_star_fraction": voting.t_star / args.rounds if voting.t_star is not None else None,
            "pruning_rounds": [r + 1 for r in voting.pruning_round_indices],
            "score_means": {int(k): v for k, v in voting.score_means.items()},
            "vote_shares": {int(k): v for k, v in voting.vote_shares.items()},
        })
    return record


def cost_crossing(dadpfl: dict, dispfl: dict) -> dict[str, Any]:
    """Where DA-DPFL's ``C_total(theta)`` crosses DisPFL's (cost model of Sec. VI-A5).

    ``final_round``: Table II's per-client, per-round load at the final masks, with DA-DPFL's mean
    delay; ``whole_run``: the sums over every round of C_time and C_energy."""
    model = CostModel()
    a = Workload(dadpfl["flops_per_client_round"], dadpfl["final_busiest_bytes"], dadpfl["mean_delay"])
    b = Workload(dispfl["flops_per_client_round"], dispfl["final_busiest_bytes"], dispfl["mean_delay"])
    out: dict[str, Any] = {"final_round_theta": model.crossing_theta(a, b)}
    for key, load in (("dadpfl", a), ("dispfl", b)):
        out[f"{key}_final_round"] = {"time_s": float(model.time(load.flops, load.bytes, load.mean_delay)),
                                     "energy_j": float(model.energy(load.flops, load.bytes))}

    def run_totals(rec: dict) -> tuple[float, float]:
        h = rec["history"]
        flops = np.array([m["flops/train_per_client"] for m in h])
        nbytes = np.array([m["comm/busiest_bytes"] for m in h])
        delay = np.array([m.get("time/delay", 0.0) for m in h])
        return float(np.sum(model.time(flops, nbytes, delay))), float(np.sum(model.energy(flops, nbytes)))

    (ta, ea), (tb, eb) = run_totals(dadpfl), run_totals(dispfl)
    d_time, d_energy = ta - tb, ea - eb
    theta = d_time / (d_time - d_energy) if d_time != d_energy else None
    out["whole_run_theta"] = theta if theta is not None and 0.0 <= theta <= 1.0 else None
    out["whole_run"] = {"dadpfl": {"time_s": ta, "energy_j": ea}, "dispfl": {"time_s": tb, "energy_j": eb}}
    return out


# --------------------------------------------------------------------------- report

def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}"


def render_markdown(data: dict[str, Any]) -> str:
    cfg = data["config"]
    parts = [p for p in PARTITIONS if p in data["results"]]
    lines = [
        f"# DA-DPFL vs DisPFL vs D-PSGD on {cfg['dataset']}",
        "",
        f"Generated by `benchmarks/compare_dadpfl.py` (seed {cfg['seed']}). Setting: K = {cfg['clients']} clients, "
        f"M = {cfg['neighbors']} neighbours (time-varying graph), N = {cfg['max_wait']} (DA-DPFL), "
        f"T = {cfg['rounds']} rounds, E = {cfg['local_epochs']} local epochs, model `{cfg['arch']}`, "
        f"batch {cfg['batch_size']}, lr {cfg['lr']} x 0.998^t, initial density {cfg['density']} (ERK) for "
        f"DisPFL and DA-DPFL (s* = 0.8), dense D-PSGD"
        + (f", a stratified subset of {cfg['train_samples']} training images" if cfg.get("train_samples") else "")
        + f", {cfg['test_samples']} personal test samples per client. Machine: {cfg['machine']}.",
        "",
        "## Accuracy (as Table I): mean personalized accuracy, final round (best round), %",
        "",
        "| method | " + " | ".join(PARTITIONS[p] for p in parts) + " |",
        "|---|" + "---|" * len(parts),
    ]
    for alg in ALGORITHMS:
        cells = []
        for p in parts:
            rec = data["results"][p].get(alg)
            cells.append("-" if rec is None else
                         f"{_pct(rec['table_final_accuracy'])} ({_pct(rec['table_best_accuracy'])})")
        lines.append(f"| {LABELS[alg]} | " + " | ".join(cells) + " |")
    lines += ["", "DisPFL and DA-DPFL: each client's model after local training on its own test set, mean over "
              "clients. D-PSGD: its consensus model (the average of all clients' models) on every client's test "
              "set (papers README); its clients' own models after local training are the \"personal\" column "
              "of the cost tables.", ""]
    lines += ["## Cost (as Table II)", ""]
    for p in parts:
        res = data["results"][p]
        lines += [
            f"### {PARTITIONS[p]}", "",
            "| method | final acc % | best acc % | personal acc % | density | sparsity | train FLOPs (total) | "
            "FLOPs/client/round (final) | busiest MB/round | mask MB/round | mean delay | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for alg in ALGORITHMS:
            rec = res.get(alg)
            if rec is None:
                continue
            lines.append(
                f"| {LABELS[alg]} | {_pct(rec['table_final_accuracy'])} | {_pct(rec['table_best_accuracy'])} | "
                f"{_pct(rec['personal_final_accuracy'])} | "
                f"{rec['final_density']:.3f} | {rec['final_sparsity']:.3f} | {rec['flops_total']:.3e} | "
                f"{rec['flops_per_client_round']:.3e} | {rec['busiest_mb_per_round']:.3f} | "
                f"{rec['busiest_mask_mb_per_round']:.3f} | {rec['mean_delay']:.2f} | {rec['wall_time_s']:.1f} |")
        da = res.get("dadpfl")
        if da is not None:
            calib = res.get("calibration")
            how = (f"calibrated from DisPFL's detection scores (expected t* = {calib['expected_t_star']})"
                   if calib else "given")
            t_star = da["t_star"]
            where = (f"t* = {t_star} of T = {cfg['rounds']} ({100 * da['t_star_fraction']:.0f}% of T)"
                     if t_star is not None else "t* was never reached (no pruning)")
            lines += ["", f"DA-DPFL: delta_pr = {da['delta_pr']:.4g} ({how}); {where}; pruning rounds "
                          f"{da['pruning_rounds']}; final sparsity {da['final_sparsity']:.3f}."]
        cross = res.get("cost_crossing")
        if cross is not None:
            def th(x):
                return "none in [0, 1]" if x is None else f"{x:.3f}"
            lines += [f"Cost model (Sec. VI-A5): DA-DPFL's C_total(theta) crosses DisPFL's at theta = "
                      f"{th(cross['final_round_theta'])} (final-round per-client load, as Table II, with DA-DPFL's "
                      f"mean delay) and at theta = {th(cross['whole_run_theta'])} (sums over all rounds)."]
        lines.append("")
    lines += [
        "Units: FLOPs count Conv/Linear multiply-adds x 2 at the active weights, training = 3 x forward, "
        "mask-search batches included; MB = 10^6 bytes of active values x 4 bytes at the busiest node "
        "(max of download and upload), mean over rounds; mask MB = one bit per masked entry per model sent; "
        "mean delay = mean over rounds of the latest start of a task in the simulated clock (task units); "
        "wall s = the run's wall-clock time on this machine (1 thread; other jobs may have shared the CPU).",
        "",
    ]
    return "\n".join(lines)


def machine() -> str:
    import os
    import platform
    return f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU, torch {torch.__version__}, " \
           f"{torch.get_num_threads()} thread(s)"


# --------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=sorted(DEFAULTS), default="digits")
    p.add_argument("--root", default=os.path.expanduser(os.environ.get("LIGHTNING_DFL_DATA", "~/.cache/lightning-dfl")),
                   help="data root (torchvision layout for mnist); default: $LIGHTNING_DFL_DATA or ~/.cache/lightning-dfl; "
                        "torchvision.datasets.MNIST(ROOT, download=True) fetches the official copy where a network exists")
    p.add_argument("--rounds", type=int, default=None, help="T (default: 40 digits, 20 mnist)")
    p.add_argument("--clients", type=int, default=20, help="K")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    p.add_argument("--partitions", default="dirichlet,pathological",
                   help="comma-separated subset of: " + ", ".join(PARTITIONS))
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated subset of: "
                   + ", ".join(ALGORITHMS))
    p.add_argument("--neighbors", type=int, default=4, help="M")
    p.add_argument("--max-wait", type=int, default=4, help="N (DA-DPFL)")
    p.add_argument("--local-epochs", type=int, default=None, help="E (default: 2)")
    p.add_argument("--density", type=float, default=0.5, help="initial density of DisPFL and DA-DPFL")
    p.add_argument("--delta-pr", default=None,
                   help="DA-DPFL's pruning threshold, a number or 'auto'")
    p.add_argument("--delta-v", type=float, default=0.5)
    p.add_argument("--target-tstar", type=float, default=0.35, help="t* / T that 'auto' aims at")
    p.add_argument("--train-samples", type=int, default=None,
                   help="mnist: stratified training subset size, 0 for all 60,000 (default 4000)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)

    d = DEFAULTS[args.dataset]
    args.arch = d["arch"]
    args.test_samples = d["test_samples"]
    for key in ("rounds", "local_epochs", "batch_size", "lr", "delta_pr", "train_samples"):
        if getattr(args, key) is None:
            setattr(args, key, d[key])
    args.partition_list = [s.strip() for s in args.partitions.split(",") if s.strip()]
    args.algorithm_list = [s.strip() for s in args.algorithms.split(",") if s.strip()]
    bad = [x for x in args.partition_list if x not in PARTITIONS]
    if bad or not args.partition_list:
        p.error(f"--partitions: unknown {bad or 'empty'}; allowed: {', '.join(PARTITIONS)}")
    bad = [x for x in args.algorithm_list if x not in ALGORITHMS]
    if bad or not args.algorithm_list:
        p.error(f"--algorithms: unknown {bad or 'empty'}; allowed: {', '.join(ALGORITHMS)}")
    args.algorithm_list = [a for a in ALGORITHMS if a in args.algorithm_list]  # DisPFL before DA-DPFL
    for key in ("rounds", "clients", "local_epochs", "batch_size", "threads"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if not 1 <= args.neighbors < args.clients:
        p.error(f"--neighbors (M) must be in [1, K={args.clients}), got {args.neighbors}")
    if not 0 <= args.max_wait <= args.neighbors:
        p.error(f"--max-wait (N) must be in [0, M={args.neighbors}], got {args.max_wait}")
    if str(args.delta_pr) == "auto":
        if "dadpfl" in args.algorithm_list and "dispfl" not in args.algorithm_list:
            p.error("--delta-pr auto calibrates from the DisPFL run: include dispfl in --algorithms "
                    "or give a number")
    else:
        try:
            args.delta_pr = float(args.delta_pr)
        except ValueError:
            p.error(f"--delta-pr must be a number > 0 or 'auto', got {args.delta_pr!r}")
        if not args.delta_pr > 0:
            p.error(f"--delta-pr must be > 0, got {args.delta_pr}")
    if args.dataset == "mnist" and not (args.root and (Path(args.root) / "MNIST" / "raw").is_dir()):
        p.error(f"--root {args.root!r} has no MNIST/raw folder (torchvision layout)")
    return args


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("dataset", "rounds", "clients", "seed", "neighbors", "max_wait",
                                          "local_epochs", "density", "delta_v", "target_tstar", "train_samples",
                                          "batch_size", "lr", "arch", "test_samples", "threads")} \
        | {"delta_pr_option": str(args.delta_pr), "machine": machine()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*personal test sets deviate.*")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"compare_{args.dataset}.json", out / f"compare_{args.dataset}.md"
    config = config_of(args)
    data: dict[str, Any] = {"config": config, "results": {}}
    if json_path.exists():
        old = json.loads(json_path.read_text())
        same = {k: v for k, v in old.get("config", {}).items() if k != "machine"} == \
               {k: v for k, v in config.items() if k != "machine"}
        if same:
            data["results"] = old.get("results", {})
        else:
            print(f"note: {json_path} holds another setting; overwriting it", file=sys.stderr)

    for partition in args.partition_list:
        res = data["results"].setdefault(partition, {})
        recorder = ScoreRecorder(args.delta_v) if str(args.delta_pr) == "auto" else None
        delta_pr = None if recorder is not None else args.delta_pr
        for alg in args.algorithm_list:
            if alg == "dadpfl" and recorder is not None:
                if not recorder.per_round:
                    raise RuntimeError("--delta-pr auto: the DisPFL run recorded no scores")
                calib = calibrate_delta_pr(recorder.per_round, args.rounds, args.target_tstar, args.delta_v)
                delta_pr = calib["delta_pr"]
                res["calibration"] = calib
                print(f"[{partition}] delta_pr calibrated to {delta_pr:.4g} (expected t* = {calib['expected_t_star']})",
                      flush=True)
            elif alg == "dadpfl":
                res.pop("calibration", None)
            start = time.perf_counter()
            rec = run_one(alg, args, partition, delta_pr=delta_pr if alg == "dadpfl" else None,
                          recorder=recorder if alg == "dispfl" else None)
            res[alg] = rec
            extra = f", t* = {rec['t_star']}, sparsity {rec['final_sparsity']:.3f}" if alg == "dadpfl" else ""
            print(f"[{partition}] {LABELS[alg]}: final {100 * rec['table_final_accuracy']:.2f}% "
                  f"(best {100 * rec['table_best_accuracy']:.2f}%) in {time.perf_counter() - start:.0f} s{extra}", flush=True)
        if "dadpfl" in res and "dispfl" in res:
            res["cost_crossing"] = cost_crossing(res["dadpfl"], res["dispfl"])
        json_path.write_text(json.dumps(data, indent=1, default=float))
        md_path.write_text(render_markdown(data))
    print(f"wrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
