"""PRISAM on the engine: the union average (Fig. 4), re-pruning at rho_i, grouping by masks, what is
sent, churn, the literal order, mixed ratios, resume, and bad settings."""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import Kill

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, RoundContext
from lightning_dfl.federation.algorithms import DPSGD, PRISAM
from lightning_dfl.federation.algorithms.prisam import CHANNELS_FIELD, ChannelMessage
from lightning_dfl.models import build_model
from lightning_dfl.module import SparseClassifier
from lightning_dfl.sparse.channels import ChannelMasks, channel_groups, expand, export, kept_count, masked_param_count

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")
K = 8


def _dm(**kw):
    options = dict(dataset="digits", num_clients=K, partition="cluster", batch_size=16, test_samples_per_client=20)
    if kw.get("partition", "cluster") == "cluster":  # num_groups is refused with another partition
        options.update(num_groups=2, between="pathological", classes_per_group=2)
    return FederatedDataModule(**{**options, **kw})


def _model(**kw):
    return SparseClassifier(**{"arch": "resnet20", "density": 1.0, "lr": 0.05, "lr_decay": 1.0, **kw})


def _trainer(algorithm, rounds=3, local_steps=3, **kw):
    return FederatedTrainer(algorithm=algorithm, rounds=rounds, local_epochs=1 if local_steps is None else None, local_steps=local_steps,
                            logger=False, accelerator="cpu", enable_progress_bar=False, **kw)


class StartOfRound(FederatedCallback):
    """The published channel masks at the start of every round."""

    def __init__(self):
        self.channels = []

    def on_federated_round_start(self, trainer, pl_module):
        self.channels.append([trainer.store.read(k, CHANNELS_FIELD).clone() for k in range(trainer.num_clients)])


@pytest.fixture(scope="module")
def run():
    """4 rounds (1 warm-up) on the cluster partition: 2 groups with disjoint classes."""
    seen = StartOfRound()
    trainer = _trainer(PRISAM(ratio=0.5, num_groups=2, warmup_rounds=1), rounds=4, local_steps=None,
                       callbacks=[seen])
    trainer.fit(_model(), _dm())
    return trainer, seen


# -- the union average (Fig. 4, notes 7) --------------------------------------------------------------
def test_union_average_takes_each_entry_over_the_models_that_keep_it():
    model = build_model("resnet20", num_classes=10)
    ones = ChannelMasks.ones(model)
    a = {n: m.clone() for n, m in ones.items()}
    b = {n: m.clone() for n, m in ones.items()}
    a["layer1.residual"][0] = False  # a drops residual channel 0, b drops block channel 0 of layer1.0
    b["layer1.0.bn1"][0] = False
    a["layer2.0.bn1"][3] = b["layer2.0.bn1"][3] = False  # kept by nobody
    messages = []
    for sender, (masks, value) in enumerate([(a, 1.0), (b, 3.0)]):
        cm = ChannelMasks(masks)
        kept = expand(model, cm, include_buffers=True)
        weights = {}
        for n, t in model.state_dict().items():
            if not t.is_floating_point():
                weights[n] = t.clone()
                continue
            w = torch.full_like(t, value)
            if n in kept:
                w = w.masked_fill(~kept[n], 1.0 if n.endswith("running_var") else 0.0)
            weights[n] = w
        messages.append(ChannelMessage(sender=sender, weights=weights, mask=None, value_bytes=0, index_bytes=0,
                                       channels=cm.to_vector()))
    out = PRISAM().union_average(model, messages)
    conv = out["layer1.0.conv1.weight"]  # out: layer1.0.bn1, in: layer1.residual
    assert conv[0, 0].eq(0).all()  # out channel 0 only in b, in channel 0 only in a: nobody held (0, 0)
    assert conv[0, 1].eq(1.0).all() and conv[1, 0].eq(3.0).all() and conv[1, 1].eq(2.0).all()
    assert out["layer1.0.bn1.weight"][0] == 1.0 and out["layer1.0.bn1.weight"][1] == 2.0
    assert out["layer2.0.bn1.weight"][3] == 0.0 and out["layer2.0.bn1.bias"][3] == 0.0
    assert out["layer2.0.bn1.running_var"][3] == 1.0  # no keeper: BatchNorm's reset value
    assert out["layer2.0.bn1.running_mean"][2] == 2.0
    assert out["fc.bias"].eq(2.0).all()  # no channel touches it: averaged over all


# -- an end-to-end run ------------------------------------------------------------------------------
def test_grouping_recovers_the_true_groups_and_members_converge_to_one_mask(run):
    trainer, _ = run
    for metrics in trainer.history[1:]:
        assert metrics["prisam/ari"] == 1.0
        assert metrics["prisam/groups"] == 2.0
    groups = trainer.datamodule.client_groups
    final = [trainer.store.read(k, CHANNELS_FIELD) for k in range(K)]
    for i in range(K):
        for j in range(K):
            if groups[i] == groups[j]:  # notes 2: equal rho makes a group's masks identical
                assert torch.equal(final[i], final[j])


def test_every_published_mask_keeps_c_minus_floor_rho_c_channels_per_layer(run):
    trainer, _ = run
    model = trainer.module.model
    for k in range(K):
        masks = ChannelMasks.from_vector(model, trainer.store.read(k, CHANNELS_FIELD))
        for group in channel_groups(model):
            assert int(masks[group.name].sum()) == kept_count(group.size, 0.5)


def test_the_published_model_is_exactly_its_exported_compact_model(run):
    trainer, _ = run
    worker = trainer.module.model
    weights, mask = trainer.store.published(3)
    with torch.no_grad():
        for n, t in worker.state_dict().items():
            if n in weights:
                t.copy_(weights[n])
    channels = ChannelMasks.from_vector(worker, trainer.store.read(3, CHANNELS_FIELD))
    for name, keep in expand(worker, channels, include_buffers=False).items():
        assert weights[name][~keep.to(weights[name].device)].eq(0).all(), name  # dropped entries stay 0
    small = export(worker, channels).eval()
    worker.eval()
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(worker(x), small(x), atol=1e-5)
    assert sum(p.numel() for p in small.parameters()) == masked_param_count(worker, channels)


def test_bytes_sent_are_the_kept_values_plus_channel_bits_plus_grouping_traffic(run):
    trainer, seen = run
    model = trainer.module.model
    groups = trainer.datamodule.client_groups
    last = trainer.history[-1]
    bits = sum(g.size for g in channel_groups(model))  # 448 for ResNet-20
    mask_bytes = (bits + 7) // 8
    floats = {n: t for n, t in model.state_dict().items() if t.is_floating_point()}
    total = 0
    for k, vector in enumerate(seen.channels[-1]):  # what each node published at the last round's start
        kept = expand(model, ChannelMasks.from_vector(model, vector), include_buffers=True)
        values = sum(int(kept[n].sum()) if n in kept else t.numel() for n, t in floats.items())
        total += values * 4 * (sum(g == groups[k] for g in groups) - 1)
    assert last["comm/total_bytes"] == total
    grouping = (K - 1) * mask_bytes + (K - 1) * K  # masks to the collector, K one-byte labels back
    assert last["prisam/grouping_bytes"] == grouping
    # the collector (node 0) downloads K-1 masks, then the 3 masks of its group-mates with their models
    assert last["comm/busiest_mask_bytes"] == (K - 1) * mask_bytes + 3 * mask_bytes


def test_it_learns_above_chance(run):
    trainer, _ = run
    assert trainer.history[-1]["acc/personal_mean"] > 0.7  # 2 classes per client: chance is 0.5


def test_flops_are_the_compact_models(run):
    trainer, _ = run
    last = trainer.history[-1]
    model = trainer.module.model
    from lightning_dfl.sparse.channels import masked_macs
    macs = masked_macs(model, ChannelMasks.from_vector(model, trainer.store.read(0, CHANNELS_FIELD)),
                       profile=trainer.module.flops_profile)
    assert last["prisam/compact_mmacs_mean"] == pytest.approx(macs / 1e6)
    assert macs < 0.35 * trainer.module.flops_profile.forward_macs()  # about (1 - rho)^2


# -- options ------------------------------------------------------------------------------------------
def test_prune_after_train_trains_under_the_union_and_publishes_at_rho():
    literal = _trainer(PRISAM(ratio=0.5, num_groups=2, warmup_rounds=1, prune_after_train=True,
                              grouping="random", num_neighbors=3, topology="time_varying"), rounds=2)
    literal.fit(_model(), _dm(partition="iid"))
    default = _trainer(PRISAM(ratio=0.5, num_groups=2, warmup_rounds=1, grouping="random", num_neighbors=3),
                       rounds=2)
    default.fit(_model(), _dm(partition="iid"))
    # density after aggregation (what is trained): the union's in the literal order, rho's in the default
    assert literal.history[1]["density/mean"] > default.history[1]["density/mean"]
    model = literal.module.model
    for k in range(K):
        masks = ChannelMasks.from_vector(model, literal.store.read(k, CHANNELS_FIELD))
        assert all(int(masks[g.name].sum()) == kept_count(g.size, 0.5) for g in channel_groups(model))
    assert "prisam/ari" not in default.history[1]  # random peers: no grouping


def test_mixed_ratios_prune_each_device_at_its_own_rho():
    trainer = _trainer(PRISAM(ratio=[0.3, 0.7], num_groups=2, warmup_rounds=1, grouping_ratio=0.7), rounds=2)
    trainer.fit(_model(), _dm())
    model = trainer.module.model
    for k in range(K):
        masks = ChannelMasks.from_vector(model, trainer.store.read(k, CHANNELS_FIELD))
        rho = [0.3, 0.7][k % 2]
        assert all(int(masks[g.name].sum()) == kept_count(g.size, rho) for g in channel_groups(model))
    assert "prisam/ari" in trainer.history[1]


def test_a_grouping_ratio_below_max_rho_is_refused_and_auto_derives_it():
    """Notes 5 / Sec. V-G: below a device's rho the grouping mask would hold pruned channels (gamma 0,
    filled by index; ARI 0.26 in the issue's probe). Refused before training, naming both values."""
    with pytest.raises(ValueError, match=r"grouping_ratio=0\.5 is below max\(rho\)=0\.7"):
        PRISAM(ratio=[0.3, 0.5, 0.7], grouping_ratio=0.5)
    PRISAM(ratio=[0.3, 0.5, 0.7], grouping_ratio=0.7)  # at max(rho): allowed
    algo = PRISAM(ratio=[0.3, 0.7], num_groups=2, warmup_rounds=1, grouping_ratio="auto")
    assert algo._grouping_ratio == 0.7
    trainer = _trainer(algo, rounds=2, local_steps=1)
    trainer.fit(_model(), _dm())
    assert {"prisam/ari", "prisam/ari_own_masks"} <= set(trainer.history[1])  # notes 5: the ARI both ways


def test_churn_is_deterministic_and_leaves_absent_devices_untouched():
    def ctx(r):
        return RoundContext(r, 10, 20, (1,) * 20, np.random.default_rng(0), seed=5)

    first, second = PRISAM(participants_per_round=10, churn=0.3), PRISAM(participants_per_round=10, churn=0.3)
    rounds = [first.participants(ctx(r)) for r in range(6)]
    assert [second.participants(ctx(r)) for r in reversed(range(6))][::-1] == rounds  # any call order
    assert len(rounds[0]) == 10 and len({tuple(p) for p in rounds}) > 1

    class Absent(FederatedCallback):
        def __init__(self):
            self.frozen = []

        def on_federated_round_start(self, trainer, pl_module):
            active = trainer.algorithm.participants(trainer.planner.context(trainer.current_round))
            absent = sorted(set(range(K)) - set(active))
            self.frozen.append({k: trainer.store.published(k)[0]["fc.weight"].clone() for k in absent})

        def on_federated_round_end(self, trainer, pl_module):
            for k, before in self.frozen[-1].items():
                assert torch.equal(trainer.store.published(k)[0]["fc.weight"], before)

    watch = Absent()
    trainer = _trainer(PRISAM(num_groups=2, warmup_rounds=1, participants_per_round=5, churn=0.4), rounds=3,
                       local_steps=2, callbacks=[watch])
    trainer.fit(_model(), _dm())
    assert any(watch.frozen)


class _Recording(PRISAM):
    """PRISAM that records every mask it groups and every channel mask it averages."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.grouped, self.averaged = [], []

    def _group(self, ctx, active, vectors):
        self.grouped.append((ctx.round_idx, list(active), vectors.copy()))
        return super()._group(ctx, active, vectors)

    def union_average(self, model, messages):
        self.averaged.append([m.channels.clone() for m in messages])
        return super().union_average(model, messages)


@pytest.mark.parametrize("grouping", ["kmeans", "random"])
def test_late_joiners_warm_up_and_prune_before_they_are_grouped_or_averaged(grouping):
    """L122 / notes 3: every device does its local warm-up and first prune before Alg. 2 sees its mask.
    A device first taking part after the warm-up (participants_per_round, churn) warms up then, so no
    all-ones (unpruned) channel mask is ever grouped or averaged (it was: 4 of 9 in the issue's probe)."""
    algo = _Recording(ratio=0.5, num_groups=2, warmup_rounds=1, participants_per_round=4, churn=0.4,
                      grouping=grouping, num_neighbors=2)
    trainer = _trainer(algo, rounds=5, local_steps=1)
    trainer.fit(_model(), _dm())
    first_seen = {}
    for r in range(5):
        for k in algo.participants(trainer.planner.context(r)):
            first_seen.setdefault(k, r)
    assert any(r >= 1 for r in first_seen.values())  # some device joined after the warm-up
    assert any(m.get("prisam/warming", 0) > 0 for m in trainer.history[1:])
    if grouping == "kmeans":
        assert algo.grouped
        for r, active, vectors in algo.grouped:
            assert not vectors.all(axis=1).any(), (r, active)
            assert all(first_seen[k] < r for k in active)  # a joiner's first round is its warm-up
    assert algo.averaged
    for channels in algo.averaged:
        assert not any(bool(c.all()) for c in channels)


@pytest.mark.parametrize("count,shares", [(4, [2, 2]), (5, [2, 3])])
def test_per_group_participants_draw_the_same_number_from_each_group(count, shares):
    """Notes 17: 100 of 200 devices take part, 20 from each of the 5 groups; a remainder goes to
    randomly chosen groups, one more each."""
    algo = PRISAM(num_groups=2, warmup_rounds=1, participants_per_round=count, participants_draw="per_group")
    trainer = _trainer(algo, rounds=1, local_steps=1)
    dm = _dm()
    trainer.fit(_model(), dm)
    chosen = algo.participants(trainer.planner.context(0))
    assert len(chosen) == count
    assert sorted(np.bincount(np.asarray(dm.client_groups)[list(chosen)], minlength=2).tolist()) == shares
    with pytest.raises(ValueError, match="unknown participants_draw 'stratified'"):
        PRISAM(participants_draw="stratified")
    import yaml  # the paper's config draws per group (notes 17)

    paper = yaml.safe_load(open(Path(__file__).resolve().parents[1] / "configs" / "prisam_cifar10_pat.yaml"))
    assert paper["trainer"]["algorithm"]["init_args"]["participants_draw"] == "per_group"


def test_per_group_draw_needs_client_groups():
    algo = PRISAM(num_groups=2, participants_per_round=4, participants_draw="per_group")
    with pytest.raises(ValueError, match="data.partition: cluster"):
        _trainer(algo, rounds=1).fit(_model(), _dm(partition="dirichlet"))


def test_default_dbscan_eps_groups_devices_of_the_digits_config_where_the_old_default_grouped_none():
    """``dbscan_eps`` defaults to "auto" (the k-distance rule on the round's masks, unit-tested in
    tests/test_grouping.py). On configs/prisam_digits.yaml (20 devices, 5 planted groups) the first masks differ
    by a share of 0.33-0.46 inside a group and 0.44-0.56 between groups (they overlap): the old default 0.1 made
    every device its own group (no aggregation at all); "auto" groups devices together, and mostly by their
    planted group. How well depends on the last bits of training: 5 groups with ARI 1.0 on an Intel Xeon, 14
    groups with ARI 0.38 on an AVX512 AMD EPYC (both torch 2.14.1), so only what holds on both is asserted."""
    from lightning_dfl.cli import FederatedCLI

    config = Path(__file__).resolve().parents[1] / "configs" / "prisam_digits.yaml"

    def first_grouping(eps):
        cli = FederatedCLI(args=["fit", "--config", str(config), "--trainer.rounds=3", "--trainer.logger=false",
                                 "--trainer.enable_progress_bar=false", "--trainer.algorithm.init_args.grouping=dbscan",
                                 f"--trainer.algorithm.init_args.dbscan_eps={eps}"])
        return cli.trainer.history[2]  # rounds 0-1 are the warm-up

    auto, old = first_grouping("auto"), first_grouping(0.1)
    assert old["prisam/groups"] == 20 and old["prisam/ari"] == 0.0  # every device alone
    assert auto["prisam/groups"] <= 15 and auto["prisam/ari"] > 0.3
    assert 0.3 < auto["prisam/dbscan_eps"] < 0.5


def _digits(grouping, seed, rounds, *extra):
    """configs/prisam_digits.yaml (20 devices in 5 planted groups) with ``grouping``; its history."""
    from lightning_dfl.cli import FederatedCLI

    config = Path(__file__).resolve().parents[1] / "configs" / "prisam_digits.yaml"
    cli = FederatedCLI(args=["fit", "--config", str(config), f"--trainer.rounds={rounds}", f"--trainer.seed={seed}",
                             "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                             "--trainer.diagnostics=false", f"--trainer.algorithm.init_args.grouping={grouping}",
                             *extra])
    return cli.trainer.history


CHURN = ("--trainer.algorithm.init_args.participants_per_round=10", "--trainer.algorithm.init_args.churn=0.3")


@pytest.mark.parametrize("seed", [0, 1])
def test_kmeans_groups_survive_devices_that_join_leave_and_return(seed):
    """Issue 36 part 3: 10 of the 20 devices a round, churn 0.3 (Sec. V-F). Clustering only the round's
    participants (about 2 per group), KMeans with k = 5 gave a joining device a group of its own and
    merged two planted groups, for good (notes 2: a joint aggregation makes their masks identical): the
    ARI of rounds 3-7 averaged 0.85 (seed 0) and 0.74 (seed 1). Alg. 2 clusters the masks of all N devices
    (absent ones with the mask they last published): 1.0 and 0.92."""
    history = _digits("kmeans", seed, 8, *CHURN)
    ari = [history[r]["prisam/ari"] for r in range(3, 8)]
    assert np.mean(ari) >= 0.9, ari
    assert all(history[r]["prisam/view"] >= history[r]["prisam/grouped"] for r in range(2, 8))


@pytest.mark.parametrize("grouping,seed", [("kmeans", 2), ("dbscan", 0), ("dbscan", 2)])
def test_groups_survive_churn_over_sixteen_rounds(grouping, seed):
    """Issue 36 part 3, its setting: the mean ARI over rounds 3-15 is at least 0.9. Clustering the masks
    the devices shared last (Alg. 1's M_i^(t)), KMeans split a group while one planted group was unseen
    and a late device of that group merged with the split-off part for good (after one joint aggregation
    their masks are identical), and DBSCAN's eps was set by a joining device's warm-up mask among
    aggregated ones: 0.80 (KMeans, seed 2), 0.82 and 0.69 (DBSCAN, seeds 0 and 2). Every device is
    clustered by its warm-up mask (Sec. V-A, item 22), which no aggregation changes: 0.92, 1.0, 1.0."""
    history = _digits(grouping, seed, 16, *CHURN)
    ari = [history[r]["prisam/ari"] for r in range(3, 16)]
    assert np.mean(ari) >= 0.9, ari
    assert ari[-5:] == [1.0] * 5, ari  # once every group has been seen the groups are the planted ones


def test_each_device_is_clustered_by_its_warm_up_mask():
    """Item 22: the mask Alg. 2 clusters for a device, in every round and whether it takes part or not,
    is the one it had published when first grouped: its warm-up prune's mask. The published masks move
    with every aggregation; the clustered ones do not (``grouping_masks="current"``: the published)."""
    seen = StartOfRound()
    algo = _Recording(num_groups=2, warmup_rounds=1, participants_per_round=5, churn=0.4)
    _trainer(algo, rounds=6, local_steps=2, callbacks=[seen]).fit(_model(), _dm())
    first: dict[int, int] = {}
    moved = 0
    for r, nodes, vectors in algo.grouped:
        for k, vector in zip(nodes, vectors):
            first.setdefault(k, r)
            assert np.array_equal(vector, seen.channels[first[k]][k].numpy()), (r, k)
            moved += not np.array_equal(vector, seen.channels[r][k].numpy())
    assert moved > 0 and len(algo.grouped) >= 4
    current = _Recording(num_groups=2, warmup_rounds=1, participants_per_round=5, churn=0.4, grouping_masks="current",
                         grouping_view="participants")
    seen = StartOfRound()
    _trainer(current, rounds=6, local_steps=2, callbacks=[seen]).fit(_model(), _dm())
    for r, nodes, vectors in current.grouped:
        assert np.array_equal(vectors, torch.stack([seen.channels[r][k] for k in nodes]).numpy())


#: the grouping's own diagnostics: they describe the masks clustered, warm-up masks since item 22
_GROUPING_DIAGNOSTICS = ("prisam/differing_dims", "prisam/distinct_masks", "prisam/grouping_fallback",
                         "prisam/dbscan_eps", "time/wall_round_s")


@pytest.mark.parametrize("grouping", ["kmeans", "dbscan"])
def test_without_churn_the_planted_groups_are_found_every_round(grouping):
    """All 20 devices every round: the groups of the first grouping (round 2) are kept in every round (the
    same warm-up masks, the same seed), the planted ones with KMeans (ARI 1.0), and the view is the participants
    themselves. Clustering the warm-up masks (item 22) or the current ones (Alg. 1's M_i^(t): a group's members
    share one mask after aggregating) gives the same groups when they are the planted ones, so every metric but
    the grouping's own diagnostics is the same, bit for bit. (DBSCAN's auto eps found the planted groups on an Intel Xeon, ARI 1.0, and 14
    groups, ARI 0.38, on an AVX512 AMD EPYC: the masks' distances inside and between groups overlap, see
    ``test_default_dbscan_eps_groups_devices_of_the_digits_config_where_the_old_default_grouped_none``.)"""
    history = _digits(grouping, 0, 5)
    ari = [history[r]["prisam/ari"] for r in range(2, 5)]
    assert ari == [ari[0]] * 3 and ari[0] > 0.3
    if grouping == "kmeans":
        assert ari[0] == 1.0
    if ari[0] != 1.0:  # groups that mix planted ones aggregate masks that then differ from the warm-up ones
        return
    assert all(history[r]["prisam/view"] == history[r]["prisam/grouped"] == 20 for r in range(2, 5))
    current = _digits(grouping, 0, 5, "--trainer.algorithm.init_args.grouping_masks=current")
    strip = lambda m: {k: v for k, v in m.items() if k not in _GROUPING_DIAGNOSTICS}  # noqa: E731
    assert [strip(m) for m in history] == [strip(m) for m in current]
    assert history[:3] == [{**m, "time/wall_round_s": h["time/wall_round_s"]} for m, h in zip(current[:3], history)]


def test_l1_penalty_adds_lambda_times_the_bn_scaling_factors():
    model = _model()
    model.build(10, 1, 8)
    batch = (torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3]))
    algo = PRISAM(l1=1e-3)
    algo._groups = channel_groups(model.model)

    class Ctx:
        module = model
    gammas = sum(m.weight.detach().abs().sum() for m in model.model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert float((algo.loss(Ctx, batch) - model.loss(batch)).detach()) == pytest.approx(1e-3 * float(gammas), rel=1e-5)


@pytest.mark.parametrize("regroup,killed_at", [("frozen", 1), ("frozen", 3), ("every_round", 2)])
def test_resume_is_bit_identical_with_frozen_groups(tmp_path, regroup, killed_at):
    """Also with the default regrouping: the collector's warm-up masks are in the checkpoint (item 22)."""
    def fit(rounds, root, ckpt=None):
        trainer = _trainer(PRISAM(num_groups=2, warmup_rounds=1, regroup=regroup, participants_per_round=6,
                                  churn=0.3), rounds=4, local_steps=2, checkpoint_every=1,
                           default_root_dir=str(root))
        if rounds < 4:
            trainer.callbacks.append(Kill(rounds, RuntimeError))
            with pytest.raises(RuntimeError, match="killed"):
                trainer.fit(_model(), _dm())
            return trainer
        trainer.fit(_model(), _dm(), ckpt_path=ckpt)
        return trainer

    straight = fit(4, tmp_path / "a")
    killed = fit(killed_at, tmp_path / "b")
    resumed = fit(4, tmp_path / "c", ckpt=str(killed.checkpoint_path))
    for n, t in straight.store.weights.items():
        assert torch.equal(t, resumed.store.weights[n])
    strip = lambda m: {k: v for k, v in m.items() if k != "time/wall_round_s"}  # noqa: E731
    assert [strip(m) for m in straight.history] == [strip(m) for m in resumed.history]


# -- bad settings -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"ratio": 1.0}, "ratio must be a pruning ratio in \\[0, 1\\), got 1.0"),
    ({"ratio": []}, "ratio must be a number in \\[0, 1\\) or a non-empty list"),
    ({"grouping": "spectral"}, "unknown grouping 'spectral'; allowed: kmeans, dbscan, random"),
    ({"regroup": "never"}, "unknown regroup 'never'; allowed: every_round, frozen"),
    ({"churn": 1.0}, "churn must be a probability in \\[0, 1\\), got 1.0"),
    ({"grouping_ratio": -0.1}, "grouping_ratio must be a pruning ratio"),
    ({"warmup_rounds": -1}, "warmup_rounds"),
    ({"grouping_masks": "last"}, "unknown grouping_masks 'last'; allowed: current, warmup"),
    ({"grouping_view": "some"}, "unknown grouping_view 'some'; allowed: all, participants"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PRISAM(**kwargs)


@pytest.mark.parametrize("model_kw,match", [
    ({"arch": "cnn_digits"}, "PRISAM prunes BN channels: channel masks are defined for"),
    ({"density": 0.5}, "set model.density to 1.0, got 0.5"),
    ({"mask_exclude": ["fc"]}, "leaves \\['fc.weight'\\] unmasked"),
])
def test_models_prisam_cannot_prune_are_refused_before_training(model_kw, match):
    with pytest.raises(ValueError, match=match):
        _trainer(PRISAM(num_groups=2), rounds=1).fit(_model(**model_kw), _dm())


def test_too_many_participants_are_refused():
    with pytest.raises(ValueError, match="participants_per_round=9 exceeds the 8 clients"):
        _trainer(PRISAM(participants_per_round=9), rounds=1).fit(_model(), _dm())


def test_dpsgd_can_report_each_clients_own_model():
    assert DPSGD(headline="personal").headline == "personal"
    with pytest.raises(ValueError, match="headline must be 'consensus'.*got 'global'"):
        DPSGD(headline="global")


def test_a_vgg11_bn_federation_prunes_and_aggregates_its_eight_bn_layers(tmp_path):
    from torchvision.io import encode_png
    from torchvision.io import write_file as write_bytes

    generator = torch.Generator().manual_seed(0)
    for half, count in (("train", 12), ("test", 6)):
        for c, name in enumerate(("ant", "bee")):
            folder = tmp_path / half / name
            folder.mkdir(parents=True)
            for i in range(count):
                image = (torch.rand(3, 32, 32, generator=generator) * 60 + 80 * c).to(torch.uint8)
                write_bytes(str(folder / f"{i:04d}.png"), encode_png(image))
    dm = FederatedDataModule(dataset="image_folder", root=str(tmp_path), num_clients=2, partition="iid",
                             batch_size=4, test_samples_per_client=3)
    trainer = _trainer(PRISAM(ratio=0.5, num_groups=1, warmup_rounds=1), rounds=2, local_steps=1)
    trainer.fit(_model(arch="vgg11", model_options={"norm": "batch"}), dm)
    model = trainer.module.model
    assert trainer.history[1]["prisam/groups"] == 1.0  # both clients aggregate together
    for k in range(2):
        masks = ChannelMasks.from_vector(model, trainer.store.read(k, CHANNELS_FIELD))
        assert len(masks) == 8 and masks.channel_count == 2752
        assert all(int(masks[g.name].sum()) == kept_count(g.size, 0.5) for g in channel_groups(model))
