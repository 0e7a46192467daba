"""DFedAvgM (Sun et al. 2021; baselines notes section 4): heavy-ball local steps restarted every round,
uniform mixing over in-neighbours and self; round 0 trains without mixing; the fp16 and DA options."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, Source
from lightning_dfl.federation.algorithms import DPSGD, Local
from lightning_dfl.federation.algorithms.dfedavgm import DELTA_FIELD, DFedAvgM
from lightning_dfl.federation.exchange.topology import build_topology
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

K = 5


def _run(algorithm, rounds=2, momentum=0.0, lr=0.05, callbacks=None, **trainer_kw):
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=32, test_samples_per_client=30)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=lr, momentum=momentum)
    trainer_kw.setdefault("local_steps", 3)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, logger=False, accelerator="cpu", cpu_threads=1,
                               enable_progress_bar=False, callbacks=callbacks, **trainer_kw)
    trainer.fit(model, dm)
    return trainer


def _models(trainer):
    return [{n: t.clone() for n, t in trainer.store.published(k)[0].items()} for k in range(K)]


def _assert_bit_identical(a, b):
    for k in range(K):
        for n in a.store.names:
            assert torch.equal(a.store.published(k)[0][n], b.store.published(k)[0][n]), (k, n)


# -- the local step routine ---------------------------------------------------------------------
class Scalar(nn.Module):
    """One parameter w and f(w) = a/2 w^2; ``hparams`` as SparseClassifier has them."""

    def __init__(self, w0, lr, weight_decay=0.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w0], dtype=torch.float64))
        self.hparams = SimpleNamespace(lr=lr, weight_decay=weight_decay)


def test_local_steps_follow_the_heavy_ball_closed_form():
    a, eta, theta, w0, steps = 1.0, 0.1, 0.9, 2.0, 25
    module = Scalar(w0, eta)
    algo = DFedAvgM(momentum=theta)
    optimizer = algo.make_optimizer(module)
    ctx = SimpleNamespace(optimizer=optimizer)

    def closure():
        optimizer.zero_grad()
        loss = 0.5 * a * module.w.pow(2).sum()
        loss.backward()
        return loss

    trajectory = [w0]
    for _ in range(steps):
        algo.optimizer_step(ctx, closure)
        trajectory.append(module.w.item())
    # z^{k+1} = (1 + theta - eta a) z^k - theta z^{k-1}, z^{-1} = z^0: z^k = c1 r1^k + c2 r2^k
    r1, r2 = np.roots([1.0, -(1 + theta - eta * a), theta]).astype(complex)
    z1 = (1 - eta * a) * w0
    c2 = (z1 - r1 * w0) / (r2 - r1)
    c1 = w0 - c2
    closed = [(c1 * r1**k + c2 * r2**k).real for k in range(steps + 1)]
    assert np.allclose(trajectory, closed, rtol=0, atol=1e-12)
    assert trajectory[2] == pytest.approx((1 + theta - eta * a) * z1 - theta * w0)
    assert trajectory[1:3] == pytest.approx([1.8, 1.44])  # by hand: 0.9 * 2; 1.8 * 1.8 - 0.9 * 2


class FirstBatch(FederatedCallback):
    """The optimizer's momentum and state when each client's first local step starts."""

    def __init__(self):
        self.seen = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            group = trainer.optimizer.param_groups[0]
            key = (trainer.current_round, trainer.current_client)
            self.seen[key] = (group["momentum"], len(trainer.optimizer.state))


def test_first_round_trains_from_x0_without_mixing_and_momentum_restarts_every_round():
    seen = FirstBatch()
    trainer = _run(DFedAvgM(num_neighbors=2), rounds=2, momentum=0.0, callbacks=[seen])  # module momentum 0
    assert set(seen.seen.values()) == {(0.9, 0)}  # theta = 0.9 whatever the module says; fresh state every task
    assert len(seen.seen) == 2 * K
    # round 0: nothing to mix, nothing sent; the models are exactly K local heavy-ball runs from x^0
    local = _run(Local(), rounds=1, momentum=0.9)
    first = _run(DFedAvgM(num_neighbors=2), rounds=1)
    _assert_bit_identical(first, local)
    assert trainer.history[0]["comm/busiest_bytes"] == 0
    one_model = trainer.store.active_values(0) * 4
    assert trainer.history[1]["comm/busiest_bytes"] == 2 * one_model  # M = 2 models in and out per client


def test_theta0_single_step_is_dpsgd_bit_for_bit():
    # M = 3: D-PSGD's round-0 average of the K identical initial models sums 4 equal float32 values and
    # divides by 4, exactly x^0; from round 1 both mix the previous round's models the same way, then step.
    dfedavgm = _run(DFedAvgM(num_neighbors=3, momentum=0.0), rounds=3, local_steps=1)
    dpsgd = _run(DPSGD(num_neighbors=3), rounds=3, local_steps=1)
    _assert_bit_identical(dfedavgm, dpsgd)
    heavy = _run(DFedAvgM(num_neighbors=3), rounds=3, local_steps=2)  # theta = 0.9 with 2 steps differs
    assert not torch.equal(heavy.store.published(0)[0]["classifier.2.weight"],
                           dpsgd.store.published(0)[0]["classifier.2.weight"])


class FrozenAfterFirstRound(DFedAvgM):
    """eta = 0 from round 1 on (round 0 trains, so the clients' models differ)."""

    def configure_optimizer(self, ctx):
        super().configure_optimizer(ctx)
        if ctx.round_idx >= 1:
            for group in ctx.optimizer.param_groups:
                group["lr"] = 0.0


class RoundModels(FederatedCallback):
    def __init__(self):
        self.models = []

    def on_federated_round_end(self, trainer, pl_module):
        self.models.append(_models(trainer))


def test_eta0_mixing_preserves_the_network_mean_and_contracts():
    topology = build_topology("time_varying", 2)
    for round_idx in range(5):  # M-in/M-out: the uniform 1/(M+1) W is doubly stochastic
        neighbors = topology.neighbors(K, round_idx, np.random.default_rng(round_idx))
        W = np.eye(K)
        for k, ins in enumerate(neighbors):
            W[k, ins] = 1
        W /= 3
        assert np.allclose(W.sum(0), 1) and np.allclose(W.sum(1), 1)
    rounds = RoundModels()
    _run(FrozenAfterFirstRound(num_neighbors=2), rounds=4, callbacks=[rounds])
    means = [{n: torch.stack([m[n] for m in models]).double().mean(0) for n in models[0]} for models in rounds.models]
    spread = [sum(float((torch.stack([m[n] for m in models]).double() - means[r][n]).norm()) for n in models[0])
              for r, models in enumerate(rounds.models)]
    for r in (1, 2, 3):
        for n in means[0]:
            assert torch.allclose(means[r][n], means[0][n], rtol=0, atol=1e-6), (r, n)
    assert spread[0] > 0 and spread[3] < spread[2] < spread[1] < spread[0]  # the models contract to consensus


def test_fp16_messages_round_the_payload_and_count_two_bytes():
    half = _run(DFedAvgM(num_neighbors=2, message_dtype="float16"), rounds=2)
    full = _run(DFedAvgM(num_neighbors=2), rounds=2)
    assert half.history[1]["comm/busiest_bytes"] == full.history[1]["comm/busiest_bytes"] / 2
    algo, store = half.algorithm, half.store
    received = algo.message(SimpleNamespace(store=store, node=0), Source(1))
    own = algo.message(SimpleNamespace(store=store, node=1), Source(1))
    sent = store.published(1)[0]
    for n, t in sent.items():
        assert torch.equal(received.weights[n], t.half().float()) and torch.equal(own.weights[n], t)
    assert any(not torch.equal(received.weights[n], t) for n, t in sent.items())


class Recorder(DFedAvgM):
    def aggregate(self, ctx, messages):
        before = ctx.worker_weights()
        result = super().aggregate(ctx, messages)
        senders = [m.sender for m in messages]
        self.log[(ctx.round_idx, ctx.node)] = (before, senders, {n: t.clone() for n, t in (result or before).items()})
        return result


def test_da_rule_adds_the_mean_fp16_delta_to_the_own_model():
    first = RoundModels()
    algo = Recorder(num_neighbors=2, rule="da", clip_grad_norm=10.0, weighting="uniform")
    algo.log = {}
    trainer = _run(algo, rounds=2, momentum=0.0, callbacks=[first])
    x0 = algo.log[(0, 0)][0]  # round 0: no sources, training starts from the shared x^0
    assert algo.log[(0, 0)][1] == [] and all(torch.equal(algo.log[(0, 0)][2][n], x0[n]) for n in x0)
    z0 = first.models[0]
    deltas = [{n: (z0[j][n] - x0[n]).half() for n in x0} for j in range(K)]  # Delta_j^0 = fp16(z_j - x_j)
    for k in range(K):
        own, senders, aggregated = algo.log[(1, k)]
        assert senders[0] == k and len(senders) == 3
        for n in x0:
            assert torch.equal(own[n], z0[k][n])  # x_k <- z_k: the model is never averaged
            expected = z0[k][n] + sum(deltas[j][n].float() for j in senders) / 3
            assert torch.allclose(aggregated[n], expected, rtol=0, atol=1e-6)
    assert trainer.store.fields[DELTA_FIELD]["classifier.2.weight"].dtype == torch.float16
    assert trainer.history[1]["comm/busiest_bytes"] == 2 * trainer.store.active_values(0) * 2  # fp16 deltas


def _run_dirichlet(algorithm, callbacks=None):
    """Two rounds on a Dirichlet partition (the clients' sample counts differ)."""
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=32, test_samples_per_client=30,
                             partition="dirichlet", alpha=0.5)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05, momentum=0.0)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=2, logger=False, accelerator="cpu", cpu_threads=1,
                               enable_progress_bar=False, callbacks=callbacks, local_steps=3)
    trainer.fit(model, dm)
    return trainer, [dm.client_train_size(k) for k in range(K)]


def test_da_rule_weighs_the_deltas_by_sample_count_by_default():
    """The DA copy (dfedavgm_api.py _aggregate): x_i + sum_j n_j Delta_j / sum_l n_l over N_i u i."""
    first = RoundModels()
    algo = Recorder(num_neighbors=2, rule="da")
    assert algo.weighting == "samples" and DFedAvgM().weighting == "uniform"
    algo.log = {}
    trainer, counts = _run_dirichlet(algo, callbacks=[first])
    assert len(set(counts)) > 1, counts  # the weights differ from 1/(M+1)
    x0 = algo.log[(0, 0)][0]
    z0 = first.models[0]
    deltas = [{n: (z0[j][n] - x0[n]).half().double() for n in x0} for j in range(K)]
    for k in range(K):
        own, senders, aggregated = algo.log[(1, k)]
        total = sum(counts[j] for j in senders)
        for n in x0:
            expected = z0[k][n].double() + sum(counts[j] / total * deltas[j][n] for j in senders)
            assert torch.allclose(aggregated[n].double(), expected, rtol=0, atol=1e-6), (k, n)
    assert algo.label() == "dfedavgm (message_dtype float16, rule da, weighting samples)"


def test_samples_weighting_mixes_the_models_by_sample_count():
    """weighting="samples" under the original rule: x_i = sum_j n_j z_j / sum_l n_l over N_i u i."""
    first = RoundModels()
    algo = Recorder(num_neighbors=2, weighting="samples")
    algo.log = {}
    trainer, counts = _run_dirichlet(algo, callbacks=[first])
    z0 = first.models[0]
    for k in range(K):
        _, senders, aggregated = algo.log[(1, k)]
        total = sum(counts[j] for j in senders)
        for n in z0[0]:
            expected = sum(counts[j] / total * z0[j][n].double() for j in senders)
            assert torch.allclose(aggregated[n].double(), expected, rtol=0, atol=1e-6), (k, n)
    assert algo.label() == "dfedavgm (weighting samples)"


@pytest.mark.parametrize("kwargs, message", [
    ({"momentum": 1.0}, r"momentum \(theta\) must be a number in \[0, 1\), got 1.0"),
    ({"momentum": "0.9"}, r"momentum \(theta\) must be a number in \[0, 1\), got '0.9'"),
    ({"rule": "dp"}, r"unknown rule 'dp'; allowed: original, da"),
    ({"message_dtype": "int8"}, r"unknown message_dtype 'int8'; allowed: float32, float16"),
    ({"rule": "da", "message_dtype": "float32"}, r"message_dtype must be 'float16' or None, got 'float32'"),
    ({"clip_grad_norm": 0}, r"clip_grad_norm must be a number > 0 or None, got 0"),
    ({"weighting": "size"}, r"unknown weighting 'size'; allowed: uniform, samples"),
    ({"topology": "star"}, r"star"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DFedAvgM(**kwargs)
