"""The federated hooks a Lightning ``Callback`` may implement.

In a plain ``lightning.pytorch.Trainer`` a callback receives the usual training hooks. In the
federation (``lightning_dfl.federation``) it receives, in addition, the hooks below, called on
the one worker module that holds the current client's state. The federated trainer exposes,
duck-typed so that callbacks never import the federation:

- ``trainer.is_federated`` (``True``), ``trainer.current_round`` (``t``, from 0),
  ``trainer.max_rounds`` (``T``), ``trainer.num_clients``;
- ``trainer.current_client`` (the client id during a client's task, else ``None``);
- ``trainer.train_dataloader``: the current client's training batches ``(x, y)``;
- ``trainer.logger`` / ``trainer.log_metrics(dict)`` for per-round metrics;
- ``trainer.client_state(client_id)``: the client's declared per-client fields, read (a view) and
  written by name. A callback declares them by defining ``client_state_fields(trainer, pl_module)``
  (a list of :class:`~lightning_dfl.state_field.StateField`: ``name``, ``shape``, ``dtype``, ``fill``,
  ``like``); in a federation callbacks keep no per-client state of their own, so the client store
  checkpoints (and later shards) it.

How the engine calls these hooks, which ones a callback defines and how a run's callbacks are merged lives
in the engine (``lightning_dfl.federation.loop.callback_hooks``); a callback needs nothing of it.

A run calls ``setup``, ``on_fit_start`` and ``on_train_start`` once, then the rounds, then
``on_train_end``, ``on_fit_end`` and ``teardown``. Order within one client's task: ``on_client_before_aggregation`` -> aggregation -> local
epochs (usual batch hooks) -> ``on_client_train_end`` (may change the model the client
publishes: pruning-time detection, PQI pruning) -> the published model is evaluated -> the model
and its mask are published ->
``on_client_end`` (may change the mask for the next round: RigL).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback


def is_federated(trainer: Any) -> bool:
    """True when ``trainer`` is lightning-dfl's federated trainer."""
    return bool(getattr(trainer, "is_federated", False))


def log_epoch_value(pl_module: Any, name: str, value: float) -> None:
    """``pl_module.log`` of a plain ``Trainer``'s per-epoch value that is the same on every rank (DDP keeps the
    weights and the masks identical): synced by a max over the ranks, which is that value exactly, so that
    Lightning does not ask for ``sync_dist`` and no rank's value is averaged into another's."""
    pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")


class FederatedCallback(Callback):
    """A ``Callback`` with no-op federated hooks; subclass it or implement the hooks by name."""

    def on_federated_round_start(self, trainer: Any, pl_module: Any) -> None:
        """Called once at the start of every round, before any client task."""

    def on_client_before_aggregation(self, trainer: Any, pl_module: Any, client_id: int) -> None:
        """Called with the client's own state loaded, before it aggregates its neighbours' models."""

    def on_client_train_end(self, trainer: Any, pl_module: Any, client_id: int) -> None:
        """Called after the client's local epochs; changes here are published to neighbours."""

    def on_client_end(self, trainer: Any, pl_module: Any, client_id: int) -> None:
        """Called after the client's model was published; may change the mask for the next round."""

    def on_federated_round_end(self, trainer: Any, pl_module: Any) -> None:
        """Called once at the end of every round, after all client tasks."""
