"""Ditto with a server (Li et al., ICML 2021, Alg. 1; baselines-notes section 2): the personal step's
fixed point on a quadratic, w trained exactly as FedAvg, v_i kept per client and scored on all K."""

import contextlib
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, masked_average
from lightning_dfl.federation.algorithms import FedAvg
from lightning_dfl.federation.algorithms.ditto import PERSONAL, Ditto
from lightning_dfl.federation.algorithms.training import train_locally
from lightning_dfl.federation.metrics.evaluation import accuracy
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

K = 5


def _run(algorithm, rounds=1, **trainer_kw):
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=32, test_samples_per_client=30)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05)
    trainer_kw.setdefault("local_epochs", 1)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, logger=False, accelerator="cpu",
                               enable_progress_bar=False, **trainer_kw)
    trainer.fit(model, dm)
    return trainer


# -- the personal step on f_i(v) = 1/2 ||v - b_i||^2 ------------------------------------------------
class Quadratic(torch.nn.Module):
    """A "model" whose parameter is v and whose loss is f(v) = 1/2 ||v - b||^2 whatever the batch."""

    def __init__(self, v0, b):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.v = torch.nn.Parameter(v0.clone())
        self.b = b

    def loss(self, batch):
        return 0.5 * (self.model.v - self.b).pow(2).sum()


def _personal_steps(lam, v0, b, w, steps=80):
    """Ditto's personal epochs as the engine runs them: the local loop with Ditto's loss hook and the
    anchor w fixed, plain SGD at lr 0.5 / (1 + lam) (the quadratic's curvature is 1 + lam)."""
    module = Quadratic(v0, b)
    fabric = SimpleNamespace(autocast=contextlib.nullcontext, backward=lambda loss: loss.backward())
    ctx = SimpleNamespace(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.5 / (1 + lam)),
                          scratch={"anchor": {"v": w}}, train_batches=[(None, torch.zeros(1))] * steps,
                          local_epochs=1, local_steps=None, call=lambda *args: None, fabric=fabric)
    train_locally(Ditto(lam=lam), ctx)
    return module.model.v.detach()


@pytest.mark.parametrize("lam", [0.0, 0.5, 2.0, 1e6])
def test_personal_model_converges_to_the_proximal_fixed_point(lam):
    g = torch.Generator().manual_seed(0)
    v0, b, w = (torch.randn(7, generator=g, dtype=torch.float64) for _ in range(3))
    v = _personal_steps(lam, v0, b, w)
    assert torch.allclose(v, (b + lam * w) / (1 + lam), atol=1e-12, rtol=0)  # argmin f_i(v) + lam/2 ||v - w||^2
    if lam == 0:
        assert torch.allclose(v, b, atol=1e-12)  # no pull: Local training, v -> argmin f_i
    if lam == 1e6:
        assert torch.allclose(v, w, atol=1e-5)  # lam -> infinity: v = w
        assert not torch.allclose(v, b, atol=1e-1)


def test_the_proximal_term_is_added_only_while_the_anchor_is_set():
    module = Quadratic(torch.ones(3), torch.zeros(3))
    ctx = SimpleNamespace(module=module, scratch={})
    assert Ditto(lam=0.5).loss(ctx, None).item() == pytest.approx(1.5)  # the global steps: f_i only
    ctx.scratch["anchor"] = {"v": torch.full((3,), 3.0)}
    assert Ditto(lam=0.5).loss(ctx, None).item() == pytest.approx(1.5 + 0.25 * 3 * 4)  # + lam/2 ||v - w||^2


# -- in a federation --------------------------------------------------------------------------------
def test_global_model_is_fedavgs_and_only_v_feels_lambda():
    fedavg = _run(FedAvg(clients_per_round=3), rounds=2)
    ditto = _run(Ditto(clients_per_round=3, lam=0.5, global_epochs=1, personal_epochs=1, weighting="samples"), rounds=2)
    loose = _run(Ditto(clients_per_round=3, lam=0.0, global_epochs=None, personal_epochs=1, weighting="samples"),
                 rounds=2)
    for n in fedavg.store.names:  # w (node K) and every published x_i: bit for bit FedAvg's, whatever lam
        assert torch.equal(ditto.store.weights[n], fedavg.store.weights[n])
        assert torch.equal(loose.store.weights[n], fedavg.store.weights[n])
    assert any(not torch.equal(ditto.store.read(k, PERSONAL)[n], loose.store.read(k, PERSONAL)[n])
               for k in range(K) for n in fedavg.store.names)
    for f, d in zip(fedavg.history, ditto.history):
        assert d["comm/busiest_bytes"] == f["comm/busiest_bytes"]  # only w travels
        assert d["flops/train_total"] == pytest.approx(2 * f["flops/train_total"], rel=1e-12)  # E_g + E_p epochs
        assert d["acc/consensus_mean"] == f["acc/consensus_mean"]  # w on every client
        assert d["acc/headline"] == d["acc/personal_mean"] != d["acc/consensus_mean"]


def test_uniform_server_step_and_personal_models_of_all_clients():
    trainer = _run(Ditto(clients_per_round=2, global_epochs=1, personal_epochs=1))
    store = trainer.store
    sampled = [k for k in range(K) if int(store.slot[k]) == 1]
    assert len(sampled) == 2
    # the original's w^{t+1} = w^t + mean_i(x_i - w^t): a plain mean of the sampled x_i, not by sample count
    expected = masked_average(*store.gather([(k, False) for k in sampled]))
    assert trainer.datamodule.client_train_size(sampled[0]) != trainer.datamodule.client_train_size(sampled[1])
    for n, t in store.published(K)[0].items():
        assert torch.allclose(t, expected[n], atol=1e-6)
    # v_i starts at w^0 (= every client's initial published model); only the sampled clients' moved
    for k in range(K):
        v, initial = store.read(k, PERSONAL), store.weights
        w0 = {n: initial[n][1 - int(store.slot[K]), K] for n in store.names}  # the server's previous slot: w^0
        same = all(torch.equal(v[n], w0[n]) for n in store.names)
        assert same == (k not in sampled)
    # the headline is v_i of all K clients on their own test sets
    accs = []
    for k in range(K):
        trainer.federation.worker.load(store.read(k, PERSONAL))
        accs.append(accuracy(trainer.module, trainer.fabric, trainer.test_batches(k)))
    assert trainer.history[-1]["acc/personal_mean"] == pytest.approx(sum(accs) / K, abs=1e-12)


@pytest.mark.parametrize("kwargs, message", [
    ({"lam": -0.1}, "lam must be a finite number >= 0, got -0.1"),
    ({"lam": math.nan}, "lam must be a finite number >= 0, got nan"),
    ({"global_epochs": 0}, r"global_epochs \(None: the trainer's local epochs\) must be an integer >= 1, got 0"),
    ({"personal_epochs": 0}, "personal_epochs must be an integer >= 1, got 0"),
    ({"weighting": "median"}, "unknown weighting 'median'; allowed: uniform, samples"),
    ({"clients_per_round": 0}, "clients_per_round must be >= 1, got 0"),
])
def test_arguments_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Ditto(**kwargs)


def test_the_personal_anchor_is_the_rounds_received_global_model():
    """Alg. 1's personal step v <- v - eta (grad F_i(v) + lam (v - w^t)) anchors v_i to w^t, the global
    model the client received this round (fixed for the round), not its previous personal model v_i
    nor its own x_i."""
    from lightning_dfl.callbacks.base import FederatedCallback

    anchors, starts = [], {}

    class Anchors(Ditto):
        def loss(self, ctx, batch):
            anchor = ctx.scratch.get("anchor")
            if anchor is not None:
                params = {n: p.detach().clone() for n, p in ctx.module.model.named_parameters()}
                anchors.append((ctx.round_idx, ctx.node, {n: t.clone() for n, t in anchor.items()}, params))
            return super().loss(ctx, batch)

    class Start(FederatedCallback):
        def on_federated_round_start(self, trainer, pl_module):
            store = trainer.store
            starts[trainer.current_round] = ({n: t.clone() for n, t in store.published(K)[0].items()},
                                             {k: {n: t.clone() for n, t in store.read(k, PERSONAL).items()}
                                              for k in range(K)})

    _run(Anchors(clients_per_round=K, global_epochs=1, personal_epochs=1), rounds=3, callbacks=[Start()])
    seen = set()
    for r, k, anchor, params in anchors:
        w_t, personal = starts[r]
        for n, t in anchor.items():
            assert torch.equal(t, w_t[n]), (r, k, n)  # w^t: the server's model at the round's start
        if (r, k) not in seen and r >= 1:  # the first personal step starts from v_i^(t-1), which differs from w^t
            assert all(torch.equal(params[n], personal[k][n]) for n in params)
            assert any(not torch.equal(anchor[n], personal[k][n]) for n in anchor)
        seen.add((r, k))
    assert {r for r, _ in seen} == {0, 1, 2} and len(seen) == 3 * K


def test_the_personal_spread_describes_the_personal_models():
    """Ditto's ``acc/personal_*`` all describe every client's personal model v_i (the spread once came from the
    shared model's trained copies: its min above the mean)."""
    trainer = _run(Ditto(clients_per_round=3, lam=0.5), rounds=2)
    for row in trainer.history:
        assert row["acc/personal_count"] == K
        assert row["acc/personal_min"] <= row["acc/personal_p10"] <= row["acc/personal_mean"] <= row["acc/personal_max"]
