"""Checkpoints of a federation between rounds: save atomically, resume where it stopped.

A checkpoint is the federation's state: the next round to run, the client store (weights, masks,
slot pointers and every declared per-client field, the callbacks' and the algorithm's), the
algorithm's and every callback's ``state_dict`` (by ``state_key``), the clock, the metrics history,
and an identity (algorithm, seed, sizes, the model's and the data's settings) that a resumed run
must match. Nothing else is needed to continue bit for bit: every random stream is derived from
``(seed, stream, round, client)`` (:func:`lightning_dfl.seeding.derive_seed`) and kept optimizer
state is a store field. The file
format (plain data only, read weights-only) is :mod:`lightning_dfl.federation.trainer.checkpoint_file`'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dfl.federation.exchange.messages import PUBLISH_BOUND
from lightning_dfl.federation.loop.state import FederationState
from lightning_dfl.federation.store.factory import load_store_state
from lightning_dfl.federation.store.partitioned import PartitionedStore
from lightning_dfl.federation.store.saved_state import StoreLayout
from lightning_dfl.federation.trainer.checkpoint_file import (
    CheckpointError,
    check_file,
    check_parts,
    check_store_layout,
    compare_identity,
    read_state,
    write_state,
)


def _plain(value: Any) -> Any:
    """Identity values as plain data (tuples as lists, other objects by repr)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def _identity(federation: FederationState) -> dict[str, Any]:
    """What must match between the run that saved and the run that resumes: every setting that changes its
    results (the trainer's, the clock's, the model's and the data's: ``dropout``, ``model/lr``, ``data/alpha``,
    ...); not those that leave them bit for bit the same (the store, its device, the processes, the logging)."""
    spec = federation.spec
    identity = {"algorithm": repr(federation.algorithm), "seed": spec.seed, "rounds": spec.rounds,
                "local_epochs": spec.local_epochs, "local_steps": spec.local_steps,
                "num_clients": spec.num_clients, "eval_every": spec.eval_every,
                "checkpoint_every": spec.checkpoint_every, "precision": _plain(spec.precision),
                # who takes part each round, and how the float arithmetic rounds: they change results too
                **{k: _plain(v) for k, v in spec.result_settings.items()}}
    derived = {"num_clients", "num_servers", "seed", "base_times"}  # set by Clock.setup from the run
    identity.update({f"clock/{k}": _plain(v) for k, v in vars(federation.clock).items()
                     if not k.startswith("_") and k not in derived})
    identity.update({f"model/{k}": _plain(v) for k, v in dict(federation.worker.module.hparams).items()})
    identity.update({f"data/{k}": _plain(v) for k, v in dict(federation.worker.datamodule.hparams).items()})
    return identity


def save_checkpoint(federation: FederationState, path: str | os.PathLike) -> Path | None:
    """Write the federation's state after round ``federation.progress.round_idx`` to ``path`` atomically.

    With several processes every process calls it and process 0 writes the one file (``None`` elsewhere): a
    partitioned store gathers every node there first, in one process's format, so that any number of
    processes can resume from it."""
    partitioned = isinstance(federation.store, PartitionedStore)
    store = federation.store.state_dict() if partitioned or federation.ownership.rank == 0 else None
    if federation.ownership.rank != 0:
        return None
    return write_state(path, {
        "next_round": federation.progress.round_idx + 1,
        "identity": _identity(federation),
        "store": store,
        "algorithm": federation.algorithm.state_dict(),
        "clock": federation.clock.state_dict(),
        "history": federation.progress.history,
        "callbacks": {c.state_key: c.state_dict() for c in federation.callbacks},
    })


def _nonfinite(tensor: Any, allow_nan: bool = False) -> bool:
    """Whether a floating ``tensor`` holds inf (or NaN, unless ``allow_nan``): one read of the device."""
    if not isinstance(tensor, torch.Tensor) or not (tensor.is_floating_point() or tensor.is_complex()):
        return False
    return bool(torch.isinf(tensor).any() if allow_nan else ~torch.isfinite(tensor).all())


def _too_large(tensor: Any) -> bool:
    """Whether a floating ``tensor`` holds a value above :data:`~lightning_dfl.federation.exchange.messages.PUBLISH_BOUND`
    in magnitude (finite or not)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or not tensor.numel():
        return False
    return bool(~(tensor.abs() <= PUBLISH_BOUND).all())


def _first_bad_node(tensor: torch.Tensor, node_dim: int) -> int:
    bad = ~(tensor.abs() <= PUBLISH_BOUND) if tensor.is_floating_point() else ~torch.isfinite(tensor)
    other = [d for d in range(bad.dim()) if d != node_dim]
    return int(bad.any(dim=other).nonzero()[0, 0]) if other else int(bad.nonzero()[0, 0])


def check_finite(state: dict[str, Any], store: Any, path: str | os.PathLike) -> None:
    """Refuse a checkpoint that holds an inf or NaN: every weight of every node (both slots), every store
    field, the algorithm's and the callbacks' tensors. A field declared with a NaN fill (NaN marks "not set
    yet") and a callback's tensors (their records use NaN the same way) may hold NaN, never inf.

    Raises:
        CheckpointError: one line naming the file, the node (client) and the parameter.
    """
    where = repr(str(path))

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"the checkpoint {where} holds non-finite values (NaN or inf) in {what}; it is not "
                               "loaded, since its clients would spread them to their neighbours (resume from an "
                               "earlier checkpoint or start afresh)")

    saved = state.get("store")
    saved = saved if isinstance(saved, dict) else {}
    specs = getattr(store, "field_specs", {})

    def refuse_large(what: str) -> CheckpointError:
        return CheckpointError(f"the checkpoint {where} holds weights above {PUBLISH_BOUND:g} in magnitude in {what}; "
                               "it is not loaded, since no client may publish such a model (its neighbours' averages "
                               "would overflow): resume from an earlier checkpoint or start afresh")

    if saved.get("format") == "compact":  # a record per node: its values (active entries) per parameter
        for node, record in enumerate(saved.get("records") or []):
            for name, values in ((record or {}).get("values") or {}).items():
                if _too_large(values):  # one pass over the values; a refusal then says which kind
                    label = f"node {node}'s (client {node}) parameter {name!r}"
                    raise refuse(label) if _nonfinite(values) else refuse_large(label)
    else:  # one stacked tensor per parameter: (slot, node, ...)
        for name, values in (saved.get("weights") or {}).items():
            if _too_large(values) or _nonfinite(values):  # _too_large covers NaN and inf of floating values
                node = _first_bad_node(values, 1) if values.dim() > 1 else 0
                label = f"node {node}'s (client {node}) parameter {name!r}"
                raise refuse(label) if _nonfinite(values) else refuse_large(label)
    for field, parts in (saved.get("fields") or {}).items():
        spec = specs.get(field)
        allow_nan = spec is not None and isinstance(spec.fill, float) and spec.fill != spec.fill
        node_dim = 1 if spec is not None and spec.published else 0
        for part, values in (parts or {}).items():
            if _nonfinite(values, allow_nan):
                label = f"field {field!r}" + (f" (parameter {part!r})" if part else "")
                if allow_nan or values.dim() <= node_dim:
                    raise refuse(label)
                node = _first_bad_node(values, node_dim)
                raise refuse(f"node {node}'s (client {node}) {label}")

    def walk(value: Any, key: str, allow_nan: bool) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}[{k!r}]", allow_nan)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]", allow_nan)
        elif _nonfinite(value, allow_nan):
            raise refuse(key)

    walk(state.get("algorithm"), "the algorithm's state", False)
    walk(state.get("callbacks"), "the callbacks' state", True)


def checkpoint_left(last: tuple[Path, int] | None, checkpoint_every: int) -> str:
    """What a run that stops now leaves to resume from: ``last`` (its last checkpoint and the rounds it holds,
    written by this run or resumed from; finite weights only), or why there is none."""
    if last is not None:
        return f"The last checkpoint, {last[0]} (after round {last[1]}), holds finite weights only"
    if not checkpoint_every:
        return "No checkpoint was written (checkpoint_every=0)"
    return f"No checkpoint was written yet (checkpoint_every={checkpoint_every}: the first after round {checkpoint_every})"


def check_resume_request(ckpt_path: Any, resume_allow: Iterable[str]) -> None:
    """Refuse, before any set-up, a ``ckpt_path`` that is no path or no readable checkpoint file, and
    ``resume_allow`` without a checkpoint."""
    if ckpt_path is not None and not isinstance(ckpt_path, (str, os.PathLike)):
        raise ValueError(f"ckpt_path must be a checkpoint file's path (a str or os.PathLike), got {ckpt_path!r}")
    if ckpt_path is not None:
        check_file(ckpt_path)
    elif resume_allow:
        raise ValueError(f"resume_allow={list(resume_allow)} applies only when resuming: give a checkpoint "
                         "(--ckpt_path) or remove resume_allow")


def load_checkpoint(federation: FederationState, path: str | os.PathLike, allow: Iterable[str] = (),
                    rounds: int | None = None) -> int:
    """Restore a set-up federation from ``path``; return the round to continue with.

    ``allow`` names identity keys that may differ from the checkpoint's (see
    :func:`~lightning_dfl.federation.trainer.checkpoint_file.compare_identity`); accepted differences are logged.
    ``rounds``, the run's rounds, may not be fewer than the rounds the checkpoint holds (none would run, and the
    summary would report the saved ones).
    """
    state = read_state(path, map_location=federation.store.device)
    check_parts(state, path, {"algorithm": federation.algorithm.state_dict(), "clock": federation.clock.state_dict()})
    next_round, history = state.get("next_round"), state.get("history")
    rounds_held = len(history) if isinstance(history, list) else None
    if type(next_round) is not int or next_round < 1 or next_round != rounds_held:
        raise CheckpointError(f"the checkpoint {str(path)!r} says next_round={next_round!r} but holds the metrics of "
                              f"{rounds_held} rounds: it is damaged or was edited (resume from another checkpoint)")
    if rounds is not None and next_round > rounds:
        raise ValueError(f"rounds={rounds} is fewer than the {next_round} rounds the checkpoint {str(path)!r} already "
                         f"holds: give rounds >= {next_round} (more than {next_round} to train on)")
    identity = _identity(federation)
    changed = compare_identity(state["identity"], identity, allow)
    check_store_layout(state["store"], StoreLayout.of(federation.store), path)  # all checked before anything loads
    if changed:
        rank_zero_info("Resuming with changed settings: " + "; ".join(
            f"{k}: checkpoint={state['identity'].get(k)!r} now={identity.get(k)!r}" for k in changed) + (
            " (schedules over the run's length, such as RigL's cosine drop fraction and the pruning rounds, follow "
            "the new rounds from here: the run differs from one started with it)" if "rounds" in changed else ""))
    check_finite(state, federation.store, path)
    store = federation.store
    load_store_state(store, state["store"])

    def empty_mask(node: int) -> bool:
        masks = store.mask(node)
        return bool(masks) and not any(bool(m.any()) for m in masks.values())

    nodes = range(store.num_nodes)
    empties = store.gather_nodes(empty_mask, nodes)
    empty = next((node for node, is_empty in zip(nodes, empties) if is_empty), None)
    if empty is not None:
        raise CheckpointError(f"the checkpoint {str(path)!r} holds an empty mask (no active weight in any layer) for "
                              f"node {empty} (client {empty}): it is damaged or was edited (resume from another "
                              "checkpoint)")
    with _loading(path, "the algorithm's state"):
        federation.algorithm.load_state_dict(state["algorithm"])
    with _loading(path, "the clock's state"):
        federation.clock.load_state_dict(state["clock"])
    federation.progress.history[:] = list(state["history"])  # in place: the trainer's list too
    saved = state["callbacks"]
    # a callback added on resume may start fresh only if it keeps no state (as Lightning allows)
    missing = [c.state_key for c in federation.callbacks if c.state_key not in saved and c.state_dict()]
    if missing:
        raise ValueError(f"the checkpoint has no state for callbacks {missing}; it has {sorted(saved)}")
    for callback in federation.callbacks:
        if callback.state_key in saved:
            with _loading(path, f"the callbacks' state {callback.state_key!r}"):
                callback.load_state_dict(saved[callback.state_key])
    return int(state["next_round"])


@contextlib.contextmanager
def _loading(path: str | os.PathLike, what: str) -> Iterator[None]:
    """A part's ``load_state_dict`` that refuses its values (a wrong type, NaN where a number must be finite, a
    missing key) raises a :class:`CheckpointError` naming the file and the part, not the bare value."""
    try:
        yield
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as err:
        reason = f"no entry {err}" if isinstance(err, KeyError) else " ".join(str(err).split())
        raise CheckpointError(f"the checkpoint {str(path)!r} is damaged or does not fit this run: {what} cannot be "
                              f"loaded ({reason}); it is not loaded (resume from another checkpoint, or start "
                              "afresh)") from None  # the message holds the cause (the CLI shows the innermost)
