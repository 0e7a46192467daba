"""Checkpoints of a federation between rounds: save atomically, resume where it stopped.

A checkpoint holds the client store (weights, masks, slot pointers, extras), the metrics history,
every callback's ``state_dict`` (by ``state_key``) and the next round to run. Nothing else is
needed to continue bit for bit: every random stream is derived from ``(seed, stream, round,
client)`` (:func:`lightning_dfl.seeding.derive_seed`) and optimizers are fresh each round.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1


def _identity(trainer: Any) -> dict[str, Any]:
    """What must match between the run that saved and the run that resumes."""
    return {"algorithm": repr(trainer.algorithm), "seed": trainer.seed, "rounds": trainer.rounds,
            "local_epochs": trainer.local_epochs, "num_clients": trainer.num_clients}


def save_checkpoint(trainer: Any, path: str | os.PathLike) -> Path:
    """Write the federation's state after round ``trainer.current_round`` to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "format_version": FORMAT_VERSION,
        "next_round": trainer.current_round + 1,
        "identity": _identity(trainer),
        "store": trainer.store.state_dict(),
        "history": trainer.history,
        "callbacks": {c.state_key: c.state_dict() for c in trainer.callbacks},
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact
    return path


def load_checkpoint(trainer: Any, path: str | os.PathLike) -> int:
    """Restore a set-up trainer from ``path``; return the round to continue with."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    state = torch.load(path, map_location=trainer.store.device, weights_only=False)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{str(path)!r} is not a lightning-dfl checkpoint of format {FORMAT_VERSION}")
    mine, theirs = _identity(trainer), state["identity"]
    differ = {k: (theirs.get(k), mine[k]) for k in mine if theirs.get(k) != mine[k]}
    if differ:
        raise ValueError("the checkpoint was written by another configuration; (checkpoint, now): "
                         + "; ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in differ.items()))
    trainer.store.load_state_dict(state["store"])
    trainer.history = list(state["history"])
    saved = state["callbacks"]
    missing = [c.state_key for c in trainer.callbacks if c.state_key not in saved]
    if missing:
        raise ValueError(f"the checkpoint has no state for callbacks {missing}; it has {sorted(saved)}")
    for callback in trainer.callbacks:
        callback.load_state_dict(saved[callback.state_key])
    return int(state["next_round"])
