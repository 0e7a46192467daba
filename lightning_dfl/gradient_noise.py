"""Gradient noise of one client's data at a fixed model: its full gradient and the spread of the
stochastic gradients around it, as PSFL's warm-up estimates them (PSFL Assumption 3, Eq. 24).

Two estimators of the same moments:

- :func:`per_sample_moments` (Eq. 24 as printed): ``f(x; xi)`` is the loss of *one* data sample
  (PSFL L64) and ``sigma^2_n = E_xi ||grad f(x; xi) - grad F_n(x)||^2`` with xi uniform over the
  client's data (Assumption 3), i.e. the population variance of the per-sample gradients. Each
  sample's gradient is computed exactly with :func:`torch.func.vmap` over ``torch.func.grad``.
- :func:`minibatch_moments` (a departure, kept as an option): the spread of the *mini-batch*
  gradients of one epoch around their mean, each batch weighted by its size. That is the variance
  of a b-sample mean, about ``sigma^2 (n - b) / (b (n - 1))``: b times smaller than Eq. 24's.

Both return :class:`GradientMoments`, whose :meth:`~GradientMoments.variance` is
``(1/n) sum_i w_i ||g_i||^2 - ||g||^2`` over the units i (samples, or batches of weight n_b).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

__all__ = ["GradientMoments", "batch_dependent_layers", "minibatch_moments", "per_sample_moments"]

#: per-sample gradients held at once: at most this many values (64 MiB of float32), at least one sample
PER_SAMPLE_BUDGET = 1 << 24


@dataclass
class GradientMoments:
    """Sums over one pass of a client's data.

    Attributes:
        count: samples seen (n).
        grad_sum: per parameter, the sum over samples of the gradient (float64); ``grad_sum / count``
            is the full local gradient ``grad F_n(x)``.
        sq_norm_sum: ``sum_i w_i ||g_i||^2`` over the units of the estimator (float).
        loss_sum: the summed per-sample loss.
        batch_sq_norm_sum: ``sum_b n_b ||g_b||^2`` over the mini-batches' mean gradients g_b (both
            estimators fill it), for :meth:`minibatch_variance`.
    """

    count: int
    grad_sum: dict[str, Tensor]
    sq_norm_sum: float
    loss_sum: float
    batch_sq_norm_sum: float

    def full_gradient(self) -> dict[str, Tensor]:
        """``grad F_n(x)``: the mean gradient over the client's samples (float64)."""
        return {k: v / self.count for k, v in self.grad_sum.items()}

    def variance(self) -> float:
        """``sigma^2_n = (1/n) sum_i w_i ||g_i||^2 - ||grad F_n||^2`` (clamped at 0 against rounding)."""
        return max(self.sq_norm_sum / self.count - self._full_sq_norm(), 0.0)

    def minibatch_variance(self) -> float:
        """The mini-batch convention's value, ``sum_b n_b ||g_b - g||^2 / n`` (for comparison)."""
        return max(self.batch_sq_norm_sum / self.count - self._full_sq_norm(), 0.0)

    def _full_sq_norm(self) -> float:
        return sum(float(v.square().sum()) for v in self.full_gradient().values())


def batch_dependent_layers(model: nn.Module) -> list[str]:
    """Names of the layers whose training-mode output couples the samples of a batch (BatchNorm):
    with them a per-sample loss ``f(x; xi)`` is not defined by the batch's loss."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _zeros_like(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}


def per_sample_moments(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]],
                       masks: Mapping[str, Tensor] | None = None, autocast: Any = None,
                       budget: int = PER_SAMPLE_BUDGET) -> GradientMoments:
    """Eq. 24's moments from exact per-sample gradients of the cross-entropy at ``model``'s weights.

    Args:
        model: a classifier in training mode without batch-coupled layers (see
            :func:`batch_dependent_layers`); its weights are not changed.
        batches: ``(x, y)`` batches covering the client's data once.
        masks: boolean masks by parameter name: gradients of inactive weights count as 0, as the
            mask's hooks make them in training.
        autocast: a context-manager factory for the precision (e.g. ``fabric.autocast``).
        budget: per-sample gradient values computed at once; batches are cut into chunks of
            ``max(1, budget // parameters)`` samples.
    """
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())
    numel = sum(p.numel() for p in params.values())
    chunk = max(1, budget // max(numel, 1))
    masks = dict(masks or {})

    def sample_loss(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        logits = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(logits, y.unsqueeze(0))

    per_sample = vmap(grad_and_value(sample_loss), in_dims=(None, 0, 0), randomness="different")
    grad_sum = _zeros_like(params)
    sq_norm_sum, loss_sum, count = 0.0, 0.0, 0
    batch_sq_norm_sum = 0.0
    for x, y in batches:
        batch_sum = _zeros_like(params)
        for start in range(0, int(y.shape[0]), chunk):
            xs, ys = x[start:start + chunk], y[start:start + chunk]
            with (autocast() if autocast is not None else torch.autocast("cpu", enabled=False)):
                grads, losses = per_sample(params, xs, ys)
            norms = torch.zeros(int(ys.shape[0]), dtype=torch.float64, device=ys.device)
            for k, g in grads.items():
                if k in masks:
                    g = g * masks[k].to(g.device)
                flat = g.flatten(1)  # reductions in the gradients' dtype (no float64 copy: 10 x faster), summed in float64
                batch_sum[k] += flat.sum(0).view_as(batch_sum[k])
                norms += torch.linalg.vector_norm(flat, dim=1).double().square()
            sq_norm_sum += float(norms.sum())
            loss_sum += float(losses.detach().double().sum())
        n = int(y.shape[0])
        count += n
        for k, v in batch_sum.items():
            grad_sum[k] += v
        batch_sq_norm_sum += sum(float(v.square().sum()) for v in batch_sum.values()) / max(n, 1)  # n ||sum / n||^2
    return GradientMoments(count, grad_sum, sq_norm_sum, loss_sum, batch_sq_norm_sum)


def minibatch_moments(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]], loss: Any,
                      backward: Any = None) -> GradientMoments:
    """The mini-batch convention (a departure from Eq. 24): each batch's mean gradient g_b, weighted by
    its size n_b, so that ``variance() = sum_b n_b ||g_b - g||^2 / n``.

    Args:
        model: the module whose parameters' ``.grad`` the backward pass fills (mask hooks apply).
        batches: ``(x, y)`` batches covering the client's data once.
        loss: ``batch -> 0-dim loss`` (the batch's mean loss).
        backward: ``loss -> None`` (default ``loss.backward()``; e.g. ``fabric.backward``).
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grad_sum = _zeros_like(params)
    sq_norm_sum, loss_sum, count = 0.0, 0.0, 0
    for batch in batches:
        model.zero_grad(set_to_none=True)
        value = loss(batch)
        (backward or Tensor.backward)(value)
        n = int(batch[1].shape[0])
        for k, p in params.items():
            g = p.grad.detach().double()
            grad_sum[k].add_(g, alpha=n)
            sq_norm_sum += n * float(g.square().sum())
        loss_sum += float(value.detach()) * n
        count += n
    model.zero_grad(set_to_none=True)
    return GradientMoments(count, grad_sum, sq_norm_sum, loss_sum, sq_norm_sum)
