"""How much a federated round costs beyond its bare SGD steps.

Two settings, both DisPFL under ``FederatedTrainer`` on one CPU thread:

* ``digits``: K = 20 clients on the embedded digits set (the README's main job: cnn_digits,
  Dir(0.3), M = 4, E = 2, batch 16, 45 test samples per client);
* ``resnet``: K = 4 clients of CIFAR ResNet18 (11.2M parameters) on a few tiny batches of random
  32x32 images (16 per client, batch 8, E = 1, 8 test samples, M = 2): the per-client cost of
  copies, masks, aggregation and RigL on a model of the papers' size.

A round's wall time (``time/wall_round_s``; the first round is a warm-up, the median of the
rest is reported) is compared with the same work done bare on a plain copy of the model (no
masks, no hooks, no store): the same number of forward/backward/SGD steps on batches of the
same sizes, one extra forward/backward per client for RigL's regrowth gradient, and the two
evaluations of every client's test set (before and after training). The batches are built
beforehand; building them (shuffle, normalize) is timed separately. Overhead per client =
(round - bare compute - batch building) / K: loading and publishing states, masked
aggregation, mask hooks, RigL's selection, accounting and callbacks.

    python benchmarks/round_overhead.py                   # both settings, ~2 min
    python benchmarks/round_overhead.py --settings digits
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.datamodules.datasets import DATASETS
from lightning_dfl.datamodules.images import ImageData, Split
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DisPFL
from lightning_dfl.models import build_model
from lightning_dfl.module import SparseClassifier
from lightning_dfl.seeding import derive_seed

SETTINGS: dict[str, dict[str, Any]] = {
    "digits": dict(dataset="digits", arch="cnn_digits", clients=20, neighbors=4, local_epochs=2, batch_size=16,
                   test_samples=45, lr=0.05, partition="dirichlet"),
    "resnet": dict(dataset="random32", arch="resnet18", clients=4, neighbors=2, local_epochs=1, batch_size=8,
                   test_samples=8, lr=0.1, partition="iid", train_per_client=16),
}


def register_random32(clients: int, per_client: int, test_per_client: int, seed: int) -> str:
    """Register ``random32``: random uint8 3x32x32 images with random labels of 10 classes."""

    def load_random32(root: str, download: bool = False) -> Split:
        g = torch.Generator().manual_seed(seed)
        classes = [str(c) for c in range(10)]

        def part(n: int) -> ImageData:
            return ImageData(torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g),
                             torch.randint(0, 10, (n,), generator=g), classes)

        return Split(part(clients * per_client), part(max(200, 4 * clients * test_per_client)))

    DATASETS["random32"] = load_random32
    return "random32"


def build(setting: dict[str, Any], seed: int) -> tuple[FederatedDataModule, SparseClassifier, DisPFL]:
    if setting["dataset"] == "random32":
        register_random32(setting["clients"], setting["train_per_client"], setting["test_samples"], seed)
    dm = FederatedDataModule(dataset=setting["dataset"], num_clients=setting["clients"],
                             partition=setting["partition"], alpha=0.3, batch_size=setting["batch_size"],
                             test_samples_per_client=setting["test_samples"], augment=False, seed=seed)
    model = SparseClassifier(setting["arch"], density=0.5, lr=setting["lr"], seed=seed)
    return dm, model, DisPFL(num_neighbors=setting["neighbors"], drop_fraction=0.5, regrowth="gradient")


#: (file suffix, function) -> label: where a profiled round spends its time (cumulative; rows may nest:
#: the RigL callback contains the regrowth gradient and the mask selection).
PROFILED = {
    ("federation/algorithms/training.py", "train_locally"): "local training (masked model under Fabric)",
    ("federation/metrics/evaluation.py", "accuracy"): "evaluations",
    ("federation/algorithms/base.py", "message"): "messages (views of the store, bytes counted)",
    ("federation/algorithms/base.py", "aggregate"): "masked aggregation (gather + average)",
    ("federation/loop/executor.py", "load"): "loading weights into the worker",
    ("federation/store/dense.py", "publish"): "publishing to the store",
    ("federation/store/dense.py", "set_mask"): "storing the next mask",
    ("callbacks/rigl.py", "on_client_end"): "RigL callback, total",
    ("sparse/rigl.py", "dense_gradients"): "  RigL dense regrowth gradient",
    ("sparse/rigl.py", "rigl_masks"): "  RigL drop/regrow selection",
    ("sparse/masks.py", "apply_"): "mask re-application (after steps, loads)",
}


class ProfileRound(FederatedCallback):
    """Runs cProfile over one round (from its federated start hook to its end hook)."""

    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx
        self.profiler = cProfile.Profile()

    def on_federated_round_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_round == self.round_idx:
            self.profiler.enable()

    def on_federated_round_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_round == self.round_idx:
            self.profiler.disable()

    def breakdown(self) -> dict[str, float]:
        """Cumulative seconds of the functions of :data:`PROFILED`, by label."""
        stats = pstats.Stats(self.profiler).stats  # (file, line, function) -> (cc, nc, tt, cumtime, callers)
        out: dict[str, float] = {}
        for (filename, _, function), (_, _, _, cumtime, _) in stats.items():
            path = filename.replace(os.sep, "/")
            label = next((lab for (suffix, fn), lab in PROFILED.items() if fn == function and path.endswith(suffix)),
                         None)
            if label is not None:
                out[label] = out.get(label, 0.0) + cumtime
        return {lab: out[lab] for lab in PROFILED.values() if lab in out}


def time_rounds(setting: dict[str, Any], rounds: int, seed: int) -> dict[str, Any]:
    """Fit ``rounds`` timed rounds plus one round under cProfile; read the rounds' wall times."""
    dm, model, algorithm = build(setting, seed)
    profile = ProfileRound(rounds)
    trainer = FederatedTrainer(algorithm, rounds=rounds + 1, local_epochs=setting["local_epochs"],
                               accelerator="cpu", logger=False, seed=seed, enable_progress_bar=False, cpu_threads=1,
                               callbacks=[profile])
    trainer.fit(model, dm)
    walls = [m["time/wall_round_s"] for m in trainer.history]
    return {"round_s": walls[:rounds], "timed_round_s": statistics.median(walls[1:rounds]),
            "train_samples": [m["samples/train"] for m in trainer.history[:rounds]], "datamodule": dm,
            "profiled_round_s": walls[rounds], "profile_s": profile.breakdown()}


def time_batches(dm: FederatedDataModule, setting: dict[str, Any], seed: int) -> tuple[float, list, list]:
    """Build every client's batches as the trainer would (E passes + 2 test passes); return the time."""
    train, test = [], []
    start = time.perf_counter()
    for k in range(dm.num_clients):
        generator = torch.Generator().manual_seed(derive_seed(seed, "data", 1, k))
        batches = dm.client_train_batches(k, generator)
        train.append([b for _ in range(setting["local_epochs"]) for b in batches])
        test_batches = dm.client_test_batches(k)
        test.append([list(test_batches), list(test_batches)])
    return time.perf_counter() - start, train, test


def time_bare(setting: dict[str, Any], dm: FederatedDataModule, train: list, test: list, repeats: int) -> dict:
    """The round's compute on a plain model: SGD steps, one regrowth gradient batch, two evaluations."""
    torch.manual_seed(0)
    net = build_model(setting["arch"], num_classes=dm.num_classes, in_channels=dm.in_channels,
                      image_size=dm.image_size)
    optimizer = torch.optim.SGD(net.parameters(), lr=setting["lr"], momentum=0.0, weight_decay=5e-4)
    steps = sum(len(t) for t in train)

    def one_round() -> tuple[float, float, float]:
        t_sgd = t_grad = t_eval = 0.0
        for k in range(dm.num_clients):
            t0 = time.perf_counter()
            net.eval()
            with torch.no_grad():
                for x, y in test[k][0]:
                    net(x).argmax(1).eq(y).sum()
            t1 = time.perf_counter()
            net.train()
            for x, y in train[k]:
                loss = F.cross_entropy(net(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            net.eval()
            with torch.no_grad():
                for x, y in test[k][1]:
                    net(x).argmax(1).eq(y).sum()
            t3 = time.perf_counter()
            net.train()
            x, y = train[k][0]
            F.cross_entropy(net(x), y).backward()  # RigL's dense regrowth gradient
            net.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            t_eval += (t1 - t0) + (t3 - t2)
            t_sgd += t2 - t1
            t_grad += t4 - t3
        return t_sgd, t_grad, t_eval

    one_round()  # warm-up
    runs = [one_round() for _ in range(repeats)]
    sgd, grad, ev = (statistics.median(r[i] for r in runs) for i in range(3))
    return {"sgd_s": sgd, "regrowth_grad_s": grad, "eval_s": ev, "bare_s": sgd + grad + ev, "sgd_steps": steps}


def measure(name: str, rounds: int, repeats: int, seed: int) -> dict[str, Any]:
    setting = SETTINGS[name]
    torch.set_num_threads(1)
    timed = time_rounds(setting, rounds, seed)
    dm = timed.pop("datamodule")
    batch_s, train, test = time_batches(dm, setting, seed)
    batch_runs = [batch_s] + [time_batches(dm, setting, seed)[0] for _ in range(repeats - 1)]
    bare = time_bare(setting, dm, train, test, repeats)
    k = setting["clients"]
    round_s = timed["timed_round_s"]
    batches = statistics.median(batch_runs)
    params = sum(p.numel() for p in build_model(setting["arch"], num_classes=dm.num_classes,
                                                in_channels=dm.in_channels, image_size=dm.image_size).parameters())
    return {
        "setting": {k2: v for k2, v in setting.items()}, "parameters": params,
        **timed, **bare, "batch_building_s": batches,
        "overhead_s": round_s - bare["bare_s"] - batches,
        "overhead_per_client_ms": 1000 * (round_s - bare["bare_s"] - batches) / k,
        "overhead_incl_batches_per_client_ms": 1000 * (round_s - bare["bare_s"]) / k,
        "round_per_client_ms": 1000 * round_s / k,
        "bare_per_client_ms": 1000 * bare["bare_s"] / k,
        "overhead_share": (round_s - bare["bare_s"] - batches) / round_s,
    }


def render(results: dict[str, Any]) -> str:
    lines = [
        "# Round overhead: a DisPFL round vs its bare compute", "",
        f"Generated by `benchmarks/round_overhead.py` on {results['machine']}, one torch thread. Round = median "
        "wall time of the rounds after the first; bare = the same SGD steps, one regrowth gradient batch and two "
        "test-set evaluations per client on a plain model; batches = building the same batches (shuffle, "
        "normalize). Overhead = round - bare - batches.", "",
        "| setting | K | params | SGD steps | round (s) | bare SGD (s) | regrowth grad (s) | evals (s) | "
        "batches (s) | overhead (s) | overhead / client (ms) | share of round |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["settings"].items():
        s = r["setting"]
        lines.append(
            f"| {name} ({s['arch']}) | {s['clients']} | {r['parameters']:,} | {r['sgd_steps']} | "
            f"{r['timed_round_s']:.3f} | {r['sgd_s']:.3f} | {r['regrowth_grad_s']:.3f} | {r['eval_s']:.3f} | "
            f"{r['batch_building_s']:.3f} | {r['overhead_s']:.3f} | {r['overhead_per_client_ms']:.1f} | "
            f"{100 * r['overhead_share']:.0f}% |")
    lines += ["", "Per-round wall times (s), the first being the warm-up: " + "; ".join(
        f"{name}: " + ", ".join(f"{w:.3f}" for w in r["round_s"]) for name, r in results["settings"].items()), ""]
    names = list(results["settings"])
    lines += ["## Where a round goes (one more round under cProfile, cumulative ms per client; rows may nest)", "",
              "| part | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    labels = list(dict.fromkeys(lab for r in results["settings"].values() for lab in r["profile_s"]))
    for label in ["profiled round"] + labels:
        cells = []
        for name in names:
            r = results["settings"][name]
            value = r["profiled_round_s"] if label == "profiled round" else r["profile_s"].get(label)
            cells.append("-" if value is None else f"{1000 * value / r['setting']['clients']:.1f}")
        lines.append(f"| {label.replace('  ', '&nbsp;&nbsp;')} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--settings", default="digits,resnet", help="comma-separated subset of: " + ", ".join(SETTINGS))
    p.add_argument("--rounds", type=int, default=4, help="rounds per setting (the first is a warm-up)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of the bare timing (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [n for n in names if n not in SETTINGS]
    if bad or not names:
        p.error(f"--settings: unknown {bad or 'empty'}; allowed: {', '.join(SETTINGS)}")
    if args.rounds < 2:
        p.error(f"--rounds must be >= 2 (the first is a warm-up), got {args.rounds}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    warnings.filterwarnings("ignore", message=".*personal test sets deviate.*")

    results: dict[str, Any] = {"machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), no GPU, "
                                          f"torch {torch.__version__}", "settings": {}}
    for name in names:
        results["settings"][name] = measure(name, args.rounds, args.repeats, args.seed)
        r = results["settings"][name]
        print(f"{name}: round {r['timed_round_s']:.3f} s, bare {r['bare_s']:.3f} s, batches "
              f"{r['batch_building_s']:.3f} s -> overhead {r['overhead_per_client_ms']:.1f} ms per client", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "round_overhead.json").write_text(json.dumps(results, indent=1))
    (out / "round_overhead.md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
