"""Where a callback keeps its per-client records: the federation's client store, or one record of its own.

In a federation a callback keeps no per-client state: it declares its records as store fields
(``client_state_fields``: a list of :class:`~lightning_dfl.state_field.StateField`) and reads and writes
them through ``trainer.client_state(k)`` (a view per field, written in place), so that they are
checkpointed (and later sharded) with the store. A plain ``lightning.pytorch.Trainer`` has one
model and no store: the callback keeps that one client's record itself, as tensors built from the
same declarations. :class:`ClientRecords` hands out either, so that a callback's rules are written
once against ``record[name]`` / ``record[name] = value``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.callbacks.base import is_federated
from lightning_dfl.state_field import StateField


class OneRecord:
    """One client's record in a plain ``Trainer``: field name -> tensor, read as views, written in place."""

    def __init__(self, fields: Sequence[StateField] = ()) -> None:
        self.values = {f.name: torch.full(tuple(f.shape), f.fill, dtype=f.dtype) for f in fields}

    def __getitem__(self, name: str) -> Tensor:
        return self.values[name]

    def __setitem__(self, name: str, value: Tensor | float) -> None:
        target = self.values[name]
        target.copy_(torch.as_tensor(value, dtype=target.dtype, device=target.device))

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def state(self) -> dict[str, Tensor]:
        return {name: t.clone() for name, t in self.values.items()}

    def load(self, state: Mapping[str, Tensor]) -> None:
        self.values = {name: torch.as_tensor(t).clone() for name, t in state.items()}


class ClientRecords:
    """A callback's per-client records: the store's fields in a federation, :attr:`plain` otherwise.

    Args:
        owner: the callback's name, for error messages.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        #: the plain ``Trainer``'s one record (unused in a federation).
        self.plain = OneRecord()

    def of(self, trainer: Any, client: int) -> Any:
        """``client``'s record: ``trainer.client_state(client)`` in a federation, else :attr:`plain`."""
        if not is_federated(trainer):
            return self.plain
        client_state = getattr(trainer, "client_state", None)
        if not callable(client_state):
            raise RuntimeError(f"{self.owner} keeps its per-client records in the federation's client store, read "
                               f"with `trainer.client_state(client_id)`; {type(trainer).__name__} has none")
        return client_state(client)

    def clients(self, trainer: Any) -> range:
        """The clients that have a record: every client in a federation, the one voter (0) otherwise."""
        return range(int(trainer.num_clients)) if is_federated(trainer) else range(1)
