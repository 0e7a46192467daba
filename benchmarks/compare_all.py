"""Every registered algorithm on one seed and one budget (DA-DPFL Tables I-II, scaled down, on the digits).

Each algorithm runs from its own ``configs/<name>_digits.yaml`` (through the CLI's config loading,
so its settings are exactly the config's), overriding only the partition and what must be equal
across algorithms: the number of clients K, the rounds T, the local epochs E, the seed, the personal
test-set size, and one torch thread. Two exceptions follow from the algorithms themselves:

- BEER runs one gradient-tracking iteration (one minibatch) per round, so it gets
  T x E x (mean minibatches per client epoch) rounds, evaluated every E x (that) rounds: the same
  number of minibatches as the others' T rounds of E epochs, and T evaluations.
- PSFL's config trains 5 local steps a round; here it trains E epochs like everyone else (its
  warm-up rounds, which train nothing, count in its T rounds as the engine counts them).

Results go to ``<out>/compare_all.{md,json}`` (every round's metrics of every run in the JSON) and
``<out>/compare_all_acc_vs_comm.png`` (needs matplotlib, the project's ``plots`` extra; without it
the plot is skipped with a note). Runs already in the JSON with the same setting are kept with
``--reuse``; ``--render-only`` redoes the .md and the plot from the JSON.

    python benchmarks/compare_all.py --rounds 40            # ~15 min on 2 shared CPU cores, 1 thread
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_dfl.cli import FederatedCLI
from lightning_dfl.federation import ALGORITHMS
from lightning_dfl.federation.metrics.report import RunSummary, mean_client_density

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
NAMES = tuple(ALGORITHMS)  # the registry's order
LABELS = {"dispfl": "DisPFL", "dadpfl": "DA-DPFL", "dpsgd": "D-PSGD", "local": "Local", "fedavg": "FedAvg",
          "psfl": "PSFL", "fedavg_ft": "FedAvg-FT", "dpsgd_ft": "D-PSGD-FT", "ditto": "Ditto",
          "dfedavgm": "DFedAvgM", "dfedsam": "DFedSAM", "feddst": "FedDST", "subfedavg": "SubFedAvg",
          "fedfomo": "FedFomo", "gossipfl": "GossipFL", "beer": "BEER", "prisam": "PRISAM"}
PARTITIONS = {"dirichlet": "Dir(0.3)", "pathological": "Pat(2)"}
#: what each headline metric is (RunSummary's acc/headline)
METRIC_TEXT = {
    "acc/personal_mean": "each client's own model on its test set",
    "acc/consensus_mean": "the shared (server or averaged) model on every client's test set",
    "acc/finetune_mean": "the shared model fine-tuned one local round by each client, on its test set",
    "acc/global": "the global model on the official test split",
    "acc/subnetwork_mean": "the server model under each client's mask, on its test set",
}
EXTRA_ACC = ("acc/personal_mean", "acc/consensus_mean", "acc/subnetwork_mean", "acc/trained_mean",
             "acc/finetune_mean", "acc/global")
MB = 1e6


# --------------------------------------------------------------------------- one run

def labelled(name: str, algorithm: Any) -> str:
    """The table's name of a run: the method's name, with the settings that depart from the original
    rule in brackets (``Algorithm.deviations``: "BEER (fresh minibatch)")."""
    deviations = algorithm.deviations()
    return f"{LABELS.get(name, name)} ({', '.join(deviations)})" if deviations else LABELS.get(name, name)


def _row_label(name: str, rec: dict[str, Any]) -> str:
    """A record's label (older records may hold the bare registry name)."""
    return LABELS.get(name, name) if rec.get("label", name) == name else rec["label"]


def cli_args(name: str, args: argparse.Namespace, partition: str, steps_per_epoch: int) -> list[str]:
    """The config and its overrides for one run."""
    rounds, extra = args.rounds, []
    if name == "beer":  # one minibatch per round: the same number of minibatches, T evaluations
        rounds = args.rounds * args.local_epochs * steps_per_epoch
        extra.append(f"--trainer.eval_every={args.local_epochs * steps_per_epoch}")
    if name == "psfl":  # its config trains local_steps; here E epochs, like every other algorithm
        extra.append("--trainer.local_steps=null")
    return [
        "--config", str(CONFIGS / f"{name}_digits.yaml"),
        f"--trainer.rounds={rounds}", f"--trainer.local_epochs={args.local_epochs}", f"--trainer.seed={args.seed}",
        f"--trainer.cpu_threads={args.threads}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        f"--data.num_clients={args.clients}", f"--data.partition={partition}", "--data.alpha=0.3",
        "--data.classes_per_client=2", f"--data.test_samples_per_client={args.test_samples}",
        *extra,
    ]


#: the per-round metrics kept in the results file (every metric of every run would be megabytes)
HISTORY_KEYS = ("round", "acc/headline", "acc/personal_mean", "acc/consensus_mean", "acc/global", "comm/busiest_bytes",
                "density/mean", "flops/train_total", "train/loss")


def headline_metric(history: list[dict[str, float]]) -> str:
    """The acc/* metric that ``acc/headline`` equals at every evaluated round (the most specific one)."""
    rows = [m for m in history if "acc/headline" in m]
    keys = [k for k in EXTRA_ACC if rows and all(k in m and m[k] == m["acc/headline"] for m in rows)]
    specific = [k for k in keys if k != "acc/personal_mean"]
    return (specific or keys or ["acc/headline"])[0]


def steps_per_epoch(args: argparse.Namespace, partition: str) -> int:
    """Mean minibatches per client epoch (rounded) of the partition, from the datamodule a run would use."""
    cli = FederatedCLI(args=cli_args("dpsgd", args, partition, 1), run=False)
    dm = cli.datamodule
    dm.prepare_data()
    dm.setup("fit")
    sizes = [dm.client_train_size(k) for k in range(args.clients)]
    return max(1, round(sum(math.ceil(s / dm.batch_size) for s in sizes) / len(sizes)))


#: benchmark-only variants (``--probes``): name -> (algorithm, extra overrides, what it is)
PROBES: dict[str, tuple[str, list[str], str]] = {
    "fedfomo_noagg": ("fedfomo", [], "FedFomo whose update always keeps theta_i (no aggregation): Local on "
                                     "FedFomo's 80% training part of each client's data"),
    "fedfomo_normalized": ("fedfomo", ["--trainer.algorithm.init_args.affinity_update=normalized"],
                           "FedFomo with the code's normalized affinity update"),
    "beer_same_batch": ("beer", ["--trainer.algorithm.init_args.gradient_difference=same_batch"],
                        "BEER with optim/BEER.py's same-minibatch gradient difference (the class default)"),
    "beer_identity": ("beer", ["--trainer.algorithm.init_args.compressor=identity"],
                      "BEER without compression (plain gradient tracking, dense float32 messages)"),
}


def run_one(name: str, args: argparse.Namespace, partition: str, spe: int,
            probe: str | None = None) -> dict[str, Any]:
    argv = cli_args(name, args, partition, spe) + (PROBES[probe][1] if probe else [])
    cli = FederatedCLI(args=argv, run=False)
    trainer = cli.trainer
    if probe == "fedfomo_noagg":  # the split and the local training stay; the weights are never applied
        trainer.algorithm.update = lambda ctx, messages, val: None
    start = time.perf_counter()
    failure = None
    try:
        trainer.fit(cli.model, cli.datamodule)
    except FloatingPointError as err:  # a probe may diverge: keep its rounds up to there
        if probe is None:
            raise
        failure = str(err).split(";")[0]
    wall = time.perf_counter() - start
    history = [dict(m) for m in trainer.history]
    summary = RunSummary.from_history(trainer.algorithm, history, wall, None,
                                      mean_client_density(trainer.store, trainer.num_clients))
    metric = headline_metric(history)
    busiest_total = sum(m.get("comm/busiest_bytes", 0.0) for m in history)
    finals = {}
    for key in EXTRA_ACC:
        values = [m[key] for m in history if key in m]
        if values:
            finals[key] = {"final": values[-1], "best": max(values)}
    record: dict[str, Any] = {
        "label": labelled(name, trainer.algorithm),
        "class": type(trainer.algorithm).__name__,
        "overrides": argv[2:],
        "rounds_run": summary.rounds,
        "headline": trainer.algorithm.headline,
        "headline_metric": metric,
        "final_accuracy": summary.final_accuracy,
        "best_accuracy": summary.best_accuracy,
        "accuracies": finals,
        "final_density": summary.final_density,
        "flops_total": summary.flops_total,
        "flops_finetune_total": sum(m.get("flops/finetune_total", 0.0) for m in history),
        "flops_per_client_round": summary.flops_per_client_round,
        "busiest_mb_per_round": summary.busiest_mb_per_round,
        "busiest_mb_total": busiest_total / MB,
        "busiest_mask_mb_total": sum(m.get("comm/busiest_mask_bytes", 0.0) for m in history) / MB,
        "mean_delay": summary.mean_delay,
        "fedfomo_positive": [m["fedfomo/positive"] for m in history if "fedfomo/positive" in m] or None,
        "wall_time_s": wall,
        "failure": failure,
        "history": [{k: m[k] for k in HISTORY_KEYS if k in m} for m in history],  # the curves, not every metric
    }
    del cli, trainer
    gc.collect()  # a finished trainer's store is freed only by the cycle collector
    return record


# --------------------------------------------------------------------------- report

def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}"


def _metric_short(key: str) -> str:
    return key.removeprefix("acc/")


def render_markdown(data: dict[str, Any]) -> str:
    cfg = data["config"]
    parts = [p for p in PARTITIONS if p in data["results"]]
    algs = [a for a in NAMES if any(a in data["results"][p] for p in parts)]
    spe = ", ".join(f"{PARTITIONS[p]}: {data['spe'][p]}" for p in parts)
    lines = [
        "# Every algorithm on one budget (digits)",
        "",
        f"Generated by `benchmarks/compare_all.py` (seed {cfg['seed']}): {cfg['command']}",
        "",
        f"Setting: the embedded digits set, K = {cfg['clients']} clients, T = {cfg['rounds']} rounds of "
        f"E = {cfg['local_epochs']} local epochs, {cfg['test_samples']} personal test samples per client; every "
        "other setting is the algorithm's `configs/<name>_digits.yaml` (model `cnn_digits`, batch 16, lr 0.05, ...). "
        f"BEER: one iteration per round, so T x E x ({spe}) "
        "(mean minibatches per client epoch) rounds. PSFL: E epochs instead of its config's 5 steps; its 5 "
        "warm-up rounds count in T. PRISAM's config trains `resnet20` (BatchNorm channels to prune), not "
        f"`cnn_digits`, and is written for a cluster partition. Machine: {cfg['machine']}.",
        "",
        "## Accuracy and cost (as Tables I-II)",
        "",
    ]
    for p in parts:
        res = data["results"][p]
        lines += [
            f"### {PARTITIONS[p]}", "",
            "| method | accuracy metric | final acc % | best acc % | busiest MB (run) | busiest MB/round | "
            "train FLOPs (total) | final density | wall s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for a in algs:
            rec = res.get(a)
            if rec is None:
                continue
            ft = f" (+{rec['flops_finetune_total']:.2e} FT)" if rec.get("flops_finetune_total") else ""
            lines.append(
                f"| {_row_label(a, rec)} | {_metric_short(rec['headline_metric'])} | {_pct(rec['final_accuracy'])} | "
                f"{_pct(rec['best_accuracy'])} | {rec['busiest_mb_total']:.1f} | {rec['busiest_mb_per_round']:.3f} | "
                f"{rec['flops_total']:.2e}{ft} | {rec['final_density']:.3f} | {rec['wall_time_s']:.0f} |")
        lines.append("")
    lines += ["## Other accuracies (final, %)", "",
              "| method | " + " | ".join(f"{PARTITIONS[p]} {_metric_short(k)}" for p in parts
                                        for k in ("acc/personal_mean", "acc/consensus_mean")) + " | other |",
              "|---|" + "---|" * (2 * len(parts) + 1)]
    for a in algs:
        cells, other = [], []
        for p in parts:
            rec = data["results"][p].get(a)
            accs = rec["accuracies"] if rec else {}
            for k in ("acc/personal_mean", "acc/consensus_mean"):
                cells.append(_pct(accs[k]["final"]) if k in accs else "-")
            for k in ("acc/subnetwork_mean", "acc/trained_mean"):
                if k in accs:
                    other.append(f"{PARTITIONS[p]} {_metric_short(k)} {_pct(accs[k]['final'])}")
        label = next((_row_label(a, data["results"][p][a]) for p in parts if a in data["results"][p]), LABELS.get(a, a))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {'; '.join(other) or '-'} |")
    probes = data.get("probes", {})
    if probes:
        names = [n for n in PROBES if any(n in probes.get(p, {}) for p in parts)]
        lines += ["", "## Probes (benchmark-only variants, same setting)", "",
                  "| probe | what | " + " | ".join(f"{PARTITIONS[p]} final (best) %" for p in parts) + " |",
                  "|---|---|" + "---|" * len(parts)]
        for n in names:
            cells = []
            for p in parts:
                rec = probes.get(p, {}).get(n)
                cells.append("-" if rec is None else f"{_pct(rec['final_accuracy'])} ({_pct(rec['best_accuracy'])})"
                             + (f", every client non-finite at {rec['failure'].split(':')[0]}" if rec.get("failure")
                                else ""))
            lines.append(f"| {n} | {PROBES[n][2]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Accuracy metrics: " + "; ".join(f"`{_metric_short(k)}` = {v}" for k, v in METRIC_TEXT.items()) + ". "
        "Each row's metric is its RunSummary headline (`acc/headline`). `personal_mean` is the mean over the "
        "clients that ran a task in the round: FedAvg(-FT), Ditto's global step, FedDST and SubFedAvg sample 5 "
        "of 20 clients a round (their configs' `clients_per_round`), so for FedAvg, FedDST and SubFedAvg it "
        "scores only the last round's 5 trained clients (SubFedAvg's headline is `subnetwork_mean`, every "
        "client); PSFL takes all 20 (N0 = 20). A label's brackets name settings that depart from the "
        "original method's rule (BEER's fresh minibatch, GossipFL's ratio and local work per gossip).",
        "",
        "Units: MB = 10^6 bytes of values at the busiest node (max of download and upload over nodes, the server "
        "included), summed over the run (`busiest MB (run)`) and its mean per round (as Table II; BEER's rounds are "
        "single iterations, so compare the run totals); masks are not included (JSON: `busiest_mask_mb_total`). "
        "Train FLOPs: `flops/train_total` summed over rounds (Conv/Linear multiply-adds x 2, training = 3 x forward; "
        "FedFomo's validation passes included; FT's fine-tuning FLOPs, which the engine keeps apart, in brackets). "
        "Final density: mean over clients of the final masks' density. Wall s: this machine, 1 thread, shared CPU.",
        "",
        f"Wall time: {data['wall_time_s']:.0f} s for the table's runs"
        + (f", {data['probe_wall_time_s']:.0f} s for the probes" if data.get("probe_wall_time_s") else "") + ".",
        "",
    ]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> Path | None:
    """Final accuracy against the busiest node's megabytes, one panel per partition: each point named beside it
    (labels placed apart, with a leader line where moved), the legend outside the panels."""
    from lightning_dfl.plots import agg_figure, place_labels

    parts = [p for p in PARTITIONS if p in data["results"]]
    try:
        fig = agg_figure(6.0 * len(parts) + 3.2, 5.5)
    except ImportError:
        print("note: matplotlib is not installed (the project's `plots` extra); no plot", file=sys.stderr)
        return None
    axes = fig.subplots(1, len(parts), squeeze=False)[0]
    markers = "osD^v<>pPX*hH8d"
    handles: dict[str, Any] = {}
    points = []
    for ax, p in zip(axes, parts):
        xs, ys, names = [], [], []
        for i, a in enumerate(NAMES):
            rec = data["results"][p].get(a)
            if rec is None:
                continue
            x = max(rec["busiest_mb_total"], 1e-2)  # Local sends nothing: drawn at the axis' floor
            label = f"{_row_label(a, rec)} ({_metric_short(rec['headline_metric'])})"
            handles[label] = ax.scatter(x, 100 * rec["final_accuracy"], marker=markers[i % len(markers)], s=55,
                                        color=f"C{i % 10}", label=label)
            xs.append(x)
            ys.append(100 * rec["final_accuracy"])
            names.append(LABELS.get(a, a))
        points.append((ax, xs, ys, names))
        ax.set(xscale="log", xlabel="busiest-node MB over the run (log; Local at 0.01)",
               ylabel="final headline accuracy, %", title=f"digits {PARTITIONS[p]}, K={data['config']['clients']}, "
               f"T={data['config']['rounds']}, E={data['config']['local_epochs']}")
        ax.grid(alpha=0.3, which="both")
    fig.legend(handles=list(handles.values()), loc="outside right center", fontsize="x-small",
               title="algorithm (headline metric)", title_fontsize="x-small")
    for ax, xs, ys, names in points:
        place_labels(ax, xs, ys, names)
    fig.savefig(path)
    return path


def machine() -> str:
    return (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}, shared with other jobs), "
            f"no GPU, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")


# --------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=40, help="T (the digits configs' 40)")
    p.add_argument("--clients", type=int, default=20, help="K")
    p.add_argument("--local-epochs", type=int, default=2, help="E")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--test-samples", type=int, default=45, help="personal test samples per client")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    p.add_argument("--partitions", default=",".join(PARTITIONS), help="comma-separated subset of: "
                   + ", ".join(PARTITIONS))
    p.add_argument("--algorithms", default=None, help="comma-separated subset of: " + ", ".join(NAMES)
                   + " (default: every registered algorithm that has a configs/<name>_digits.yaml)")
    p.add_argument("--probes", default="", help="comma-separated benchmark-only variants to run as well: "
                   + ", ".join(PROBES))
    p.add_argument("--reuse", action="store_true", help="keep runs already in the JSON with the same setting")
    p.add_argument("--render-only", action="store_true", help="redo the .md and the plot from the JSON")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.partition_list = [s.strip() for s in args.partitions.split(",") if s.strip()]
    if args.algorithms is None:
        args.algorithm_list = [a for a in NAMES if (CONFIGS / f"{a}_digits.yaml").is_file()]
        skipped = [a for a in NAMES if a not in args.algorithm_list]
        if skipped:
            print(f"note: no configs/<name>_digits.yaml for {', '.join(skipped)}; skipped", file=sys.stderr)
    else:
        args.algorithm_list = [s.strip() for s in args.algorithms.split(",") if s.strip()]
    bad = [x for x in args.partition_list if x not in PARTITIONS]
    if bad or not args.partition_list:
        p.error(f"--partitions: unknown {bad or 'empty'}; allowed: {', '.join(PARTITIONS)}")
    bad = [x for x in args.algorithm_list if x not in NAMES]
    if bad or not args.algorithm_list:
        p.error(f"--algorithms: unknown {bad or 'empty'}; allowed: {', '.join(NAMES)}")
    missing = [x for x in args.algorithm_list if not (CONFIGS / f"{x}_digits.yaml").is_file()]
    if missing:
        p.error(f"no configs/<name>_digits.yaml for {missing}")
    args.probe_list = [s.strip() for s in args.probes.split(",") if s.strip()]
    bad = [x for x in args.probe_list if x not in PROBES]
    if bad:
        p.error(f"--probes: unknown {bad}; allowed: {', '.join(PROBES)}")
    for key in ("rounds", "clients", "local_epochs", "test_samples", "threads"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.clients < 6:
        p.error("--clients must be >= 6 (the configs' M = 4 neighbours and 5 sampled clients)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*personal test sets deviate.*")
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "compare_all.json", out / "compare_all.md"
    png_path = out / "compare_all_acc_vs_comm.png"
    if args.render_only:
        data = json.loads(json_path.read_text())
        md_path.write_text(render_markdown(data))
        drawn = plot(data, png_path)
        print(f"rendered {md_path}{', ' + str(drawn) if drawn else ''} from {json_path}")
        return 0

    config = {k: getattr(args, k) for k in ("rounds", "clients", "local_epochs", "seed", "test_samples", "threads")}
    parser = build_parser()
    command = " ".join(["python benchmarks/compare_all.py", f"--rounds {args.rounds}"] + [
        f"--{k.replace('_', '-')} {v}" for k, v in config.items() if k != "rounds" and v != parser.get_default(k)]
                       + ([f"--probes {','.join(args.probe_list)}"] if args.probe_list else []))
    data: dict[str, Any] = {"config": {**config, "machine": machine(), "command": f"`{command}`"},
                            "results": {}, "spe": {}, "wall_time_s": 0.0}
    if args.reuse and json_path.exists():
        old = json.loads(json_path.read_text())
        if {k: old["config"].get(k) for k in config} == config:
            data["results"], data["spe"] = old.get("results", {}), old.get("spe", {})
            data["probes"], data["probe_wall_time_s"] = old.get("probes", {}), old.get("probe_wall_time_s", 0.0)
            data["wall_time_s"] = old.get("wall_time_s", 0.0)
        else:
            print(f"note: {json_path} holds another setting; not reused", file=sys.stderr)

    begin = time.perf_counter()
    earlier, probe_time = data["wall_time_s"], 0.0
    for partition in args.partition_list:
        res = data["results"].setdefault(partition, {})
        spe = data["spe"][partition] = steps_per_epoch(args, partition)
        for name in args.algorithm_list:
            if args.reuse and name in res:
                continue
            rec = run_one(name, args, partition, spe)
            res[name] = rec
            data["wall_time_s"] = earlier + time.perf_counter() - begin - probe_time
            print(f"[{partition}] {rec['label']}: {_metric_short(rec['headline_metric'])} final "
                  f"{100 * rec['final_accuracy']:.2f}% (best {100 * rec['best_accuracy']:.2f}%), "
                  f"busiest {rec['busiest_mb_total']:.1f} MB, {rec['flops_total']:.2e} FLOPs, density "
                  f"{rec['final_density']:.3f}, {rec['wall_time_s']:.0f} s "
                  f"(total {data['wall_time_s']:.0f} s)", flush=True)
            json_path.write_text(json.dumps(data, separators=(",", ":"), default=float))
        for probe in args.probe_list:  # their time is not part of the table's wall time
            if args.reuse and probe in data.get("probes", {}).get(partition, {}):
                continue
            start = time.perf_counter()
            rec = run_one(PROBES[probe][0], args, partition, spe, probe=probe)
            probe_time += time.perf_counter() - start
            data["probe_wall_time_s"] = data.get("probe_wall_time_s", 0.0) + time.perf_counter() - start
            rec["label"], rec["probe"] = probe, PROBES[probe][2]
            data.setdefault("probes", {}).setdefault(partition, {})[probe] = rec
            print(f"[{partition}] probe {probe}: {_metric_short(rec['headline_metric'])} final "
                  f"{100 * rec['final_accuracy']:.2f}% (best {100 * rec['best_accuracy']:.2f}%), "
                  f"{rec['wall_time_s']:.0f} s" + (f"; {rec['failure']}" if rec["failure"] else ""), flush=True)
            json_path.write_text(json.dumps(data, separators=(",", ":"), default=float))
    md_path.write_text(render_markdown(data))
    drawn = plot(data, png_path)
    print(f"wrote {md_path}, {json_path}{', ' + str(drawn) if drawn else ''} ({data['wall_time_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
