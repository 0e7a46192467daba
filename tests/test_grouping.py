"""Similar-device discovery: compaction, clustering, its fallbacks and its determinism (PRISAM Alg. 2)."""

import numpy as np
import pytest

from lightning_dfl.grouping import compact, group_masks, nearest_labels


def test_compaction_drops_exactly_the_dimensions_all_masks_agree_on():
    masks = np.array([[1, 0, 1, 1, 0],
                      [1, 0, 0, 1, 1],
                      [1, 0, 1, 1, 1]], dtype=bool)
    dims, kept = compact(masks)
    assert kept.tolist() == [2, 4]
    assert dims.tolist() == [[True, False], [False, True], [True, True]]


def _two_clusters(rng, per_group=6, bits=40, flips=2):
    centres = np.zeros((2, bits), dtype=bool)
    centres[0, :20] = True
    centres[1, 20:] = True
    rows, truth = [], []
    for g in range(2):
        for _ in range(per_group):
            row = centres[g].copy()
            row[rng.choice(bits, size=flips, replace=False)] ^= True
            rows.append(row)
            truth.append(g)
    return np.array(rows), np.array(truth)


@pytest.mark.parametrize("method", ["kmeans", "dbscan"])
def test_clear_clusters_are_found_and_labels_are_numbered_by_first_appearance(method):
    masks, truth = _two_clusters(np.random.default_rng(0))
    order = np.random.default_rng(1).permutation(len(truth))
    grouping = group_masks(masks[order], num_groups=2, method=method, seed=0, eps=0.3, min_samples=2)
    assert grouping.num_groups == 2
    assert grouping.labels[0] == 0  # the first device's group is group 0
    same = truth[order][:, None] == truth[order][None, :]
    assert np.array_equal(grouping.labels[:, None] == grouping.labels[None, :], same)
    assert not grouping.fallback


def test_kmeans_is_deterministic_for_a_seed():
    masks = np.random.default_rng(3).random((20, 30)) < 0.5
    first = group_masks(masks, 4, seed=7)
    assert np.array_equal(first.labels, group_masks(masks, 4, seed=7).labels)


def test_fewer_distinct_masks_than_groups_gives_each_distinct_mask_its_own_group():
    masks = np.array([[1, 0, 1], [0, 1, 1], [1, 0, 1], [0, 1, 1]], dtype=bool)
    grouping = group_masks(masks, num_groups=5)
    assert grouping.fallback and grouping.labels.tolist() == [0, 1, 0, 1]
    assert grouping.differing_dims == 2 and grouping.distinct_masks == 2
    identical = group_masks(np.ones((3, 4), dtype=bool), num_groups=2)
    assert identical.fallback and identical.labels.tolist() == [0, 0, 0] and identical.differing_dims == 0


def test_exactly_k_distinct_masks_run_kmeans_without_a_fallback():
    """Notes 4: the fallback is for *fewer* distinct masks than k; with exactly k KMeans finds them
    (each its own group) and ``prisam/grouping_fallback`` must stay 0 (``<=`` logged 1 every round)."""
    masks = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=bool)
    grouping = group_masks(masks, num_groups=3, seed=0)
    assert not grouping.fallback
    assert grouping.labels.tolist() == [0, 1, 2, 0, 1, 2] and grouping.distinct_masks == 3


def test_auto_eps_is_the_largest_distance_to_a_devices_nearest_other_device():
    """The k-distance rule (min_samples 2): every device reaches one other within eps, so none is
    noise; the two planted clusters stay apart. Placed halfway to the next possible distance. On two
    clean clusters the default rule (the widest gap of the density tree) finds the same eps."""
    from lightning_dfl.grouping import auto_eps

    masks, truth = _two_clusters(np.random.default_rng(0))
    dims, _ = compact(masks)
    differ = (dims[:, None, :] != dims[None, :, :]).sum(axis=2).astype(float)
    np.fill_diagonal(differ, np.inf)
    assert auto_eps(dims, 2, rule="kdist") == pytest.approx((differ.min(axis=1).max() + 0.5) / dims.shape[1])
    assert auto_eps(dims, 2) == auto_eps(dims, 2, rule="kdist")
    grouping = group_masks(masks, num_groups=2, method="dbscan", eps="auto", min_samples=2)
    assert grouping.eps == auto_eps(dims, 2) and grouping.num_groups == 2
    assert np.array_equal(grouping.labels[:, None] == grouping.labels[None, :], truth[:, None] == truth[None, :])
    assert auto_eps(dims[:1], 2) == 1.0  # fewer devices than min_samples: nothing to reach


def test_dbscan_noise_points_are_singleton_groups():
    masks, _ = _two_clusters(np.random.default_rng(0), per_group=4)
    outlier = np.zeros((1, masks.shape[1]), dtype=bool)
    outlier[0, ::2] = True
    grouping = group_masks(np.vstack([masks, outlier]), num_groups=2, method="dbscan", eps=0.2, min_samples=3)
    assert grouping.num_groups == 3
    assert (grouping.labels == grouping.labels[-1]).sum() == 1  # the outlier is alone


def test_nearest_labels_assigns_a_newcomer_to_the_closest_known_mask():
    known = np.array([[1, 1, 0, 0], [0, 0, 1, 1]], dtype=bool)
    queries = np.array([[1, 0, 0, 0], [0, 1, 1, 1]], dtype=bool)
    assert nearest_labels(known, np.array([4, 9]), queries).tolist() == [4, 9]


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "spectral"}, "unknown grouping method 'spectral'; allowed: kmeans, dbscan"),
    ({"num_groups": 0}, "num_groups"),
    ({"eps": 0.0}, "eps must be in \\(0, 1\\]"),
    ({"eps": "knee"}, "eps must be in \\(0, 1\\] \\(a Hamming distance\\), 'auto' or 'kdist', got 'knee'"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_masks(np.ones((2, 3), dtype=bool), **{"num_groups": 2, **kwargs})


# -- churn: devices that join, leave and return (issue 36, part 3) ---------------------------------
def _consensus_groups_and_a_returning_outlier():
    """Three planted groups whose members aggregated (identical masks, notes 2: A and B 20 bits apart,
    C far), four members each, and a device of A returning with a mask 24 bits from A's."""
    bits = 60
    a = np.zeros(bits, dtype=bool)
    a[0:30] = True
    b = a.copy()
    b[20:30], b[30:40] = False, True
    c = np.zeros(bits, dtype=bool)
    c[30:60] = True
    outlier = a.copy()
    outlier[0:12], outlier[40:52] = False, True
    view = np.array([a] * 4 + [b] * 4 + [c] * 4 + [outlier])
    return view, np.array([0] * 4 + [1] * 4 + [2] * 4 + [0])


def test_a_returning_outlier_does_not_merge_two_planted_groups():
    """The round's participants are one member of A, one of B, two of C and the returning device. On
    these five masks alone KMeans (k = 3) must spend a group on the outlier and merges A with B, for
    good (their joint aggregation makes their masks identical, notes 2). Clustered with the masks the
    absent members last published (Alg. 2 over all devices, line 7: the sum runs over k = 1..N), A and
    B stay apart and the outlier joins A."""
    view, truth = _consensus_groups_and_a_returning_outlier()
    present = [0, 4, 8, 9, 12]
    alone = group_masks(view[present], num_groups=3, seed=0)
    assert alone.labels[0] == alone.labels[1]  # the defect: A and B merged
    grouping = group_masks(view, num_groups=3, seed=0).restrict(present)
    assert np.array_equal(grouping.labels[:, None] == grouping.labels[None, :],
                          truth[present][:, None] == truth[present][None, :])
    assert grouping.labels.tolist() == [0, 1, 2, 2, 0]  # renumbered by first appearance among the present


def _three_noisy_groups_and_an_outlier():
    rng = np.random.default_rng(0)
    bits = 60
    centres = np.zeros((3, bits), dtype=bool)
    centres[0, 0:30], centres[1, 10:40], centres[2, 20:50] = True, True, True  # A-B, B-C 20 bits apart
    rows = []
    for g in range(3):
        for _ in range(4):
            row = centres[g].copy()
            row[rng.choice(bits, size=2, replace=False)] ^= True
            rows.append(row)
    outlier = centres[0] | centres[1]  # a device between A and B, 13 bits from its nearest
    outlier[rng.choice(bits, size=3, replace=False)] ^= True
    return np.array(rows + [outlier]), np.repeat(np.arange(3), 4)


def test_dbscan_auto_eps_with_one_outlier_keeps_the_groups():
    """The k-distance rule takes the largest distance to a device's nearest other device, so the one
    outlier sets eps for all (0.29 here) and links A and B. The default rule cuts the merge heights of
    DBSCAN's density tree at their widest gap: the outlier is noise (a group of its own, notes 4) and
    the three groups stay apart."""
    from lightning_dfl.grouping import auto_eps

    masks, truth = _three_noisy_groups_and_an_outlier()
    dims, _ = compact(masks)
    old = group_masks(masks, num_groups=3, method="dbscan", eps="kdist")
    assert old.labels[0] == old.labels[4]  # the defect: A and B in one group
    grouping = group_masks(masks, num_groups=3, method="dbscan", eps="auto")
    assert grouping.eps == auto_eps(dims, 2) < auto_eps(dims, 2, rule="kdist")
    assert np.array_equal(grouping.labels[:-1, None] == grouping.labels[None, :-1], truth[:, None] == truth[None, :])
    assert (grouping.labels == grouping.labels[-1]).sum() == 1  # the outlier alone


def test_auto_eps_leaves_identical_group_masks_apart():
    """Without churn every group's members share one mask after their first aggregation (notes 2): no
    device needs a neighbour farther than 0, and eps stays below one bit, as the k-distance rule had it."""
    from lightning_dfl.grouping import auto_eps

    masks = np.repeat(np.array([[1, 1, 0, 0, 1, 0], [0, 1, 1, 0, 0, 1], [1, 0, 0, 1, 1, 1]], dtype=bool), 3, axis=0)
    dims, _ = compact(masks)
    assert auto_eps(dims, 2) == auto_eps(dims, 2, rule="kdist") == 0.5 / dims.shape[1]


def _three_groups_with_one_close_pair():
    """Three planted groups of three devices: each device sets 4 private bits (8 bits between two members
    of a group), group B also sets bits 0-3 and C bits 4-7 (12 bits between groups); devices 0 and 1
    share 3 of their private bits (2 bits apart)."""
    rows = np.zeros((9, 8 + 4 * 9), dtype=bool)
    for i in range(9):
        group = i // 3
        rows[i, 4 * group - 4:4 * group] = group > 0
        rows[i, 8 + 4 * i:12 + 4 * i] = True
    rows[1, 12:16] = False
    rows[1, [8, 9, 10, 12]] = True
    return rows, np.repeat(np.arange(3), 3)


def test_auto_eps_cuts_only_where_half_the_devices_are_core_points():
    """Few devices give few merge heights (2, 8 and 12 bits here): the widest gap (2 to 8) lies above the
    one close pair, and a cut there leaves 7 of the 9 devices noise, each alone (seen under churn on the
    digits config: rounds with most devices alone; docs/prisam.md item 22). Only cuts at which at least
    half of the devices are core points are candidates: eps in the gap 8 to 12 finds the three groups."""
    from lightning_dfl.grouping import auto_eps, merge_heights

    masks, truth = _three_groups_with_one_close_pair()
    dims, _ = compact(masks)
    core, heights = merge_heights(dims, 2)
    assert sorted(set(heights.tolist())) == [2.0, 8.0, 12.0] and sorted(core.tolist()) == [2, 2] + [8] * 7
    assert auto_eps(dims, 2) == 8.5 / dims.shape[1] == auto_eps(dims, 2, rule="kdist")
    grouping = group_masks(masks, num_groups=3, method="dbscan", eps="auto")
    assert grouping.labels.tolist() == truth.tolist()
