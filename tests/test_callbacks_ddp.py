"""The sparse-training callbacks in a user's own 2-process DDP ``lightning.Trainer`` on the CPU (gloo).

Strategy ``"ddp"`` re-launches ``sys.argv``, so the fit runs as a script in a subprocess; each rank saves what
it ended with and the test compares the ranks."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import textwrap

import torch

_SCRIPT = """
import sys

import torch

torch.set_num_threads(1)
import lightning as L

from lightning_dfl.callbacks import PQIPruning, PruningTimeVoting, RigL
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.module import SparseClassifier


class Probe(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        self.initial = {n: int(m.sum()) for n, m in pl_module.mask.masks.items()}

    def on_train_epoch_start(self, trainer, pl_module):
        sampler = trainer.train_dataloader.sampler
        self.sampler = (type(sampler).__name__, sampler.num_replicas, sampler.rank, list(iter(sampler)))


probe = Probe()
voting, rigl = PruningTimeVoting(delta_pr=10.0), RigL(regrowth="random", update_every=5)
callbacks = [voting, PQIPruning(target_sparsity=0.8), rigl, probe]
model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=4, limit_train_batches=6,
                    limit_val_batches=2, callbacks=callbacks, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
data = FederatedDataModule(dataset="digits", num_clients=1, batch_size=32, cache=False)
trainer.fit(model, data)
torch.save({"weights": model.state_dict(), "masks": model.mask.state(), "initial": probe.initial,
            "t_star": voting.t_star, "pruning": voting.pruning_round_indices, "history": callbacks[1].state_dict(),
            "rigl": rigl.state_dict()["num_updates"], "sampler": probe.sampler, "train_size": data.client_train_size(0),
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
           f"{sys.argv[1]}/rank{trainer.global_rank}.pt")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ddp(script_text: str, tmp_path) -> subprocess.CompletedProcess:
    """Run ``script_text`` as a script (``strategy="ddp"`` launches ``sys.argv`` again) with ``tmp_path`` as its
    argument, on a free port, and assert it succeeded."""
    script = tmp_path / "fit_ddp.py"
    script.write_text(textwrap.dedent(script_text))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_two_process_ddp_keeps_the_ranks_identical_and_syncs_what_differs(tmp_path):
    """RigL (random regrowth), PruningTimeVoting and PQIPruning on SparseClassifier under ``strategy="ddp"``:
    both ranks end with the same weights, masks, t* and prune events; RigL keeps every layer's active count
    (less what PQI pruned); val/loss (over each rank's half of the test set) is averaged over the ranks and
    Lightning asks for no ``sync_dist``; the DistributedSampler gives each rank half the training samples."""
    done = _run_ddp(_SCRIPT, tmp_path)
    assert "sync_dist" not in done.stderr + done.stdout, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    a, b = ranks
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert all(torch.equal(a["masks"][k], b["masks"][k]) for k in a["masks"])
    assert a["t_star"] == b["t_star"] == 2 and a["pruning"] == b["pruning"] == (2,)
    history = a["history"]["history"]
    assert history == b["history"]["history"] and [e["round_idx"] for e in history] == [2]
    assert a["rigl"] == b["rigl"] == 4  # steps 5, 10, 15, 20 of T = 24
    pruned = history[0]["counts"]
    assert {n: int(m.sum()) for n, m in a["masks"].items()} == {n: c - pruned[n] for n, c in a["initial"].items()}
    epoch_level = {name: value for name, value in a["metrics"].items() if name != "train/loss"}  # a rank's step
    assert epoch_level == {name: b["metrics"][name] for name in epoch_level}  # val/loss synced, the rest the same
    assert {"val/loss", "voting/t_star", "pqi/pruned_weights", "sparsity/mean"} <= set(a["metrics"])
    n = a["train_size"]
    (kind, replicas, rank0, idx0), (_, _, rank1, idx1) = a["sampler"], b["sampler"]
    assert (kind, replicas, rank0, rank1) == ("DistributedSampler", 2, 0, 1)
    assert len(idx0) == len(idx1) == math.ceil(n / 2) and set(idx0) | set(idx1) == set(range(n))


_GRADIENT_SCRIPT = """
import sys

import torch

torch.set_num_threads(1)
import lightning as L

from lightning_dfl.callbacks import RigL
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.module import SparseClassifier
from lightning_dfl.sparse.rigl import dense_gradients, rigl_masks

STEP = 3


class Expect(L.Callback):
    \"\"\"Before RigL's update at STEP: the mask RigL must pick from the gradient averaged over both ranks' batches,
    and the one rank 0's batch alone would give.\"\"\"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != STEP:
            return
        mask = pl_module.mask
        mask.apply_()
        weights = {n: p.detach().clone() for n, p in mask.params.items()}
        local = dense_gradients(pl_module, mask, pl_module.loss, [batch], absolute=False)
        both = {n: trainer.strategy.all_gather(g) for n, g in local.items()}
        fraction = rigl.fraction(STEP, rigl._total)
        pick = lambda scores: rigl_masks(weights, mask.masks, fraction, scores=scores, mode="gradient")
        self.averaged = pick({n: g.mean(0).abs() for n, g in both.items()})
        self.rank0 = pick({n: g[0].abs() for n, g in both.items()})


class Seen(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == STEP:
            self.mask = pl_module.mask.state()


rigl, expect, seen = RigL(regrowth="gradient", update_every=STEP), Expect(), Seen()
model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, limit_train_batches=2 * STEP,
                    limit_val_batches=0, callbacks=[expect, rigl, seen], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, FederatedDataModule(dataset="digits", num_clients=1, batch_size=32, cache=False))
torch.save({"seen": seen.mask, "averaged": expect.averaged, "rank0": expect.rank0, "updates": rigl.state_dict()},
           f"{sys.argv[1]}/rank{trainer.global_rank}.pt")
"""


def test_ddp_gradient_regrowth_scores_the_gradient_of_every_ranks_batch(tmp_path):
    """RigL's regrowth under DDP scores the dense gradient averaged over the ranks (the global batch's, as one
    process with that batch would): the mask it picks is the one of the averaged gradient on both ranks, not the
    one rank 0's batch alone gives (which differs here)."""
    _run_ddp(_GRADIENT_SCRIPT, tmp_path)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["updates"]["num_updates"] == 1
        assert all(torch.equal(got["seen"][n], got["averaged"][n]) for n in got["averaged"])
        assert not all(torch.equal(got["averaged"][n], got["rank0"][n]) for n in got["averaged"])
