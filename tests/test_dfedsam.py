"""DFedSAM (Shi et al. 2023; baselines notes section 5): DFedAvgM with SAM local steps, DFedSAM-MGS's
Q gossip steps, and FLOPs counted for both passes."""

import warnings

import pytest
import torch
from torch import nn

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms.dfedavgm import DFedAvgM
from lightning_dfl.federation.algorithms.dfedsam import REPORT, DFedSAM, sam_step
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

K = 5


def _run(algorithm, rounds=2, **trainer_kw):
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=32, test_samples_per_client=30)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05)
    trainer_kw.setdefault("local_steps", 3)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, logger=False, accelerator="cpu", cpu_threads=1,
                               enable_progress_bar=False, **trainer_kw)
    trainer.fit(model, dm)
    return trainer


def _same(a, b):
    return all(torch.equal(a.store.published(k)[0][n], b.store.published(k)[0][n])
               for k in range(K) for n in a.store.names)


# -- the SAM step routine ------------------------------------------------------------------------
class Quadratic(nn.Module):
    """f(w) = sum_i a_i/2 w_i^2 over scalar parameters; records where each loss is evaluated."""

    def __init__(self, *values):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.tensor(v, dtype=torch.float64)) for v in values])
        self.seen = []

    def closure_for(self, optimizer, a):
        def closure():
            optimizer.zero_grad()
            self.seen.append([float(w.detach()) for w in self.ws])
            loss = sum(0.5 * ai * w**2 for ai, w in zip(a, self.ws))
            loss.backward()
            return loss
        return closure


@pytest.mark.parametrize("w0", [3.0, -3.0])
def test_sam_step_on_a_quadratic_uses_the_gradient_at_w_plus_rho_sign_w(w0):
    a, rho, lr = 2.0, 0.5, 0.1
    module = Quadratic(w0)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)  # fresh: the buffer is the gradient
    loss = sam_step(optimizer, module.closure_for(optimizer, [a]), rho)
    sign = 1.0 if w0 > 0 else -1.0
    assert module.seen == [[w0], [pytest.approx(w0 + rho * sign, abs=1e-12)]]  # z, then z_hat = z + rho sign z
    assert module.ws[0].grad.item() == pytest.approx(a * (w0 + rho * sign))    # a (w + rho sign w) = +-7
    assert module.ws[0].item() == pytest.approx(w0 - lr * a * (w0 + rho * sign))  # stepped from w: +-2.3
    assert module.ws[0].item() == pytest.approx(2.3 * sign)
    assert loss.item() == 0.5 * a * w0**2  # the loss at z


def test_sam_perturbation_is_normalised_over_all_parameters():
    module = Quadratic(3.0, 4.0)  # a = 1: g = (3, 4), ||g|| = 5
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    sam_step(optimizer, module.closure_for(optimizer, [1.0, 1.0]), rho=1.0)
    assert module.seen[1] == [pytest.approx(3.0 + 0.6), pytest.approx(4.0 + 0.8)]  # not per-tensor (1, 1)
    assert [w.item() for w in module.ws] == [3.0, 4.0]  # z restored exactly (lr 0)


def test_sam_second_pass_leaves_batchnorm_statistics_and_rng_as_one_pass():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Dropout(0.5), nn.Linear(3, 2))
    x = torch.randn(8, 4)
    plain = [p.detach().clone() for p in net.state_dict().values()]

    def run(step):
        net.load_state_dict(dict(zip(net.state_dict(), plain)))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

        def closure():
            optimizer.zero_grad()
            loss = net(x).square().mean()
            loss.backward()
            return loss
        torch.manual_seed(1)
        step(optimizer, closure)
        return {n: t.clone() for n, t in net.state_dict().items()}, torch.rand(1)

    def plain_step(optimizer, closure):
        closure()
        optimizer.step()

    one, after_one = run(plain_step)
    sam0, after_sam0 = run(lambda o, c: sam_step(o, c, 0.0, net))
    sam, _ = run(lambda o, c: sam_step(o, c, 0.5, net))
    assert all(torch.equal(one[n], sam0[n]) for n in one) and torch.equal(after_one, after_sam0)
    assert torch.equal(sam["1.running_mean"], one["1.running_mean"])  # only the pass at z updates the stats
    assert not torch.equal(sam["0.weight"], one["0.weight"])


# -- in a federation -----------------------------------------------------------------------------
def test_rho0_is_dfedavgm_bit_for_bit_and_flops_count_both_passes():
    dfedavgm = _run(DFedAvgM(num_neighbors=2), rounds=2)
    flat = _run(DFedSAM(num_neighbors=2, rho=0.0), rounds=2)
    sharp = _run(DFedSAM(num_neighbors=2, rho=0.05), rounds=2)
    assert _same(flat, dfedavgm)
    assert not _same(sharp, dfedavgm)
    for r in range(2):
        base = dfedavgm.history[r]
        for run in (flat, sharp):
            assert run.history[r]["flops/train_total"] == 2 * base["flops/train_total"] > 0
            assert run.history[r]["samples/train"] == 2 * base["samples/train"]
            assert run.history[r]["comm/busiest_bytes"] == base["comm/busiest_bytes"]


class Reports(DFedSAM):
    def optimizer_step(self, ctx, closure):
        loss = super().optimizer_step(ctx, closure)
        self.reports[(ctx.round_idx, ctx.node)] = (dict(ctx.report), ctx.train_batches.samples)
        return loss


def test_second_pass_samples_are_reported_per_client():
    algo = Reports(num_neighbors=2)
    algo.reports = {}
    _run(algo, rounds=1, local_steps=2)
    for k in range(K):
        report, samples = algo.reports[(0, k)]
        assert report[REPORT] == samples / 2 > 0  # as many again as the batches drawn


def test_mgs_gossip_steps_mix_the_trained_models_within_the_round():
    one = _run(DFedSAM(topology="full", rho=0.05), rounds=1)
    two = _run(DFedSAM(topology="full", rho=0.05, gossip_steps=2), rounds=1)
    # round 0: exchange 0 trains as DFedSAM does (no mixing yet), exchange 1 mixes: on the full graph,
    # every client then holds the mean of the K trained models
    trained = [one.store.published(k)[0] for k in range(K)]
    for k in range(K):
        for n, t in two.store.published(k)[0].items():
            assert torch.allclose(t, sum(m[n] for m in trained) / K, rtol=0, atol=1e-6)
    assert one.history[0]["comm/busiest_bytes"] == 0
    assert two.history[0]["comm/busiest_bytes"] == (K - 1) * one.store.active_values(0) * 4
    assert two.history[0]["flops/train_total"] == one.history[0]["flops/train_total"]  # gossip costs no FLOPs


@pytest.mark.parametrize("kwargs, message", [
    ({"rho": -0.1}, r"rho must be a finite number >= 0 \(grid \[0.01, 0.02, 0.05, 0.1, 0.2, 0.5\]\), got -0.1"),
    ({"rho": float("nan")}, r"rho must be a finite number >= 0"),
    ({"gossip_steps": 0}, r"gossip_steps \(Q\) must be an integer >= 1, got 0"),
    ({"momentum": -0.5}, r"momentum \(theta\) must be a number in \[0, 1\), got -0.5"),
    ({"message_dtype": "bf16"}, r"unknown message_dtype 'bf16'"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DFedSAM(**kwargs)
