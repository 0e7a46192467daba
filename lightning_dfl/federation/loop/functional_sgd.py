"""``sgd_step``: ``torch.optim.SGD``'s update as a function of tensors, for steps taken without an optimizer
object (the batched executor's, over clients' stacked parameters).

PyTorch's SGD (its ``foreach`` form, the default on a GPU), with weight decay ``lambda``, momentum ``mu``,
dampening ``tau`` and learning rate ``eta``, on gradient ``g`` of weight ``w``:

    d = g + lambda * w
    b = d                                  (the first step)
    b = mu * b + (1 - tau) * d             (later steps)
    s = d + mu * b  (Nesterov)   or   s = b
    w = w - eta * s

Each operation is a multi-tensor one (``torch._foreach_*``): a few kernels for a whole model on a GPU. The
last line subtracts the product ``eta * s`` where ``torch.optim.SGD`` adds ``s`` with ``alpha = -eta``: the two
can differ in the last bit. ``tests/test_functional_sgd.py`` checks it against ``torch.optim.SGD`` step by step.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sgd_step"]


@torch.no_grad()
def sgd_step(weights: list[Tensor], grads: list[Tensor], momenta: list[Tensor] | None, *, lr: float,
             weight_decay: float = 0.0, momentum: float = 0.0, dampening: float = 0.0,
             nesterov: bool = False) -> tuple[list[Tensor], list[Tensor] | None]:
    """One SGD step (module docstring): the updated weights, and the momentum buffers after it (``None``
    without momentum). ``momenta`` ``None`` is the first step (the buffers start as the step's direction).
    Nothing is changed in place."""
    steps = list(grads)
    if weight_decay:
        steps = torch._foreach_add(steps, torch._foreach_mul(weights, weight_decay))
    kept = None
    if momentum:
        kept = steps if momenta is None else torch._foreach_add(torch._foreach_mul(momenta, momentum),
                                                                torch._foreach_mul(steps, 1 - dampening))
        steps = torch._foreach_add(steps, torch._foreach_mul(kept, momentum)) if nesterov else kept
    return torch._foreach_sub(weights, torch._foreach_mul(steps, lr)), kept
