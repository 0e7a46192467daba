"""A saved store's format, checked before anything loads: what a live store expects (:class:`StoreLayout`), the
error a saved state that does not fit raises (:class:`SavedStateError`), and the checks both stores' formats
share (names, tensors, slots, the declared fields).

Each store checks its own format (:meth:`~lightning_dfl.federation.store.protocol.ClientStore.check_saved_state`:
the dense store's in :mod:`~lightning_dfl.federation.store.dense`, the compact store's records in
:mod:`~lightning_dfl.federation.store.records`); :func:`~lightning_dfl.federation.store.factory.check_store_state`
picks the check by the saved format, and the checkpoint reader names the file in its error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["INT_DTYPES", "SavedStateError", "StoreLayout", "check_fields", "check_slots", "named", "shown_list",
           "tensor_of"]

#: the dtypes a saved store's integer tensors (slots, value counts) may have
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class SavedStateError(ValueError):
    """What is wrong with a saved store's structure, in one line (the checkpoint reader adds the file)."""


@dataclass(frozen=True)
class StoreLayout:
    """What a saved store must hold to load into a live store of either backend: the nodes, each
    parameter's shape and dtype (in the model's order), the masked names, and each field's parts as saved
    (shape with the node dimensions, dtype)."""

    num_nodes: int
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    masked_names: list[str]
    fields: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]

    @classmethod
    def of(cls, store: Any) -> StoreLayout:
        """The layout of a live dense or compact store (a partitioned one: of every node, its ``layout()``)."""
        whole = getattr(store, "layout", None)
        if callable(whole):
            return whole()
        shapes = getattr(store, "shapes", None) or {n: tuple(t.shape[2:]) for n, t in store.weights.items()}
        dtypes = getattr(store, "dtypes", None) or {n: t.dtype for n, t in store.weights.items()}
        return cls(store.num_nodes, {n: tuple(shapes[n]) for n in store.names}, {n: dtypes[n] for n in store.names},
                   list(store.masked_names), {name: {p: (tuple(t.shape), t.dtype) for p, t in parts.items()}
                                              for name, parts in store.fields.items()})


def check_fields(saved: Mapping[str, Any], layout: StoreLayout) -> None:
    """A saved store's declared fields (``saved["fields"]``), each part's shape and dtype as ``layout``'s."""
    if "fields" not in saved:
        raise SavedStateError("its store has no 'fields'")
    fields = named(saved["fields"], "its store's state fields", list(layout.fields))
    for name, parts in layout.fields.items():
        theirs = named(fields[name], f"its field {name!r}", list(parts))
        for part, (shape, dtype) in parts.items():
            tensor_of(theirs[part], f"its field {name!r}" + (f" (parameter {part!r})" if part else ""), shape,
                      (dtype,))


def check_slots(slot: Any, num_nodes: int) -> None:
    """A saved store's slot pointers: one integer per node, each 0 or 1."""
    tensor_of(slot, "its store's slots", (num_nodes,), INT_DTYPES)
    if not bool(((slot == 0) | (slot == 1)).all()):
        raise SavedStateError(f"its store's slots hold {sorted(set(slot.tolist()))}, expected 0 or 1")


def named(value: Any, what: str, names: list[str]) -> dict[str, Any]:
    """``value`` as a dict by exactly ``names``; else one line naming what it lacks and what it has more."""
    if not isinstance(value, dict):
        raise SavedStateError(f"{what} are a {type(value).__name__}, expected a dict by name")
    lacking, extra = [n for n in names if n not in value], [n for n in value if n not in names]
    if lacking or extra:
        parts = ([f"lack {shown_list(lacking)}"] if lacking else []) + (
            [f"hold unknown {shown_list(extra)}"] if extra else [])
        raise SavedStateError(f"{what} {' and '.join(parts)} (this run's model has {shown_list(names)})")
    return value


def tensor_of(value: Any, what: str, shape: tuple[int, ...] | None, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """``value`` if it is a tensor of ``shape`` (any if None) and one of ``dtypes``; else one line naming both."""
    if not isinstance(value, torch.Tensor):
        raise SavedStateError(f"{what} is a {type(value).__name__}, expected a tensor")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise SavedStateError(f"{what} has shape {tuple(value.shape)}, this run's store {tuple(shape)}")
    if value.dtype not in dtypes:
        allowed = dtypes[0] if len(dtypes) == 1 else "an integer dtype"
        raise SavedStateError(f"{what} has dtype {value.dtype}, this run's store {allowed}")
    return value


def shown_list(names: Any) -> str:
    """A list of names, cut after 6."""
    if not isinstance(names, (list, tuple)):
        return repr(names)
    return repr(list(names[:6]))[:-1] + (f", ... {len(names) - 6} more]" if len(names) > 6 else "]")
