"""Gradient moments of PSFL's warm-up (Eq. 24): exact per-sample gradients, and the mini-batch departure."""

import pytest
import torch
from torch import nn

from lightning_dfl.gradient_noise import batch_dependent_layers, minibatch_moments, per_sample_moments


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))


def _batches():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 1, 6, 6, generator=g)
    y = torch.randint(0, 4, (11,), generator=g)
    return [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])]  # a short last batch


def _grad(model, x, y, masks=None):
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
    for n, m in (masks or {}).items():
        grads[n] *= m
    return torch.cat([g.reshape(-1) for g in grads.values()])


@pytest.mark.parametrize("budget", [1, 10**9], ids=["one_sample_at_a_time", "whole_batches"])
def test_per_sample_moments_match_one_backward_per_sample(budget):
    model = _model()
    masks = {"3.weight": torch.rand(4, 48, generator=torch.Generator().manual_seed(2)) < 0.5}
    per_sample = torch.stack([_grad(model, x[i:i + 1], y[i:i + 1], masks) for x, y in _batches() for i in range(len(y))])
    full = per_sample.mean(0)
    sigma2 = float((per_sample - full).square().sum(1).mean())  # (1/n) sum_i ||g_i - g||^2
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = per_sample_moments(model, _batches(), masks, budget=budget)
    assert m.count == 11
    assert torch.allclose(torch.cat([g.reshape(-1) for g in m.full_gradient().values()]), full, rtol=1e-5, atol=1e-8)
    assert m.variance() == pytest.approx(sigma2, rel=1e-5)
    assert float(m.full_gradient()["3.weight"][~masks["3.weight"]].abs().max()) == 0.0  # inactive: no gradient
    with torch.no_grad():
        loss = float(sum(nn.functional.cross_entropy(model(x), y, reduction="sum") for x, y in _batches())) / 11
    assert m.loss_sum / m.count == pytest.approx(loss, rel=1e-5)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the weights do not move


def test_minibatch_moments_are_the_size_weighted_spread_of_batch_gradients():
    """The departure: sum_b n_b ||g_b - g||^2 / n over the batches' mean gradients (the short batch weighs less)."""
    model = _model()
    batches = _batches()
    grads = [(_grad(model, x, y), len(y)) for x, y in batches]
    full = sum(g * n for g, n in grads) / 11
    spread = sum(n * float((g - full).square().sum()) for g, n in grads) / 11
    m = minibatch_moments(model, batches, lambda b: nn.functional.cross_entropy(model(b[0]), b[1]))
    assert torch.allclose(torch.cat([g.reshape(-1) for g in m.full_gradient().values()]), full, rtol=1e-6, atol=1e-9)
    assert m.variance() == pytest.approx(spread, rel=1e-6)
    assert m.minibatch_variance() == m.variance()
    per_sample = per_sample_moments(model, batches, budget=50)  # chunks of one sample: a batch spans chunks
    assert per_sample.minibatch_variance() == pytest.approx(spread, rel=1e-5)  # the same from per-sample sums
    assert per_sample.variance() > 2 * m.variance()  # a 4-sample mean varies less than one sample


def test_batch_dependent_layers_name_batchnorm():
    assert batch_dependent_layers(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))) == ["1"]
    assert batch_dependent_layers(nn.Sequential(nn.Conv2d(1, 2, 3), nn.GroupNorm(1, 2))) == []
