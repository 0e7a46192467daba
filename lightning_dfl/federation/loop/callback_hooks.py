"""The callbacks' plumbing in the engine: which hooks a callback defines, the sharding protocol, a run's
callbacks merged, and the dispatch that calls a hook on each of them.

Callbacks themselves (``lightning_dfl.callbacks``) import none of this: they implement Lightning's hooks
and the federated ones of :class:`~lightning_dfl.callbacks.base.FederatedCallback` by name.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from lightning.pytorch import Callback

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.errors import ConfigurationError
from lightning_dfl.hooks import is_overridden

__all__ = ["SHARD_PROTOCOL", "UNSUPPORTED_STOCK", "HookDispatch", "check_supported", "defined_hooks",
           "federated_batch_hooks", "merge_callbacks", "speaks_shard_protocol"]


def defined_hooks(callback: Any, hooks: tuple[str, ...]) -> list[str]:
    """The ``hooks`` that ``callback``'s class defines itself (not Lightning's or :class:`FederatedCallback`'s
    no-op defaults): what a sharded or batched executor must account for."""
    return [h for h in hooks if is_overridden(h, callback, Callback, FederatedCallback)]


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
        _check_hook_callables(callback)


def _check_hook_callables(callback: Any) -> None:
    """Refuse a hook given to a callback instance as a callable (``LambdaCallback(on_fit_start=f)``) that cannot take
    the arguments the hook is called with (``ConfigurationError`` naming the callback, the hook and the callable)."""
    for hook, fn in vars(callback).items():
        declared = getattr(FederatedCallback, hook, None)
        if not (hook.startswith("on_") and callable(declared) and callable(fn)):
            continue
        params = list(inspect.signature(declared).parameters)[1:]  # without self
        try:
            inspect.signature(fn).bind(*params)
        except ValueError:  # a builtin without a signature: it cannot be checked here
            continue
        except TypeError as err:
            name = getattr(fn, "__qualname__", repr(fn))
            raise ConfigurationError(f"trainer.callbacks: {type(callback).__name__}'s {hook}={name} cannot be called "
                                     f"with the hook's arguments ({', '.join(params)}): {err}") from None


def merge_callbacks(defaults: list[Any], callbacks: Any) -> list[Any]:
    """A run's callbacks: the algorithm's ``defaults`` in their order (a user instance of the same class takes the
    default's place, so e.g. voting still runs before PQI), then the user's other ``callbacks`` (one or a list of
    Lightning callbacks; anything else is refused by name, as are the stock ones a federation cannot run)."""
    if callbacks is not None and not isinstance(callbacks, (Callback, list, tuple)):
        callbacks = [callbacks]  # refused below, by name
    user = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    wrong = next((c for c in user if not isinstance(c, Callback)), None)
    if wrong is not None:
        raise ValueError(f"callbacks must be Lightning Callback instances (e.g. RigL()), got {wrong!r} "
                         f"({type(wrong).__name__})")
    check_supported(user)
    merged = [next((c for c in user if type(c) is type(d)), d) for d in defaults]
    merged += [c for c in user if not any(c is m for m in merged)]
    keys: dict[str, Any] = {}
    for callback in merged:  # a checkpoint keeps each stateful callback's state under its state_key
        if type(callback).state_dict is Callback.state_dict:
            continue  # no state of its own (e.g. a LambdaCallback): any number of them
        twin = keys.setdefault(callback.state_key, callback)
        if twin is not callback:
            raise ValueError(f"two {type(callback).__name__} callbacks would share one checkpoint entry "
                             f"({callback.state_key!r}), so a resume could not tell their states apart: give one "
                             f"{type(callback).__name__}" + (" (the algorithm's own is replaced by yours)"
                                                             if any(type(d) is type(callback) for d in defaults)
                                                             else ""))
    return merged


class HookDispatch:
    """``dispatch(hook, *args)`` runs ``hook(owner, module, *args)`` on every callback that defines it, as
    Lightning calls its callbacks (with the trainer first). It holds its owner weakly: the record that
    keeps it does not keep a finished trainer, and its store, alive."""

    def __init__(self, owner: Any, callbacks: list[Any], module: Any) -> None:
        self._owner = weakref.ref(owner)
        self.callbacks, self.module = callbacks, module

    def __call__(self, hook: str, *args: Any) -> None:
        owner = self._owner()
        for callback in self.callbacks:
            fn = getattr(callback, hook, None)
            if callable(fn):
                fn(owner, self.module, *args)
