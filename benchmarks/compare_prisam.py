"""PRISAM vs DisPFL vs D-PSGD vs Local on MNIST cluster partitions (PRISAM Table I, scaled to a CPU).

Issue 13's evidence. Every method trains ResNet-20 (BatchNorm, shortcut option B) on the same
clients, partition, seed, rounds and local steps, on two cluster partitions of 5 groups
(prisam-notes 17): pathological (2 disjoint classes per group) and Dirichlet(0.2) between groups,
IID within a group. Methods (prisam-notes 13):

- PRISAM at rho = 0.3 / 0.5 / 0.7: KMeans (k = 5) on the compacted BN channel masks every round
  after the warm-up, group union average, re-prune at rho by the averaged |gamma| (notes 2);
- PRISAM at rho = 0.5 with ``grouping="random"``: M random peers, no grouping (Sec. V-E);
- DisPFL at density 0.5 (ERK, RigL regrowth), M random peers;
- "FedAvg": D-PSGD with M random peers, each device scored by its own model (``headline="personal"``);
- Local: no communication.

Reported per method and partition: final and best mean personalized accuracy (each device's model on
its own test set), busiest-node MB per round and total bytes, training FLOPs, the forward MMACs per
sample of the final model (PRISAM: the compact model, notes 12; the others count dense), the
grouping's adjusted Rand index (ARI) per round, and for PRISAM rho 0.3 / 0.5 / 0.7 the exported,
physically smaller model of one client (parameters, MMACs, median CPU latency at 1 thread of the
full and the exported model, max |logit difference|), and the dense vs exported CPU latency once more
from thread CPU time in interleaved passes (``compare_prisam_latency.json``; see
:func:`interleaved_latency`). Per partition the runs are kept in
``<out>/compare_prisam_<partition>.json`` (so partitions can run in separate processes and an
interrupted invocation resumes); every invocation then merges what is there into
``<out>/compare_prisam.{json,md}`` and the plots ``compare_prisam_ari.png`` (ARI over rounds) and
``compare_prisam_masks.png`` (every client's final compact channel mask in 2-D by PCA, coloured by
true group, marker by the group KMeans finds).

    python benchmarks/compare_prisam.py                              # both partitions in turn, then the latency
    python benchmarks/compare_prisam.py --partitions pathological &  # or one process per partition (~37 min
    python benchmarks/compare_prisam.py --partitions dirichlet; wait #   wall on 2 loaded cores), then
    python benchmarks/compare_prisam.py --latency-only               # only re-measure the CPU latency
    python benchmarks/compare_prisam.py --render-only                # redo .md and plots from the JSON
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

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.export import export_client
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DPSGD, PRISAM, DisPFL, Local
from lightning_dfl.federation.algorithms.prisam import CHANNELS_FIELD
from lightning_dfl.grouping import compact, group_masks
from lightning_dfl.models import build_model as build_network
from lightning_dfl.module import SparseClassifier
from lightning_dfl.seeding import derive_seed
from lightning_dfl.sparse.channels import ChannelMasks, apply_channel_masks_, export, masked_macs
from lightning_dfl.sparse.flops import profile_flops

PARTITIONS = {"pathological": "Pat (2 classes / group)", "dirichlet": "Dir(0.2) between groups"}
METHODS = ("prisam_0.5", "prisam_0.3", "prisam_0.7", "prisam_random", "dispfl", "dpsgd", "local")
LABELS = {"prisam_0.3": "PRISAM rho 0.3", "prisam_0.5": "PRISAM rho 0.5", "prisam_0.7": "PRISAM rho 0.7",
          "prisam_random": "PRISAM rho 0.5, random peers", "dispfl": "DisPFL (density 0.5)",
          "dpsgd": "FedAvg (D-PSGD, random peers, personal)", "local": "Local"}
TABLE_ORDER = ("prisam_0.3", "prisam_0.5", "prisam_0.7", "prisam_random", "local", "dpsgd", "dispfl")
#: PRISAM Table I (CIFAR-10 VGG11 / SVHN ResNet-20), Dir 0.2 / pathological, from prisam-notes
PAPER = {"prisam_0.3": ("81.23 / 89.03", "74.98 / 78.41"), "prisam_0.5": ("80.28 / 90.88", "75.88 / 75.90"),
         "prisam_0.7": ("80.57 / 90.57", "75.97 / 57.54"), "local": ("73.57 / 84.35", "58.11 / 63.11"),
         "dpsgd": ("68.48 / 50.63", "70.50 / 54.56"), "dispfl": ("76.53 / 50.38", "61.49 / 58.39")}
MB = 1e6


# --------------------------------------------------------------------------- pieces

class RecordingPRISAM(PRISAM):
    """PRISAM that also keeps every round's found group labels (benchmark-only; it wraps the
    private ``_group``, which is called once per grouping round)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.found: list[dict[str, Any]] = []

    def _group(self, ctx, active, vectors):
        grouping = super()._group(ctx, active, vectors)
        self.found.append({"round": ctx.round_idx + 1, "clients": [int(k) for k in active],
                           "labels": grouping.labels.tolist()})
        return grouping


def build_datamodule(args: argparse.Namespace, partition: str) -> FederatedDataModule:
    return FederatedDataModule(
        dataset="mnist", root=args.root, num_clients=args.clients, partition="cluster", num_groups=args.groups,
        between=partition, classes_per_group=2, alpha=args.alpha, batch_size=args.batch_size,
        test_samples_per_client=args.test_samples, augment=False, seed=args.seed,
        max_train_samples=args.train_samples or None,
    )


def build_algorithm(method: str, args: argparse.Namespace):
    common = dict(num_groups=args.groups, warmup_rounds=args.warmup_rounds, num_neighbors=args.neighbors)
    if method.startswith("prisam_") and method != "prisam_random":
        return RecordingPRISAM(ratio=float(method.removeprefix("prisam_")), grouping="kmeans", **common)
    if method == "prisam_random":
        return RecordingPRISAM(ratio=0.5, grouping="random", **common)
    if method == "dispfl":
        return DisPFL(num_neighbors=args.neighbors, drop_fraction=0.5, regrowth="gradient")
    if method == "dpsgd":
        return DPSGD(num_neighbors=args.neighbors, headline="personal")
    return Local()


def build_model(args: argparse.Namespace, method: str) -> SparseClassifier:
    # notes 16: SGD, constant lr, momentum 0, weight decay 5e-4, the same for every method
    return SparseClassifier("resnet20", density=args.density if method == "dispfl" else 1.0, distribution="erk",
                            lr=args.lr, lr_decay=1.0, momentum=0.0, weight_decay=5e-4, seed=args.seed)


def _pca2(x: np.ndarray) -> np.ndarray:
    """The rows of ``x`` on its first two principal axes (numpy SVD); zeros where the rank is lower."""
    centred = x - x.mean(axis=0, keepdims=True)
    out = np.zeros((x.shape[0], 2))
    if centred.size and np.abs(centred).sum() > 0:
        u, s, _ = np.linalg.svd(centred, full_matrices=False)
        k = min(2, len(s))
        out[:, :k] = u[:, :k] * s[:k]
    return out


def run_one(method: str, args: argparse.Namespace, partition: str, workdir: str) -> dict[str, Any]:
    datamodule = build_datamodule(args, partition)
    algorithm = build_algorithm(method, args)
    model = build_model(args, method)
    root = tempfile.mkdtemp(prefix=f"{method}_", dir=workdir)
    is_prisam = isinstance(algorithm, PRISAM)
    trainer = FederatedTrainer(
        algorithm, rounds=args.rounds, local_steps=args.local_steps, eval_every=1, accelerator="cpu", logger=False,
        default_root_dir=root, seed=args.seed, enable_progress_bar=False, cpu_threads=args.threads,
        checkpoint_every=args.rounds if is_prisam else 0,
    )
    start = time.perf_counter()
    summary = trainer.fit(model, datamodule)
    wall = time.perf_counter() - start
    history = [{k: float(v) for k, v in m.items()} for m in trainer.history]
    personal = [m["acc/personal_mean"] for m in history if "acc/personal_mean" in m]
    last = history[-1]
    shape = (model.hparams.in_channels, model.hparams.image_size, model.hparams.image_size)
    dense = profile_flops(model.model, shape)
    dense_params = sum(p.numel() for p in model.model.parameters())
    truth = list(datamodule.client_groups)
    record: dict[str, Any] = {
        "label": LABELS[method], "algorithm": repr(algorithm), "wall_time_s": wall,
        "final_accuracy": personal[-1] if personal else None, "best_accuracy": max(personal) if personal else None,
        "best_round": int(np.argmax(personal)) + 1 if personal else None,
        "busiest_mb_per_round": summary.busiest_mb_per_round,
        "busiest_mb_max": max(m.get("comm/busiest_bytes", 0.0) for m in history) / MB,
        "total_bytes": sum(m.get("comm/total_bytes", 0.0) for m in history),
        "flops_total": summary.flops_total, "final_density": summary.final_density,
        "dense_mmacs": dense.forward_macs() / 1e6, "dense_params": dense_params,
        "dense_mib_x10": 10 * dense_params * 4 / 2 ** 20,
        "client_groups": truth,
        "history": history,
    }
    if is_prisam:
        grouped = [m for m in history if "prisam/ari" in m]
        record.update({
            "mmacs": last.get("prisam/compact_mmacs_mean", record["dense_mmacs"]),
            "params": last.get("prisam/compact_params_mean", dense_params),
            "published_mib_x10": last.get("prisam/published_mib_x10"),
            "grouping_bytes_total": sum(m.get("prisam/grouping_bytes", 0.0) for m in history),
            "ari": [(i + 1, m["prisam/ari"]) for i, m in enumerate(history) if "prisam/ari" in m],
            "groups": [(i + 1, m["prisam/groups"]) for i, m in enumerate(history) if "prisam/groups" in m],
            "differing_dims": [(i + 1, m["prisam/differing_dims"]) for i, m in enumerate(history)
                               if "prisam/differing_dims" in m],
            "final_ari": grouped[-1]["prisam/ari"] if grouped else None,
            "found_groups": algorithm.found,
        })
        vectors = np.stack([trainer.store.read(k, CHANNELS_FIELD).cpu().numpy() for k in range(args.clients)])
        dims, kept = compact(vectors)
        seed = derive_seed(args.seed, "prisam/grouping", args.rounds) % (2 ** 32)
        regroup = group_masks(vectors, args.groups, "kmeans", seed)
        record["final_masks"] = {
            "bits": int(vectors.shape[1]), "kept_channels": vectors.sum(axis=1).tolist(),
            "differing_dims": int(dims.shape[1]), "distinct_masks": regroup.distinct_masks,
            "found_labels": regroup.labels.tolist(), "pca": _pca2(dims.astype(np.float64)).tolist(),
            "compact": ["".join("1" if b else "0" for b in row) for row in dims],
        }
        from sklearn.metrics import adjusted_rand_score
        record["final_masks"]["ari"] = float(adjusted_rand_score(truth, regroup.labels))
        if method != "prisam_random" and args.export_client is not None:
            out = Path(root) / f"client{args.export_client}.pt2"
            report = export_client(trainer.checkpoint_path, args.export_client, out, latency=True, threads=1)
            record["export"] = {k: v for k, v in report.as_dict().items() if k != "path"}
    else:
        record.update({"mmacs": record["dense_mmacs"], "params": dense_params})
    del trainer
    gc.collect()
    shutil.rmtree(root, ignore_errors=True)
    return record


def _time_forward(model: torch.nn.Module, x: torch.Tensor, warmup: int, repeats: int) -> dict[str, float]:
    """One pass: ``warmup`` untimed forwards, then ``repeats`` timed ones; the median wall time, the
    median CPU time of this thread and the fastest wall time (ms). With one intra-op thread the forward
    runs in the calling thread, so its CPU time leaves out the time other jobs hold the core."""
    wall, cpu = [], []
    with torch.inference_mode():
        for _ in range(warmup):
            model(x)
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.thread_time()
            model(x)
            cpu.append((time.thread_time() - c0) * 1e3)
            wall.append((time.perf_counter() - w0) * 1e3)
    return {"wall_ms": float(np.median(wall)), "cpu_ms": float(np.median(cpu)), "min_wall_ms": min(wall)}


def interleaved_latency(ratios: list[float], trials: int, repeats: int) -> dict[str, Any]:
    """CPU latency (1 thread, batch 1) of the dense ResNet-20 and of the exported model at each rho,
    measured in ``trials`` interleaved passes (dense, rho 0.3, 0.5, 0.7, dense, ...) of ``repeats``
    forwards each after a warm-up: per model the median over the passes of the per-pass medians of
    wall time and of thread CPU time, and the fastest wall time seen.

    On a shared, oversubscribed CPU the wall time of a forward that spans several scheduler time
    slices includes the slices other jobs take, which penalizes the longer (dense) forward most; the
    thread's CPU time does not (``export_client``'s single wall-time pass per run is kept beside it).
    The exported architecture depends only on rho: every BN group keeps ``C - floor(rho C)`` channels
    (notes 6), so a freshly initialized ResNet-20 pruned at rho and exported has the clients' shapes
    (its parameter and MAC counts are checked against the runs' exports in the report); the latency
    does not depend on the weights' values."""
    shape = (1, 28, 28)
    models: dict[str, torch.nn.Module] = {}
    counts: dict[str, dict[str, float]] = {}
    dense = build_network("resnet20", num_classes=10, in_channels=1, image_size=28).eval()
    models["dense"] = dense
    profile = profile_flops(dense, shape)
    counts["dense"] = {"params": sum(p.numel() for p in dense.parameters()), "mmacs": profile.forward_macs() / 1e6}
    for rho in ratios:
        net = build_network("resnet20", num_classes=10, in_channels=1, image_size=28).eval()
        masks = ChannelMasks.from_bn_scaling(net, rho)
        apply_channel_masks_(net, masks)
        models[f"{rho}"] = export(net, masks).eval()
        counts[f"{rho}"] = {"params": sum(p.numel() for p in models[f"{rho}"].parameters()),
                            "mmacs": masked_macs(net, masks, profile=profile) / 1e6}
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
    passes: dict[str, list[dict[str, float]]] = {k: [] for k in models}
    try:
        for _ in range(trials):
            for key, net in models.items():
                passes[key].append(_time_forward(net, x, warmup=10, repeats=repeats))
    finally:
        torch.set_num_threads(previous)
    out = {}
    for key, rows in passes.items():
        out[key] = {**counts[key], "cpu_ms": float(np.median([r["cpu_ms"] for r in rows])),
                    "wall_ms": float(np.median([r["wall_ms"] for r in rows])),
                    "min_wall_ms": min(r["min_wall_ms"] for r in rows), "passes": rows}
    return {"trials": trials, "repeats": repeats, "machine": machine(), "load_average": list(os.getloadavg()),
            "models": out}


# --------------------------------------------------------------------------- report

def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def render_markdown(data: dict[str, Any]) -> str:
    cfg, results = data["config"], data["results"]
    parts = [p for p in PARTITIONS if p in results]
    lines = [
        "# PRISAM vs DisPFL vs D-PSGD vs Local on MNIST cluster partitions",
        "",
        f"Generated by `benchmarks/compare_prisam.py` (seed {cfg['seed']}). MNIST (1x28x28, no augmentation), "
        + (f"a stratified {cfg['train_samples']}-image subset of the training split" if cfg["train_samples"]
           else "all 60,000 training images")
        + f", K = {cfg['clients']} devices in {cfg['groups']} groups of {cfg['clients'] // cfg['groups']} "
        f"(all take part every round), {cfg['test_samples']} personal test images per device; ResNet-20 (BN) for "
        f"every method; T = {cfg['rounds']} rounds of {cfg['local_steps']} local SGD steps of batch "
        f"{cfg['batch_size']} (lr {cfg['lr']} constant, momentum 0, weight decay 5e-4); PRISAM: "
        f"{cfg['warmup_rounds']} warm-up rounds (local, dense, then the first prune), KMeans k = {cfg['groups']} "
        f"on the compact BN masks every round after; random peers (PRISAM random, DisPFL, D-PSGD): "
        f"M = {cfg['neighbors']} per round (time-varying). Machine: {cfg['machine']}.",
        "",
        "## Mean personalized accuracy, final round (best round), %",
        "",
        "| method | " + " | ".join(PARTITIONS[p] for p in parts) + " | paper, CIFAR-10 VGG11 (Dir 0.2 / Pat) "
        "| paper, SVHN ResNet-20 (Dir 0.2 / Pat) |",
        "|---|" + "---|" * (len(parts) + 2),
    ]
    for m in TABLE_ORDER:
        cells = []
        for p in parts:
            rec = results[p].get(m)
            cells.append("-" if rec is None else f"{_pct(rec['final_accuracy'])} ({_pct(rec['best_accuracy'])})")
        paper = PAPER.get(m, ("-", "-"))
        lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + f" | {paper[0]} | {paper[1]} |")
    lines += ["", "The same runs scored by each device's model right after aggregation, before its local training "
              "(`acc/aggregated_mean`; Local: its model of the previous round), final round (best round), %:", "",
              "| method | " + " | ".join(PARTITIONS[p] for p in parts) + " |", "|---|" + "---|" * len(parts)]
    for m in TABLE_ORDER:
        cells = []
        for p in parts:
            agg = [h["acc/aggregated_mean"] for h in results[p].get(m, {}).get("history", [])
                   if "acc/aggregated_mean" in h]
            cells.append(f"{_pct(agg[-1])} ({_pct(max(agg))})" if agg else "-")
        lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    lines += [""]
    for p in parts:
        res = results[p]
        lines += [
            f"## {PARTITIONS[p]}: cost", "",
            "| method | final acc % | best acc % | busiest MB / round | total MB | 10 x published MiB | "
            "training FLOPs | forward MMACs / sample | params | final ARI | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in TABLE_ORDER:
            rec = res.get(m)
            if rec is None:
                continue
            mib = rec.get("published_mib_x10")
            lines.append(
                f"| {LABELS[m]} | {_pct(rec['final_accuracy'])} | {_pct(rec['best_accuracy'])} | "
                f"{rec['busiest_mb_per_round']:.3f} | {rec['total_bytes'] / MB:.1f} | "
                f"{_num(mib) if mib is not None else _num(rec['dense_mib_x10']) + ' (dense)'} | "
                f"{rec['flops_total']:.3e} | {rec['mmacs']:.2f} | {rec['params']:,.0f} | "
                f"{_num(rec.get('final_ari'))} | {rec['wall_time_s']:.0f} |")
        lines += [""]
        ari_rows = [m for m in TABLE_ORDER if res.get(m, {}).get("ari")]
        if ari_rows:
            rounds = [r for r, _ in res[ari_rows[0]]["ari"]]
            lines += ["ARI of the found groups against the true groups per round (groups found, compact mask "
                      "length):", "",
                      "| method | " + " | ".join(f"r{r}" for r in rounds) + " |",
                      "|---|" + "---|" * len(rounds)]
            for m in ari_rows:
                rec = res[m]
                groups = dict(rec["groups"])
                dims = dict(rec["differing_dims"])
                lines.append(f"| {LABELS[m]} | " + " | ".join(
                    f"{a:.2f} ({groups.get(r, 0):.0f}, {dims.get(r, 0):.0f})" for r, a in rec["ari"]) + " |")
            lines += [""]
        exports = [m for m in TABLE_ORDER if res.get(m, {}).get("export")]
        if exports:
            lines += [f"Exported model of client {res[exports[0]]['export']['client']} (physically pruned, "
                      "`lightning_dfl.export.export_client`: median wall-clock latency of one sample's forward at 1 "
                      "thread, one pass right after the run; on the shared, loaded machine these wall times are "
                      "inflated and noisy, see the CPU-time table below):", "",
                      "| method | params full | params exported | MMACs full | MMACs exported | latency full ms | "
                      "latency exported ms | speed-up | max abs logit diff |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for m in exports:
                e = res[m]["export"]
                lines.append(
                    f"| {LABELS[m]} | {e['params_full']:,} | {e['params_exported']:,} | {e['mmacs_full']:.2f} | "
                    f"{e['mmacs_exported']:.2f} | {_num(e['latency_full_ms'], '.3f')} | "
                    f"{_num(e['latency_exported_ms'], '.3f')} | "
                    f"{_num(e['latency_full_ms'] / e['latency_exported_ms'] if e['latency_exported_ms'] else None)}x | "
                    f"{e['max_abs_logit_diff']:.1e} |")
            lines += [""]
    lat = data.get("latency")
    if lat:
        dense = lat["models"]["dense"]
        load = ", ".join(f"{v:.1f}" for v in lat.get("load_average", []))
        lines += [f"## CPU latency, dense vs exported (1 thread, batch 1, one 1x28x28 image; {lat['trials']} "
                  f"interleaved passes of {lat['repeats']} forwards; load average {load} on {os.cpu_count()} cores)",
                  "",
                  "| model | params | MMACs | params of the runs' exports | CPU time ms | speed-up | fastest wall ms | "
                  "speed-up | median wall ms |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key, rec in lat["models"].items():
            exported = sorted({f"{r['export']['params_exported']:,}" for res in results.values()
                               for m, r in res.items() if r.get("export") and m == f"prisam_{key}"})
            name = "ResNet-20 dense" if key == "dense" else f"exported at rho {key}"
            lines.append(f"| {name} | {rec['params']:,.0f} | {rec['mmacs']:.2f} | {', '.join(exported) or '-'} | "
                         f"{rec['cpu_ms']:.3f} | {dense['cpu_ms'] / rec['cpu_ms']:.2f}x | {rec['min_wall_ms']:.3f} | "
                         f"{dense['min_wall_ms'] / rec['min_wall_ms']:.2f}x | {rec['wall_ms']:.3f} |")
        lines += ["", "CPU time = the median over passes of the median thread CPU time per forward (robust to other "
                  "jobs holding the core); fastest wall = the quickest forward seen; median wall = what "
                  "`export_client` measures (inflated for forwards longer than a scheduler slice on a loaded "
                  "machine). The exported architecture depends only on rho (every BN group keeps C - floor(rho C) "
                  "channels), so these are freshly initialized ResNet-20s pruned at rho and exported; their "
                  "parameter counts equal the runs' exports (column 4).", ""]
    lines += [
        "Units: accuracy = mean over devices of each device's own model on its own test set (D-PSGD too: "
        "`headline=\"personal\"`); MB = 10^6 bytes; busiest MB / round = the busiest node's max of download and "
        "upload per round (kept values x 4 B plus mask bits; PRISAM adds the grouping traffic), mean over rounds; "
        "total MB = all bytes sent in the run; 10 x published MiB = Table I's communication column (10 x the "
        "mean published model, notes 11; the others' dense model for reference); training FLOPs = Conv/Linear "
        "multiply-adds x 2 at the active weights, training = 3 x forward, summed over the run; forward MMACs / "
        "sample and params = the final model (PRISAM: the compact model, mean over devices; the others dense, "
        "notes 12 - DisPFL's unstructured sparsity gives no speed-up); final ARI = the adjusted Rand index of "
        "the last round's grouping; wall s = the run's wall-clock time (1 torch thread, shared CPU).",
        "",
    ]
    return "\n".join(lines)


def _figure(width: float, height: float) -> Any:
    from lightning_dfl.plots import agg_figure

    return agg_figure(width, height)


def plot_results(data: dict[str, Any], out: Path) -> list[Path]:
    results = data["results"]
    parts = [p for p in PARTITIONS if p in results]
    prisams = ("prisam_0.3", "prisam_0.5", "prisam_0.7")
    paths = []
    fig = _figure(6.0 * max(1, len(parts)) + 1.6, 6.5)
    axes = np.array(fig.subplots(2, max(1, len(parts)), squeeze=False, sharex=True))
    styles = (("o", "-"), ("s", "--"), ("^", ":"))
    for col, p in enumerate(parts):
        top, bottom = axes[0, col], axes[1, col]
        for i, m in enumerate(prisams):
            rec = results[p].get(m)
            if rec and rec.get("ari"):
                marker, ls = styles[i]
                xs, ys = zip(*rec["ari"])
                top.plot(xs, ys, ls=ls, marker=marker, ms=5, mfc="none", color=f"C{i}", label=LABELS[m])
                xs, ys = zip(*rec["differing_dims"])
                bottom.plot(xs, ys, ls=ls, marker=marker, ms=5, mfc="none", color=f"C{i}", label=LABELS[m])
        top.set(ylabel="adjusted Rand index (found vs true)", title=f"MNIST, {PARTITIONS[p]}", ylim=(-0.2, 1.1))
        bottom.set(xlabel="round", ylabel="differing mask dimensions (of 448)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if handles:  # one legend for every panel, outside them: inside, it hid the lines at its corner
        fig.legend(handles, labels, loc="outside right center", fontsize="small")
    paths.append(out / "compare_prisam_ari.png")
    fig.savefig(paths[-1])

    fig = _figure(4.0 * len(prisams), 3.8 * max(1, len(parts)))
    axes = np.array(fig.subplots(max(1, len(parts)), len(prisams), squeeze=False))
    markers = "osD^vP*Xph"
    for row, p in zip(axes, parts):
        for ax, m in zip(row, prisams):
            rec = results[p].get(m)
            if not rec or "final_masks" not in rec:
                ax.set_axis_off()
                continue
            fm = rec["final_masks"]
            xy = np.asarray(fm["pca"])
            truth, found = rec["client_groups"], fm["found_labels"]
            rng = np.random.default_rng(0)  # a small jitter: devices of one group often share a mask exactly
            span = max(float(np.ptp(xy)) if xy.size else 0.0, 1.0)
            xy = xy + rng.normal(scale=0.015 * span, size=xy.shape)
            for k, (x, y) in enumerate(xy):
                ax.scatter(x, y, color=f"C{truth[k]}", marker=markers[found[k] % len(markers)], s=50,
                           edgecolors="k", linewidths=0.5)
            ax.set(title=f"{LABELS[m]}, {p}\n{fm['differing_dims']} differing of {fm['bits']} bits, "
                         f"{fm['distinct_masks']} distinct, ARI {fm['ari']:.2f}", xlabel="PC 1", ylabel="PC 2")
            ax.title.set_fontsize("small")
            ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D
    groups = sorted(set(results[parts[0]][next(iter(results[parts[0]]))]["client_groups"])) if parts else []
    handles = [Line2D([], [], ls="", marker="o", color=f"C{g}", label=f"true group {g}") for g in groups]
    handles += [Line2D([], [], ls="", marker=markers[g], color="grey", label=f"found group {g}") for g in groups]
    fig.legend(handles=handles, loc="outside right center", fontsize="small")
    fig.suptitle("Final compact channel masks (PCA, jittered): colour = true group, marker = KMeans group")
    paths.append(out / "compare_prisam_masks.png")
    fig.savefig(paths[-1])
    return paths


def machine() -> str:
    return (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}, shared with other jobs), "
            f"no GPU, torch {torch.__version__}, 1 thread")


# --------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--root", default=os.path.expanduser(os.environ.get("LIGHTNING_DFL_DATA", "~/.cache/lightning-dfl")),
                   help="data root (torchvision layout MNIST/raw); default: $LIGHTNING_DFL_DATA or ~/.cache/lightning-dfl; "
                        "torchvision.datasets.MNIST(ROOT, download=True) fetches the official copy where a network exists")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partitions", default=",".join(PARTITIONS), help="comma-separated subset of: "
                   + ", ".join(PARTITIONS))
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of: " + ", ".join(METHODS))
    p.add_argument("--clients", type=int, default=15, help="K (all take part every round)")
    p.add_argument("--groups", type=int, default=5, help="k, true groups and KMeans clusters")
    p.add_argument("--alpha", type=float, default=0.2, help="Dirichlet alpha between groups")
    p.add_argument("--train-samples", type=int, default=6000, help="stratified MNIST training subset (0: all)")
    p.add_argument("--test-samples", type=int, default=50, help="personal test images per device")
    p.add_argument("--rounds", type=int, default=12, help="T, warm-up included")
    p.add_argument("--warmup-rounds", type=int, default=2, help="PRISAM's local dense rounds (notes 3)")
    p.add_argument("--local-steps", type=int, default=4, help="local SGD steps per round")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--neighbors", type=int, default=3, help="M, random peers per round (not PRISAM's groups)")
    p.add_argument("--density", type=float, default=0.5, help="DisPFL's density")
    p.add_argument("--export-client", type=int, default=0, help="the client whose PRISAM model is exported")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for training")
    p.add_argument("--latency-trials", type=int, default=7, help="interleaved passes of the latency measurement")
    p.add_argument("--latency-repeats", type=int, default=50, help="forwards per pass (their median is the pass)")
    p.add_argument("--latency-only", action="store_true",
                   help="only (re)measure the dense vs exported latency (compare_prisam_latency.json), then render")
    p.add_argument("--fresh", action="store_true", help="ignore runs already in <out>/compare_prisam_<partition>.json")
    p.add_argument("--render-only", action="store_true",
                   help="merge the per-partition files into compare_prisam.{json,md} and redo the plots, no runs")
    args = p.parse_args(argv)
    args.partition_list = [s.strip() for s in args.partitions.split(",") if s.strip()]
    args.method_list = [s.strip() for s in args.methods.split(",") if s.strip()]
    if not args.partition_list or any(x not in PARTITIONS for x in args.partition_list):
        p.error(f"--partitions: allowed {', '.join(PARTITIONS)}; got {args.partition_list}")
    if not args.method_list or any(x not in METHODS for x in args.method_list):
        p.error(f"--methods: allowed {', '.join(METHODS)}; got {args.method_list}")
    for key in ("clients", "groups", "rounds", "local_steps", "batch_size", "neighbors", "threads", "test_samples",
                "latency_trials", "latency_repeats"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.groups > args.clients or not 1 <= args.neighbors < args.clients:
        p.error("need --groups <= --clients and 1 <= --neighbors < --clients")
    if not 0 <= args.warmup_rounds < args.rounds:
        p.error("--warmup-rounds must be in [0, --rounds)")
    if not 0 <= args.export_client < args.clients:
        p.error("--export-client must be a client id")
    if not args.render_only and not (Path(args.root) / "MNIST" / "raw").is_dir():
        p.error(f"--root {args.root!r} has no MNIST/raw folder (torchvision layout)")
    return args


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("seed", "clients", "groups", "alpha", "train_samples", "test_samples", "rounds", "warmup_rounds",
            "local_steps", "batch_size", "lr", "neighbors", "density", "export_client", "threads")
    return {k: getattr(args, k) for k in keys} | {"dataset": "mnist", "arch": "resnet20", "machine": machine()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return {k: v for k, v in a.items() if k != "machine"} == {k: v for k, v in b.items() if k != "machine"}


def merge(out: Path, config: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {"config": config, "results": {}}
    for p in PARTITIONS:
        path = out / f"compare_prisam_{p}.json"
        if path.exists():
            part = json.loads(path.read_text())
            if _same(part["config"], config):
                data["results"][p] = part["runs"]
                data.setdefault("wall_time_s", {})[p] = sum(r["wall_time_s"] for r in part["runs"].values())
            else:
                print(f"note: {path} holds another setting; left out", file=sys.stderr)
    lat = out / "compare_prisam_latency.json"
    if lat.exists():
        data["latency"] = json.loads(lat.read_text())
    return data


def write_reports(out: Path, data: dict[str, Any]) -> list[Path]:
    (out / "compare_prisam.json").write_text(json.dumps(data, indent=1, default=float))
    (out / "compare_prisam.md").write_text(render_markdown(data))
    return [out / "compare_prisam.json", out / "compare_prisam.md", *plot_results(data, out)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = config_of(args)
    if args.render_only:
        old = out / "compare_prisam.json"
        if old.exists():  # render the setting the JSON holds
            config = json.loads(old.read_text())["config"]
        data = merge(out, config)
        paths = write_reports(out, data)
        print("rendered " + ", ".join(str(p) for p in paths))
        return 0
    def latency() -> None:
        print(f"latency: {args.latency_trials} interleaved passes ...", flush=True)
        lat = interleaved_latency([0.3, 0.5, 0.7], args.latency_trials, args.latency_repeats)
        (out / "compare_prisam_latency.json").write_text(json.dumps(lat, indent=1))
        print("  CPU time " + ", ".join(f"{k}: {v['cpu_ms']:.3f} ms" for k, v in lat["models"].items()), flush=True)

    if args.latency_only:
        old = out / "compare_prisam.json"
        if old.exists():
            config = json.loads(old.read_text())["config"]
        latency()
        paths = write_reports(out, merge(out, config))
        print("rendered " + ", ".join(str(p) for p in paths))
        return 0
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*personal test sets deviate.*")
    workdir = tempfile.mkdtemp(prefix="compare_prisam_")
    t0 = time.perf_counter()
    try:
        for p in args.partition_list:
            path = out / f"compare_prisam_{p}.json"
            part = {"config": config, "runs": {}}
            if path.exists() and not args.fresh:
                old = json.loads(path.read_text())
                if _same(old["config"], config):
                    part["runs"] = old["runs"]
            for m in args.method_list:
                if m in part["runs"]:
                    print(f"[{p}] {LABELS[m]}: reused", flush=True)
                    continue
                rec = run_one(m, args, p, workdir)
                part["runs"][m] = rec
                path.write_text(json.dumps(part, indent=1, default=float))
                extra = (f", compact {rec['mmacs']:.2f} MMACs, final ARI {_num(rec.get('final_ari'))}"
                         if m.startswith("prisam") else "")
                print(f"[{p}] {LABELS[m]}: final {_pct(rec['final_accuracy'])}% (best {_pct(rec['best_accuracy'])}%), "
                      f"busiest {rec['busiest_mb_per_round']:.3f} MB/round{extra} in {rec['wall_time_s']:.0f} s "
                      f"(elapsed {time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if set(args.partition_list) == set(PARTITIONS):  # split runs: measure once, with --latency-only, after both
        latency()
    paths = write_reports(out, merge(out, config))
    print(f"wrote {', '.join(str(p) for p in paths)} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
