"""FedDST (Bibikar et al., 2022): global ERK mask, client readjustment, holder averaging, server re-prune."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, Message, Source, Task
from lightning_dfl.federation.algorithms import feddst
from lightning_dfl.federation.algorithms.feddst import FedDST, holder_average, regrow_over_all, reprune
from lightning_dfl.federation.store import DenseClientStore
from lightning_dfl.module import SparseClassifier
from lightning_dfl.seeding import derive_seed
from lightning_dfl.sparse.erk import active_count, erk_densities
from lightning_dfl.sparse.masks import ModelMask

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

K = 5


class Record(FederatedCallback):
    """Per round: the server's mask at the round's end; per client task: the mask it published and
    the server's mask it started from (the server runs after its clients)."""

    def __init__(self):
        self.server, self.clients = [], []

    def on_client_end(self, trainer, pl_module, client_id):
        store = trainer.store
        published = {n: m.clone() for n, m in store.published(client_id, fresh=True)[1].items()}
        start = {n: m.clone() for n, m in store.mask(K).items()}
        self.clients.append((trainer.current_round, client_id, published, start))

    def on_federated_round_end(self, trainer, pl_module):
        self.server.append({n: m.clone() for n, m in trainer.store.mask(K).items()})


@pytest.fixture(scope="module")
def run():
    record = Record()
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=32, test_samples_per_client=30)
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
    algorithm = FedDST(clients_per_round=3, readjust_every=2, decay_end=5)  # readjusts in rounds 1 and 3
    trainer = FederatedTrainer(algorithm=algorithm, rounds=5, local_epochs=1, logger=False, accelerator="cpu",
                               enable_progress_bar=False, callbacks=[record], cpu_threads=1)
    trainer.fit(model, dm)
    return trainer, record


def test_server_mask_keeps_each_layers_erk_budget_exactly(run):
    trainer, record = run
    params = trainer.module.maskable_parameters()
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    targets = {n: active_count(d, math.prod(shapes[n])) for n, d in erk_densities(shapes, 0.5).items()}
    assert len(record.server) == 5
    for mask in record.server:  # after every server step
        assert {n: int(m.sum()) for n, m in mask.items()} == targets
    weights, published = trainer.store.published(K)
    for n, m in published.items():  # the server's published model is zero outside its mask
        assert torch.equal(m, record.server[-1][n]) and not weights[n][~m].any()


def test_global_mask_changes_only_on_readjustment_rounds(run):
    trainer, record = run
    readjusting = [r for r in range(5) if trainer.algorithm.drop_fraction(r, 5) > 0]
    assert readjusting == [1, 3]
    initial = trainer.module.draw_initial_masks(torch.Generator().manual_seed(0))  # the shared mask's layer sizes
    previous = None
    for r, mask in enumerate(record.server):
        if previous is not None:
            changed = any(not torch.equal(mask[n], previous[n]) for n in mask)
            assert changed == (r in readjusting), r
        previous = mask
    assert [h["feddst/mask_changed"] for h in trainer.history] == [0.0, 1.0, 0.0, 1.0, 0.0]
    # clients train with the server's mask; they change it only on readjustment rounds, keeping each layer's count
    for r, client, published, start in record.clients:
        same = all(torch.equal(published[n], start[n]) for n in published)
        assert same == (r not in readjusting), (r, client)
        assert {n: int(m.sum()) for n, m in published.items()} == {n: int(m.sum()) for n, m in initial.items()}
    # mask bits travel only when a mask changed: none in round 0, uploads of readjusted masks in round 1
    assert trainer.history[0]["comm/busiest_mask_bytes"] == 0 and trainer.history[1]["comm/busiest_mask_bytes"] > 0
    assert trainer.history[1]["flops/readjust"] > 0 and trainer.history[2]["flops/readjust"] == 0
    assert trainer.history[-1]["acc/headline"] == trainer.history[-1]["acc/consensus_mean"]


def _message(sender, w, m, b):
    return Message(sender, {"w": w, "b": b}, {"w": m}, 0, 0)


def test_disjoint_holders_keep_their_values_then_the_server_reprunes_by_magnitude():
    a_mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    b_mask = torch.tensor([[0, 0, 1], [1, 1, 0]], dtype=torch.bool)
    a = _message(0, torch.tensor([[2.0, -5.0, 0.0], [0.0, 0.0, 0.0]]), a_mask, torch.tensor([1.0, 1.0]))
    b = _message(1, torch.tensor([[0.0, 0.0, 0.5], [-3.0, 1.0, 0.0]]), b_mask, torch.tensor([5.0, 5.0]))
    average, union = holder_average([a, b], (1.0, 3.0))  # n_a = 1, n_b = 3
    # each held position takes its single holder's value (n cancels); nobody holds (1, 2): 0/0 -> 0
    assert average["w"].tolist() == [[2.0, -5.0, 0.5], [-3.0, 1.0, 0.0]]
    assert average["b"].tolist() == [4.0, 4.0]  # unmasked: (1 * 1 + 3 * 5) / 4
    assert torch.equal(union["w"], a_mask | b_mask)
    assert reprune(average, union, {"w": 3})["w"].tolist() == [[True, True, False], [True, False, False]]
    assert torch.equal(reprune(average, union, {"w": 6})["w"], union["w"])  # never grows past the union

    # the server step: average, re-prune to the ERK budget (3), zero the rest, store the new global mask
    store = DenseClientStore({"w": torch.zeros(2, 3), "b": torch.zeros(2)}, ["w"], num_nodes=3)
    budget_mask = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)  # 3 active: the layer's ERK budget
    module = SimpleNamespace(draw_initial_masks=lambda generator: {"w": budget_mask})
    ctx = SimpleNamespace(node=2, store=store, module=module,
                          task=Task(2, sources=(Source(0, fresh=True), Source(1, fresh=True)), coefficients=(1.0, 3.0),
                                    train=False))
    new = FedDST(clients_per_round=2).server_step(ctx, [a, b])
    assert new["w"].tolist() == [[2.0, -5.0, 0.0], [-3.0, 0.0, 0.0]] and new["b"].tolist() == [4.0, 4.0]
    assert store.mask(2)["w"].tolist() == [[True, True, False], [True, False, False]]


def test_paper_and_code_schedules():
    algo = FedDST(readjustment_ratio=0.5, readjust_every=10)  # t_end = T / 2 = 20
    assert algo.drop_fraction(1, 40) == pytest.approx(0.25 * (1 + math.cos(math.pi / 20)))
    assert algo.drop_fraction(11, 40) == pytest.approx(0.25 * (1 + math.cos(11 * math.pi / 20)))
    assert [algo.drop_fraction(t, 40) for t in (0, 2, 10, 21, 31)] == [0.0] * 5  # not (t-1) mod 10 == 0, or past t_end
    # dst.py: the annealed alpha * _decay(t) only gates the round (dst.py:403); the drop is the constant alpha (:264)
    code = FedDST(readjustment_ratio=0.5, readjust_every=10, schedule="code")
    assert [code.drop_fraction(t, 40) for t in (1, 11)] == [0.5, 0.5]
    assert [code.drop_fraction(t, 40) for t in (0, 2, 10, 21, 31)] == [0.0] * 5  # the same gate: t_end = 20
    assert FedDST(readjustment_ratio=0.0, readjust_every=1, schedule="code").drop_fraction(1, 40) == 0.0
    assert FedDST(readjustment_ratio=0.3, readjust_every=1, decay_end=3, schedule="code").drop_fraction(2, 40) == 0.3
    assert FedDST(readjust_every=1, decay_end=3).drop_fraction(0, 40) == pytest.approx(0.5)


# -- dst.py's readjustment: regrowth over all entries (models.py:179-217) ---------------------------------------------
W0 = [[0.9, -0.1, 0.0], [0.5, 0.0, 0.2]]
M0 = [[True, True, False], [True, False, True]]  # 4 active: alpha 0.5 drops k = 2, |w| smallest: -0.1 (1) and 0.2 (5)
G0 = [[0.3, 0.8, 0.65], [0.7, 0.05, 0.6]]  # |gradient|: top 2 over all entries are 1 (0.8) and 3 (0.7, active)


class _Tiny(torch.nn.Module):
    """One masked 2x3 weight whose loss sum(w * G) has gradient G (the batch's inputs)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(W0))
        self.mask = ModelMask(self, {"w": torch.tensor(M0)}).attach()
        self.flops_profile = SimpleNamespace(dense_forward_flops=lambda: 7)

    def loss(self, batch):
        return (self.w * batch[0]).sum()


def test_regrow_over_all_picks_active_entries_and_zeroes_the_picks():
    masks, picks = regrow_over_all({"w": torch.tensor(W0)}, {"w": torch.tensor(M0)}, 0.5, {"w": torch.tensor(G0)})
    # kept {0, 3} | picks {1, 3}: the pick on active 3 leaves 3 active weights (dst.py's count drop)
    assert masks["w"].tolist() == [[True, True, False], [True, False, False]]
    assert picks["w"].tolist() == [[False, True, False], [True, False, False]]
    # nothing dropped (alpha 0) or a dense layer: unchanged, no picks
    same, none = regrow_over_all({"w": torch.tensor(W0)}, {"w": torch.tensor(M0)}, 0.0, {"w": torch.tensor(G0)})
    assert same["w"].tolist() == M0 and not none["w"].any()
    dense = torch.ones(2, 3, dtype=torch.bool)
    same, none = regrow_over_all({"w": torch.tensor(W0)}, {"w": dense}, 0.5, {"w": torch.tensor(G0)})
    assert same["w"].all() and not none["w"].any()


@pytest.mark.parametrize("regrow_among, mask, weights", [
    # ours (RigL): regrow among {1, 2, 4, 5} (inactive after the drop) by |g|: 1 (0.8), 2 (0.65); 1 keeps its -0.1
    ("inactive", [[True, True, True], [True, False, False]], [[0.9, -0.1, 0.0], [0.5, 0.0, 0.0]]),
    # dst.py: picks 1 and 3 over all entries, both set to 0 (3 was active with 0.5: reset); 5 dropped (0)
    ("all", [[True, True, False], [True, False, False]], [[0.9, 0.0, 0.0], [0.0, 0.0, 0.0]]),
])
def test_a_clients_readjustment_by_regrowth_rule(regrow_among, mask, weights):
    module = _Tiny()
    batch = (torch.tensor(G0), torch.zeros(4))
    ctx = SimpleNamespace(module=module, scratch={"feddst/last_batch": batch}, report={})
    algo = FedDST(regrow_among=regrow_among)
    algo._readjust(ctx, 0.5, 1.0)
    assert module.mask.masks["w"].tolist() == mask
    assert torch.equal(module.w.detach(), torch.tensor(weights))
    assert ctx.report["feddst/readjust_flops"] == 3 * 7 * 4 and algo.tally["readjusted"] == 1
    # no drop fraction (not a readjustment round): nothing changes
    module, ctx.scratch["feddst/last_batch"] = _Tiny(), batch
    ctx.module = module
    algo._readjust(ctx, 0.0, 1.0)
    assert module.mask.masks["w"].tolist() == M0 and torch.equal(module.w.detach(), torch.tensor(W0))


# -- dst.py's readjustment clock: the client's lifetime epochs (dst.py:263, 273) ----------------------------------------
@pytest.mark.parametrize("start, epochs, round_idx, expected, end", [
    (8, 3, 1, ["train", "train", "readjust 0.5", "train"], 11),  # lifetime epochs 8, 9 (readjusts), 10
    (0, 3, 1, ["train"] * 3, 3),  # 0, 1, 2: none is 9 mod 10
    (19, 1, 1, ["train", "readjust 0.5"], 20),
    (29, 2, 2, ["train", "readjust 0", "train"], 31),  # round 2 is no readjustment round: alpha_t 0 (nothing done)
])
def test_the_epoch_clock_readjusts_after_lifetime_epochs_nine_mod_ten(monkeypatch, start, epochs, round_idx,
                                                                      expected, end):
    log, written = [], {}

    def train(algorithm, ctx, epochs=None):
        assert epochs == 1
        log.append("train")
        return 2.0

    monkeypatch.setattr(feddst, "train_locally", train)
    monkeypatch.setattr(FedDST, "_readjust", lambda self, ctx, fraction, loss: log.append(f"readjust {fraction:g}"))
    algo = FedDST(readjustment_ratio=0.5, readjust_every=1, decay_end=40, schedule="code", readjust_clock="epoch")
    ctx = SimpleNamespace(round_idx=round_idx, num_rounds=40, local_epochs=epochs, local_steps=None,
                          read=lambda name: torch.tensor(start), write=written.__setitem__)
    if round_idx == 2:
        algo.readjust_every = 2  # (2 - 1) mod 2 != 0
    assert algo.local_train(ctx) == 2.0
    assert log == expected and written == {feddst.EPOCHS: end}


def test_the_epoch_clock_keeps_a_private_count_only_when_on_and_refuses_local_steps():
    assert FedDST().state_fields() == []
    (field,) = FedDST(readjust_clock="epoch").state_fields()
    assert (field.name, field.dtype, field.fill, field.published) == ("feddst/epochs", torch.int64, 0, False)
    ctx = SimpleNamespace(round_idx=1, num_rounds=40, local_epochs=1, local_steps=4)
    with pytest.raises(ValueError, match="readjust_clock 'epoch' counts local epochs.*local steps \\(4\\)"):
        FedDST(readjust_clock="epoch").local_train(ctx)


def test_a_run_with_every_dst_option_counts_each_clients_epochs():
    """5 local epochs a round, readjustment every round before t_end = 4: a client readjusts in the rounds where its
    lifetime epochs 5c..5c+4 hold 9 mod 10, its participations c = 1, 3, ..."""
    record = Record()
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=64, test_samples_per_client=30)
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
    algorithm = FedDST(clients_per_round=3, readjust_every=1, decay_end=4, schedule="code", regrow_among="all",
                       readjust_clock="epoch", reprune_ties="random")
    trainer = FederatedTrainer(algorithm=algorithm, rounds=4, local_epochs=5, logger=False, accelerator="cpu",
                               enable_progress_bar=False, callbacks=[record], cpu_threads=1)
    trainer.fit(model, dm)
    seen = {k: 0 for k in range(K)}
    expected = [0] * 4
    for r, client, _, _ in record.clients:
        expected[r] += seen[client] % 2
        seen[client] += 1
    assert sum(expected) > 0 and [h["feddst/readjusted_clients"] for h in trainer.history] == expected
    assert {k: int(trainer.store.read(k, "feddst/epochs")) for k in range(K)} == {k: 5 * c for k, c in seen.items()}
    assert algorithm.label() == ("feddst (readjust_every 1, decay_end 4, schedule code, regrow_among all, "
                                 "readjust_clock epoch, reprune_ties random)")


# -- the server's re-prune: ties --------------------------------------------------------------------------------------
def test_reprune_breaks_ties_by_index_or_at_random_among_held_entries():
    w = {"w": torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0])}
    held = {"w": torch.tensor([True, True, True, True, True, True, True, False])}  # 7 not held
    assert reprune(w, held, {"w": 3})["w"].tolist() == [True, True, False, False, True, False, False, False]
    picks = set()
    for seed in range(20):
        order = torch.randperm(8, generator=torch.Generator().manual_seed(seed))
        tied = [int(i) for i in order if int(i) not in (4, 7)][:2]  # the first two held zeros in the random order
        expected = [i in (4, *tied) for i in range(8)]
        assert reprune(w, held, {"w": 3}, torch.Generator().manual_seed(seed))["w"].tolist() == expected
        picks |= set(tied)
    assert picks == {0, 1, 2, 3, 5, 6}  # every held zero is kept under some seed, the unheld one never
    assert torch.equal(reprune(w, held, {"w": 7}, torch.Generator().manual_seed(0))["w"], held["w"])


def test_the_server_seeds_its_random_ties_from_the_run_seed_and_round():
    a = _message(0, torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 0.0]]), torch.ones(2, 3, dtype=torch.bool),
                 torch.tensor([1.0, 1.0]))

    def step(seed, round_idx):
        store = DenseClientStore({"w": torch.zeros(2, 3), "b": torch.zeros(2)}, ["w"], num_nodes=2)
        budget_mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
        ctx = SimpleNamespace(node=1, store=store, seed=seed, round_idx=round_idx,
                              module=SimpleNamespace(draw_initial_masks=lambda generator: {"w": budget_mask}),
                              task=Task(1, sources=(Source(0, fresh=True),), coefficients=(1.0,), train=False))
        FedDST(clients_per_round=1, reprune_ties="random").server_step(ctx, [a])
        return store.mask(1)["w"].reshape(-1)

    for seed, round_idx in [(0, 0), (0, 1), (3, 0)]:
        generator = torch.Generator().manual_seed(derive_seed(seed, "feddst/reprune", round_idx))
        order = torch.randperm(6, generator=generator)
        tie = next(int(i) for i in order if int(i) != 1)  # 3.0 kept, then the first zero in the round's order
        assert step(seed, round_idx).tolist() == [i in (1, tie) for i in range(6)]
        assert torch.equal(step(seed, round_idx), step(seed, round_idx))  # reproducible


def test_the_dst_options_are_labelled():
    assert FedDST().label() == "feddst"
    assert FedDST(regrow_among="all").label() == "feddst (regrow_among all)"
    assert FedDST(readjust_clock="epoch").label() == "feddst (readjust_clock epoch)"
    assert FedDST(reprune_ties="random").label() == "feddst (reprune_ties random)"
    assert FedDST(schedule="code").label() == "feddst (schedule code)"


@pytest.mark.parametrize("kwargs, match", [
    ({"readjustment_ratio": 1.5}, "readjustment_ratio .alpha. must be a number in \\[0, 1\\], got 1.5"),
    ({"readjust_every": 0}, "readjust_every .R_adj. must be an integer >= 1, got 0"),
    ({"decay_end": 0}, "decay_end .t_end. must be an integer >= 1, got 0"),
    ({"schedule": "linear"}, "unknown schedule 'linear'; allowed: paper, code"),
    ({"regrow_among": "active"}, "unknown regrow_among 'active'; allowed: inactive, all"),
    ({"readjust_clock": "step"}, "unknown readjust_clock 'step'; allowed: round, epoch"),
    ({"reprune_ties": "magnitude"}, "unknown reprune_ties 'magnitude'; allowed: index, random"),
    ({"clients_per_round": 0}, "clients_per_round must be an integer >= 1, got 0"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedDST(**kwargs)
