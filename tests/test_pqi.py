"""PQ-index-driven pruning (DA-DPFL Alg. 2 with SAP's PQ index; papers' errata)."""

import math

import pytest
import torch

from lightning_dfl.sparse.pqi import (
    pq_index,
    pqi_keep_bound,
    pqi_prune_count,
    pqi_prune_masks,
    prune_budget,
    smallest_active,
)

# --- PQ index ---------------------------------------------------------------------------------

def test_pq_index_hand_computed_1234():
    # mean sqrt|w| = (1 + sqrt2 + sqrt3 + 2) / 4; squared, over mean|w| = 2.5.
    mean_sqrt = (1 + math.sqrt(2) + math.sqrt(3) + 2) / 4
    expected = 1 - mean_sqrt**2 / 2.5
    assert pq_index(torch.tensor([1.0, 2.0, 3.0, 4.0])) == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(0.0555856, abs=1e-6)


def test_pq_index_hand_computed_1119():
    # p=.5, q=1: mean sqrt = (1+1+1+3)/4 = 1.5 -> 2.25; mean |w| = 3 -> I = 1 - 0.75 = 0.25.
    w = torch.tensor([1.0, -1.0, 1.0, -9.0])
    assert pq_index(w) == pytest.approx(0.25, abs=1e-12)
    # p=1, q=2: mean|w| = 3, rms = sqrt(84/4) = sqrt(21) -> I = 1 - 3/sqrt(21).
    assert pq_index(w, p=1.0, q=2.0) == pytest.approx(1 - 3 / math.sqrt(21), abs=1e-12)


def test_pq_index_range_scale_invariance_and_equal_magnitudes():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        w = torch.randn(257, generator=gen) * 10 ** torch.randint(-4, 4, (1,), generator=gen).item()
        index = pq_index(w)
        assert 0.0 <= index < 1.0
        assert pq_index(w * 1e3) == pytest.approx(index, abs=1e-6)  # float32 rounding of w * 1e3
    assert pq_index(torch.full((10,), -0.3)) == pytest.approx(0.0, abs=1e-12)
    assert pq_index(torch.tensor([[2.0, -2.0], [2.0, 2.0]])) == pytest.approx(0.0, abs=1e-12)
    # Concentrating the mass raises the index toward 1.
    spiky = torch.zeros(1000)
    spiky[0] = 1.0
    assert 0.99 < pq_index(spiky) < 1.0


def test_pq_index_empty_and_zero_input_is_zero():
    assert pq_index(torch.empty(0)) == 0.0
    assert pq_index(torch.zeros(5)) == 0.0


@pytest.mark.parametrize("p,q", [(0.0, 1.0), (1.0, 1.0), (1.5, 1.0), (0.2, 0.5), (-1.0, 2.0)])
def test_pq_index_rejects_bad_p_q(p, q):
    with pytest.raises(ValueError, match="the PQ index needs"):
        pq_index(torch.ones(3), p=p, q=q)


def test_pq_index_rejects_non_finite():
    with pytest.raises(ValueError, match="non-finite"):
        pq_index(torch.tensor([1.0, math.inf]))


# --- keep bound and count ---------------------------------------------------------------------

def test_keep_bound_and_count_hand_computed():
    # w = [1, 1, 1, 9], p=.5, q=1: I = 0.25, r = 4 (1-I)^(0.5/0.5) = 3, c = floor(4 * 0.25) = 1.
    assert pqi_keep_bound(4, 0.25) == pytest.approx(3.0)
    assert pqi_prune_count(4, 0.25) == 1
    # SAP exponent qp/(q-p) = 2 at p=1, q=2 (DA-DPFL's printed p/(q-p) would give 1):
    # I = 1 - 3/sqrt(21), r = 4 (9/21) = 12/7, c = floor(4 (1 - 3/7)) = floor(16/7) = 2.
    index = 1 - 3 / math.sqrt(21)
    assert pqi_keep_bound(4, index, p=1.0, q=2.0) == pytest.approx(12 / 7)
    assert pqi_prune_count(4, index, p=1.0, q=2.0) == 2
    # eta_c: (1 + 1)^(-q/(q-p)) = 1/4 at p=.5, q=1 (the printed eta_c = 1 prunes ~3/4).
    assert pqi_keep_bound(100, 0.2, eta_c=1.0) == pytest.approx(100 * 0.25 * 0.8)
    assert pqi_prune_count(100, 0.2, eta_c=1.0, gamma=0.9, beta=1.0) == math.floor(100 * 0.9 * 0.8)


def test_count_capped_by_beta_and_scaled_by_gamma():
    # I = 0.95 -> r/d = 0.05; gamma (1 - r/d) = 0.95 > beta = 0.9.
    assert pqi_prune_count(1000, 0.95) == 900
    assert pqi_prune_count(1000, 0.95, beta=0.5) == 500
    assert pqi_prune_count(1000, 0.2, gamma=0.5) == 100
    assert pqi_prune_count(1000, 0.0) == 0
    assert pqi_prune_count(0, 0.5) == 0


@pytest.mark.parametrize("kwargs", [{"eta_c": -0.1}, {"gamma": -1.0}, {"beta": 1.5}, {"beta": -0.1}])
def test_count_rejects_bad_hyper_parameters(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        pqi_prune_count(10, 0.2, **kwargs)


def test_keep_bound_rejects_bad_index():
    with pytest.raises(ValueError, match="PQ index"):
        pqi_keep_bound(10, 1.0)


# --- masks ------------------------------------------------------------------------------------

def test_prune_masks_drops_smallest_active_weights_only():
    # Active: [1, 1, 1, 9] (I = 0.25 -> prune 1); the inactive 0.001 must not be counted.
    w = {"a": torch.tensor([[0.001, 1.0], [-1.0, 1.0], [9.0, 5.0]])}
    m = {"a": torch.tensor([[False, True], [True, True], [True, False]])}
    new, counts = pqi_prune_masks(w, m)
    assert counts == {"a": 1}
    # Ties among the three 1s: the first in flat order goes.
    expected = torch.tensor([[False, False], [True, True], [True, False]])
    assert torch.equal(new["a"], expected)
    assert new["a"].dtype == torch.bool
    assert torch.equal(m["a"], torch.tensor([[False, True], [True, True], [True, False]]))  # untouched


def test_prune_masks_deterministic_ties():
    w = {"a": torch.ones(50)}
    w["a"][-1] = 100.0  # make the layer compressible
    m = {"a": torch.ones(50, dtype=torch.bool)}
    new1, counts = pqi_prune_masks(w, m)
    new2, _ = pqi_prune_masks(w, m)
    assert counts["a"] > 0
    assert torch.equal(new1["a"], new2["a"])
    # Equal magnitudes: the earliest flat indices are dropped.
    assert not new1["a"][: counts["a"]].any() and new1["a"][counts["a"]:].all()


def test_smallest_active_ignores_inactive():
    w = torch.tensor([0.0, 5.0, 1.0, 2.0])
    mask = torch.tensor([False, True, True, True])
    assert smallest_active(w, mask, 2).tolist() == [2, 3]
    assert smallest_active(w, mask, 0).numel() == 0


def _layers(seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = {"conv": torch.randn(16, 8, 3, 3, generator=gen) ** 3,
               "fc": torch.randn(10, 64, generator=gen) ** 3}
    masks = {name: torch.rand(w.shape, generator=gen) < 0.5 for name, w in weights.items()}
    return weights, masks


def test_prune_masks_counts_match_per_layer_formula():
    weights, masks = _layers()
    new, counts = pqi_prune_masks(weights, masks)
    for name in weights:
        active = weights[name][masks[name]]
        expected = pqi_prune_count(active.numel(), pq_index(active))
        assert counts[name] == expected > 0
        assert int(masks[name].sum()) - int(new[name].sum()) == expected
        assert not (new[name] & ~masks[name]).any()  # nothing revived


def test_prune_budget():
    masks = {"a": torch.tensor([True] * 6 + [False] * 4), "b": torch.ones(10, dtype=torch.bool)}
    # 20 masked, 4 zeros: s* = 0.8 allows 16 zeros -> 12 more.
    assert prune_budget(masks, 0.8) == 12
    assert prune_budget(masks, 0.1) == 0  # already past
    assert prune_budget({"a": torch.ones(100, dtype=torch.bool)}, 0.7) == 70  # 100 * 0.7 float noise
    with pytest.raises(ValueError, match="target_sparsity"):
        prune_budget(masks, 1.2)


def test_no_overshoot_lands_exactly_on_target():
    weights, masks = _layers(1)
    _, free_counts = pqi_prune_masks(weights, masks)
    total_masked = sum(m.numel() for m in masks.values())
    zeros_before = sum(int((~m).sum()) for m in masks.values())
    # A target that the unconstrained step would pass.
    target = (zeros_before + sum(free_counts.values()) // 2) / total_masked
    budget = prune_budget(masks, target)
    assert 0 < budget < sum(free_counts.values())
    new, counts = pqi_prune_masks(weights, masks, max_prune=budget)
    assert sum(counts.values()) == budget
    zeros_after = sum(int((~m).sum()) for m in new.values())
    assert zeros_after == math.floor(total_masked * target + 1e-6)
    # One common factor: every layer is scaled to within one unit of its proportional share.
    factor = budget / sum(free_counts.values())
    for name in counts:
        assert abs(counts[name] - free_counts[name] * factor) < 1
        assert counts[name] <= free_counts[name]


def test_no_overshoot_largest_remainder_hand_computed():
    # Three equal layers that each want 1, budget 2: shares 2/3 each, floors 0, the remainder
    # goes to the first two layers (ties keep layer order).
    w = torch.tensor([1.0, 1.0, 1.0, 9.0])
    weights = {"x": w, "y": w.clone(), "z": w.clone()}
    masks = {k: torch.ones(4, dtype=torch.bool) for k in weights}
    _, counts = pqi_prune_masks(weights, masks, max_prune=2)
    assert counts == {"x": 1, "y": 1, "z": 0}
    _, counts = pqi_prune_masks(weights, masks, max_prune=0)
    assert counts == {"x": 0, "y": 0, "z": 0}
    _, counts = pqi_prune_masks(weights, masks, max_prune=10)  # budget not binding
    assert counts == {"x": 1, "y": 1, "z": 1}


def test_prune_masks_rejects_bad_input():
    weights, masks = _layers()
    with pytest.raises(ValueError, match="max_prune"):
        pqi_prune_masks(weights, masks, max_prune=-1)
    with pytest.raises(ValueError, match="no weights"):
        pqi_prune_masks({"conv": weights["conv"]}, masks)
    with pytest.raises(ValueError, match="shape"):
        pqi_prune_masks({"conv": weights["conv"], "fc": weights["fc"].T}, masks)
    with pytest.raises(ValueError, match="p < q"):
        pqi_prune_masks(weights, masks, p=1.0, q=1.0)


@pytest.mark.parametrize("kwargs,match", [({"p": 2.0, "q": 1.0}, "p < q"), ({"index": 1.5}, "PQ index"),
                                          ({"d": -1}, "d ")])
def test_count_of_an_empty_layer_still_checks_its_arguments(kwargs, match):
    args = {"d": 0, "index": 0.5, **kwargs}
    with pytest.raises(ValueError, match=match):
        pqi_prune_count(**args)


def test_prune_masks_bfloat16_weights_match_float32():
    weights, masks = _layers(2)
    expected, expected_counts = pqi_prune_masks({n: w.bfloat16().float() for n, w in weights.items()}, masks)
    new, counts = pqi_prune_masks({n: w.bfloat16() for n, w in weights.items()}, masks)
    assert counts == expected_counts and all(c > 0 for c in counts.values())
    assert all(torch.equal(new[n], expected[n]) for n in masks)


def test_smallest_active_with_nan_weights_returns_count_numbers_first():
    w = torch.tensor([3.0, math.nan, 1.0, math.nan, 2.0])
    mask = torch.tensor([True, True, True, True, False])
    assert smallest_active(w, mask, 2).tolist() == [0, 2]
    assert smallest_active(w, mask, 3).tolist() == [0, 1, 2]  # then the first NaN by position
