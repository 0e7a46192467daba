"""A DisPFL round under our ``fit`` against a minimal hand-written PyTorch loop of the same steps.

Both sides run, each in a fresh process, the same work on CIFAR-10 (``cnn_cifar``, E = 1, batch
128, Dir(0.3), ERK density 0.5, random regrowth with the cosine drop schedule): per round every
client averages its own and M random neighbours' published models over the weights each holds
(times its own mask), is tested on its test set, trains one local epoch of masked SGD, is tested
again, publishes, and moves its mask (drop the smallest-magnitude share, regrow as many at random).
The hand loop is one model, a list of state dicts and a few lines per step (no store, hooks,
accounting or logging); it reads its batches from the same data module, so the data pipeline is
the same on both sides. Reported: median round time over the rounds after the first, start-up
(process start to the first round), peak RSS.

    tar -xJf ../shared/data/cifar10-jpg.tar.xz -C ~/.cache/lightning-dfl/
    python benchmarks/round_time.py --root ~/.cache/lightning-dfl/cifar10-jpg          # K=10/M=3 and K=100/M=10
    python benchmarks/round_time.py --root ... --settings k10 --rounds 3 --max-train-samples 5000
"""

from __future__ import annotations

T0 = __import__("time").time()  # process start, before the heavy imports

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

SETTINGS = {"k10": (10, 3), "k100": (100, 10)}
RESULTS = Path(__file__).resolve().parent / "results"


def _datamodule(args, clients):
    from lightning_dfl.datamodules import FederatedDataModule

    return FederatedDataModule(dataset="image_folder", root=args.root, num_clients=clients, partition="dirichlet",
                               alpha=0.3, batch_size=128, test_samples_per_client=args.test_samples,
                               max_train_samples=args.max_train_samples, augment=False, seed=0)


def run_ours(args, clients, neighbors) -> dict:
    import torch

    from lightning_dfl.callbacks.base import FederatedCallback
    from lightning_dfl.federation.algorithms import DisPFL
    from lightning_dfl.federation.trainer import FederatedTrainer
    from lightning_dfl.module import SparseClassifier

    starts: list[float] = []

    class Clock(FederatedCallback):
        def on_federated_round_start(self, trainer, pl_module):
            starts.append(time.time())

    torch.set_num_threads(args.threads)
    options = {"diagnostics": False} if "diagnostics" in FederatedTrainer.__init__.__code__.co_varnames else {}
    trainer = FederatedTrainer(DisPFL(num_neighbors=neighbors, regrowth="random", drop_fraction=0.5),
                               rounds=args.rounds, local_epochs=1, accelerator="cpu", logger=False, seed=0,
                               enable_progress_bar=False, cpu_threads=args.threads, callbacks=[Clock()], **options)
    model = SparseClassifier("cnn_cifar", density=0.5, lr=0.1, lr_decay=1.0, seed=0)
    trainer.fit(model, _datamodule(args, clients))
    walls = [m["time/wall_round_s"] for m in trainer.history]
    accuracy = trainer.history[-1]["acc/personal_mean"]
    return {"startup_s": starts[0] - T0, "round_s": walls, "accuracy": accuracy}


def run_loop(args, clients, neighbors) -> dict:
    """The hand-written loop: the same steps, nothing else."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from lightning_dfl.models import build_model
    from lightning_dfl.sparse.erk import initial_masks

    torch.set_num_threads(args.threads)
    dm = _datamodule(args, clients)
    dm.setup("fit")
    torch.manual_seed(0)
    model = build_model("cnn_cifar", num_classes=10, in_channels=3, image_size=32)
    params = dict(model.named_parameters())
    masked = [n for n, p in params.items() if p.dim() > 1]
    generator = torch.Generator().manual_seed(0)
    masks = [initial_masks({n: params[n] for n in masked}, 0.5, generator=generator) for _ in range(clients)]
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    published = [{n: t * masks[k][n] if n in masks[k] else t.clone() for n, t in start.items()} for k in range(clients)]
    rng = np.random.default_rng(0)

    def test(k):
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in dm.client_test_batches(k):
                correct += int((model(x).argmax(1) == y).sum())
        return correct

    round_s, starts, accuracy = [], [], 0.0
    for t in range(args.rounds):
        starts.append(time.time())
        tic = time.perf_counter()
        fraction = 0.5 / 2 * (1 + math.cos(math.pi * t / args.rounds))
        new, correct, total = [], 0, 0
        for k in range(clients):
            others = [j for j in range(clients) if j != k]
            sources = [k, *rng.choice(others, size=neighbors, replace=False).tolist()]
            with torch.no_grad():
                agg = {}
                for n in start:
                    total_w = sum(published[j][n] for j in sources)
                    if n in masks[k]:
                        held = sum(masks[j][n].float() for j in sources)
                        agg[n] = total_w / held.clamp_min(1) * masks[k][n]
                    else:
                        agg[n] = total_w / len(sources)
                model.load_state_dict(agg)
            test(k)
            model.train()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=5e-4)
            for x, y in dm.client_train_batches(k, torch.Generator().manual_seed(t * clients + k)):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                for n in masked:
                    params[n].grad.mul_(masks[k][n])
                optimizer.step()
                with torch.no_grad():
                    for n in masked:
                        params[n].mul_(masks[k][n])
            correct += test(k)
            total += dm.client_test_size(k)
            new.append({n: v.detach().clone() for n, v in model.state_dict().items()})
            with torch.no_grad():  # random regrowth: drop the smallest magnitudes, regrow as many at random
                for n in masked:
                    mask = masks[k][n]
                    active = int(mask.sum())
                    drop = int(fraction * active)
                    score = torch.where(mask, params[n].abs(), torch.full_like(params[n], float("inf")))
                    dropped = torch.topk(score.flatten(), drop, largest=False).indices
                    flat = mask.flatten().clone()
                    flat[dropped] = False
                    candidates = torch.nonzero(~mask.flatten()).flatten()
                    grown = candidates[torch.randperm(candidates.numel(), generator=generator)[:drop]]
                    flat[grown] = True
                    masks[k][n] = flat.view_as(mask)
        published = new
        accuracy = correct / total
        round_s.append(time.perf_counter() - tic)
    return {"startup_s": starts[0] - T0, "round_s": round_s, "accuracy": accuracy}


def child(args) -> None:
    clients, neighbors = SETTINGS[args.setting]
    result = (run_ours if args.child == "ours" else run_loop)(args, clients, neighbors)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def parent(args) -> None:
    rows = []
    for setting in args.settings:
        for side in ("loop", "ours"):
            cmd = [sys.executable, __file__, "--child", side, "--setting", setting, "--root", args.root,
                   "--rounds", str(args.rounds), "--threads", str(args.threads), "--test-samples",
                   str(args.test_samples), "--max-train-samples", str(args.max_train_samples)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            result.update(setting=setting, side=side, median_round_s=statistics.median(result["round_s"][1:]))
            rows.append(result)
            print(f"{setting} {side}: round {result['median_round_s']:.2f} s, start-up {result['startup_s']:.1f} s, "
                  f"peak RSS {result['peak_rss_mib']:.0f} MiB, accuracy {result['accuracy']:.3f}", flush=True)
    by = {(r["setting"], r["side"]): r for r in rows}
    lines = ["# Round time: our fit against a hand-written loop of the same steps", "",
             f"{platform.machine()}, {args.threads} torch thread(s); CIFAR-10 (jpg folders), cnn_cifar, E = 1, "
             f"batch 128, Dir(0.3), density 0.5, random regrowth; {args.max_train_samples} training images, "
             f"{args.test_samples} test images per client; {args.rounds} rounds, median of rounds 2..{args.rounds}.", "",
             "| K, M | loop round (s) | ours round (s) | ours / loop | loop start-up (s) | ours start-up (s) | "
             "loop peak RSS (MiB) | ours peak RSS (MiB) |", "|---|---|---|---|---|---|---|---|"]
    for setting in args.settings:
        loop, ours = by[(setting, "loop")], by[(setting, "ours")]
        clients, neighbors = SETTINGS[setting]
        lines.append(f"| {clients}, {neighbors} | {loop['median_round_s']:.2f} | {ours['median_round_s']:.2f} | "
                     f"{ours['median_round_s'] / loop['median_round_s']:.2f} | {loop['startup_s']:.1f} | "
                     f"{ours['startup_s']:.1f} | {loop['peak_rss_mib']:.0f} | {ours['peak_rss_mib']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "round_time.md").write_text(text)
    (RESULTS / "round_time.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the unpacked cifar10-jpg folder")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--test-samples", type=int, default=100)
    parser.add_argument("--max-train-samples", type=int, default=10000)
    parser.add_argument("--child", choices=("ours", "loop"), help=argparse.SUPPRESS)
    parser.add_argument("--setting", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
