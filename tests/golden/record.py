"""Record (or check) the engine's golden runs: DisPFL, DA-DPFL (voting and PQI firing), D-PSGD,
Local, FedAvg, and the algorithms with a round-level evaluation or their own data access (Ditto,
FedAvg-FT, D-PSGD-FT, Sub-FedAvg, FedFomo) on the digits set, a few rounds each.

    python tests/golden/record.py          # rewrite tests/golden/engine_runs.pt
    python tests/golden/record.py fedfomo  # re-record one run (it then holds the machine it was recorded on)

What is recorded, per run: every metric of every round except wall times, the per-client rows of
``clients.csv``, and every node's final published weights, published mask and current mask (as SHA-256
fingerprints of their bytes, which keeps the file small).
``tests/test_golden.py`` re-runs the same configurations and compares bit for bit. A deliberate
change of results re-records the file in its own commit that says why.
"""

from __future__ import annotations

import csv
import hashlib
import platform
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import (
    DADPFL,
    DPSGD,
    DPSGDFT,
    DisPFL,
    Ditto,
    FedAvg,
    FedAvgFT,
    FedFomo,
    Local,
    SubFedAvg,
)
from lightning_dfl.module import SparseClassifier

PATH = Path(__file__).with_name("engine_runs.pt")

#: name -> (algorithm factory, rounds, module density, trainer options)
RUNS = {
    "dispfl": (lambda: DisPFL(num_neighbors=2), 3, 0.5, {}),
    "dadpfl": (lambda: DADPFL(num_neighbors=2, max_wait=2, delta_pr=1000.0, target_sparsity=0.7), 5, 0.5,
               {"client_speeds": [1.0, 2.0, 0.5, 1.0, 1.5, 1.0]}),
    "dpsgd": (lambda: DPSGD(num_neighbors=2), 3, 1.0, {}),
    "local": (lambda: Local(), 2, 0.5, {}),
    "fedavg": (lambda: FedAvg(clients_per_round=3), 3, 1.0, {}),
    "ditto": (lambda: Ditto(clients_per_round=3, global_epochs=1, personal_epochs=1), 2, 1.0, {}),
    "fedavg_ft": (lambda: FedAvgFT(clients_per_round=3, finetune_epochs=1), 2, 1.0, {}),
    "dpsgd_ft": (lambda: DPSGDFT(num_neighbors=2, finetune_epochs=1), 2, 1.0, {}),
    "subfedavg": (lambda: SubFedAvg(clients_per_round=3, acc_thresh=0.0, dist_thresh=0.0), 3, 1.0, {}),
    "fedfomo": (lambda: FedFomo(num_neighbors=2), 2, 1.0, {}),
}


def fingerprint(tensor: torch.Tensor) -> str:
    """dtype, shape and the SHA-256 of the raw bytes: equal exactly when the tensors are bit-identical."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{tensor.dtype} {tuple(tensor.shape)} {hashlib.sha256(raw).hexdigest()}"


def run(name: str, root: str) -> dict:
    """Run one golden configuration; return what is compared."""
    factory, rounds, density, options = RUNS[name]
    warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")
    dm = FederatedDataModule(dataset="digits", num_clients=6, batch_size=32, test_samples_per_client=40,
                             partition="dirichlet", alpha=0.5, seed=1)
    model = SparseClassifier(arch="cnn_digits", density=density, lr=0.05, seed=1)
    trainer = FederatedTrainer(algorithm=factory(), rounds=rounds, local_epochs=1, accelerator="cpu",
                               enable_progress_bar=False, seed=3, default_root_dir=root, cpu_threads=1, **options)
    trainer.fit(model, dm)
    metrics = [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in trainer.history]
    with (Path(trainer.log_dir) / "clients.csv").open() as f:
        clients = list(csv.DictReader(f))
    nodes = []
    for node in range(trainer.store.num_nodes):
        state = trainer.store.state(node)
        nodes.append({part: {key: fingerprint(t) for key, t in getattr(state, part).items()}
                      for part in ("weights", "published_mask", "mask")})
    return {"metrics": metrics, "clients": clients, "nodes": nodes}


def _cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The kernels' code path: float results are bit-identical only on the same one. The ISA level alone
    does not fix it: oneDNN and the BLAS pick other kernels on another processor of the same level (an
    AVX512 AMD EPYC and an AVX512 Intel Xeon differ in the last bits), so the model name is part of it."""
    return f"torch {torch.__version__.split('+')[0]}, {torch.backends.cpu.get_cpu_capability()}, {_cpu_model()}"


def recorded_on(record: dict, name: str) -> str:
    """The machine ``name``'s run was recorded on: its own (re-recorded alone), else the file's."""
    return record[name].get("machine", record["machine"])


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; recorded: {', '.join(RUNS)}")
    with tempfile.TemporaryDirectory() as root:
        if names:  # these runs only, each marked with this machine; the others keep theirs
            record = torch.load(PATH, weights_only=True)
            record.update({name: {**run(name, root), "machine": machine()} for name in names})
        else:
            record = {name: run(name, root) for name in RUNS}
            record["machine"] = machine()
    torch.save(record, PATH)
    print(f"wrote {PATH} ({PATH.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
