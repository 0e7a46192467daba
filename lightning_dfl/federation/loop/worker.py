"""``Worker``: the one module every task trains on, set up once under Fabric.

The worker is the LightningModule (its model and mask), its Fabric-wrapped optimizer, Fabric, the module's
floating parameters and buffers by the store's names (what a task loads and publishes), and the data it draws
batches from, on its device and in the precision's input dtype. A task loads a client's state into it, trains
and publishes; nothing is built per client or per round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.federation.algorithms.context import CountingBatches
from lightning_dfl.transfers import copy_all_, to_device

__all__ = ["Worker"]


@dataclass(eq=False)
class Worker:
    """The worker (module docstring)."""

    module: Any
    optimizer: Any
    fabric: Any
    datamodule: Any
    #: the module's floating parameters and buffers by the store's names (views: writing them writes the module)
    tensors: dict[str, Tensor]
    #: the precision's (and memory format's) conversion of a batch, or ``None``
    convert_input: Callable[[Any], Any] | None = None
    #: the module's captured local steps (``cuda_graphs``: :mod:`~lightning_dfl.federation.loop.step_graphs`), or ``None``
    step_graphs: Any = None

    @property
    def device(self) -> torch.device:
        return self.fabric.device

    @torch.no_grad()
    def load(self, weights: dict[str, Tensor]) -> None:
        """Copy ``weights`` (the store's names) into the module (from a pinned store, overlapping)."""
        copy_all_((tensor, weights[name]) for name, tensor in self.tensors.items())

    def weights(self) -> dict[str, Tensor]:
        """A copy of the module's floating parameters and buffers (the store's names)."""
        return {name: tensor.detach().clone() for name, tensor in self.tensors.items()}

    def train_batches(self, client: int, generator: torch.Generator) -> CountingBatches:
        """``client``'s training batches drawn with ``generator``, on the device, in the precision's input dtype."""
        return CountingBatches(self.datamodule.client_train_batches(client, generator, device=self.device),
                               self.convert_input)

    def test_batches(self, client: int) -> CountingBatches:
        """``client``'s test batches on the device, in the precision's input dtype."""
        return CountingBatches(self.datamodule.client_test_batches(client, device=self.device), self.convert_input)

    def global_test_batches(self) -> Iterable[tuple[Tensor, Tensor]]:
        """The official test split, normalised, on the device in the precision's input dtype."""
        for x, y in self.datamodule.test_dataloader():
            batch = (to_device(x, self.device), to_device(y, self.device))
            yield self.convert_input(batch) if self.convert_input is not None else batch
