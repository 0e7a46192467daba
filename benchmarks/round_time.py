"""A DisPFL round under our ``fit`` against an independent hand-written PyTorch loop of the same steps.

Both sides run, each in a fresh process, the same work on CIFAR-10 (``cnn_cifar``, E = 1, batch
128, SGD lr 0.1 with weight decay 5e-4 and no momentum, Dir(0.3), ERK density 0.5, random
regrowth with the cosine drop schedule alpha_t = 0.25 (1 + cos(pi t / T))): per round every
client averages its own and M random neighbours' published models over the weights each holds
(times its own mask), is tested on its test set (evaluation batch 512), trains one local epoch of
masked SGD on augmented batches (random crop 32 with zero padding 4, horizontal flip: what our
CIFAR configs get, ``augment`` left at its default), is tested again, publishes, and moves its
mask (drop the ceil(alpha_t n) smallest-magnitude active weights, regrow as many at random).

The hand loop (:func:`run_loop`) is a floor written the way a researcher would write it in one
file with plain PyTorch and numpy; it imports nothing from ``lightning_dfl``:

* data: the ImageFolder layout ``<root>/{train,test}/<class>/*.jpg`` (classes sorted by name),
  decoded with PIL into NHWC uint8 arrays once and cached as ``.npy`` files under
  ``~/.cache/lightning-dfl/round_time_loop/`` (``--cold`` ignores that cache and decodes again;
  our side then runs with ``cache=False`` too); ``--max-train-samples`` keeps a per-class share of
  the training split; CIFAR-10's published mean/std;
* partition: per class, client proportions from Dir(0.3), zeroed for clients already holding
  N / K samples, the class's shuffled samples cut at the cumulative proportions, redrawn until
  every client holds at least 10 samples (the FedML / DisPFL code's rule, as ours);
* test sets: each client draws ``--test-samples`` images from the test split with its training
  label proportions (largest-remainder rounding, per class without replacement; as ours);
* model: ``cnn_cifar`` written out here (conv5x5(64) - pool - conv5x5(64) - pool - FC 384 - FC 192
  - FC 10, PyTorch's default initialisation); ERK masks (RigL Sec. 3) on every conv / linear
  weight, a different random mask per client;
* batches: a client's uint8 NHWC images are indexed by a numpy permutation, cropped and flipped
  as a torch uint8 NHWC batch, then ``permute(0, 3, 1, 2).float()`` and normalised. That permute
  is a view, and ``float()`` and the normalisation keep its strides, so the batches (training and
  evaluation) reach the model in ``torch.channels_last`` memory format (checked at run time:
  ``batch_channels_last`` in the JSON); the model's weights stay in the default (NCHW) format.

Per round, both sides record wall time, minor page faults (``ru_minflt`` deltas) and system CPU
time (``ru_stime`` deltas) of their own process; ours inside a FederatedCallback between
``on_federated_round_start`` and ``on_federated_round_end``. Reported: medians over the rounds
after the first, start-up (process start to the first round), data load time, peak RSS, final
mean personal accuracy. Both children run as a user runs them: the benchmark sets no environment
variables unless asked with ``--env KEY=VALUE`` (for both children).

    # ~/.cache/lightning-dfl/cifar10-jpg: CIFAR-10 as image folders (train/<class>/*, test/<class>/*),
    # e.g. a cifar10-jpg.tar.xz unpacked there with tar -xJf ARCHIVE -C ~/.cache/lightning-dfl/
    python benchmarks/round_time.py --root ~/.cache/lightning-dfl/cifar10-jpg          # K=10/M=3 and K=100/M=10
    python benchmarks/round_time.py --root ... --settings k10 --rounds 3 --max-train-samples 5000
    python benchmarks/round_time.py --root ... --env MALLOC_MMAP_THRESHOLD_=2000000000 \\
        --env MALLOC_TRIM_THRESHOLD_=4000000000
"""

from __future__ import annotations

T0 = __import__("time").time()  # process start, before the heavy imports

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

SETTINGS = {"k10": (10, 3), "k100": (100, 10)}
RESULTS = Path(__file__).resolve().parent / "results"
LOOP_CACHE = Path("~/.cache/lightning-dfl/round_time_loop").expanduser()
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
BATCH, EVAL_BATCH, LR, WEIGHT_DECAY, ALPHA, DENSITY, DROP0 = 128, 512, 0.1, 5e-4, 0.3, 0.5, 0.5


def usage() -> tuple[int, float]:
    """(minor page faults, system CPU seconds) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_stime


class RoundMeter:
    """Per-round wall time, minor faults and system time, between ``start()`` and ``stop()``."""

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.wall: list[float] = []
        self.minflt: list[int] = []
        self.sys: list[float] = []

    def start(self) -> None:
        if self.first_start is None:
            self.first_start = time.time()
        self._faults, self._sys = usage()
        self._tic = time.perf_counter()

    def stop(self) -> None:
        self.wall.append(time.perf_counter() - self._tic)
        faults, sys_s = usage()
        self.minflt.append(faults - self._faults)
        self.sys.append(sys_s - self._sys)

    def result(self) -> dict:
        return {"startup_s": self.first_start - T0, "round_s": self.wall, "minflt": self.minflt, "sys_s": self.sys}


# ---------------------------------------------------------------------------------------------- ours


def run_ours(args, clients, neighbors) -> dict:
    import torch

    from lightning_dfl.callbacks.base import FederatedCallback
    from lightning_dfl.datamodules import FederatedDataModule
    from lightning_dfl.federation import FederatedTrainer
    from lightning_dfl.federation.algorithms import DisPFL
    from lightning_dfl.module import SparseClassifier

    meter = RoundMeter()

    class Meter(FederatedCallback):
        def on_federated_round_start(self, trainer, pl_module):
            meter.start()

        def on_federated_round_end(self, trainer, pl_module):
            meter.stop()

    torch.set_num_threads(args.threads)
    tic = time.perf_counter()
    # augment left at its default (on for CIFAR-10, as configs/dispfl_cifar10_dir.yaml runs); eval batch 512 (default)
    dm = FederatedDataModule(dataset="image_folder", root=args.root, num_clients=clients, partition="dirichlet",
                             alpha=ALPHA, batch_size=BATCH, test_samples_per_client=args.test_samples,
                             max_train_samples=args.max_train_samples, seed=0, **({"cache": False} if args.cold else {}))
    dm.setup("fit")  # idempotent: fit's own setup call finds it done; timed here to report the data load
    data_s = time.perf_counter() - tic
    assert dm.augment and dm.eval_batch_size == EVAL_BATCH, (dm.augment, dm.eval_batch_size)
    options = {"diagnostics": False} if "diagnostics" in FederatedTrainer.__init__.__code__.co_varnames else {}
    trainer = FederatedTrainer(DisPFL(num_neighbors=neighbors, regrowth="random", drop_fraction=DROP0),
                               rounds=args.rounds, local_epochs=1, accelerator=args.device, logger=False, seed=0,
                               enable_progress_bar=False, cpu_threads=args.threads, callbacks=[Meter()], **options)
    model = SparseClassifier("cnn_cifar", density=DENSITY, lr=LR, lr_decay=1.0, momentum=0.0,
                             weight_decay=WEIGHT_DECAY, seed=0)
    trainer.fit(model, dm)
    result = meter.result()
    result.update(data_s=data_s, accuracy=trainer.history[-1]["acc/personal_mean"],
                  accuracy_aggregated=trainer.history[-1].get("acc/aggregated_mean"),
                  trainer_wall_round_s=[m["time/wall_round_s"] for m in trainer.history],
                  train_samples=sum(dm.client_train_size(k) for k in range(clients)))
    return result


# ---------------------------------------------------------------------------------------------- the loop


def run_loop(args, clients, neighbors) -> dict:
    """The hand-written loop: the same steps in plain PyTorch and numpy, no code of ours."""
    import hashlib

    import numpy as np
    import torch
    import torch.nn.functional as F
    from PIL import Image
    from torch import nn

    torch.set_num_threads(args.threads)
    tic = time.perf_counter()

    # --- data: decode the JPEG folders once into NHWC uint8 arrays, cached as .npy files
    root = Path(args.root).expanduser().resolve()
    cache = LOOP_CACHE / hashlib.sha1(str(root).encode()).hexdigest()[:16]
    names = ("train_x", "train_y", "test_x", "test_y")
    cached = not args.cold and all((cache / f"{n}.npy").is_file() for n in names)
    if cached:
        train_x, train_y, test_x, test_y = (np.load(cache / f"{n}.npy") for n in names)
    else:
        classes = sorted(e.name for e in os.scandir(root / "train") if e.is_dir())

        def decode(half):
            files = [(root / half / c / f, i) for i, c in enumerate(classes)
                     for f in sorted(os.listdir(root / half / c))]
            x = np.stack([np.asarray(Image.open(p).convert("RGB")) for p, _ in files])
            return x, np.array([i for _, i in files], dtype=np.int64)

        (train_x, train_y), (test_x, test_y) = decode("train"), decode("test")
        cache.mkdir(parents=True, exist_ok=True)
        for n, a in zip(names, (train_x, train_y, test_x, test_y)):
            np.save(cache / f"{n}.tmp.npy", a)
            os.replace(cache / f"{n}.tmp.npy", cache / f"{n}.npy")
    num_classes = int(train_y.max()) + 1
    rng = np.random.default_rng(0)
    if args.max_train_samples < len(train_y):  # the same share of every class
        keep = np.concatenate([rng.permutation(np.flatnonzero(train_y == c))[
            :round(args.max_train_samples * np.mean(train_y == c))] for c in range(num_classes)])
        train_x, train_y = train_x[np.sort(keep)], train_y[np.sort(keep)]

    # --- Dirichlet(alpha) label partition over the clients (FedML / DisPFL code's rule)
    n = len(train_y)
    for _ in range(1000):
        parts = [[] for _ in range(clients)]
        for c in range(num_classes):
            idx = rng.permutation(np.flatnonzero(train_y == c))
            p = rng.dirichlet(np.full(clients, ALPHA))
            p = p * np.array([len(part) < n / clients for part in parts])
            cuts = (np.cumsum(p / p.sum()) * len(idx)).astype(int)[:-1]
            for part, piece in zip(parts, np.split(idx, cuts)):
                part.extend(piece.tolist())
        if min(len(part) for part in parts) >= 10:
            break
    else:
        raise ValueError(f"no Dir({ALPHA}) draw gave each of {clients} clients 10 of the {n} training images")
    parts = [np.sort(np.array(part)) for part in parts]

    # --- personal test sets: args.test_samples images per client with its training label proportions
    tests = []
    for part in parts:
        share = np.bincount(train_y[part], minlength=num_classes) / len(part) * args.test_samples
        take = np.floor(share).astype(int)
        take[np.argsort(take - share)[:args.test_samples - take.sum()]] += 1  # largest remainders
        tests.append(np.sort(np.concatenate([rng.choice(np.flatnonzero(test_y == c), t, replace=False)
                                             for c, t in enumerate(take) if t > 0])))

    gen = torch.Generator().manual_seed(0)  # crops, flips, masks, regrowth
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1).to(args.device)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1).to(args.device)

    def to_input(x):  # uint8 NHWC -> normalised float NCHW (a permuted view: channels-last strides)
        return (x.permute(0, 3, 1, 2).float() / 255 - mean) / std

    def augment(x):  # random crop 32 with zero padding 4, then horizontal flip, on a uint8 NHWC batch
        b = x.shape[0]
        padded = F.pad(x, (0, 0, 4, 4, 4, 4))
        dy, dx = torch.randint(0, 9, (b,), generator=gen), torch.randint(0, 9, (b,), generator=gen)
        ar = torch.arange(32)
        x = padded[torch.arange(b)[:, None, None], (dy[:, None] + ar)[:, :, None], (dx[:, None] + ar)[:, None, :]]
        flip = torch.rand(b, generator=gen) < 0.5
        return torch.where(flip[:, None, None, None], x.flip(2), x)

    data_s = time.perf_counter() - tic

    # --- model: cnn_cifar
    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 64, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
                nn.Conv2d(64, 64, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2))
            self.classifier = nn.Sequential(
                nn.Linear(64 * 5 * 5, 384), nn.ReLU(inplace=True), nn.Linear(384, 192), nn.ReLU(inplace=True),
                nn.Linear(192, 10))

        def forward(self, x):
            return self.classifier(self.features(x).flatten(1))

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = CNN().to(device)
    params = dict(model.named_parameters())
    masked = [name for name, p in params.items() if p.dim() > 1]  # every conv and linear weight

    # --- ERK densities (RigL Sec. 3): eps * sum(shape) / prod(shape), layers above 1 made dense
    numel = {name: params[name].numel() for name in masked}
    raw = {name: sum(params[name].shape) / numel[name] for name in masked}
    dense: set[str] = set()
    while True:
        budget = DENSITY * sum(numel.values()) - sum(numel[name] for name in dense)
        eps = budget / sum(raw[name] * numel[name] for name in masked if name not in dense)
        over = {name for name in masked if name not in dense and eps * raw[name] > 1}
        if not over:
            break
        dense |= over
    density = {name: 1.0 if name in dense else eps * raw[name] for name in masked}

    def random_mask(name):
        flat = torch.zeros(numel[name], dtype=torch.bool)
        flat[torch.randperm(numel[name], generator=gen)[:round(density[name] * numel[name])]] = True
        return flat.view_as(params[name]).to(device)

    masks = [{name: random_mask(name) for name in masked} for _ in range(clients)]
    init = {name: t.detach().clone() for name, t in model.state_dict().items()}
    published = [{name: t * masks[k][name] if name in masked else t.clone() for name, t in init.items()}
                 for k in range(clients)]
    channels_last = []

    def test(k):
        model.eval()
        correct = 0
        with torch.no_grad():
            for s in range(0, len(tests[k]), EVAL_BATCH):
                idx = tests[k][s:s + EVAL_BATCH]
                x = to_input(torch.from_numpy(test_x[idx]).to(device))
                correct += int((model(x).argmax(1) == torch.from_numpy(test_y[idx]).to(device)).sum())
        return correct / len(tests[k])

    meter = RoundMeter()
    accuracy, accuracy_aggregated = 0.0, 0.0
    for t in range(args.rounds):
        meter.start()
        fraction = DROP0 / 2 * (1 + math.cos(math.pi * t / args.rounds))
        new, accs, accs_agg = [], [], []
        for k in range(clients):
            sources = [k, *rng.choice([j for j in range(clients) if j != k], size=neighbors, replace=False)]
            with torch.no_grad():  # masked averaging: each weight over the sources that hold it, times my mask
                agg = {}
                for name in init:
                    total = sum(published[j][name] for j in sources)
                    if name in masked:
                        held = sum(masks[j][name].float() for j in sources)
                        agg[name] = total / held.clamp_min(1) * masks[k][name]
                    else:
                        agg[name] = total / len(sources)
                model.load_state_dict(agg)
            accs_agg.append(test(k))
            model.train()
            optimizer = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            xs, ys = train_x[parts[k]], train_y[parts[k]]
            order = rng.permutation(len(ys))
            for s in range(0, len(ys), BATCH):
                idx = order[s:s + BATCH]
                x = to_input(augment(torch.from_numpy(xs[idx])).to(device))
                y = torch.from_numpy(ys[idx]).to(device)
                if not channels_last:
                    channels_last.append(x.is_contiguous(memory_format=torch.channels_last))
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                for name in masked:
                    params[name].grad.mul_(masks[k][name])
                optimizer.step()
                with torch.no_grad():
                    for name in masked:
                        params[name].mul_(masks[k][name])
            accs.append(test(k))
            new.append({name: v.detach().clone() for name, v in model.state_dict().items()})
            with torch.no_grad():  # random regrowth: drop the smallest magnitudes, regrow as many at random
                for name in masked:
                    mask = masks[k][name].flatten()
                    drop = math.ceil(fraction * int(mask.sum()))
                    score = torch.where(mask, params[name].detach().abs().flatten(), math.inf)
                    kept = mask.clone()
                    kept[torch.topk(score, drop, largest=False).indices] = False
                    candidates = torch.nonzero(~kept).flatten()
                    kept[candidates[torch.randperm(len(candidates), generator=gen)[:drop].to(device)]] = True
                    masks[k][name] = kept.view_as(params[name])
        published = new
        accuracy, accuracy_aggregated = sum(accs) / clients, sum(accs_agg) / clients
        meter.stop()
    eval_x = to_input(torch.from_numpy(test_x[tests[0][:EVAL_BATCH]]).to(device))
    result = meter.result()
    result.update(data_s=data_s, data_cached=cached, accuracy=accuracy, accuracy_aggregated=accuracy_aggregated,
                  batch_channels_last=channels_last[0],
                  eval_batch_channels_last=eval_x.is_contiguous(memory_format=torch.channels_last),
                  train_samples=int(sum(len(p) for p in parts)))
    return result


# ---------------------------------------------------------------------------------------------- driver


def child(args) -> None:
    import torch

    clients, neighbors = SETTINGS[args.setting]
    result = (run_ours if args.child == "ours" else run_loop)(args, clients, neighbors)
    r = resource.getrusage(resource.RUSAGE_SELF)
    result.update(peak_rss_mib=r.ru_maxrss / 1024, total_minflt=r.ru_minflt, total_sys_s=r.ru_stime,
                  total_user_s=r.ru_utime, torch=torch.__version__, threads=torch.get_num_threads(),
                  device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    print("RESULT " + json.dumps(result))


def cpu_description() -> tuple[str, list[str]]:
    """(model name, which of CPU_FLAGS the CPU has) from /proc/cpuinfo (platform.processor() as a fallback)."""
    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), [f for f in CPU_FLAGS if f in flags]


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def parent(args) -> None:
    env = dict(os.environ)
    env.update(args.env)
    rows = []
    for setting in args.settings:
        for side in ("loop", "ours"):
            cmd = [sys.executable, __file__, "--child", side, "--setting", setting, "--root", args.root,
                   "--rounds", str(args.rounds), "--threads", str(args.threads), "--test-samples",
                   str(args.test_samples), "--max-train-samples", str(args.max_train_samples),
                   "--device", args.device]
            if args.cold:
                cmd.append("--cold")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                sys.exit(f"{setting} {side} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
            result.update(setting=setting, side=side, median_round_s=median_after_first(result["round_s"]),
                          median_minflt=median_after_first(result["minflt"]),
                          median_sys_s=median_after_first(result["sys_s"]))
            rows.append(result)
            print(f"{setting} {side}: round {result['median_round_s']:.2f} s, {result['median_minflt']:,.0f} minor "
                  f"faults, sys {result['median_sys_s']:.2f} s, start-up {result['startup_s']:.1f} s (data "
                  f"{result['data_s']:.1f} s), peak RSS {result['peak_rss_mib']:.0f} MiB, accuracy "
                  f"{result['accuracy']:.3f}", flush=True)
    by = {(r["setting"], r["side"]): r for r in rows}
    cpu, flags = cpu_description()
    first = rows[0]
    loop_rows = [r for r in rows if r["side"] == "loop"]
    formats = {("channels_last" if r["batch_channels_last"] else "contiguous (NCHW)") for r in loop_rows}
    date = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"
    span = f"median of rounds 2..{args.rounds}" if args.rounds > 1 else "one round"
    cache = ("decoded from the JPEGs on both sides (--cold)" if args.cold else
             "each side's decoded-data cache (loop: " + ", ".join(
                 f"{r['setting']} {'hit' if r['data_cached'] else 'miss'}" for r in loop_rows) + ")")
    lines = [
        "# Round time: our fit against an independent hand-written loop of the same steps", "",
        f"- date: {date}",
        f"- CPU: {cpu}; flags: {', '.join(flags) or 'none'} of {', '.join(CPU_FLAGS)}",
        f"- torch {first['torch']}, {first['threads']} thread(s); device: {first.get('device_name', 'cpu')}",
        f"- command: `{shlex.join([Path(sys.executable).name, *sys.argv])}`",
        f"- environment added: {' '.join(f'{k}={v}' for k, v in args.env.items()) or 'none'}",
        f"- CIFAR-10 (jpg folders), cnn_cifar, E = 1, batch 128, eval batch 512, crop + flip, Dir(0.3), density 0.5, "
        f"random regrowth; {args.max_train_samples} training images, {args.test_samples} test images per client; "
        f"{args.rounds} rounds, {span}; start-up: {cache}",
        f"- the loop's batches reach the model as {', '.join(sorted(formats))}", "",
        "| K, M | loop s/round | ours s/round | ours / loop | loop minor faults/round | ours minor faults/round | "
        "ours / loop faults | loop sys s/round | ours sys s/round | start-up s loop / ours | "
        "peak RSS MiB loop / ours | accuracy loop / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for setting in args.settings:
        loop, ours = by[(setting, "loop")], by[(setting, "ours")]
        clients, neighbors = SETTINGS[setting]
        fault_ratio = ours["median_minflt"] / loop["median_minflt"] if loop["median_minflt"] else math.inf
        lines.append(
            f"| {clients}, {neighbors} | {loop['median_round_s']:.2f} | {ours['median_round_s']:.2f} | "
            f"{ours['median_round_s'] / loop['median_round_s']:.2f} | {loop['median_minflt']:,.0f} | "
            f"{ours['median_minflt']:,.0f} | {fault_ratio:.2f} | {loop['median_sys_s']:.2f} | "
            f"{ours['median_sys_s']:.2f} | {loop['startup_s']:.1f} / {ours['startup_s']:.1f} | "
            f"{loop['peak_rss_mib']:.0f} / {ours['peak_rss_mib']:.0f} | "
            f"{loop['accuracy']:.3f} / {ours['accuracy']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "round_time" if args.device == "cpu" else f"round_time_{args.device}"
    (out / f"{stem}.md").write_text(text)
    header = {"date": date, "cpu": cpu, "cpu_flags": flags, "torch": first["torch"], "threads": args.threads,
              "command": sys.argv, "env": args.env, "cold": args.cold}
    (out / f"{stem}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(f"wrote {out / f'{stem}.md'} and {out / f'{stem}.json'}")


def env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the unpacked cifar10-jpg folder")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both sides train")
    parser.add_argument("--test-samples", type=int, default=100)
    parser.add_argument("--max-train-samples", type=int, default=10000)
    parser.add_argument("--env", type=env_pair, action="append", default=[], metavar="KEY=VALUE",
                        help="set an environment variable for both child processes (repeatable)")
    parser.add_argument("--cold", action="store_true",
                        help="decode the JPEGs on both sides (the loop ignores its .npy cache, ours runs cache=False)")
    parser.add_argument("--out", default=str(RESULTS), help="folder of the results (default: benchmarks/results)")
    parser.add_argument("--child", choices=("ours", "loop"), help=argparse.SUPPRESS)
    parser.add_argument("--setting", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.env = dict(args.env)
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
