"""RigL mask search: the pure drop-and-regrow step, the plain-Trainer callback, the federated hook."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import plain_trainer
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dfl.callbacks.rigl import RigL
from lightning_dfl.deferred import device_paths_on_cpu
from lightning_dfl.sparse.erk import initial_masks
from lightning_dfl.sparse.masks import ModelMask, count_active_together
from lightning_dfl.sparse.rigl import (
    cosine_drop_fraction,
    dense_gradients,
    num_dropped,
    num_dropped_together,
    rigl_masks,
)
from lightning_dfl.sparse.select import (
    largest_k,
    largest_k_mask,
    largest_k_mask_among,
    largest_k_masks_together,
    smallest_k,
    smallest_k_mask,
    smallest_k_mask_among,
    smallest_k_masks_together,
)


def _bool(rows):
    return torch.tensor(rows, dtype=torch.bool)


# -- the pure function ---------------------------------------------------------------------
def test_cosine_schedule_values():
    assert cosine_drop_fraction(0.5, 0, 100) == pytest.approx(0.5)
    assert cosine_drop_fraction(0.5, 50, 100) == pytest.approx(0.25)
    assert cosine_drop_fraction(0.3, 25, 100) == pytest.approx(0.15 * (1 + math.sqrt(0.5)))
    assert cosine_drop_fraction(0.5, 100, 100) == pytest.approx(0.0)
    assert cosine_drop_fraction(0.5, 250, 100) == pytest.approx(0.0)  # clamped at T


@pytest.mark.parametrize("args", [(1.5, 0, 10), (-0.1, 0, 10), (0.5, -1, 10), (0.5, 0, 0), (0.5, 0.5, 10)])
def test_cosine_schedule_rejects(args):
    with pytest.raises(ValueError, match=repr(args[0]) if not 0 <= args[0] <= 1 else "step|total"):
        cosine_drop_fraction(*args)


def test_num_dropped_is_ceil_without_float_noise():
    assert num_dropped(0.3, 10) == 3  # 0.3 * 10 = 3.0000000000000004 in floats
    assert num_dropped(0.25, 6) == 2  # ceil(1.5), as the DisPFL authors' fire_mask
    assert num_dropped(0.01, 7) == 1
    assert num_dropped(0.0, 7) == 0
    assert num_dropped(1.0, 7) == 7


def test_drop_counts_computed_on_the_device_equal_the_hosts():
    """On an accelerator the counts stay where the masks are: the same float64 operations give the same integers."""
    counts = [0, 1, 6, 7, 10, 100, 1000, 123_457, 2_359_296, 11_173_962]
    fractions = [0.0, 0.01, 0.05, 0.1, 0.25, 0.3, 0.5, 0.7, 1.0, 1 / 3, 0.5 / 2 * (1 + math.cos(math.pi * 7 / 500))]
    for fraction in fractions:
        expected = [num_dropped(fraction, n) for n in counts]
        assert num_dropped_together(fraction, torch.tensor(counts)).tolist() == expected, fraction
    assert num_dropped_together(0.3, torch.tensor([10])).tolist() == [3]  # not 4 (float noise)


def test_hand_checked_drop_and_regrow():
    w = torch.tensor([[0.5, -0.1, 0.0, 0.9], [0.2, 0.0, -0.3, 0.05]])
    m = _bool([[1, 1, 0, 1], [1, 0, 1, 1]])  # active |w|: 0.5 0.1 0.9 0.2 0.3 0.05
    g = torch.tensor([[9.0, 0.4, -0.7, 9.0], [0.1, 0.6, 9.0, -0.2]])
    # k = ceil(0.5 * 6) = 3: drop flat 7 (0.05), 1 (0.1), 4 (0.2); candidates 1 2 4 5 7 with
    # |g| 0.4 0.7 0.1 0.6 0.2 -> grow 2, 5 and the just-dropped 1.
    new = rigl_masks({"a": w}, {"a": m}, 0.5, scores={"a": g})
    assert torch.equal(new["a"], _bool([[1, 1, 1, 1], [0, 1, 1, 0]]))
    assert new["a"].dtype == torch.bool
    assert torch.equal(m, _bool([[1, 1, 0, 1], [1, 0, 1, 1]]))  # inputs untouched
    assert torch.equal(w, torch.tensor([[0.5, -0.1, 0.0, 0.9], [0.2, 0.0, -0.3, 0.05]]))


def test_ties_break_by_flat_index():
    w = torch.ones(6)
    m = _bool([1, 1, 1, 1, 0, 0])
    # k = 2: equal magnitudes drop indices 0 and 1 first.
    new = rigl_masks({"a": w}, {"a": m}, 0.5, scores={"a": torch.tensor([0.0, 0, 0, 0, 5, 5])})
    assert torch.equal(new["a"], _bool([0, 0, 1, 1, 1, 1]))
    # equal scores grow the lowest candidate indices (0 and 1 again).
    new = rigl_masks({"a": w}, {"a": m}, 0.5, scores={"a": torch.tensor([3.0, 3, 0, 0, 3, 3])})
    assert torch.equal(new["a"], m)


def test_selection_ranks_nan_last_and_always_picks_k():
    nan = math.nan
    v = torch.tensor([1.0, nan, 0.5, nan, 0.5])
    assert smallest_k(v, 2).tolist() == [2, 4]
    assert smallest_k(v, 4).tolist() == [0, 1, 2, 4]  # the numbers, then the first NaN
    assert largest_k(v, 2).tolist() == [0, 2]  # 1.0, then the first of the tied 0.5s
    assert largest_k(v, 4).tolist() == [0, 1, 2, 4]
    for k in range(6):
        assert int(smallest_k_mask(v, k).sum()) == k
        assert int(smallest_k_mask(torch.full((3,), nan), k).sum()) == min(k, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_selection_on_the_host_equals_a_stable_sort(dtype):
    """The CPU's selection (NumPy's introselect, then ties by position) picks what the accelerators' stable
    sort picks: ties, NaN, infinities and -0.0 included, every k."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        values = torch.randint(-2, 3, (n,), generator=gen).to(dtype)  # many ties
        if dtype.is_floating_point:
            values[torch.rand(n, generator=gen) < 0.1] = math.nan
            values[torch.rand(n, generator=gen) < 0.1] = math.inf
            values[torch.rand(n, generator=gen) < 0.1] = -0.0
        for k in range(-1, n + 2):
            host = smallest_k_mask(values, k)
            with device_paths_on_cpu():
                sorted_ = smallest_k_mask(values, k)
            assert torch.equal(host, sorted_), (values, k)


@pytest.mark.parametrize("radix_min_size", [1, None])
def test_the_counting_pass_finds_the_same_kth_value(monkeypatch, radix_min_size):
    """float32 selection by the top 16 bits of order-preserving keys (every array when the size floor is 1; a
    large one at the shipped floor) picks what the stable sort picks: negatives, -0.0 beside +0.0, infinities,
    many ties in one bucket, NaN."""
    import lightning_dfl.sparse.select as select

    if radix_min_size is not None:
        monkeypatch.setattr(select, "RADIX_MIN_SIZE", radix_min_size)
    gen = torch.Generator().manual_seed(4)
    sizes = [1, 2, 5, 17, 40] * 8 if radix_min_size else [select.RADIX_MIN_SIZE, 3 * select.RADIX_MIN_SIZE + 5]
    for i, n in enumerate(sizes):
        values = torch.randn(n, generator=gen) * 10.0 ** (i % 3 - 1)
        values[torch.rand(n, generator=gen) < 0.3] = 1.5  # one bucket holds many ties
        values[torch.rand(n, generator=gen) < 0.1] = -0.0
        values[torch.rand(n, generator=gen) < 0.1] = 0.0
        values[torch.rand(n, generator=gen) < 0.05] = -math.inf
        values[torch.rand(n, generator=gen) < 0.05] = math.inf
        if i % 2:
            values[torch.rand(n, generator=gen) < 0.05] = math.nan
        ks = range(n + 1) if n < 50 else [1, n // 7, n // 2, n - 3, n]
        for k in ks:
            with device_paths_on_cpu():
                sorted_ = smallest_k_mask(values, k)
            assert torch.equal(smallest_k_mask(values, k), sorted_), (n, k)


def test_selection_among_candidates():
    """RigL's drop (among the active weights) and regrowth (among the rest): only candidates are chosen, the
    smallest (largest) first, ties by position; for finite values the same as filling the others with inf."""
    values = torch.tensor([0.0, 3.0, 1.0, 1.0, 2.0, 0.5])
    among = _bool([False, True, True, True, True, False])
    assert smallest_k_mask_among(values, among, 2).tolist() == [False, False, True, True, False, False]
    assert largest_k_mask_among(values, among, 2).tolist() == [False, True, False, False, True, False]
    assert largest_k_mask_among(values, among, 3).tolist() == [False, True, True, False, True, False]  # tie: 2 first
    assert not smallest_k_mask_among(values, among, 0).any()
    assert smallest_k_mask_among(values, among, 4).tolist() == among.tolist()
    with pytest.raises(ValueError, match="k=5 exceeds the 4 candidate"):
        smallest_k_mask_among(values, among, 5)
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        values = torch.randint(-3, 3, (n,), generator=gen).float()
        among = torch.rand(n, generator=gen) < 0.6
        for k in range(int(among.sum()) + 1):
            filled = smallest_k_mask(values.masked_fill(~among, math.inf), k)
            assert torch.equal(smallest_k_mask_among(values, among, k), filled)
            with device_paths_on_cpu():
                assert torch.equal(smallest_k_mask_among(values, among, k), filled)
            assert torch.equal(largest_k_mask_among(values, among, k),
                               largest_k_mask(values.masked_fill(~among, -math.inf), k))


def test_selection_of_every_part_at_once_equals_each_parts_own():
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        sizes = torch.randint(1, 30, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        ks = [int(torch.randint(-1, size + 2, (1,), generator=gen)) for size in sizes]  # also k < 0 and k > size
        values = torch.randint(0, 4, (sum(sizes),), generator=gen).float()  # many ties
        values[torch.rand(values.shape, generator=gen) < 0.1] = math.inf
        values[torch.rand(values.shape, generator=gen) < 0.05] = math.nan
        parts = values.split(sizes)
        assert torch.equal(smallest_k_masks_together(values, sizes, ks),
                           torch.cat([smallest_k_mask(p, k) for p, k in zip(parts, ks)]))
        assert torch.equal(largest_k_masks_together(values, sizes, ks),
                           torch.cat([largest_k_mask(p, k) for p, k in zip(parts, ks)]))
        # the counts as a tensor where the values are (never read): the same choice
        assert torch.equal(smallest_k_masks_together(values, sizes, torch.tensor(ks)),
                           smallest_k_masks_together(values, sizes, ks))
    # by hand: [2, 1, 1 | 0, 5]: the smallest 2 of the first part (a tie: the lower position), 1 of the second
    chosen = smallest_k_masks_together(torch.tensor([2.0, 1, 1, 0, 5]), [3, 2], [2, 1])
    assert chosen.tolist() == [False, True, True, True, False]
    with pytest.raises(ValueError, match="sizes"):
        smallest_k_masks_together(torch.zeros(4), [2, 1], [1, 1])


def test_active_counts_together_equal_each_masks_count():
    gen = torch.Generator().manual_seed(2)
    masks = {f"l{i}": torch.rand(3 + i, 5, generator=gen) < 0.4 for i in range(8)}
    masks["l3"] = masks["l3"].float()  # 0/1 of another dtype
    expected = [int(m.count_nonzero()) for m in masks.values()]
    assert count_active_together(masks).tolist() == expected
    with device_paths_on_cpu():  # the running sum over all masks, as on an accelerator
        assert count_active_together(masks).tolist() == expected
        assert count_active_together(dict(list(masks.items())[:3])).tolist() == expected[:3]


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.3, 1.0])
def test_gradient_regrowth_of_all_layers_at_once_equals_layer_by_layer(fraction):
    """On an accelerator every layer is selected together, its drop count computed on the device; the masks are the
    CPU's, ties included, also for a dense layer, an empty one and a layer that drops nothing."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(16, 3, 3, 3), (32, 16, 3, 3), (10, 32), (7,), (64, 32, 1, 1)]
    weights = {f"w{i}": torch.randint(-3, 4, s, generator=gen).float() for i, s in enumerate(shapes)}  # ties
    scores = {n: torch.randint(0, 3, w.shape, generator=gen).float() for n, w in weights.items()}
    scores["w1"][0, 0, 0, 0] = math.nan
    masks = {n: torch.rand(w.shape, generator=gen) < 0.5 for n, w in weights.items()}
    masks["w3"] = torch.ones(7, dtype=torch.bool)  # a dense layer regrows what it drops
    masks["w5"] = torch.zeros(4, 4, dtype=torch.bool)  # nothing to drop
    weights["w5"], scores["w5"] = torch.ones(4, 4), torch.ones(4, 4)
    masks["w6"] = torch.zeros(9, dtype=torch.bool)
    masks["w6"][4] = True  # one active weight: ceil(fraction) = 1 dropped unless the fraction is 0
    weights["w6"], scores["w6"] = torch.arange(9.0), torch.arange(9.0)
    host = rigl_masks(weights, masks, fraction, scores=scores)
    with device_paths_on_cpu():
        device = rigl_masks(weights, masks, fraction, scores=scores)
    assert list(device) == list(masks)
    for name, mask in masks.items():
        assert torch.equal(device[name], host[name]), name
        assert device[name].shape == mask.shape and int(device[name].sum()) == int(mask.sum())


def test_selection_and_rigl_on_bfloat16():
    v = torch.tensor([3.0, 1.0, 2.0, 1.0, 5.0])
    assert smallest_k(v.bfloat16(), 3).tolist() == smallest_k(v, 3).tolist() == [1, 2, 3]
    assert largest_k(v.bfloat16(), 2).tolist() == [0, 4]
    gen = torch.Generator().manual_seed(1)
    w, g = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    m = torch.rand(8, 8, generator=gen) < 0.5
    expected = rigl_masks({"a": w.bfloat16().float()}, {"a": m}, 0.3, scores={"a": g.bfloat16().float()})
    new = rigl_masks({"a": w.bfloat16()}, {"a": m}, 0.3, scores={"a": g.bfloat16()})
    assert torch.equal(new["a"], expected["a"]) and int(new["a"].sum()) == int(m.sum())


def test_density_exact_and_dense_layer_unchanged_both_modes():
    gen = torch.Generator().manual_seed(0)
    weights = {"conv": torch.randn(8, 4, 3, 3, generator=gen), "fc": torch.randn(10, 32, generator=gen),
               "dense": torch.randn(5, 7, generator=gen)}
    masks = {"conv": torch.rand(8, 4, 3, 3, generator=gen) < 0.3, "fc": torch.rand(10, 32, generator=gen) < 0.6,
             "dense": torch.ones(5, 7, dtype=torch.bool)}
    scores = {name: torch.randn(w.shape, generator=gen) for name, w in weights.items()}
    for mode in ("gradient", "random"):
        for fraction in (0.05, 0.3, 0.5, 1.0):
            new = rigl_masks(weights, masks, fraction, scores=scores, mode=mode,
                             generator=torch.Generator().manual_seed(1))
            for name in masks:
                assert int(new[name].sum()) == int(masks[name].sum()), (mode, fraction, name)
            assert new["dense"].all()
            assert not torch.equal(new["conv"], masks["conv"])
    # drop fraction 0 changes nothing
    new = rigl_masks(weights, masks, 0.0, scores=scores)
    assert all(torch.equal(new[n], masks[n]) for n in masks)


def test_random_mode_keeps_the_largest_and_is_deterministic():
    gen = torch.Generator().manual_seed(3)
    w = {"a": torch.randn(40, 50, generator=gen)}
    m = {"a": torch.rand(40, 50, generator=gen) < 0.4}
    n = int(m["a"].sum())
    k = num_dropped(0.3, n)

    def run(seed):
        return rigl_masks(w, m, 0.3, mode="random", generator=torch.Generator().manual_seed(seed))["a"]

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))
    with device_paths_on_cpu():  # the accelerators' candidates (nonzero_static): the same draw, the same mask
        on_device = run(5)
    assert torch.equal(on_device, run(5))
    magnitudes = w["a"].abs()[m["a"]]
    threshold = magnitudes.sort().values[k]  # the n - k largest survive the drop
    survivors = m["a"] & (w["a"].abs() >= threshold)
    assert int(survivors.sum()) == n - k
    assert bool(run(5)[survivors].all())


def test_rigl_masks_validation():
    w, m, s = {"a": torch.ones(3)}, {"a": _bool([1, 0, 1])}, {"a": torch.ones(3)}
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="drop_fraction"):
            rigl_masks(w, m, bad, scores=s)
    with pytest.raises(ValueError, match="'magnitude'"):
        rigl_masks(w, m, 0.5, scores=s, mode="magnitude")
    with pytest.raises(ValueError, match="needs scores"):
        rigl_masks(w, m, 0.5)
    with pytest.raises(ValueError, match=r"scores are missing.*'a'"):
        rigl_masks(w, m, 0.5, scores={"b": torch.ones(3)})
    with pytest.raises(ValueError, match=r"weights are missing.*'a'"):
        rigl_masks({}, m, 0.5, scores=s)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        rigl_masks({"a": torch.ones(4)}, m, 0.5, scores=s)


def test_dense_gradients_bypass_mask_and_restore_state():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Dropout(0.5), nn.Linear(5, 3))
    mask = ModelMask(net, {"0.weight": torch.rand(5, 6) < 0.5, "2.weight": torch.rand(3, 5) < 0.5}).attach()
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    net.train()
    net[1].eval()  # a mixed mode must come back as it was
    sentinel = torch.full_like(net[0].weight, 7.0)
    net[0].weight.grad = sentinel

    def loss_fn(batch):
        return nn.functional.cross_entropy(net(batch[0]), batch[1])

    scores = dense_gradients(net, mask, loss_fn, batches)

    assert net[0].weight.grad is sentinel and net[2].weight.grad is None and net[0].bias.grad is None
    assert net.training and net[0].training and not net[1].training
    # reference: the unmasked gradient, averaged over the two batches, in eval mode
    ref = nn.Sequential(nn.Linear(6, 5), nn.Dropout(0.5), nn.Linear(5, 3))
    ref.load_state_dict(net.state_dict())
    ref.eval()
    loss = sum(nn.functional.cross_entropy(ref(bx), by) for bx, by in batches) / 2
    loss.backward()
    assert set(scores) == {"0.weight", "2.weight"}
    torch.testing.assert_close(scores["0.weight"], ref[0].weight.grad.abs())
    torch.testing.assert_close(scores["2.weight"], ref[2].weight.grad.abs())
    assert bool((scores["0.weight"][~mask.masks["0.weight"]] > 0).any())  # inactive weights scored
    with pytest.raises(ValueError, match="at least one batch"):
        dense_gradients(net, mask, loss_fn, [])


# -- the callback in a plain Trainer -------------------------------------------------------
class DigitsMLP(LightningModule):
    """A LightningModule that knows nothing of lightning-dfl."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.steps_called = 0
        self.logged = 0

    def forward(self, x):
        return self.net(x)

    def log(self, *args, **kwargs):
        self.logged += 1
        super().log(*args, **kwargs)

    def training_step(self, batch, batch_idx):
        self.steps_called += 1
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)






def test_plain_trainer_keeps_density_and_zeros(digits_loader):
    torch.manual_seed(0)
    model = DigitsMLP()
    start = initial_masks(model, 0.3, "erk", generator=torch.Generator().manual_seed(0))
    rigl = RigL(density=0.3, update_every=5)
    trainer = plain_trainer([rigl], max_epochs=3)
    trainer.fit(model, digits_loader)

    steps = trainer.global_step
    assert steps == 3 * len(digits_loader)
    assert rigl.owns_mask and rigl.state_dict()["num_updates"] == len(range(5, steps, 5))
    masks = rigl.state_dict()["masks"]
    assert set(masks) == {"net.0.weight", "net.2.weight"}
    for name, mask in masks.items():
        assert int(mask.sum()) == int(start[name].sum())  # per-layer counts exactly preserved
    total = sum(m.numel() for m in masks.values())
    assert abs(sum(int(m.sum()) for m in masks.values()) / total - 0.3) <= len(masks) / total
    assert sum(int((masks[n] & ~start[n]).sum()) for n in masks) > 0  # the mask moved
    params = dict(model.named_parameters())
    for name, mask in masks.items():  # momentum 0.9 + weight decay revive nothing
        assert torch.count_nonzero(params[name].detach()[~mask]) == 0
    # the scoring passes called training_step but logged nothing
    assert model.steps_called == steps + rigl.state_dict()["num_updates"]
    assert model.logged == steps
    # it learned something
    x, y = digits_loader.dataset.tensors
    assert (model(x).argmax(1) == y).float().mean() > 0.6
    # hooks are removed once fit ends
    nn.functional.cross_entropy(model(x), y).backward()
    assert torch.count_nonzero(params["net.0.weight"].grad[~masks["net.0.weight"]]) > 0


def test_epoch_interval_checkpoint_and_random_regrowth(digits_loader):
    torch.manual_seed(1)
    model = DigitsMLP()
    rigl = RigL(density=0.5, distribution="uniform", regrowth="random", update_interval="epoch",
                update_every=1, seed=4)
    plain_trainer([rigl], max_epochs=3, limit_train_batches=4).fit(model, digits_loader)
    state = rigl.state_dict()
    assert state["num_updates"] == 2  # after epochs 1 and 2; epoch 3 is T, where alpha_T = 0
    assert model.steps_called == 12  # random regrowth needs no gradient pass
    assert all(m.device.type == "cpu" and m.dtype == torch.bool for m in state["masks"].values())
    assert all(int(m.sum()) == m.numel() // 2 for m in state["masks"].values())

    # restoring the state into a fresh callback gives the saved mask, not a new random one
    other = DigitsMLP()
    restored = RigL(density=0.5, distribution="uniform", seed=99)
    restored.load_state_dict(state)
    restored.setup(SimpleNamespace(), other, "fit")
    restored.on_fit_start(SimpleNamespace(), other)  # the mask is set up once the module is built
    assert restored.state_dict()["num_updates"] == 2
    for name, param in other.named_parameters():
        if name in state["masks"]:
            assert torch.equal(restored.state_dict()["masks"][name], state["masks"][name])
            assert torch.count_nonzero(param.detach()[~state["masks"][name]]) == 0


def test_infinite_training_is_refused(digits_loader):
    with pytest.raises(MisconfigurationException, match="finite training length"):
        plain_trainer([RigL()], max_epochs=-1, max_steps=-1).fit(DigitsMLP(), digits_loader)


# -- the federated hook ----------------------------------------------------------------------
class MaskedNet(nn.Module):
    """A module that carries its own ModelMask and a ``loss(batch)``, as lightning-dfl's models."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(10, 16), nn.Linear(16, 4)
        masks = initial_masks(self, 0.4, "uniform", generator=torch.Generator().manual_seed(seed))
        self.mask = ModelMask(self, masks).attach()

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)


def _fed_trainer(current_round, max_rounds=10):
    gen = torch.Generator().manual_seed(11)
    data = TensorDataset(torch.randn(24, 10, generator=gen), torch.randint(0, 4, (24,), generator=gen))
    return SimpleNamespace(is_federated=True, current_round=current_round, max_rounds=max_rounds,
                           train_dataloader=DataLoader(data, batch_size=8))


def test_federated_gradient_update_matches_the_pure_function():
    net = MaskedNet()
    trainer = _fed_trainer(current_round=3)
    before = net.mask.state()
    weights = {n: p.detach().clone() for n, p in net.mask.params.items()}
    batches = list(trainer.train_dataloader)[:2]
    ref = MaskedNet()
    ref.load_state_dict(net.state_dict())
    with ref.mask.dense_gradients():  # the unmasked gradient, averaged over two batches
        (sum(ref.loss(b) for b in batches) / 2).backward()
    scores = {name: p.grad.abs() for name, p in ref.named_parameters() if name in before}
    expected = rigl_masks(weights, before, cosine_drop_fraction(0.5, 3, 10), scores=scores)

    RigL(gradient_batches=2).on_client_end(trainer, net, client_id=7)

    for name in before:
        assert torch.equal(net.mask.masks[name], expected[name])
        assert int(net.mask.masks[name].sum()) == int(before[name].sum())
        dropped = before[name] & ~expected[name]
        assert dropped.any() and torch.count_nonzero(net.mask.params[name].detach()[dropped]) == 0


def test_federated_random_regrowth_is_order_independent():
    def run(order):
        out = {}
        for client in order:
            net = MaskedNet(seed=0)
            RigL(regrowth="random", seed=5).on_client_end(_fed_trainer(2), net, client_id=client)
            out[client] = net.mask.state()
        return out

    a, b = run([1, 2]), run([2, 1])
    for client in (1, 2):
        assert all(torch.equal(a[client][n], b[client][n]) for n in a[client])
    assert not all(torch.equal(a[1][n], a[2][n]) for n in a[1])  # client id enters the seed


def test_federated_skips_step_updates_and_stops_late():
    net = MaskedNet()
    before = net.mask.state()
    rigl = RigL(update_every=1, stop_fraction=0.5)
    rigl.on_train_batch_end(_fed_trainer(1), net, None, None, 0)  # federation: no step update
    rigl.on_client_end(_fed_trainer(5), net, client_id=0)  # t = 5 >= 0.5 * 10: stopped
    assert all(torch.equal(net.mask.masks[n], before[n]) for n in before)
    rigl.on_client_end(_fed_trainer(4), net, client_id=0)
    assert not all(torch.equal(net.mask.masks[n], before[n]) for n in before)
    with pytest.raises(RuntimeError, match="needs the module's own ModelMask"):
        rigl.on_client_end(_fed_trainer(1), nn.Linear(2, 2), client_id=0)


# -- constructor ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, shown", [
    ({"drop_fraction": 1.5}, "1.5"), ({"drop_fraction": "cosine"}, "'cosine'"),
    ({"regrowth": "momentum"}, "'momentum'"), ({"gradient_batches": 0}, "0"),
    ({"update_every": 2.5}, "2.5"), ({"update_interval": "batch"}, "'batch'"),
    ({"stop_fraction": 0.0}, "0.0"), ({"density": 1.2}, "1.2"), ({"density": 0}, "0"),
    ({"distribution": "erdos"}, "'erdos'"), ({"seed": "x"}, "'x'"), ({"verbose": 3}, "3"),
])
def test_constructor_errors_name_the_value(kwargs, shown):
    (key,) = kwargs
    with pytest.raises(MisconfigurationException, match=rf"`{key}`.*{shown}"):
        RigL(**kwargs)


def test_callable_drop_fraction_is_used_and_checked():
    net = MaskedNet()
    before = net.mask.state()
    RigL(drop_fraction=lambda t, total: 0.0).on_client_end(_fed_trainer(0), net, client_id=0)
    assert all(torch.equal(net.mask.masks[n], before[n]) for n in before)
    with pytest.raises(ValueError, match=r"returned 2\.0 at t=0, T=10"):
        RigL(drop_fraction=lambda t, total: 2.0).on_client_end(_fed_trainer(0), net, client_id=0)


def test_verbose_logs_one_line_per_update_and_per_layer(caplog):
    net = MaskedNet()
    with caplog.at_level(logging.INFO):
        RigL(verbose=2).on_client_end(_fed_trainer(0), net, client_id=3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RigL")]
    assert len(lines) == 1 + len(net.mask)
    assert lines[0].startswith("RigL round 0 client 3: density 0.40")
    assert "fc1.weight" in lines[1] and "fc2.weight" in lines[2]


def test_a_density_other_than_the_models_is_refused_in_a_federation():
    """In a federation the clients' masks are drawn at the model's density: RigL(density=...) must not differ."""
    net = MaskedNet()  # uniform masks at 0.4
    with pytest.raises(MisconfigurationException, match=r"^RigL\(density=0.3\) in a federation: the clients' masks "
                                                          r"are drawn at the model's density 0\.40\d*; leave RigL's"):
        RigL(density=0.3).setup(_fed_trainer(current_round=0), net, "fit")
    RigL(density=0.4).setup(_fed_trainer(current_round=0), net, "fit")
    RigL().setup(_fed_trainer(current_round=0), net, "fit")
