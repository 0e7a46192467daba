"""DA-DPFL as an algorithm on the engine: dynamic aggregation plans and sparse-to-sparser runs."""

import warnings

import numpy as np
import pytest

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import Clock, FederatedTrainer
from lightning_dfl.federation.algorithms import DADPFL, RoundContext
from lightning_dfl.federation.algorithms.dadpfl_waits import simulate_round
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


def _ctx(round_idx=0, num_clients=8, seed=0):
    return RoundContext(round_idx, 10, num_clients, tuple([10] * num_clients), np.random.default_rng(seed))


def test_n0_is_parallel_dfl():
    plan = DADPFL(num_neighbors=3, max_wait=0).plan_round(_ctx())
    assert all(not s.fresh for t in plan.tasks for s in t.sources)
    assert Clock().round_metrics(plan) == {"parallelism": 1.0, "max_parallelism": 1.0, "delay": 0.0, "duration": 1.0}


def test_full_topology_with_n_equal_m_is_sequential():
    algo = DADPFL(topology="full", max_wait=4)
    algo.validate(5)
    plan = algo.plan_round(_ctx(num_clients=5))
    order = plan.meta["reuse_order"]
    assert [t.node for t in plan.order()] == order
    for position, task in enumerate(plan.order()):  # each client reuses all earlier clients' fresh models
        assert {s.node for s in task.sources if s.fresh} == set(order[:position])
    assert Clock().round_metrics(plan)["delay"] == 4


def test_plan_clock_matches_the_scheduling_simulator():
    algo = DADPFL(num_neighbors=3, max_wait=2)
    ctx = _ctx(round_idx=3, num_clients=12, seed=5)
    plan = algo.plan_round(ctx)
    times = Clock().schedule(plan)
    ctx = _ctx(round_idx=3, num_clients=12, seed=5)  # same draws again
    neighbors = algo.neighbors(ctx)
    order = ctx.rng.permutation(12)
    reuse = [0] * 12
    for pos, c in enumerate(order):
        reuse[int(c)] = pos
    simulated = simulate_round(neighbors, reuse, 2)
    assert [times[k][0] for k in range(12)] == [float(s) for s in simulated.start]


def test_max_wait_above_m_is_refused_before_training():
    with pytest.raises(ValueError, match="max_wait"):
        DADPFL(num_neighbors=2, max_wait=3).validate(10)


def test_dadpfl_prunes_towards_the_target_without_overshoot():
    dm = FederatedDataModule(dataset="digits", num_clients=6, batch_size=32, test_samples_per_client=40)
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
    algo = DADPFL(num_neighbors=2, max_wait=2, delta_pr=1000.0, target_sparsity=0.7)  # votes stable at once
    trainer = FederatedTrainer(algorithm=algo, rounds=8, local_epochs=1, logger=False, accelerator="cpu",
                               enable_progress_bar=False)
    trainer.fit(model, dm)
    first, last = trainer.history[0], trainer.history[-1]
    assert last["density/mean"] < first["density/mean"] - 0.1  # sparse to sparser
    assert last["density/min"] >= 0.3 - 1e-3  # never past s* = 0.7
    assert last["flops/train_per_client"] < first["flops/train_per_client"]
    assert last["comm/busiest_bytes"] < first["comm/busiest_bytes"]
    assert any("voting/t_star" in m for m in trainer.history)
    assert sum(m.get("pqi/pruned_clients", 0) for m in trainer.history) > 0
    assert last["acc/personal_mean"] > 0.4
    assert any(m["time/delay"] > 0 for m in trainer.history)


def test_a_run_resumed_with_more_rounds_prunes_on_the_new_schedule(tmp_path):
    """Eq. 6 prunes until T: a 6-round run resumed for T = 12 prunes at the rounds of T = 12 after round 6 (as the
    log says, the schedules follow the new rounds), not only at those the checkpoint's T = 6 gave."""
    from lightning_dfl.callbacks import PruningTimeVoting
    from lightning_dfl.pruning_time import pruning_rounds

    def run(rounds, ckpt_path=None):
        dm = FederatedDataModule(dataset="digits", num_clients=4, batch_size=32, test_samples_per_client=20)
        model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
        trainer = FederatedTrainer(algorithm=DADPFL(num_neighbors=2, max_wait=2, delta_pr=1000.0), rounds=rounds,
                                   local_steps=1, local_epochs=None, logger=False, accelerator="cpu",
                                   checkpoint_every=rounds, default_root_dir=str(tmp_path), enable_progress_bar=False)
        trainer.fit(model, dm, ckpt_path=ckpt_path)
        return trainer, next(c for c in trainer.callbacks if isinstance(c, PruningTimeVoting))

    first, voting = run(6)
    t_star = voting.t_star
    before = tuple(t - 1 for t in pruning_rounds(t_star, 6))
    after = tuple(t - 1 for t in pruning_rounds(t_star, 12))
    assert voting.pruning_round_indices == before and len(after) > len(before)  # the longer run prunes more
    resumed, voting = run(12, str(first.checkpoint_path))
    assert voting.t_star == t_star and voting.pruning_round_indices == after
    pruned = [i for i, m in enumerate(resumed.history) if m.get("pqi/pruned_clients", 0) > 0]
    assert pruned == [i for i in after if i in before or i >= 6]  # rounds 0-5 ran under T = 6


def test_a_user_callback_takes_the_default_ones_place():
    from lightning_dfl.callbacks import PQIPruning, PruningTimeVoting, RigL

    mine = PQIPruning(target_sparsity=0.6)
    trainer = FederatedTrainer(algorithm=DADPFL(num_neighbors=2, max_wait=1), callbacks=[mine], logger=False)
    assert [type(c) for c in trainer.callbacks] == [PruningTimeVoting, PQIPruning, RigL]
    assert trainer.callbacks[1] is mine


def test_client_speeds_drive_the_simulated_clock():
    dm = FederatedDataModule(dataset="digits", num_clients=4, batch_size=64, test_samples_per_client=20)
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
    algo = DADPFL(topology="full", max_wait=3)
    trainer = FederatedTrainer(algorithm=algo, rounds=1, local_epochs=1, logger=False, accelerator="cpu",
                               enable_progress_bar=False, client_speeds=[1.0, 2.0, 4.0, 0.5])
    trainer.fit(model, dm)
    # sequential: the round lasts the sum of all task durations
    assert trainer.history[0]["time/duration"] == pytest.approx(1.0 + 0.5 + 0.25 + 2.0)
    with pytest.raises(ValueError, match="client_speeds has 2 entries for 4 clients"):
        FederatedTrainer(algorithm=algo, client_speeds=[1.0, 1.0], logger=False).fit(
            SparseClassifier(arch="cnn_digits"), dm)
