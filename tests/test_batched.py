"""Batched clients (torch.func vmap over a level's clients) against the serial executor."""

import warnings

import pytest
import torch
from torch import nn

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DPSGD, DFedSAM, DisPFL, Local
from lightning_dfl.federation.loop import batched
from lightning_dfl.federation.loop.batched import auto_group_size, check_batchable, client_step_bytes, memory_budget
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


def _fit(algorithm, batched, rounds=1, momentum=0.0, arch="cnn_digits", callbacks=None, local_epochs=1,
         model_options=None, lr=0.05, weight_decay=5e-4, data=None, **kw):
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, local_epochs=None if kw.get("local_steps") else local_epochs, seed=0, accelerator="cpu",
                               logger=False, enable_progress_bar=False, batched_clients=batched,
                               callbacks=callbacks, **kw)
    model = SparseClassifier(arch=arch, density=0.5, lr=lr, momentum=momentum, weight_decay=weight_decay,
                             model_options=model_options)
    # uneven clients: Dirichlet sizes, and a last batch smaller than the others
    dm = FederatedDataModule(**{"dataset": "digits", "num_clients": 6, "batch_size": 16, "test_samples_per_client": 20,
                                **(data or {})})
    trainer.fit(model, dm)
    return trainer


def _close(a, b, atol=1e-4, rel=1e-4):
    """Equal up to float rounding (SGD amplifies rounding differences over many steps: longer runs
    are compared with a looser tolerance)."""
    for name, t in a.store.weights.items():
        assert torch.allclose(t, b.store.weights[name], atol=atol), name
    for x, y in zip(a.history, b.history):
        assert x["acc/personal_mean"] == pytest.approx(y["acc/personal_mean"], abs=1 / 120)  # one test sample
        assert x["samples/train"] == y["samples/train"] and x["flops/train_total"] == y["flops/train_total"]
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=rel)


@pytest.mark.parametrize("algorithm", [lambda: Local(), lambda: DPSGD(num_neighbors=2)], ids=["local", "dpsgd"])
def test_batched_training_equals_the_serial_path_up_to_rounding(algorithm):
    _close(_fit(algorithm(), False), _fit(algorithm(), True))


def test_two_rounds_of_two_epochs_stay_close():
    """The serial path runs channels-last kernels (memory_format auto), the batched one NCHW: 2.1e-3 apart
    here (2.6e-4 with memory_format contiguous on both)."""
    _close(_fit(DPSGD(num_neighbors=2), False, rounds=2, local_epochs=2),
           _fit(DPSGD(num_neighbors=2), True, rounds=2, local_epochs=2), atol=5e-3, rel=1e-3)


def test_momentum_and_a_mask_search_match_the_serial_path():
    _close(_fit(DisPFL(num_neighbors=2), False, momentum=0.5), _fit(DisPFL(num_neighbors=2), True, momentum=0.5))


def test_local_steps_with_uneven_clients_match():
    _close(_fit(Local(), False, local_steps=7), _fit(Local(), True, local_steps=7))


def test_the_compact_store_gives_the_same_batched_run_bit_for_bit():
    """Start-of-round records freed after a level's last reader (the batched executor reads a whole level
    first): the same run as with the dense store."""
    dense = _fit(DisPFL(num_neighbors=2), True, rounds=2, momentum=0.5)
    compact = _fit(DisPFL(num_neighbors=2), True, rounds=2, momentum=0.5, store="compact")
    strip = [{k: v for k, v in m.items() if "wall" not in k} for m in dense.history]
    assert [{k: v for k, v in m.items() if "wall" not in k} for m in compact.history] == strip
    for node in range(6):
        (wd, md), (wc, mc) = dense.store.published(node), compact.store.published(node)
        assert all(torch.equal(wd[n].view(torch.uint8), wc[n].view(torch.uint8)) for n in wd)
        assert all(torch.equal(md[n], mc[n]) for n in md)
    assert not any(record["neg"] for record in compact.store.records)  # pruned weights are plain +0.0 here too


def _weights(trainer):
    return {n: t.clone() for n, t in trainer.store.weights.items()}


def test_a_level_trained_in_groups_gives_the_run_of_one_group(monkeypatch):
    """Groups of 1 and 4 (of 6 clients): started, trained and finished group by group, the same run as one group
    up to float64 rounding (~1e-16 here), and as the serial path."""
    sizes = []
    train_together = batched.BatchedExecutor._train_together

    def recorded(self, items):
        sizes.append(len(items))
        return train_together(self, items)

    monkeypatch.setattr(batched.BatchedExecutor, "_train_together", recorded)
    runs = {}
    for group in (None, 1, 4):
        sizes.clear()
        trainer = _fit(DisPFL(num_neighbors=2), True, momentum=0.5, precision="64-true", batched_group_size=group)
        runs[group] = (_weights(trainer), trainer.history[-1])
        assert sizes == {None: [6], 1: [1] * 6, 4: [4, 2]}[group]
    serial = _fit(DisPFL(num_neighbors=2), False, momentum=0.5, precision="64-true")
    for group in (1, 4):
        for name, tensor in runs[None][0].items():
            assert torch.allclose(runs[group][0][name], tensor, atol=1e-12, rtol=0), (group, name)
            assert torch.allclose(serial.store.weights[name], tensor, atol=1e-12, rtol=0), name
        assert runs[group][1]["acc/personal_mean"] == runs[None][1]["acc/personal_mean"]


def test_the_automatic_group_size_divides_the_memory_budget_by_a_clients_step(monkeypatch, caplog):
    """``batched_group_size: None``: the budget over one client's measured step, floored, at least one."""
    assert auto_group_size(1000, 2999) == 2 and auto_group_size(1000, 3000) == 3
    assert auto_group_size(1000, 999) == 1 and auto_group_size(1000, None) is None
    sizes = []
    train_together = batched.BatchedExecutor._train_together
    monkeypatch.setattr(batched.BatchedExecutor, "_train_together",
                        lambda self, items: sizes.append(len(items)) or train_together(self, items))
    monkeypatch.setattr(batched, "client_step_bytes", lambda model, inputs, autocast: 3 * 2**20)
    monkeypatch.setattr(batched, "memory_budget", lambda device: 8 * 2**20)
    with caplog.at_level("INFO"):
        trainer = _fit(Local(), True, rounds=2)
    assert trainer.executor.group_size == 2 and sizes == [2, 2, 2] * 2
    assert [r.getMessage() for r in caplog.records if "Batched clients" in r.getMessage()] == [
        "Batched clients: at most 2 clients per step (one client's step takes about 3.0 MiB; 8.0 MiB may be used "
        "on cpu)"]


def test_the_group_size_is_measured_at_a_whole_batch_even_when_the_first_client_has_less(monkeypatch):
    """Clients of ~100-400 digits and batches of 512: the first client's only batch is short, the estimate is
    taken on a whole batch of 512 (its rows repeated), as the larger clients' steps take."""
    rows = []
    measure = batched.client_step_bytes
    monkeypatch.setattr(batched, "client_step_bytes",
                        lambda model, inputs, autocast: rows.append(len(inputs)) or measure(model, inputs, autocast))
    _fit(Local(), True, data={"batch_size": 512})
    assert rows == [512]


def test_a_clients_step_counts_the_saved_activations_twice_and_the_parameters_six_times():
    """Linear(4, 3) then ReLU on 5 float32 samples: the forward saves the input (5 x 4 x 4 B) and the ReLU's
    output (5 x 3 x 4 B), not the weight (a parameter); the parameters take (12 + 3) x 4 B."""
    assert client_step_bytes(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), torch.randn(5, 4)) == 2 * 140 + 6 * 60
    # measured as a training step runs (an evaluation-mode BatchNorm saves less), leaving the statistics and mode
    norm = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU()).eval()
    inputs = torch.randn(5, 1, 6, 6) * 10
    assert client_step_bytes(norm, inputs) == client_step_bytes(norm.train(), inputs)
    assert torch.equal(norm[1].running_mean, torch.zeros(2)) and int(norm[1].num_batches_tracked) == 0
    client_step_bytes(norm.eval(), inputs)
    assert not norm.training


def test_the_memory_budget_is_a_share_of_the_hosts_available_memory_on_a_cpu(monkeypatch):
    monkeypatch.setattr(batched, "available_bytes", lambda: 1000)
    assert memory_budget(torch.device("cpu")) == 600
    monkeypatch.setattr(batched, "available_bytes", lambda: None)
    assert memory_budget(torch.device("cpu")) is None


@pytest.mark.parametrize("kwargs,match", [
    ({"batched_clients": True, "batched_group_size": 0}, "batched_group_size .* must be .*1.* got 0"),
    ({"batched_group_size": 4}, "batched_group_size=4 sizes the groups of batched clients, but batched_clients is "
                                "false"),
])
def test_a_bad_group_size_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FederatedTrainer(logger=False, **kwargs)


#: a few clients and samples: the papers' models are large for a CPU test
_SMALL = {"num_clients": 2, "max_train_samples": 50, "test_samples_per_client": 10}


@pytest.mark.parametrize("arch,image_size", [("resnet18", 8), ("vgg11", 32)], ids=["resnet18", "vgg11"])
def test_the_papers_groupnorm_models_match_the_serial_path_in_a_dispfl_round(arch, image_size):
    """ResNet18 (configs/dispfl_cifar10_dir.yaml) and VGG11 (the DA-DPFL configs) as their configs build
    them: GroupNorm(32), no buffers, no dropout; small inputs (VGG11 needs 32x32), two clients. Compared in
    64-true: on these few upscaled digits both models are ill-conditioned in float32 (groups of near-constant
    values), the float32 serial path itself differs from the float64 one by up to ~1e-3 on a few weights,
    as much as the float32 batched path differs from either (float32: the next test)."""
    kw = dict(arch=arch, lr=0.01, momentum=0.5, precision="64-true", data={**_SMALL, "image_size": image_size})
    regrowth = "gradient" if arch == "resnet18" else "random"  # the config's; DisPFL's published runs (faster)
    serial, batched = (_fit(DisPFL(num_neighbors=1, regrowth=regrowth), b, **kw) for b in (False, True))
    norms = {type(m) for m in batched.module.model.modules() if isinstance(m, (nn.GroupNorm, nn.BatchNorm2d))}
    assert norms == {nn.GroupNorm} and not list(batched.module.model.buffers())
    _close(serial, batched, atol=1e-10, rel=1e-10)


def test_resnet18_in_float32_matches_the_serial_path_up_to_its_conditioning():
    kw = dict(arch="resnet18", lr=0.01, momentum=0.5, local_steps=2, data={**_SMALL, "image_size": 8})
    _close(_fit(Local(), False, **kw), _fit(Local(), True, **kw), atol=1e-3, rel=1e-5)


@pytest.mark.parametrize("arch,options,data", [
    ("resnet20", None, None),  # six uneven clients: last batches of different sizes, clients running out
    ("resnet20", None, {"batch_size": 256}),  # first batches of different sizes: step 0 in several calls
    ("vgg11", {"norm": "batch"}, {**_SMALL, "image_size": 32}),  # configs/dpsgd_prisam_cifar10_pat.yaml's model
], ids=["resnet20", "resnet20_first_batches_differ", "vgg11_bn"])
def test_batchnorm_running_statistics_match_the_serial_path(arch, options, data):
    """Each client's running statistics are stacked and updated by the batched forward; clients whose batches
    differ in size run in separate calls (a padded sample would enter the batch statistics). Compared in
    64-true: in float32 a BatchNorm net on these few digits amplifies rounding from the first step (the
    float32 serial path differs from the float64 one about as much as the batched path does), so there
    float32 results cannot be compared tightly."""
    kw = dict(arch=arch, model_options=options, data=data, momentum=0.5, precision="64-true")
    neighbors = (data or {}).get("num_clients", 6) - 1
    serial, batched = _fit(DPSGD(num_neighbors=neighbors), False, **kw), _fit(DPSGD(num_neighbors=neighbors), True, **kw)
    _close(serial, batched, atol=1e-10, rel=1e-10)
    stats = [n for n in batched.store.weights if n.endswith("running_mean")]
    assert stats and all(batched.store.weights[n].abs().sum() > 0 for n in stats)  # trained statistics, stored
    counters = {n: b for n, b in serial.module.model.named_buffers() if n.endswith("num_batches_tracked")}
    assert counters and all(int(b) > 0 for b in counters.values())
    assert all(torch.equal(b, batched.module.model.get_buffer(n)) for n, b in counters.items())


def test_batchnorm_without_momentum_dropout_and_other_buffers_are_refused():
    trainer = _fit(Local(), True, arch="resnet20", local_steps=1)
    model = trainer.module.model

    def check_batchable_run():
        state = trainer.federation
        check_batchable(state.algorithm, state.worker.module, state.worker.optimizer, state.spec.precision,
                        state.callbacks)

    model.bn1.momentum = None
    with pytest.raises(ValueError, match="bn1 \\(BatchNorm2d\\) has momentum=None"):
        check_batchable_run()
    model.bn1.momentum = 0.1
    model.register_buffer("scale", torch.ones(1))
    with pytest.raises(ValueError, match="the model has buffers \\(scale\\); only BatchNorm's"):
        check_batchable_run()
    del model.scale
    model.drop = nn.Dropout(0.0)  # an identity: batched
    check_batchable_run()
    model.drop.p = 0.5
    with pytest.raises(ValueError, match="drop \\(Dropout\\) draws random numbers"):
        check_batchable_run()


class BatchHook(FederatedCallback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass


@pytest.mark.parametrize("kwargs,match", [
    ({"arch": "cnn_ham"}, "the model's classifier.0 \\(Dropout\\) draws random numbers"),
    ({"algorithm": DFedSAM(num_neighbors=2)}, "DFedSAM has its own loss"),
    ({"callbacks": [BatchHook()]}, "callback BatchHook has batch hooks \\(on_train_batch_end\\)"),
    ({"precision": "bf16-true"}, "precision 'bf16-true'; only 32-true and 64-true are batched"),
])
def test_what_cannot_be_batched_is_refused_before_training(kwargs, match):
    algorithm = kwargs.pop("algorithm", Local())
    with pytest.raises(ValueError, match=match):
        _fit(algorithm, True, rounds=1, **kwargs)


class IdleBatchHook(BatchHook):
    federated_batch_hooks = ()  # its batch hook does nothing in a federation (as RigL's and PQIPruning's)


class UsedBatchHook(BatchHook):
    federated_batch_hooks = ("on_train_batch_end",)


def test_a_callback_declares_which_batch_hooks_it_uses_in_a_federation():
    """``federated_batch_hooks``: a callback whose batch hooks are idle in a federation says so and is batched (no
    class list in the executor); one that uses them, or declares nothing, is refused by name."""
    from lightning_dfl.callbacks import PQIPruning, RigL
    from lightning_dfl.federation.loop.callback_hooks import federated_batch_hooks

    hooks = batched._BATCH_HOOKS
    assert federated_batch_hooks(IdleBatchHook(), hooks) == []
    assert federated_batch_hooks(BatchHook(), hooks) == federated_batch_hooks(UsedBatchHook(), hooks) == \
        ["on_train_batch_end"]
    assert federated_batch_hooks(RigL(), hooks) == federated_batch_hooks(PQIPruning(), hooks) == []
    _fit(Local(), True, rounds=1, callbacks=[IdleBatchHook()])
    with pytest.raises(ValueError, match="callback UsedBatchHook has batch hooks \\(on_train_batch_end\\)"):
        _fit(Local(), True, rounds=1, callbacks=[UsedBatchHook()])


def test_batched_clients_with_several_processes_is_refused():
    with pytest.raises(ValueError, match="batched_clients .* cannot be combined with 2 processes"):
        FederatedTrainer(devices=2, batched_clients=True, logger=False)


def test_a_steps_batches_are_stacked_with_zero_weight_padding():
    """Clients' batches of 3, 1 and 2 samples: padded to 3 with zeros of weight 0, the real samples in order."""
    gen = torch.Generator().manual_seed(0)
    sizes = [3, 1, 2]
    batches = [(torch.randn(n, 2, 4, 4, generator=gen).contiguous(memory_format=torch.channels_last),
                torch.randint(0, 9, (n,), generator=gen)) for n in sizes]
    xs, ys, ws = batched._stacked(batches, sizes)
    assert xs.shape == (3, 3, 2, 4, 4) and ys.shape == ws.shape == (3, 3)
    assert ws.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    for j, ((x, y), n) in enumerate(zip(batches, sizes)):
        assert torch.equal(xs[j, :n], x) and torch.equal(ys[j, :n], y)
        assert not xs[j, n:].any() and not ys[j, n:].any()
    full = batched._stacked(batches[:1] * 2, [3, 3])  # equal sizes: stacked, no padding
    assert torch.equal(full[0], torch.stack([batches[0][0]] * 2)) and full[2].eq(1).all()
