"""Partitions of a training split over clients, and personal test sets (DisPFL App. B.1)."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_dfl.datamodules.partition import (
    PARTITIONERS,
    DirichletPartitioner,
    ExDirPartitioner,
    IIDPartitioner,
    Partitioner,
    PathologicalPartitioner,
    allocate_counts,
    build_partitioner,
    personal_test_indices,
    register_partitioner,
)

# 10 classes of unequal sizes (100..190), shuffled: 1,450 samples
LABELS = np.random.default_rng(0).permutation(np.repeat(np.arange(10), np.arange(100, 200, 10)))


def _assert_disjoint_sorted(parts, n):
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged), "a sample is shared between clients"
    assert merged.min() >= 0 and merged.max() < n
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)


def _mean_label_entropy(parts, labels):
    entropies = []
    for p in parts:
        q = np.bincount(labels[p], minlength=10) / len(p)
        q = q[q > 0]
        entropies.append(-(q * np.log(q)).sum())
    return float(np.mean(entropies))


# ----------------------------------------------------------------------------- IID


def test_iid_uses_every_sample_once_in_equal_shards():
    parts = IIDPartitioner()(LABELS, 7, seed=0)
    _assert_disjoint_sorted(parts, len(LABELS))
    assert sum(len(p) for p in parts) == len(LABELS)
    assert {len(p) for p in parts} == {207, 208}  # 1450 = 7 * 207 + 1
    assert all(np.array_equal(a, b) for a, b in zip(parts, IIDPartitioner()(LABELS, 7, seed=0)))
    assert not np.array_equal(parts[0], IIDPartitioner()(LABELS, 7, seed=1)[0])


def test_iid_needs_a_sample_per_client():
    with pytest.raises(ValueError, match="5 clients.*only 3 samples"):
        IIDPartitioner()(np.array([0, 1, 0]), 5, seed=0)


# ----------------------------------------------------------------------------- Dirichlet


def test_dirichlet_is_disjoint_complete_and_respects_min_size():
    parts = DirichletPartitioner(alpha=0.3, min_size=40)(LABELS, 10, seed=1)
    _assert_disjoint_sorted(parts, len(LABELS))
    assert sum(len(p) for p in parts) == len(LABELS)  # Hsu et al. hand out every sample
    assert min(len(p) for p in parts) >= 40


def test_dirichlet_determinism_and_seed_sensitivity():
    part = DirichletPartitioner(alpha=0.5)
    a, b, c = part(LABELS, 10, seed=3), part(LABELS, 10, seed=3), part(LABELS, 10, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_smaller_alpha_gives_more_label_skew():
    skewed = [_mean_label_entropy(DirichletPartitioner(0.1, 1)(LABELS, 10, s), LABELS) for s in range(3)]
    mild = [_mean_label_entropy(DirichletPartitioner(1.0, 1)(LABELS, 10, s), LABELS) for s in range(3)]
    near_iid = [_mean_label_entropy(DirichletPartitioner(100.0, 1)(LABELS, 10, s), LABELS) for s in range(3)]
    assert max(skewed) < min(mild) < max(mild) < min(near_iid)
    assert min(near_iid) > 0.95 * np.log(10)


def test_equal_quota_rule_stops_clients_at_n_over_k():
    # 10 classes of 100 to 10 clients with alpha -> 0: each class lands almost whole on one client.
    # Without DisPFL's quota a client would soon collect two or three whole classes; with it, a client
    # that holds >= N/K = 100 samples gets nothing more, so nobody passes 99 + 100 samples.
    labels = np.repeat(np.arange(10), 100)
    for seed in range(5):
        sizes = [len(p) for p in DirichletPartitioner(alpha=0.01, min_size=0)(labels, 10, seed)]
        assert max(sizes) <= 199 and sum(sizes) == 1000


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.5, 1.0])
def test_dirichlet_gives_nothing_more_to_a_client_at_its_quota(alpha):
    # Classes are handed out in label order; a client already holding >= N/K samples when class c
    # comes up must get none of it, also when float rounding leaves cumsum(q)[-1] just below 1
    for seed in range(20):
        parts = DirichletPartitioner(alpha, min_size=1)(LABELS, 10, seed)
        counts = np.stack([np.bincount(LABELS[p], minlength=10) for p in parts])  # [client, class]
        before = np.cumsum(counts, axis=1) - counts  # what each client held when each class came up
        assert not np.any((before >= len(LABELS) / 10) & (counts > 0)), f"seed {seed}"


def test_dirichlet_errors_name_the_values():
    for bad in (0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"alpha must be a finite number > 0, got {bad!r}"):
            DirichletPartitioner(alpha=bad)
    with pytest.raises(ValueError, match=r"20 clients min_size=10 samples: only 150 samples \(need 200\)"):
        DirichletPartitioner(alpha=1.0, min_size=10)(LABELS[:150], 20, seed=0)
    with pytest.raises(ValueError, match="in 3 attempts"):  # alpha tiny: some client always nearly empty
        DirichletPartitioner(alpha=0.001, min_size=100, max_attempts=3)(LABELS, 14, seed=0)


# ----------------------------------------------------------------------------- pathological


@pytest.mark.parametrize("num_clients,per_client", [(10, 2), (7, 3), (4, 10), (23, 1)])
def test_pathological_clients_hold_exactly_n_balanced_classes(num_clients, per_client):
    parts = PathologicalPartitioner(per_client)(LABELS, num_clients, seed=0)
    _assert_disjoint_sorted(parts, len(LABELS))
    held = [set(LABELS[p].tolist()) for p in parts]
    assert all(len(h) == per_client for h in held)
    usage = np.bincount([c for h in held for c in h], minlength=10)
    assert usage.max() - usage.min() <= 1  # every class used by floor or ceil(K n / C) clients
    for c in range(10):  # a class's samples: all used, in equal shards among its holders
        shards = [np.sum(LABELS[p] == c) for p in parts if c in set(LABELS[p].tolist())]
        assert sum(shards) == np.sum(LABELS == c) and max(shards) - min(shards) <= 1


def test_pathological_determinism_and_random_combinations():
    part = PathologicalPartitioner(2)
    a, b = part(LABELS, 10, seed=0), part(LABELS, 10, seed=0)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    combos = {frozenset(LABELS[p].tolist()) for s in range(5) for p in part(LABELS, 10, seed=s)}
    assert len(combos) > 10  # class pairs vary with the seed, not a fixed pairing


def test_pathological_errors_name_both_values():
    with pytest.raises(ValueError, match="classes_per_client=11 exceeds the number of classes in the labels \\(10\\)"):
        PathologicalPartitioner(11)(LABELS, 5, seed=0)
    with pytest.raises(ValueError, match="classes_per_client must be an integer >= 1, got 0"):
        PathologicalPartitioner(0)
    with pytest.raises(ValueError, match="class 1 has 1 samples, fewer than the 3 clients"):
        PathologicalPartitioner(2)(np.array([0, 0, 0, 1]), 3, seed=0)


# ----------------------------------------------------------------------------- ExDir (PSFL, psfl-notes 16)

MNIST_LABELS = np.repeat(np.arange(10), 6000)  # MNIST-sized: 60,000 labels, 6,000 per class


def _class_counts(parts, labels, num_classes=10):
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])  # [client, class]


def test_exdir_500_clients_mnist_sized():
    # PSFL's setting: N = 500 clients, ExDir(2, 10); [25]'s rule asks every class to have >= 2*500 // 10 // 5 = 20
    # holders. (A partition takes ~5 ms here; no timing is asserted.)
    parts = ExDirPartitioner(classes_per_client=2, alpha=10.0)(MNIST_LABELS, 500, seed=0)
    assert len(parts) == 500
    _assert_disjoint_sorted(parts, len(MNIST_LABELS))
    counts = _class_counts(parts, MNIST_LABELS)
    assert (np.count_nonzero(counts, axis=1) <= 2).all()  # at most C classes per client
    assert counts.sum() == len(MNIST_LABELS)  # every class drawn, every sample assigned once
    assert counts.sum(axis=1).min() >= 10  # the default min_size, [25]'s and PSFL's 10
    assert (np.count_nonzero(counts, axis=0) >= 20).all()
    # the cap (N / K = 120): classes come up in label order, and a client holding >= 120 samples gets no more
    before = np.cumsum(counts, axis=1) - counts
    assert not np.any((before >= 120) & (counts > 0))
    assert (counts.sum(axis=1) < 120 + counts.max(axis=1)).all()  # so it ends at most one class share above


def test_exdir_is_deterministic_per_seed_and_varies_across_seeds():
    part = ExDirPartitioner(classes_per_client=2, alpha=10.0)
    a, b, c = part(MNIST_LABELS, 500, 3), part(MNIST_LABELS, 500, 3), part(MNIST_LABELS, 500, 4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert sum(not np.array_equal(x, y) for x, y in zip(a, c)) > 450
    held_a = [frozenset(MNIST_LABELS[p].tolist()) for p in a]
    held_c = [frozenset(MNIST_LABELS[p].tolist()) for p in c]
    assert held_a != held_c  # the class draw changes too


def _shares_among_holders(alpha, seeds, num_clients=40):
    """Per class and seed, the shares of the class's holders (C = 1: the cap never acts; min_size = 0: no redraw).

    The holders are step 1's draw, replayed from the seed (it is the partition's first use of its generator), so
    a holder whose share rounds to 0 samples still counts.
    """
    labels = np.repeat(np.arange(10), 1000)
    part = ExDirPartitioner(1, alpha, min_size=0)
    out = []
    for seed in seeds:
        holders = part._draw_classes(num_clients, 10, np.random.default_rng(seed))
        counts = _class_counts(part(labels, num_clients, seed), labels)
        for c, clients in enumerate(holders):
            assert counts[:, c].sum() == 1000 and counts[clients, c].sum() == 1000  # only holders get c, all of it
            out.append(counts[clients, c] / 1000)
    return out


def test_exdir_shares_of_a_class_follow_a_dirichlet_across_its_holders():
    # q_c ~ Dir(alpha) over the m holders of c: a holder's share has mean 1/m and variance
    # (1/m)(1 - 1/m) / (m alpha + 1). Pooled (share - 1/m)^2 over that variance: ~1 for every alpha.
    for alpha in (0.5, 10.0):
        ratios = []
        for shares in _shares_among_holders(alpha, range(60)):
            m = len(shares)
            if m > 1:
                ratios.extend((shares - 1 / m) ** 2 / ((1 / m) * (1 - 1 / m) / (m * alpha + 1)))
        assert 0.8 < np.mean(ratios) < 1.2, (alpha, np.mean(ratios))


def test_exdir_alpha_sets_how_evenly_a_class_is_shared():
    # the largest share of a class among its m holders, times m: 1 when even, m when one holder takes it all
    def mean_max_share(alpha):
        return float(np.mean([s.max() * len(s) for s in _shares_among_holders(alpha, range(10))]))

    even, skewed = mean_max_share(1000.0), mean_max_share(0.05)
    assert even < 1.1 and skewed > 2.5, (even, skewed)


def test_exdir_hand_checked_cases():
    # one holder per class (C K = L = 10, an exact cover): every client gets two whole classes
    labels = np.repeat(np.arange(10), 7)
    for seed in range(3):
        counts = _class_counts(ExDirPartitioner(2, 1.0)(labels, 5, seed), labels)
        assert sorted(counts.sum(axis=1).tolist()) == [14] * 5
        assert set(counts.ravel().tolist()) == {0, 7} and (np.count_nonzero(counts, axis=0) == 1).all()
    # C K < L: one client draws 2 of 4 classes; the other two classes stay unassigned
    labels = np.array([0, 1, 2, 3] * 5)
    (part,) = ExDirPartitioner(2, 1.0, min_size=0)(labels, 1, seed=0)
    held = np.unique(labels[part])
    assert len(held) == 2 and np.array_equal(part, np.flatnonzero(np.isin(labels, held)))
    # the cap: both clients hold both classes of 6; alpha -> 0 gives class 0 whole to one client, which then holds
    # N / K = 6 samples, so class 1 goes whole to the other
    labels = np.array([0, 1] * 6)
    for seed in range(10):
        a, b = ExDirPartitioner(2, 1e-6, min_size=0)(labels, 2, seed)
        assert sorted([labels[a].tolist(), labels[b].tolist()]) == [[0] * 6, [1] * 6]


def test_exdir_errors_name_the_values():
    with pytest.raises(ValueError, match=r"classes_per_client=11 exceeds the number of classes in the labels \(10\)"):
        ExDirPartitioner(11, 1.0)(LABELS, 5, seed=0)
    with pytest.raises(ValueError, match="classes_per_client must be an integer >= 1, got 0"):
        ExDirPartitioner(0, 1.0)
    for bad in (0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"alpha must be a finite number > 0, got {bad!r}"):
            ExDirPartitioner(2, bad)
    with pytest.raises(ValueError, match="min_size must be an integer >= 0, got -1"):
        ExDirPartitioner(2, 1.0, min_size=-1)
    with pytest.raises(ValueError, match=r"200 clients min_size=10 samples: only 1450 samples \(need 2000\)"):
        ExDirPartitioner(2, 10.0)(LABELS, 200, seed=0)
    with pytest.raises(ValueError, match=(
        r"^ExDir partition \(classes_per_client=2, alpha=0.001\) found no draw giving every one of 14 clients "
        r"min_size=50 samples in 3 attempts; raise alpha or classes_per_client, or lower min_size or num_clients$"
    )):
        ExDirPartitioner(2, 0.001, min_size=50, max_attempts=3)(LABELS, 14, seed=0)
    with pytest.raises(ValueError, match=(  # 50 clients x 2 classes can cover 100 classes only exactly: unlikely
        r"^ExDir partition: no draw of classes_per_client=2 classes for each of 50 clients gave every one of the "
        r"100 classes at least 1 holder\(s\) in 100 attempts; raise num_clients or classes_per_client$"
    )):
        ExDirPartitioner(2, 10.0, max_attempts=1)(np.repeat(np.arange(100), 20), 50, seed=0)


# ----------------------------------------------------------------------------- registry


def test_registry_builds_by_name_and_rejects_unknown():
    assert {"iid", "dirichlet", "pathological", "exdir"} <= set(PARTITIONERS)
    assert isinstance(build_partitioner("dirichlet", alpha=0.3), DirichletPartitioner)
    assert build_partitioner("pathological", classes_per_client=3).classes_per_client == 3
    assert build_partitioner("exdir", classes_per_client=2, alpha=10.0).min_size == 10
    with pytest.raises(ValueError, match="unknown partition 'zipf'; allowed: .*dirichlet.*exdir.*iid.*pathological"):
        build_partitioner("zipf")
    with pytest.raises(TypeError):
        build_partitioner("iid", alpha=0.3)  # options are the scheme's own


def test_new_scheme_is_one_registered_class():
    @register_partitioner("_test_round_robin")
    class RoundRobin(Partitioner):
        def _partition(self, labels, num_clients, rng):
            return [np.arange(k, len(labels), num_clients) for k in range(num_clients)]

    try:
        parts = build_partitioner("_test_round_robin")(np.zeros(7, dtype=int), 3, seed=0)
        assert [p.tolist() for p in parts] == [[0, 3, 6], [1, 4], [2, 5]]
        with pytest.raises(ValueError, match="already registered"):
            register_partitioner("_test_round_robin")(RoundRobin)
    finally:
        PARTITIONERS.pop("_test_round_robin")


def test_partitioner_argument_checks():
    with pytest.raises(ValueError, match="num_clients must be an integer >= 1, got 0"):
        IIDPartitioner()(LABELS, 0, seed=0)
    with pytest.raises(ValueError, match="1-D integer array"):
        IIDPartitioner()(LABELS.astype(float), 2, seed=0)


# ----------------------------------------------------------------------------- personal test sets


@pytest.mark.parametrize(
    "weights,total,capacity,expected",
    [
        ([1, 1, 1], 100, None, [34, 33, 33]),  # remainders tie: the lowest index first
        ([1, 1, 1], 2, None, [1, 1, 0]),
        ([105, 4, 24, 6], 100, None, [76, 3, 17, 4]),  # quotas 75.54, 2.88, 17.27, 4.32
        ([6, 3, 1], 10, None, [6, 3, 1]),
        ([1, 0, 1], 3, None, [2, 0, 1]),  # a class the client lacks never appears
        ([2, 1], 10, [5, 100], [5, 5]),  # class 0 capped: its shortfall goes to class 1
        ([3, 1, 1], 10, [4, 100, 100], [4, 3, 3]),
        ([1, 1, 0], 10, [2, 3, 50], [2, 3, 0]),  # not enough of the client's classes: all of them
        ([5, 5], 0, None, [0, 0]),
    ],
)
def test_allocate_counts_hand_computed(weights, total, capacity, expected):
    assert allocate_counts(weights, total, capacity).tolist() == expected


def test_personal_test_set_follows_train_proportions_without_replacement():
    test_labels = np.repeat(np.arange(4), 50)
    rng = np.random.default_rng(0)
    idx = personal_test_indices([105, 4, 24, 6], test_labels, 100, rng)
    assert len(idx) == 100 and len(np.unique(idx)) == 100 and np.all(np.diff(idx) > 0)
    # class 0 wants 76 but the test split holds 50: it gives all 50, and the other 26 go 4:24:6 on top
    # of the first pass's 3, 17, 4 (quotas 3.06, 18.35, 4.59 -> 3, 18, 5)
    assert np.bincount(test_labels[idx], minlength=4).tolist() == [50, 6, 35, 9]
    same = personal_test_indices([105, 4, 24, 6], test_labels, 100, np.random.default_rng(0))
    assert np.array_equal(idx, same)
    assert personal_test_indices([0, 0, 0, 0], test_labels, 100, rng).size == 0


def test_equal_dirichlet_gives_equal_sizes_disjoint_and_skewed():
    from lightning_dfl.datamodules import EqualDirichletPartitioner

    labels = np.repeat(np.arange(10), 100)
    parts = EqualDirichletPartitioner(alpha=0.1)(labels, 7, seed=3)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1000
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat) == 1000
    top_share = np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])
    iid_share = np.mean([np.bincount(labels[p], minlength=10).max() / len(p)
                         for p in EqualDirichletPartitioner(alpha=1000.0)(labels, 7, seed=3)])
    assert top_share > iid_share + 0.2
    again = EqualDirichletPartitioner(alpha=0.1)(labels, 7, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    with pytest.raises(ValueError, match="alpha"):
        EqualDirichletPartitioner(alpha=0.0)
