"""PSFL on the engine: chains of clients, the uniform server step, the warm-up and the solved structure."""

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import Kill

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import Clock, FederatedTrainer, masked_average
from lightning_dfl.federation.algorithms.psfl import PSFL
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")
K = 8


def _fit(algorithm, rounds=1, callbacks=None, **kw):
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=16, test_samples_per_client=20)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05, lr_decay=1.0)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, local_steps=3, logger=False,
                               accelerator="cpu", enable_progress_bar=False, callbacks=callbacks, **kw)
    trainer.fit(model, dm)
    return trainer


class Plans(FederatedCallback):
    def __init__(self):
        self.models = {}

    def on_federated_round_start(self, trainer, pl_module):
        self.server_start = {n: t.clone() for n, t in trainer.store.published(K)[0].items()}


def test_s_equal_1_is_fedavg_with_a_uniform_average():
    algo = PSFL(clients_per_round=4, sequences=4, sampler="uniform")
    trainer = _fit(algo)
    store = trainer.store
    trained = [k for k in range(K) if int(store.slot[k]) == 1]
    assert len(trained) == 4
    expected = masked_average(*store.gather([(k, False) for k in trained]))  # 1/W each (Eq. 3), not by samples
    for n, t in store.published(K)[0].items():
        assert torch.allclose(t, expected[n], atol=1e-6)
    assert trainer.history[0]["psfl/W"] == 4 and trainer.history[0]["psfl/S"] == 1
    assert 0.0 <= trainer.history[0]["acc/global"] <= 1.0 and "acc/headline" in trainer.history[0]


def test_w_equal_1_is_sequential_fl_a_chain_ending_at_the_server():
    seen = []

    class Reads(FederatedCallback):
        def on_client_before_aggregation(self, trainer, pl_module, client_id):
            seen.append(client_id)

    algo = PSFL(clients_per_round=5, sequences=1, sampler="uniform")
    trainer = _fit(algo, callbacks=[Reads()])
    store = trainer.store
    last = seen[-1]
    for n, t in store.published(K)[0].items():  # the server holds the chain's last model
        assert torch.equal(t, store.published(last)[0][n])
    assert len(seen) == 5 and trainer.history[0]["psfl/W"] == 1 and trainer.history[0]["psfl/S"] == 5
    assert trainer.history[0]["time/duration"] == 5.0  # Eq. 4: the slowest sequence's summed time


def test_round_time_is_the_slowest_sequences_sum():
    speeds = [1.0, 0.5, 2.0, 1.0, 0.25, 1.0, 4.0, 1.0]
    algo = PSFL(clients_per_round=6, sequences=2, sampler="uniform")
    plans = []
    original = PSFL.plan_round

    def spy(self, ctx):
        plan = original(self, ctx)
        plans.append(plan)
        return plan

    PSFL.plan_round = spy
    try:
        trainer = _fit(algo, client_speeds=speeds)
    finally:
        PSFL.plan_round = original
    sequences = plans[0].meta["sequences"]
    assert trainer.history[0]["time/duration"] == pytest.approx(max(sum(1 / speeds[k] for k in s) for s in sequences))


def test_warmup_estimates_then_solves_the_structure_and_restarts_from_x0():
    clock = Clock(distribution="discrete", noise=0.2)
    algo = PSFL(clients_per_round=6, warmup_rounds=2, sampler="time")
    start = {}

    class Server(FederatedCallback):
        def on_federated_round_start(self, trainer, pl_module):
            start[trainer.current_round] = {n: t.clone() for n, t in trainer.store.published(K)[0].items()}

    sequences = []
    original = PSFL.plan_round

    def spy(self, ctx):
        plan = original(self, ctx)
        if "sequences" in plan.meta:
            sequences.append(plan.meta["sequences"])
        return plan

    PSFL.plan_round = spy
    try:
        trainer = _fit(algo, rounds=4, clock=clock, callbacks=[Server()])
    finally:
        PSFL.plan_round = original
    h = trainer.history
    assert [m["psfl/warmup"] for m in h] == [1.0, 1.0, 0.0, 0.0]
    for n, t in start[2].items():  # the global model did not move in the warm-up: training starts from x^0
        assert torch.equal(t, start[0][n])
    assert not all(torch.equal(t, start[0][n]) for n, t in trainer.store.published(K + 1)[0].items())
    w_mean, w_max = h[2]["psfl/w_star_mean"], h[2]["psfl/w_star_max"]
    assert 1.0 <= w_mean <= 6.0 and 1.0 <= w_max <= 6.0
    assert h[2]["psfl/W"] * h[2]["psfl/S"] <= 6 and h[2]["psfl/W"] == min(6, max(1, round(w_mean)))
    assert h[2]["psfl/sigma2"] > 0 and h[2]["time/warmup"] == pytest.approx(h[0]["time/duration"] + h[1]["time/duration"])
    # the estimates are the running means of the clock's times of the rounds a client ran in
    times = [clock.compute_times(r) for r in range(4)]
    ran = {r: set(range(K)) for r in (0, 1)}
    ran.update({r: {k for seq in sequences[r - 2] for k in seq} for r in (2, 3)})
    for k in range(K):
        assert algo.estimates()[k] == pytest.approx(np.mean([times[r][k] for r in range(4) if k in ran[r]]))


@pytest.mark.parametrize("killed_at", [1, 3], ids=["in_the_warmup", "after_it"])
def test_psfl_checkpoint_resumes_bit_identical(tmp_path, killed_at):
    def run(rounds, ckpt=None, root=None):
        dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=16, test_samples_per_client=20)
        model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05, lr_decay=1.0)
        trainer = FederatedTrainer(algorithm=PSFL(clients_per_round=6, warmup_rounds=2), rounds=4,
                                   local_steps=3, logger=False, accelerator="cpu", enable_progress_bar=False,
                                   clock=Clock(distribution="uniform", noise=0.2), checkpoint_every=1,
                                   default_root_dir=str(root or tmp_path))
        if rounds < 4:
            trainer.callbacks.append(Kill(rounds, RuntimeError))
            with pytest.raises(RuntimeError, match="killed"):
                trainer.fit(model, dm)
            return trainer
        trainer.fit(model, dm, ckpt_path=ckpt)
        return trainer

    straight = run(4, root=tmp_path / "a")
    killed = run(killed_at, root=tmp_path / "b")
    resumed = run(4, ckpt=str(killed.checkpoint_path), root=tmp_path / "c")
    for n, t in straight.store.weights.items():
        assert torch.equal(t, resumed.store.weights[n])
    strip = lambda m: {k: v for k, v in m.items() if k != "time/wall_round_s"}  # noqa: E731
    assert [strip(m) for m in straight.history] == [strip(m) for m in resumed.history]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="sequences \\(W\\) must be <= clients_per_round"):
        PSFL(clients_per_round=4, sequences=5)
    with pytest.raises(ValueError, match="unknown sampler 'fast'"):
        PSFL(sampler="fast")
    with pytest.raises(ValueError, match="warmup_rounds must be an integer >= 2"):
        PSFL(warmup_rounds=1)
    with pytest.raises(ValueError, match="c0 must be in"):
        PSFL(c0=0.3)
    with pytest.raises(ValueError, match="unknown sigma2_estimator 'batch'; allowed: per_sample, minibatch"):
        PSFL(sigma2_estimator="batch")
    with pytest.raises(ValueError, match="clients_per_round \\(N0\\) must be <= the number of clients"):
        PSFL(clients_per_round=20, sequences=2).validate(8)


def test_time_to_target_is_the_elapsed_time_of_the_first_evaluation_reaching_it():
    trainer = _fit(PSFL(clients_per_round=4, sequences=2, sampler="uniform", target_accuracy=0.3), rounds=6)
    h = trainer.history
    first = next(i for i, m in enumerate(h) if m["acc/global"] >= 0.3)
    assert "time/to_target" not in h[first - 1] if first else True
    assert all(m["time/to_target"] == h[first]["time/elapsed"] for m in h[first:])


def test_time_estimates_count_each_round_once_when_stragglers_make_it_replan():
    ran = []

    class Count(FederatedCallback):
        def on_client_before_aggregation(self, trainer, pl_module, client_id):
            ran.append(client_id)

    algo = PSFL(clients_per_round=4, sequences=2, sampler="time")
    trainer = _fit(algo, rounds=4, callbacks=[Count()], clock=Clock(distribution="discrete", noise=0.2), deadline=6.0)
    assert sum(m["faults/stragglers"] for m in trainer.history) > 0  # some rounds were planned again
    assert algo._time_count.sum() == len(ran)  # each client that ran is observed once per round


class _Sets(PSFL):
    """PSFL whose warm-up rounds see fixed client sets (as dropout, a deadline or sampling would)."""

    def __init__(self, sets, **kw):
        super().__init__(**kw)
        self.sets = sets

    def participants(self, ctx):
        return self.sets[ctx.round_idx] if ctx.round_idx < len(self.sets) else None


@pytest.mark.parametrize("sets", [[(0, 1, 2, 3, 4, 5), (2, 3, 4, 5, 6, 7)], [tuple(range(K)), (1, 3, 4, 6)]],
                         ids=["same_count_other_clients", "unequal_counts"])
def test_kappa2_pairs_warmup_times_by_client_id(sets):
    """Eq. 26: kappa^2 = mean over clients of var_k(t_n^k), each client's times paired by its id (over the
    warm-up rounds it took part in; clients seen once carry no variance). Position pairing gave a wrong
    kappa^2 for different client sets and a numpy ValueError for unequal counts."""
    clock = Clock(distribution="discrete", noise=0.2)
    algo = _Sets(sets, clients_per_round=4, warmup_rounds=2, sampler="uniform")
    trainer = _fit(algo, rounds=3, clock=clock)
    times = [clock.compute_times(r) for r in range(2)]
    both = sorted(set(sets[0]) & set(sets[1]))
    variances = [np.var([times[0][k], times[1][k]]) for k in both]  # hand-computed, by id
    h = trainer.history[2]
    assert h["psfl/kappa2_mean"] == pytest.approx(np.mean(variances), rel=1e-12)
    assert h["psfl/kappa2_max"] == pytest.approx(np.max(variances), rel=1e-12)
    assert h["psfl/t_mean"] == pytest.approx(np.mean([times[r][k] for r in range(2) for k in sets[r]]), rel=1e-12)
    assert algo.warmup_estimates()["kappa2_mean"] == h["psfl/kappa2_mean"]


def _baseline_overrides(text):
    """The ``--...`` overrides of every line (with its continuation) that names FedAvg or SFL."""
    joined = text.replace("\\\n", " ")
    found = {}
    for line in joined.splitlines():
        for name in ("FedAvg", "SFL"):
            if re.search(rf"(#\s*{name}\b|^#\s+{name}:)", line.strip()) and "sequences=" in line:
                found[name] = re.findall(r"--trainer\.algorithm\.init_args\.\w+=\S+", line)
    return found


@pytest.mark.parametrize("config", ["psfl_digits.yaml", "psfl_cifar10.yaml", "psfl_ham10000.yaml"])
def test_baseline_commands_sample_uniformly(config):
    """psfl-notes 11: FedAvg (W = N0) and SFL (W = 1) as baselines sample uniformly and skip the warm-up;
    the README's commands and the configs' headers must say so (they kept ``sampler: time``)."""
    from lightning_dfl.cli import FederatedCLI

    root = Path(__file__).resolve().parents[1]
    sources = {"header": _baseline_overrides((root / "configs" / config).read_text())}
    if config == "psfl_digits.yaml":
        readme = (root / "README.md").read_text()
        sources["README"] = _baseline_overrides(readme[readme.index("### PSFL"):readme.index("### PRISAM")])
    for where, found in sources.items():
        assert set(found) == {"FedAvg", "SFL"}, (where, found)
        for name, overrides in found.items():
            cli = FederatedCLI(args=["--config", str(root / "configs" / config), *overrides], run=False)
            algo = cli.trainer.algorithm
            assert algo.sampler == "uniform" and algo.warmup_rounds == 0, (where, name, overrides)
            assert algo.sequences == (1 if name == "SFL" else algo.clients_per_round), (where, name)


def _flat_grad(model):
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.requires_grad])


def _brute_force_moments(module, dm, k):
    """Client k's full gradient and Eq. 24's sigma^2 from one backward pass per sample (batch of one)."""
    grads = []
    module.train()
    for x, y in dm.client_train_batches(k, torch.Generator()):
        for i in range(len(y)):
            module.zero_grad()
            torch.nn.functional.cross_entropy(module.model(x[i:i + 1]), y[i:i + 1]).backward()
            grads.append(_flat_grad(module.model))
    grads = torch.stack(grads)
    full = grads.mean(0)
    return full, float((grads - full).square().sum(1).mean())


def test_warmup_sigma2_is_the_per_sample_variance_and_b_the_spread_of_client_gradients():
    """Eq. 24 and Assumption 3: sigma^2_(n,k) = E_xi ||grad f(x^k; xi) - grad F_n(x^k)||^2 with xi ONE sample
    drawn uniformly from client n's data; Eq. 25: B_k = (1/N) sum_n ||grad F_n(x^k) - grad F(x^k)||^2. Checked
    against brute-force per-sample gradients at the warm-up models x^0 and x^1. (The mini-batch spread of the
    batch-16 gradients that this replaced was about 10 x smaller and pinned W* at 1.)"""
    models = {}

    class Warm(FederatedCallback):
        def on_federated_round_start(self, trainer, pl_module):
            models[trainer.current_round] = {n: t.clone() for n, t in trainer.store.published(K + 1)[0].items()}

    algo = PSFL(clients_per_round=6, warmup_rounds=2)
    trainer = _fit(algo, rounds=2, callbacks=[Warm()])
    dm = trainer.datamodule
    module = SparseClassifier(arch="cnn_digits", density=1.0)
    module.build_for(dm)
    for r in (0, 1):
        module.model.load_state_dict(models[r])
        fulls = []
        for k in range(K):
            full, sigma2 = _brute_force_moments(module, dm, k)
            assert algo._sigma2[r][k] == pytest.approx(sigma2, rel=1e-5)
            fulls.append(full)
        fulls = torch.stack(fulls)
        b = float((fulls - fulls.mean(0)).square().sum(1).mean())
        assert algo._b[r] == pytest.approx(b, rel=1e-5)
    assert trainer.history[1]["psfl/warmup"] == 1.0


def test_per_sample_sigma2_refuses_batchnorm_before_training_and_the_departure_is_labelled():
    """BatchNorm couples a batch's samples, so Eq. 24's per-sample loss is undefined: refused at set-up, naming
    the way out; the mini-batch estimator runs, labelled as a departure (not when the structure is fixed)."""
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=16, test_samples_per_client=20)
    model = SparseClassifier(arch="resnet20", density=1.0)
    trainer = FederatedTrainer(algorithm=PSFL(clients_per_round=4), rounds=1, local_steps=1, logger=False,
                               accelerator="cpu", enable_progress_bar=False)
    with pytest.raises(ValueError, match="per-sample sigma\\^2 .*BatchNorm.*sigma2_estimator: minibatch"):
        trainer.fit(model, dm)
    assert trainer.history == []
    assert PSFL(sigma2_estimator="minibatch").label() == "PSFL (sigma^2 per minibatch)"
    assert PSFL().label() == "PSFL"


def test_fixed_structures_are_named_by_their_structure_in_reports_and_run_folders(tmp_path):
    """PSFL run as FedAvg or SFL (the README's baselines) says so in the summary and its run folder."""
    fedavg = PSFL(clients_per_round=20, sequences=20, sampler="uniform", sigma2_estimator="minibatch")
    assert fedavg.label() == "PSFL (W = 20, S = 1, uniform) = FedAvg" and fedavg.run_name() == "psfl_fedavg"
    sfl = PSFL(clients_per_round=20, sequences=1, sampler="uniform")
    assert sfl.label() == "PSFL (W = 1, S = 20, uniform) = SFL" and sfl.run_name() == "psfl_sfl"
    mixed = PSFL(clients_per_round=20, sequences=4)
    assert mixed.label() == "PSFL (W = 4, S = 5, time)" and mixed.run_name() == "psfl_w4"
    assert PSFL().run_name() == "psfl"
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=16, test_samples_per_client=20)
    trainer = FederatedTrainer(algorithm=PSFL(clients_per_round=4, sequences=4, sampler="uniform"), rounds=1,
                               local_steps=1, accelerator="cpu", enable_progress_bar=False,
                               default_root_dir=str(tmp_path))
    summary = trainer.fit(SparseClassifier(arch="cnn_digits", density=1.0), dm)
    assert summary.label == "PSFL (W = 4, S = 1, uniform) = FedAvg"
    assert Path(trainer.log_dir).parent == tmp_path / "psfl_fedavg"
