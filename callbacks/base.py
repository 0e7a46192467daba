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
  (a list of dicts: ``name``, ``shape``, ``dtype``, ``fill``, ``like``); in a federation callbacks
  keep no per-client state of their own, so the client store checkpoints (and later shards) it.

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


def defined_hooks(callback: Any, hooks: tuple[str, ...]) -> list[str]:
    """The ``hooks`` that ``callback``'s class defines itself (not Lightning's or :class:`FederatedCallback`'s
    no-op defaults): what a sharded or batched executor must account for."""
    defaults = (Callback, FederatedCallback)
    return [h for h in hooks if getattr(type(callback), h, None) not in (None, *(getattr(d, h, None) for d in defaults))]


#: what a callback implements so that what it counts in a task can be moved between processes (sharding) and
#: taken back when the task is discarded (:mod:`lightning_dfl.federation.loop.sharded`)
SHARD_PROTOCOL = ("shard_snapshot", "shard_delta", "shard_rollback", "shard_apply")


def speaks_shard_protocol(obj: Any) -> bool:
    """Whether ``obj`` implements every method of :data:`SHARD_PROTOCOL`."""
    return all(callable(getattr(obj, name, None)) for name in SHARD_PROTOCOL)


def federated_batch_hooks(callback: Any, hooks: tuple[str, ...]) -> list[str]:
    """The ``hooks`` (batch hooks) that ``callback`` acts in within a federation: those its class defines
    (:func:`defined_hooks`), less those it declares idle there (its ``federated_batch_hooks``: the ones it uses
    in a federation; a callback that declares nothing uses every hook it defines)."""
    declared = getattr(callback, "federated_batch_hooks", None)
    defined = defined_hooks(callback, hooks)
    return defined if declared is None else [h for h in defined if h in declared]


#: stock Lightning callbacks that need a ``Trainer``'s loops, and why a federation has no use for them
UNSUPPORTED_STOCK = {
    "ModelCheckpoint": "a federation writes its own checkpoints: set trainer.checkpoint_every (resume with --ckpt_path)",
    "EarlyStopping": "a federation runs its rounds with no validation loop to monitor: set trainer.rounds",
    "LearningRateMonitor": "a federation has no scheduler to monitor: the learning rate of round t is "
                           "model.lr x model.lr_decay^t",
}


def check_supported(callbacks: list[Any]) -> None:
    """Refuse the stock Lightning callbacks a federation cannot run (:data:`UNSUPPORTED_STOCK`), by name."""
    from lightning.pytorch import callbacks as stock

    for callback in callbacks:
        name = next((n for n in UNSUPPORTED_STOCK if isinstance(callback, getattr(stock, n))), None)
        if name is not None:
            raise ValueError(f"trainer.callbacks: {name} is not supported in a federation: {UNSUPPORTED_STOCK[name]}")


def merge_callbacks(defaults: list[Any], callbacks: Any) -> list[Any]:
    """A run's callbacks: the algorithm's ``defaults`` in their order (a user instance of the same class takes the
    default's place, so e.g. voting still runs before PQI), then the user's other ``callbacks`` (one or a list of
    Lightning callbacks; anything else is refused by name, as are the stock ones a federation cannot run)."""
    from lightning.pytorch import Callback

    if callbacks is not None and not isinstance(callbacks, (Callback, list, tuple)):
        callbacks = [callbacks]  # refused below, by name
    user = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    wrong = next((c for c in user if not isinstance(c, Callback)), None)
    if wrong is not None:
        raise ValueError(f"callbacks must be Lightning Callback instances (e.g. RigL()), got {wrong!r} "
                         f"({type(wrong).__name__})")
    check_supported(user)
    merged = [next((c for c in user if type(c) is type(d)), d) for d in defaults]
    return merged + [c for c in user if not any(c is m for m in merged)]
