"""FedDST (Bibikar et al., 2022): global ERK mask, client readjustment, holder averaging, server re-prune."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, Message, Source, Task
from lightning_dfl.federation.algorithms.feddst import FedDST, holder_average, reprune
from lightning_dfl.federation.store import DenseClientStore
from lightning_dfl.module import SparseClassifier
from lightning_dfl.sparse.erk import active_count, erk_densities

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
    code = FedDST(readjustment_ratio=0.5, readjust_every=10, schedule="code")
    assert code.drop_fraction(1, 40) == pytest.approx(0.5 * algo.drop_fraction(1, 40))
    assert FedDST(readjust_every=1, decay_end=3).drop_fraction(0, 40) == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs, match", [
    ({"readjustment_ratio": 1.5}, "readjustment_ratio .alpha. must be a number in \\[0, 1\\], got 1.5"),
    ({"readjust_every": 0}, "readjust_every .R_adj. must be an integer >= 1, got 0"),
    ({"decay_end": 0}, "decay_end .t_end. must be an integer >= 1, got 0"),
    ({"schedule": "linear"}, "unknown schedule 'linear'; allowed: paper, code"),
    ({"clients_per_round": 0}, "clients_per_round must be an integer >= 1, got 0"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedDST(**kwargs)
