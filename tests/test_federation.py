"""End-to-end behaviour of the federated engine on the embedded digits set."""

import warnings

import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.callbacks.rigl import RigL
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import Clock, FederatedTrainer, RoundPlan, masked_average
from lightning_dfl.federation.algorithms import DPSGD, DisPFL, FedAvg, Local
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


def _run(algorithm, rounds=2, local_epochs=1, num_clients=6, density=0.5, callbacks=None, seed=0, **trainer_kw):
    dm = FederatedDataModule(dataset="digits", num_clients=num_clients, batch_size=32, test_samples_per_client=40,
                             seed=seed)
    model = SparseClassifier(arch="cnn_digits", density=density, lr=0.05, seed=seed)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, local_epochs=local_epochs, logger=False,
                               accelerator="cpu", enable_progress_bar=False, callbacks=callbacks, seed=seed,
                               **trainer_kw)
    trainer.fit(model, dm)
    return trainer


def test_dispfl_learns_keeps_density_and_personal_masks():
    trainer = _run(DisPFL(num_neighbors=2), rounds=4, local_epochs=2)
    last = trainer.history[-1]
    assert last["acc/personal_mean"] > 0.5  # chance is 0.1
    assert last["density/mean"] == pytest.approx(0.5, abs=2e-3) and last["density/std"] < 1e-3
    store = trainer.store
    name = store.masked_names[1]
    assert not torch.equal(store.masks[name][0], store.masks[name][1])  # personal masks
    for k in range(6):  # published weights are zero outside the mask they were trained with
        weights, masks = store.published(k)
        for n in store.masked_names:
            assert (weights[n][~masks[n]] == 0).all()


def test_communication_and_flops_follow_the_papers_conventions():
    trainer = _run(DisPFL(num_neighbors=2), rounds=1, local_epochs=1)
    m = trainer.history[0]
    store = trainer.store
    active = store.active_values(0)
    assert all(store.active_values(k) == active for k in range(6))  # ERK counts are exact per layer
    # exactly M=2 models in and out per client, 4 bytes per active value
    assert m["comm/busiest_bytes"] == 2 * active * 4
    assert m["comm/busiest_mask_bytes"] == 2 * -(-store.masked_size() // 8)
    assert m["comm/total_bytes"] == 6 * 2 * active * 4
    # 3 x forward FLOPs on the active weights of the mask trained with, for every training sample,
    # plus RigL's one dense-gradient batch at dense FLOPs
    profile, dm = trainer.module.flops_profile, trainer.datamodule
    expected = sum(dm.client_train_size(k) * 3 * profile.forward_flops(store.published(k)[1])
                   + min(32, dm.client_train_size(k)) * 3 * profile.dense_forward_flops() for k in range(6))
    assert m["flops/train_total"] == pytest.approx(expected, rel=1e-12)


def test_local_sends_nothing_and_dpsgd_reports_consensus():
    local = _run(Local(), rounds=1)
    assert local.history[0]["comm/busiest_bytes"] == 0
    dpsgd = _run(DPSGD(num_neighbors=2), rounds=1, density=1.0)
    assert "acc/consensus_mean" in dpsgd.history[0]
    assert dpsgd.history[0]["density/mean"] == 1.0
    assert dpsgd.history[0]["comm/busiest_mask_bytes"] == 0


def test_fedavg_server_is_the_sample_weighted_average_of_sampled_clients():
    trainer = _run(FedAvg(clients_per_round=3), rounds=1, density=1.0)
    store, dm = trainer.store, trainer.datamodule
    server = dm.num_clients
    trained = [k for k in range(dm.num_clients) if int(store.slot[k]) == 1]
    assert len(trained) == 3 and int(store.slot[server]) == 1
    weights, masks = store.gather([(k, False) for k in trained])
    expected = masked_average(weights, masks, coefficients=[dm.client_train_size(k) for k in trained])
    got, _ = store.published(server)
    for n in expected:
        assert torch.allclose(got[n], expected[n], atol=1e-6)
    assert trainer.history[0]["acc/headline"] == trainer.history[0]["acc/consensus_mean"]


def test_same_seed_same_results_and_task_order_does_not_matter(monkeypatch):
    a = _run(DisPFL(num_neighbors=2), rounds=2)
    b = _run(DisPFL(num_neighbors=2), rounds=2)
    monkeypatch.setattr(RoundPlan, "order", lambda self: list(reversed(self._order)))
    c = _run(DisPFL(num_neighbors=2), rounds=2)
    for other in (b, c):
        for n in a.store.names:
            assert torch.equal(a.store.weights[n], other.store.weights[n])
        for n in a.store.masked_names:
            assert torch.equal(a.store.masks[n], other.store.masks[n])
    keys = ("acc/personal_mean", "train/loss", "comm/busiest_bytes")
    assert [[h[k] for k in keys] for h in a.history] == [[h[k] for k in keys] for h in c.history]
    d = _run(DisPFL(num_neighbors=2), rounds=1, seed=1)
    assert not torch.equal(a.store.masks[a.store.masked_names[1]], d.store.masks[d.store.masked_names[1]])


class Recorder(FederatedCallback):
    def __init__(self):
        self.events = []

    def on_federated_round_start(self, trainer, pl_module):
        self.events.append(("round_start", trainer.current_round))

    def on_client_before_aggregation(self, trainer, pl_module, client_id):
        self.events.append(("before_aggregation", client_id))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.events or self.events[-1][0] != "batch":
            self.events.append(("batch", trainer.current_client))

    def on_client_train_end(self, trainer, pl_module, client_id):
        self.events.append(("train_end", client_id))

    def on_client_end(self, trainer, pl_module, client_id):
        self.events.append(("client_end", client_id))

    def on_federated_round_end(self, trainer, pl_module):
        self.events.append(("round_end", trainer.current_round))


def test_callbacks_receive_federated_hooks_in_order():
    recorder = Recorder()
    _run(Local(), rounds=1, num_clients=2, callbacks=[recorder])
    assert recorder.events == [
        ("round_start", 0),
        ("before_aggregation", 0), ("batch", 0), ("train_end", 0), ("client_end", 0),
        ("before_aggregation", 1), ("batch", 1), ("train_end", 1), ("client_end", 1),
        ("round_end", 0),
    ]


def test_bad_configurations_fail_before_training():
    with pytest.raises(ValueError, match="M=6, K=6"):
        _run(DisPFL(num_neighbors=6), rounds=1)
    with pytest.raises(ValueError, match="density must be in"):
        SparseClassifier(density=1.5)
    with pytest.raises(ValueError, match="unknown arch 'resnet999'"):
        SparseClassifier(arch="resnet999")
    with pytest.raises(ValueError, match="clients_per_round"):
        _run(FedAvg(clients_per_round=10), rounds=1)
    with pytest.raises(ValueError, match="rounds must be an integer >= 1"):
        FederatedTrainer(rounds=0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions_train_and_keep_the_mask(precision):
    trainer = _run(DisPFL(num_neighbors=2), rounds=2, precision=precision)
    last = trainer.history[-1]
    assert last["density/mean"] == pytest.approx(0.5, abs=2e-3)
    assert last["acc/personal_mean"] > 0.2
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert trainer.store.weights[trainer.store.masked_names[0]].dtype == dtype


def test_float16_aggregation_accumulates_in_float32():
    """Half-precision models average in float32: in float16 the divisor's floor (1e-12) was 0, so a weight no
    source held became 0 / 0 = NaN, and sums of large weights overflowed."""
    masks = {"w": torch.tensor([[True, False, False], [True, True, False]])}
    weights = {"w": torch.tensor([[40000.0, 0.0, 0.0], [40000.0, 2.0, 0.0]], dtype=torch.float16)}
    out = masked_average(weights, masks, receiver_mask={"w": torch.tensor([True, True, True])})["w"]
    assert out.dtype == torch.float16 and out.tolist() == [40000.0, 2.0, 0.0]


def test_dispfl_in_16_true_stays_finite():
    """16-true DisPFL ended "diverged" after its first aggregation (NaN from the float16 average), while Local
    trained: an aggregation bug, not a divergence."""
    trainer = _run(DisPFL(num_neighbors=2), rounds=2, num_clients=4, local_epochs=None, local_steps=2,
                   precision="16-true")
    store = trainer.store
    assert store.weights[store.masked_names[0]].dtype == torch.float16
    assert all(torch.isfinite(w).all() for w in store.weights.values())
    assert all(m["faults/nonfinite_clients"] == 0 and m["train/loss"] < 1e4 for m in trainer.history)


@pytest.mark.parametrize("kwargs, message", [
    ({"devices": "auto"}, "devices \\(processes per node\\) must be an integer >= 1, got 'auto'"),
    ({"strategy": "ddp"}, "strategy='ddp' with 1 process"),
    ({"logger": "wandb"}, "logger must be"),
    ({"local_epochs": -1}, "local_epochs must be an integer >= 0"),
    ({"client_speeds": [1.0, 0.0]}, "client_speeds must all be > 0"),
    ({"client_speeds": [1.0], "clock": Clock()}, "client_speeds or a clock, not both"),
    ({"clock": "fast"}, "clock must be a lightning_dfl.federation.loop.clock.Clock, got str"),
    ({"cpu_threads": 0}, r"cpu_threads \(at most the \d+ CPUs this process may use\) must be an integer in \[1, \d+\], got 0"),
    ({"checkpoint_every": 1.5}, "checkpoint_every .0: never. must be an integer >= 0, got 1.5"),
    # from Python, not the CLI: each once ended in a TypeError/AttributeError deep inside set-up or the first round
    ({"client_speeds": "fast"}, "client_speeds must be a list of numbers > 0 .one per client., got 'fast'"),
    ({"client_speeds": [1.0, "2"]}, "client_speeds must be a list of numbers > 0 .one per client., got \\[1.0, '2'\\]"),
    ({"callbacks": "RigL"}, "callbacks must be Lightning Callback instances .e.g. RigL\\(\\)., got 'RigL' .str."),
    ({"callbacks": [RigL(), "RigL"]}, "callbacks must be Lightning Callback instances .e.g. RigL\\(\\)., got 'RigL'"),
    ({"seed": None}, "seed must be an integer in \\[0, 4294967295\\], got None"),
    ({"seed": -1}, "seed must be an integer in \\[0, 4294967295\\], got -1"),
    ({"default_root_dir": None}, "default_root_dir must be a folder's path .a str or os.PathLike., got None"),
    ({"accelerator": "tpu"}, "accelerator='tpu' .*allowed: auto, cpu, gpu, cuda, mps"),
])
def test_trainer_arguments_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FederatedTrainer(**kwargs)


def test_fit_refuses_a_checkpoint_path_that_is_not_a_path(tmp_path):
    trainer = FederatedTrainer(rounds=1, logger=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match="ckpt_path must be a checkpoint file's path .a str or os.PathLike., got 123"):
        trainer.fit(SparseClassifier(arch="cnn_digits"), FederatedDataModule(dataset="digits", num_clients=4), ckpt_path=123)


@pytest.mark.parametrize("algorithm", [DisPFL, DPSGD])
def test_num_neighbors_must_be_an_integer(algorithm):
    with pytest.raises(ValueError, match="num_neighbors must be an integer >= 0, got '4'"):
        algorithm(num_neighbors="4")


def test_a_user_algorithm_from_the_readme_runs_as_a_chain():
    from lightning_dfl.federation import Algorithm, Source, Task

    class Chain(Algorithm):
        name = "chain"

        def plan_round(self, ctx):
            order = [int(k) for k in ctx.rng.permutation(ctx.num_clients)]
            tasks = [Task(node=order[0])]
            tasks += [Task(node=k, sources=(Source(prev, fresh=True),)) for prev, k in zip(order, order[1:])]
            return RoundPlan(ctx.round_idx, tasks)

    trainer = _run(Chain(), rounds=2, num_clients=5, density=1.0)
    assert [m["time/delay"] for m in trainer.history] == [4.0, 4.0]  # sequential
    assert trainer.history[-1]["comm/busiest_bytes"] > 0
