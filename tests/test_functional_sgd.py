"""The batched executor's functional SGD step and loss against ``torch.optim.SGD`` and PyTorch's cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_dfl.federation.loop.functional_sgd import sgd_step


@pytest.mark.parametrize("momentum, weight_decay, dampening, nesterov", [
    (0.0, 0.0, 0.0, False), (0.0, 5e-4, 0.0, False), (0.9, 0.0, 0.0, False), (0.9, 5e-4, 0.0, False),
    (0.9, 5e-4, 0.1, False), (0.9, 5e-4, 0.0, True), (0.5, 1e-2, 0.0, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sgd_step_equals_torch_optim_sgd(momentum, weight_decay, dampening, nesterov, dtype):
    """Four steps of ``sgd_step`` equal four of ``torch.optim.SGD(foreach=True)`` on the same gradients, momentum
    buffers included, to the last bits: ``torch.optim.SGD`` adds ``-lr * step`` with ``alpha`` where ``sgd_step``
    subtracts the product (a rounding apart); a wrong term (dampening, Nesterov, weight decay) is ~1e-2 apart."""
    close = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-14, "atol": 1e-15}
    generator = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (5,), (2, 3, 3)]
    start = [torch.randn(s, generator=generator, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=generator, dtype=dtype) for s in shapes] for _ in range(4)]
    params = [torch.nn.Parameter(w.clone()) for w in start]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=momentum, weight_decay=weight_decay, dampening=dampening,
                                nesterov=nesterov, foreach=True)
    weights, momenta = [w.clone() for w in start], None
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
        weights, momenta = sgd_step(weights, step_grads, momenta, lr=0.05, weight_decay=weight_decay,
                                    momentum=momentum, dampening=dampening, nesterov=nesterov)
        for p, w in zip(params, weights):
            torch.testing.assert_close(w, p.detach(), **close)
        if momentum:
            for p, b in zip(params, momenta):
                torch.testing.assert_close(b, optimizer.state[p]["momentum_buffer"], **close)
        else:
            assert momenta is None


def test_sgd_step_changes_nothing_in_place():
    weights, grads = [torch.ones(3)], [torch.full((3,), 2.0)]
    new, momenta = sgd_step(weights, grads, None, lr=0.5, momentum=0.9, weight_decay=0.1)
    assert torch.equal(weights[0], torch.ones(3)) and torch.equal(grads[0], torch.full((3,), 2.0))
    assert torch.allclose(new[0], torch.full((3,), 1.0 - 0.5 * 2.1)) and torch.allclose(momenta[0], torch.full((3,), 2.1))


def test_the_batched_loss_is_the_mean_cross_entropy_of_the_real_samples():
    """The batched step's loss (``batched._weighted_cross_entropy``): with every sample real it is PyTorch's mean
    cross-entropy; padded samples (weight 0) change nothing."""
    from lightning_dfl.federation.loop.batched import weighted_cross_entropy

    generator = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(6, 10, generator=generator, dtype=torch.float64), torch.arange(6) % 10
    assert torch.allclose(weighted_cross_entropy(logits, labels, torch.ones(6, dtype=torch.float64)),
                          F.cross_entropy(logits, labels), rtol=1e-15, atol=0)
    padded = torch.cat([logits, torch.randn(3, 10, generator=generator, dtype=torch.float64)])
    weights = torch.cat([torch.ones(6), torch.zeros(3)]).to(torch.float64)
    assert torch.allclose(weighted_cross_entropy(padded, torch.cat([labels, torch.zeros(3, dtype=torch.long)]),
                                                 weights), F.cross_entropy(logits, labels), rtol=1e-15, atol=0)
