"""Checkpoints of a federation between rounds: save atomically, resume where it stopped.

A checkpoint is the federation's state: the next round to run, the client store (weights, masks,
slot pointers and every declared per-client field, the callbacks' and the algorithm's), the
algorithm's and every callback's ``state_dict`` (by ``state_key``), the clock, the metrics history,
and an identity (algorithm, seed, sizes, the model's and the data's settings) that a resumed run
must match. Nothing else is needed to continue bit for bit: every random stream is derived from
``(seed, stream, round, client)`` (:func:`lightning_dfl.seeding.derive_seed`) and kept optimizer
state is a store field. The file
format (plain data only, read weights-only) is :mod:`lightning_dfl.federation.checkpoint_io`'s.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dfl.federation.checkpoint_io import compare_identity, read_state, write_state


def _plain(value: Any) -> Any:
    """Identity values as plain data (tuples as lists, other objects by repr)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def _identity(trainer: Any) -> dict[str, Any]:
    """What must match between the run that saved and the run that resumes: the run's settings and
    the model's and the data's (``model/lr``, ``data/alpha``, ...)."""
    identity = {"algorithm": repr(trainer.algorithm), "seed": trainer.seed, "rounds": trainer.rounds,
                "local_epochs": trainer.local_epochs, "local_steps": trainer.local_steps,
                "num_clients": trainer.num_clients, "eval_every": trainer.eval_every,
                "checkpoint_every": trainer.checkpoint_every, "precision": _plain(trainer.precision)}
    derived = {"num_clients", "num_servers", "seed", "base_times"}  # set by Clock.setup from the run
    identity.update({f"clock/{k}": _plain(v) for k, v in vars(trainer.clock).items()
                     if not k.startswith("_") and k not in derived})
    identity.update({f"model/{k}": _plain(v) for k, v in dict(trainer.module.hparams).items()})
    identity.update({f"data/{k}": _plain(v) for k, v in dict(trainer.datamodule.hparams).items()})
    return identity


def save_checkpoint(trainer: Any, path: str | os.PathLike) -> Path:
    """Write the federation's state after round ``trainer.current_round`` to ``path`` atomically."""
    return write_state(path, {
        "next_round": trainer.current_round + 1,
        "identity": _identity(trainer),
        "store": trainer.store.state_dict(),
        "algorithm": trainer.algorithm.state_dict(),
        "clock": trainer.clock.state_dict(),
        "history": trainer.history,
        "callbacks": {c.state_key: c.state_dict() for c in trainer.callbacks},
    })


def load_checkpoint(trainer: Any, path: str | os.PathLike, allow: Iterable[str] = ()) -> int:
    """Restore a set-up trainer from ``path``; return the round to continue with.

    ``allow`` names identity keys that may differ from the checkpoint's (see
    :func:`~lightning_dfl.federation.checkpoint_io.compare_identity`); accepted differences are logged.
    """
    state = read_state(path, map_location=trainer.store.device)
    identity = _identity(trainer)
    changed = compare_identity(state["identity"], identity, allow)
    if changed:
        rank_zero_info("Resuming with changed settings: " + "; ".join(
            f"{k}: checkpoint={state['identity'].get(k)!r} now={identity.get(k)!r}" for k in changed))
    trainer.store.load_state_dict(state["store"])
    trainer.algorithm.load_state_dict(state["algorithm"])
    trainer.clock.load_state_dict(state["clock"])
    trainer.history = list(state["history"])
    saved = state["callbacks"]
    # a callback added on resume may start fresh only if it keeps no state (as Lightning allows)
    missing = [c.state_key for c in trainer.callbacks if c.state_key not in saved and c.state_dict()]
    if missing:
        raise ValueError(f"the checkpoint has no state for callbacks {missing}; it has {sorted(saved)}")
    for callback in trainer.callbacks:
        if callback.state_key in saved:
            callback.load_state_dict(saved[callback.state_key])
    return int(state["next_round"])
