"""PRISAM's cluster partitions (PRISAM Sec. V, prisam-notes 17): groups of clients, label skew between, IID within."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.datamodules.partition import PARTITIONERS, build_partitioner

# 10 classes of unequal sizes (100..190), shuffled: 1,450 samples
LABELS = np.random.default_rng(0).permutation(np.repeat(np.arange(10), np.arange(100, 200, 10)))
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _cluster(**kwargs):
    return build_partitioner("cluster", **kwargs)


def _check_disjoint_sorted(parts, n):
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged), "a sample is shared between clients"
    assert merged.min() >= 0 and merged.max() < n
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)
    return merged


def test_registered_and_groups_are_contiguous_blocks():
    assert PARTITIONERS.get("cluster").name == "cluster"
    p = _cluster(num_groups=5)
    assert p.groups(200).tolist() == np.repeat(np.arange(5), 40).tolist()  # the paper: 200 devices, 5 x 40
    assert p.groups(10).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    uneven = _cluster(num_groups=4).groups(10)  # c * 4 // 10
    assert uneven.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert uneven.dtype == np.int64 and np.ptp(np.bincount(uneven)) <= 1


@pytest.mark.parametrize("between", ["dirichlet", "pathological"])
@pytest.mark.parametrize(("num_clients", "num_groups"), [(20, 5), (13, 4), (6, 6), (7, 1)])
def test_clients_disjoint_and_groups_split_equally(between, num_clients, num_groups):
    p = _cluster(num_groups=num_groups, between=between, alpha=0.5, classes_per_group=2 if num_groups <= 5 else 1)
    parts = p(LABELS, num_clients, seed=3)
    assert len(parts) == num_clients
    merged = _check_disjoint_sorted(parts, len(LABELS))
    groups = p.groups(num_clients)
    used = np.unique(np.concatenate([np.unique(LABELS[q]) for q in parts]))
    assert len(merged) == np.isin(LABELS, used).sum()  # every sample of a used class assigned exactly once
    if between == "dirichlet":
        assert len(merged) == len(LABELS)
    for g in range(num_groups):
        sizes = [len(parts[c]) for c in np.flatnonzero(groups == g)]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1  # IID, equal shares within a group


def test_pathological_groups_hold_disjoint_class_sets():
    p = _cluster(num_groups=5, between="pathological")
    parts = p(LABELS, 20, seed=1)
    groups = p.groups(20)
    group_classes = []
    for g in range(5):
        clients = np.flatnonzero(groups == g)
        held = np.unique(LABELS[np.concatenate([parts[c] for c in clients])])
        assert len(held) == 2
        group_classes.append(set(held.tolist()))
        group_samples = np.concatenate([parts[c] for c in clients])
        assert len(group_samples) == np.isin(LABELS, held).sum()  # all samples of a class go to its group
        for c in clients:  # ~75 samples per client from 2 classes of 100+: an IID share holds both
            assert set(np.unique(LABELS[parts[c]]).tolist()) == group_classes[-1]
    assert set().union(*group_classes) == set(range(10))  # 2 x 5 = 10: disjoint and covering


def test_hand_checkable_pathological_example():
    labels = np.repeat(np.arange(10), 10)  # sample i has class i // 10
    p = _cluster(num_groups=2, between="pathological", classes_per_group=2)
    parts = p(labels, 4, seed=0)
    assert p.groups(4).tolist() == [0, 0, 1, 1]
    assert [len(q) for q in parts] == [10, 10, 10, 10]  # 2 classes x 10 samples per group, halved
    g0 = set(np.unique(labels[np.concatenate(parts[:2])]).tolist())
    g1 = set(np.unique(labels[np.concatenate(parts[2:])]).tolist())
    assert len(g0) == len(g1) == 2 and not g0 & g1
    assert sorted(np.concatenate(parts[:2]).tolist()) == sorted(i for i in range(100) if i // 10 in g0)
    assert sorted(np.concatenate(parts[2:]).tolist()) == sorted(i for i in range(100) if i // 10 in g1)
    assert len(_check_disjoint_sorted(parts, 100)) == 40  # the other 6 classes belong to no group


def test_dirichlet_is_seeded_and_skews_groups():
    p = _cluster(num_groups=4, between="dirichlet", alpha=0.2)
    a, b, c = p(LABELS, 12, seed=7), p(LABELS, 12, seed=7), p(LABELS, 12, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))
    groups = p.groups(12)
    counts = np.stack([np.bincount(LABELS[np.concatenate([a[k] for k in np.flatnonzero(groups == g)])], minlength=10)
                       for g in range(4)])
    assert np.array_equal(counts.sum(axis=0), np.bincount(LABELS))  # each class divided among the groups
    assert (counts / counts.sum(axis=0)).max() > 0.6  # alpha 0.2: some group takes most of some class
    # within a group the clients' class mixes follow the group's (IID): no client lacks a class of >= 40 samples
    for g in range(4):
        for k in np.flatnonzero(groups == g):
            held = np.bincount(LABELS[a[k]], minlength=10)
            assert (held[counts[g] >= 40] > 0).all()


def test_dirichlet_large_alpha_is_near_uniform_over_groups():
    labels = np.repeat(np.arange(4), 2000)
    p = _cluster(num_groups=2, between="dirichlet", alpha=1000.0)
    parts = p(labels, 4, seed=0)
    per_group = [np.bincount(labels[np.concatenate(parts[2 * g:2 * g + 2])], minlength=4) for g in range(2)]
    assert all(abs(int(n) - 1000) < 100 for n in np.concatenate(per_group))


def test_tiny_alpha_still_leaves_no_client_empty():
    p = _cluster(num_groups=5, between="dirichlet", alpha=1e-3)
    parts = p(LABELS, 10, seed=0)
    assert min(len(q) for q in parts) >= 1 and sum(len(q) for q in parts) == len(LABELS)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_groups": 0}, "num_groups must be an integer >= 1, got 0"),
    ({"num_groups": 2.5}, "num_groups must be an integer >= 1, got 2.5"),
    ({"num_groups": 2, "between": "iid"}, "between must be one of 'dirichlet', 'pathological'.*got 'iid'"),
    ({"num_groups": 2, "alpha": 0}, "alpha must be a finite number > 0, got 0"),
    ({"num_groups": 2, "classes_per_group": 0}, "classes_per_group must be an integer >= 1, got 0"),
])
def test_bad_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _cluster(**kwargs)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="classes_per_group=3 x num_groups=4 = 12 exceeds the 10 classes"):
        _cluster(num_groups=4, between="pathological", classes_per_group=3)(LABELS, 8, seed=0)
    with pytest.raises(ValueError, match="num_groups=5 exceeds num_clients=3"):
        _cluster(num_groups=5)(LABELS, 3, seed=0)
    with pytest.raises(ValueError, match="num_groups=5 exceeds num_clients=3"):
        _cluster(num_groups=5).groups(3)
    with pytest.raises(ValueError, match="group 0 holds 2 samples.*fewer than its 3 clients"):
        _cluster(num_groups=1, between="pathological", classes_per_group=1)(np.array([0, 0, 1]), 3, seed=0)
    with pytest.raises(ValueError, match="alpha=0.001.*in 2 attempts"):
        _cluster(num_groups=5, alpha=1e-3, max_attempts=2)(np.repeat(np.arange(2), 10), 10, seed=0)  # 2 classes, 5 groups


# ----------------------------------------------------------------------------- the datamodule


def test_datamodule_client_groups_on_digits():
    dm = FederatedDataModule(dataset="digits", num_clients=10, partition="cluster", num_groups=5,
                             between="pathological", test_samples_per_client=20)
    assert dm.client_groups == (0, 0, 1, 1, 2, 2, 3, 3, 4, 4)
    held = [set(np.flatnonzero(dm.client_label_counts(k)).tolist()) for k in range(10)]
    for g in range(5):
        assert held[2 * g] == held[2 * g + 1] and len(held[2 * g]) == 2  # a group's clients share its 2 classes
        assert set(np.flatnonzero(dm.client_test_label_counts(2 * g)).tolist()) <= held[2 * g]
    assert set().union(*held) == set(range(10))
    sizes = [dm.client_train_size(k) for k in range(10)]
    assert all(abs(sizes[2 * g] - sizes[2 * g + 1]) <= 1 for g in range(5))
    assert sum(sizes) == len(dm.split.train)
    assert FederatedDataModule(dataset="digits", num_clients=10, partition="dirichlet").client_groups is None


def test_datamodule_dirichlet_cluster_is_seeded():
    def label_counts(seed):
        dm = FederatedDataModule(dataset="digits", num_clients=6, partition="cluster", num_groups=3, alpha=0.2,
                                 test_samples_per_client=20, seed=seed)
        assert dm.client_groups == (0, 0, 1, 1, 2, 2)
        return np.stack([dm.client_label_counts(k) for k in range(6)])

    assert np.array_equal(label_counts(0), label_counts(0))
    assert not np.array_equal(label_counts(0), label_counts(1))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"partition": "cluster"}, r"partition='cluster' needs num_groups.*got None"),
    ({"partition": "cluster", "num_groups": 0}, "num_groups must be an integer >= 1, got 0"),
    ({"partition": "cluster", "num_groups": 11}, "num_groups=11 exceeds num_clients=10"),
    ({"partition": "cluster", "num_groups": 2, "between": "random"}, "between must be one of.*got 'random'"),
    ({"partition": "cluster", "num_groups": 2, "classes_per_group": -1},
     "classes_per_group must be an integer >= 1, got -1"),
    ({"partition": "dirichlet", "num_groups": 3},  # the groups asked for would not exist
     r"num_groups=3 is read by partition='cluster' only, got partition='dirichlet'"),
])
def test_datamodule_bad_cluster_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FederatedDataModule(dataset="digits", num_clients=10, **kwargs)


def test_datamodule_pathological_too_many_classes_fails_at_setup():
    dm = FederatedDataModule(dataset="digits", num_clients=12, partition="cluster", num_groups=6,
                             between="pathological")
    with pytest.raises(ValueError, match="classes_per_group=2 x num_groups=6 = 12 exceeds the 10 classes"):
        dm.setup()


def test_checkpoint_refuses_another_grouping():
    def make(**kw):
        return FederatedDataModule(dataset="digits", num_clients=10, partition="cluster", **kw)

    state = make(num_groups=5).state_dict()
    assert {"num_groups", "between", "classes_per_group"} <= set(state)
    make(num_groups=5).load_state_dict(state)  # same grouping: accepted
    with pytest.raises(ValueError, match="num_groups: checkpoint 5 vs now 2"):
        make(num_groups=2).load_state_dict(state)
    with pytest.raises(ValueError, match="between: checkpoint 'dirichlet' vs now 'pathological'"):
        make(num_groups=5, between="pathological").load_state_dict(state)
    with pytest.raises(ValueError, match="classes_per_group: checkpoint 2 vs now 1"):
        make(num_groups=5, classes_per_group=1).load_state_dict(state)


def test_cli_parses_cluster_options():
    from lightning_dfl.cli import FederatedCLI

    cli = FederatedCLI(args=["--config", str(CONFIGS / "dispfl_digits.yaml"), "--data.num_clients=8",
                             "--data.partition=cluster", "--data.num_groups=4", "--data.between=pathological",
                             "--data.classes_per_group=2"], run=False)
    assert cli.datamodule.client_groups == (0, 0, 1, 1, 2, 2, 3, 3)
    assert cli.datamodule.hparams.between == "pathological"
