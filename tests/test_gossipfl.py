"""GossipFL (SAPS-FL, baselines notes section 6): a random perfect matching each round, random-k
coordinates from the pair's shared seed, the pair's selected coordinates both become their mean,
the others stay bit-identical, and only the k values are counted."""

import math
import warnings

import numpy as np
import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, RoundContext
from lightning_dfl.federation.algorithms.gossipfl import GossipFL, pair_seed, random_matching
from lightning_dfl.federation.exchange.messages import RandomKCodec
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


class Perturb(FederatedCallback):
    """At each round's start, gives every client a different model (all start from one init) and keeps
    a copy of the start-of-round models."""

    def __init__(self):
        self.before = {}

    def on_federated_round_start(self, trainer, pl_module):
        store, gen = trainer.store, torch.Generator().manual_seed(trainer.current_round)
        for k in range(trainer.num_clients):
            for t in store.published(k)[0].values():
                t.add_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
        self.before[trainer.current_round] = {k: {n: t.clone() for n, t in store.published(k)[0].items()}
                                              for k in range(trainer.num_clients)}


class Recorded(GossipFL):
    """Keeps each round's matching."""

    def plan_round(self, ctx):
        plan = super().plan_round(ctx)
        self.pairs = getattr(self, "pairs", []) + [plan.meta["pairs"]]
        return plan


def _run(algorithm, clients=6, rounds=1, callbacks=None, **kw):
    dm = FederatedDataModule(dataset="digits", num_clients=clients, batch_size=32, test_samples_per_client=20)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05)
    kw.setdefault("local_epochs", 0)  # training off: the round is the gossip step alone
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, logger=False, accelerator="cpu",
                               enable_progress_bar=False, callbacks=callbacks, **kw)
    trainer.fit(model, dm)
    return trainer


def _context(clients, round_idx=0, participants=None):
    return RoundContext(round_idx, 10, clients, (1,) * clients,
                        np.random.default_rng(round_idx), participants=participants)


def test_every_client_is_in_exactly_one_pair_and_an_odd_one_out_only_trains():
    algo = GossipFL()
    for round_idx in range(5):
        plan = algo.plan_round(_context(6, round_idx))
        peer = {t.node: [s.node for s in t.receives_from()] for t in plan.tasks}
        assert sorted(peer) == list(range(6)) and all(len(p) == 1 for p in peer.values())  # degree 1
        assert all(peer[peer[k][0]] == [k] for k in peer)  # an involution: a perfect matching
        assert all(t.sources[0].node == t.node for t in plan.tasks)  # its own model comes first
    matchings = {tuple(algo.plan_round(_context(6, r)).meta["pairs"]) for r in range(10)}
    assert len(matchings) > 3  # re-drawn each round
    # an odd number of active clients: a maximum matching, one client alone (no source: no message)
    plan = algo.plan_round(_context(6, 3, participants=(0, 1, 2, 4, 5)))
    alone = [t.node for t in plan.tasks if not t.sources]
    assert len(alone) == 1 and len(plan.tasks) == 5 and len(plan.meta["pairs"]) == 2
    assert sorted(random_matching([3], np.random.default_rng(0))) == []


def test_the_shared_seed_selects_the_same_coordinates_on_both_sides():
    codec = RandomKCodec(0.1, bytes_per_index=0)
    a, b = {"w": torch.randn(40, 10)}, {"w": torch.randn(40, 10) + 5}

    def sent(weights, seed):
        return codec.encode(weights, None, sender=0, masked_names=[],
                            generator=torch.Generator().manual_seed(seed)).mask["w"]

    assert pair_seed(0, 3, 0, 2, 5) == pair_seed(0, 3, 0, 5, 2)
    assert torch.equal(sent(a, pair_seed(0, 3, 0, 2, 5)), sent(b, pair_seed(0, 3, 0, 5, 2)))
    assert int(sent(a, pair_seed(0, 3, 0, 2, 5)).sum()) == 40
    assert not torch.equal(sent(a, pair_seed(0, 3, 0, 2, 5)), sent(a, pair_seed(0, 4, 0, 2, 5)))  # fresh each round
    assert not torch.equal(sent(a, pair_seed(0, 3, 0, 2, 5)), sent(a, pair_seed(0, 3, 0, 2, 4)))  # and each pair


@pytest.mark.parametrize("clients", [6, 5])
def test_a_pairs_selected_coordinates_become_their_mean_and_the_rest_is_untouched(clients):
    seen = Perturb()
    ratio = 0.1
    algo = Recorded(compress_ratio=ratio)
    trainer = _run(algo, clients=clients, callbacks=[seen])
    before, store = seen.before[0], trainer.store
    after = {k: store.published(k)[0] for k in range(clients)}
    changed = {k: {n: after[k][n] != before[k][n] for n in after[k]} for k in range(clients)}
    (pairs,) = algo.pairs
    paired = {k for pair in pairs for k in pair}
    for k, j in pairs:
        for n, x in after[k].items():
            mean = 0.5 * before[k][n] + 0.5 * before[j][n]
            selected = changed[k][n]
            assert torch.equal(selected, changed[j][n])  # the same coordinates on both sides
            assert torch.equal(x[selected], mean[selected]) and torch.equal(after[j][n][selected], mean[selected])
            assert torch.equal(x[~selected], before[k][n][~selected])  # bit-identical elsewhere
            assert int(selected.sum()) == math.ceil(ratio * x.numel())  # k coordinates per tensor
            assert torch.allclose(x + after[j][n], before[k][n] + before[j][n], atol=1e-5)  # the pair sum is kept
    assert len(paired) == clients - clients % 2  # everybody paired but the odd one out
    if clients % 2:
        (alone,) = set(range(clients)) - paired
        assert all(torch.equal(after[alone][n], before[alone][n]) for n in before[alone])


def test_communication_is_k_values_of_4_bytes_per_message_without_indices():
    trainer = _run(GossipFL(compress_ratio=0.05), clients=4, rounds=2)
    shapes = [t.numel() for t in trainer.store.published(0)[0].values()]
    message = sum(math.ceil(0.05 * n) for n in shapes) * 4
    for m in trainer.history:
        assert m["comm/busiest_bytes"] == message  # one peer: one message in, one out
        assert m["comm/busiest_mask_bytes"] == 0  # the shared seed: no index sent
        assert m["comm/total_bytes"] == 4 * message
    top = _run(GossipFL(compress_ratio=0.05, compressor="top_k"), clients=4).history[0]
    assert top["comm/busiest_bytes"] == message and top["comm/busiest_mask_bytes"] == message  # 4 B indices


def test_trains_on_digits_after_gossip():
    trainer = _run(GossipFL(compress_ratio=0.5), clients=4, rounds=2, local_epochs=1)
    assert trainer.history[-1]["acc/personal_mean"] > 0.3 and "acc/consensus_mean" in trainer.history[-1]
    assert trainer.history[-1]["samples/train"] > 0


@pytest.mark.parametrize("kwargs, message", [
    ({"compress_ratio": 0.0}, "compress_ratio must be a number in \\(0, 1\\], got 0.0"),
    ({"compress_ratio": 1.5}, "compress_ratio must be a number in \\(0, 1\\], got 1.5"),
    ({"compressor": "sign"}, "unknown compressor 'sign'; allowed: random_k, top_k"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GossipFL(**kwargs)
