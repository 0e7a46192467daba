"""The federation checkpoint's file: plain data only, written atomically, read without running code.

A checkpoint is a ``torch.save`` zip archive of a dict that holds only tensors and plain containers
(dict with str/int keys, list, tuple, str, int, float, bool, None) plus a format marker. It is read
with ``torch.load(weights_only=True)``: a file that carries any other pickled object is refused, never
executed. Every damaged or foreign file gives one :class:`CheckpointError` naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import zipfile
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_dfl.federation.store.saved_state import SavedStateError, StoreLayout
from lightning_dfl.files import path_kind
from lightning_dfl.host_memory import available_bytes, format_bytes

FORMAT = "lightning-dfl/federation"
FORMAT_VERSION = 2

#: identity keys that may change on resume without invalidating the run (always allowed).
SAFE_TO_CHANGE = frozenset({"rounds", "eval_every", "checkpoint_every"})

_SCALARS = (str, int, float, bool, type(None))
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_MAPPINGS = (dict, OrderedDict)
_ZIP_MAGIC = b"PK\x03\x04"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read: missing, damaged, foreign or of another format version."""


def write_state(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` (tensors and plain containers only) to ``path`` atomically; return the path.

    The data goes to ``<path>.tmp`` beside it, is flushed and fsynced, then replaces ``path``; the folder is
    fsynced where the OS allows. If writing fails the temporary file is removed and ``path`` keeps its
    previous content; a hard crash (power loss) may leave ``<path>.tmp``, which the next write replaces.

    Raises:
        TypeError: naming the key path of the first value that is not a tensor or plain container.
        ValueError: when ``state`` uses the marker's keys ``format`` / ``format_version``.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    reserved = sorted({"format", "format_version"} & set(state))
    if reserved:
        raise ValueError(f"state keys {reserved} are reserved for the checkpoint's format marker")
    _check_plain(state, "state")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as file:
            torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch's zip writer reports a failed write as a RuntimeError
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        cause = _write_cause(err)
        kept = "the previous checkpoint is kept" if path.is_file() else "no earlier checkpoint exists"
        raise CheckpointError(f"cannot write the checkpoint {str(path)!r}: {cause}; {kept}") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return path


def _write_cause(err: BaseException) -> str:
    """Why a write failed, in words: the OS error (disk full, read-only folder, ...) torch may have wrapped."""
    chain: list[BaseException] = [err]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)  # type: ignore[arg-type]
    os_error = next((e for e in chain if isinstance(e, OSError)), None)
    if os_error is not None:
        code = f" ({errno.errorcode.get(os_error.errno, os_error.errno)})" if os_error.errno else ""
        return f"{os_error.strerror or os_error}{code}"
    return f"{_reason(err)} (a failed write: is the disk full?)"


def check_file(path: str | os.PathLike) -> Path:
    """The cheap checks of a checkpoint path, before a run sets anything up: it exists, is a file, is
    not empty, and opens as a zip archive (its directory only is read). Returns it as a ``Path``."""
    path = Path(path)
    where = repr(str(path))
    kind = path_kind(path)
    if kind == "missing":
        raise CheckpointError(f"no checkpoint at {where}: the path does not exist")
    if kind != "a regular file":  # a FIFO would block the read below
        raise CheckpointError(f"no checkpoint at {where}: it is {kind}, not a regular file")
    with open(path, "rb") as file:
        head = file.read(len(_ZIP_MAGIC))
    if not head:
        raise CheckpointError(f"the checkpoint {where} is empty (0 bytes): it was never fully written")
    if head != _ZIP_MAGIC:
        raise CheckpointError(f"{where} is not a checkpoint: it is not a torch zip archive (random bytes, another "
                              "format or a legacy torch file)")
    try:
        with zipfile.ZipFile(path) as archive:
            parts = archive.infolist()
    except (zipfile.BadZipFile, EOFError) as err:
        raise CheckpointError(f"the checkpoint {where} is truncated or damaged: it starts as a torch archive but its "
                              f"zip directory is unreadable ({err})") from err
    _check_declared_size(parts, path.stat().st_size, where)
    return path


#: how much more than its file size a checkpoint's parts may declare, when some are compressed
_EXPANSION = 4
_EXPANSION_SLACK = 64 * 2**20


def _check_declared_size(parts: list[zipfile.ZipInfo], file_size: int, where: str) -> None:
    """Refuse an archive whose parts declare more data than it can hold (a "zip bomb") or than memory holds.

    Only the zip directory is read, never a part's data. ``torch.save`` stores every part uncompressed,
    so the declared sizes add up to about the file size. Compressed parts (a checkpoint re-zipped by a
    tool) are not refused outright, since sparse weights do compress; but together the parts may declare
    at most ``4 x`` the file size ``+ 64 MiB``: well above what real weights compress to, far below a
    bomb's ratio of ~1000 (a 1 MB file expanding to 1 GB). The declared total must also fit in the
    memory available now, as ``torch.load`` reads every part into memory.
    """
    declared = sum(part.file_size for part in parts)
    bound = file_size * _EXPANSION + _EXPANSION_SLACK
    if declared > bound:
        raise CheckpointError(f"the checkpoint {where} declares {format_bytes(declared)} of data in a file of "
                              f"{format_bytes(file_size)}: refused before reading it, since a torch checkpoint stores "
                              f"its data uncompressed (at most {format_bytes(bound)}, 4 x the file size + 64 MiB, is "
                              "allowed)")
    available = _available_memory()
    if available is not None and declared > available:
        raise CheckpointError(f"the checkpoint {where} declares {format_bytes(declared)} of data, more than the "
                              f"{format_bytes(available)} of memory available: refused before reading it")


def _available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable, else the free pages), or None where unknown."""
    available = available_bytes()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # not on this OS
        return None


def read_state(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load what :func:`write_state` wrote to ``path`` (without the format marker), weights-only.

    The archive's checksums are verified first (``torch.load`` does not check them): one extra read of the file.

    Raises:
        CheckpointError: for a missing path or a folder, an empty, truncated or damaged file, a file that
            carries a pickled object (refused, not executed), a foreign file, or another format version.
    """
    path = check_file(path)
    where = repr(str(path))
    problem = _archive_problem(path)
    if problem is not None:
        raise CheckpointError(f"the checkpoint {where} is {problem}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        reason = _reason(err)
        if found is None and re.search(r"Unsupported operand|truncated|invalid load key|could not find MARK|"
                                       r"unpickling stack underflow", reason):
            raise CheckpointError(f"the checkpoint {where} is damaged: its pickled data cannot be read "
                                  f"weights-only ({reason})") from err
        what = found.group(1) if found is not None else reason
        raise CheckpointError(f"{where} holds a refused pickled object ({what}), not only tensors and plain "
                              "containers; it is not loaded, since loading it could run arbitrary code") from err
    except (RuntimeError, EOFError, ValueError, KeyError) as err:
        raise CheckpointError(f"the checkpoint {where} is damaged or not a torch checkpoint: "
                              f"{_reason(err)}") from err
    _check_loaded(state, where)
    _check_format(state, where)
    return {k: v for k, v in state.items() if k not in ("format", "format_version")}


def compare_identity(saved: Mapping[str, Any], current: Mapping[str, Any], allow: Iterable[str] = ()) -> list[str]:
    """The keys on which the checkpoint's identity ``saved`` and the ``current`` run differ but may.

    ``SAFE_TO_CHANGE`` keys may always differ; any other key only when named in ``allow``.

    Raises:
        ValueError: listing each disallowed difference as ``key: checkpoint=<v> now=<v>``, or naming the
            ``allow`` entries that are not identity keys.
    """
    keys = sorted(set(saved) | set(current))
    allowed = set(allow)
    unknown = sorted(allowed - set(keys))
    if unknown:
        raise ValueError(f"resume_allow cannot allow {unknown}: not identity keys; the identity keys are {keys}")
    changed = [k for k in keys if k not in saved or k not in current or saved[k] != current[k]]
    refused = [k for k in changed if k not in SAFE_TO_CHANGE and k not in allowed]
    if refused:
        lines = "\n".join(f"  {k}: checkpoint={_shown(saved, k)} now={_shown(current, k)}" for k in refused)
        raise ValueError(f"the checkpoint was written by another configuration:\n{lines}\nto resume anyway, allow "
                         f"these changes with --trainer.resume_allow '[{','.join(refused)}]' (FederatedTrainer("
                         f"resume_allow={refused}) in Python; the resumed run is then not the one that was saved)")
    return changed


def _shown(identity: Mapping[str, Any], key: str) -> str:
    return repr(identity[key]) if key in identity else "<absent>"


def _check_plain(value: Any, where: str) -> None:
    """Raise TypeError at the first value under ``value`` that is not a tensor or plain container."""
    kind = type(value)
    if kind in _TENSORS or kind in _SCALARS:
        return
    if kind in _MAPPINGS:
        for key, item in value.items():
            if type(key) not in (str, int):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; keys must be str or int")
            _check_plain(item, f"{where}[{key!r}]")
        return
    if kind in (list, tuple):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    hint = ("; numpy values are not allowed: convert with .item(), float()/int() or torch.from_numpy"
            if kind.__module__.partition(".")[0] == "numpy" else "")
    raise TypeError(f"{where}: {kind.__name__} is not a tensor or plain container (dict with str/int keys, list, "
                    f"tuple, str, int, float, bool, None){hint}")


def _check_format(state: Any, where: str) -> None:
    """Raise CheckpointError unless ``state`` carries this module's format marker and version."""
    ours = isinstance(state, dict) and (
        state.get("format") == FORMAT
        or ("format" not in state and "identity" in state and "format_version" in state))  # format 1 had no marker
    if not ours:
        raise CheckpointError(f"{where} is not a lightning-dfl federation checkpoint: it seems to hold "
                              f"{_describe(state)}")
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        age = "a newer" if isinstance(version, int) and version > FORMAT_VERSION else "an older"
        raise CheckpointError(f"the checkpoint {where} has format_version {version!r}, written by {age} "
                              f"lightning-dfl; this one reads format_version {FORMAT_VERSION} only")


#: the deepest nesting of containers a checkpoint may hold (this package's checkpoints nest about 6 deep)
MAX_DEPTH = 64


def _check_loaded(state: Any, where: str) -> None:
    """Refuse what ``torch.load`` accepted but no checkpoint of this package holds: containers nested deeper than
    :data:`MAX_DEPTH` (every later walk would exceed Python's recursion limit), and a tensor that addresses more
    elements than its storage holds or lies outside it (a "stride bomb": zero or overlapping strides make a few
    stored bytes look like terabytes, which any check or copy would then allocate). One pass, without recursion."""
    stack: list[tuple[Any, int, str]] = [(state, 0, "")]
    while stack:
        value, depth, key = stack.pop()
        if isinstance(value, torch.Tensor):
            problem = _tensor_problem(value)
            if problem is not None:
                raise CheckpointError(f"the checkpoint {where} holds a tensor {key or 'at its top'} that {problem}: "
                                      "refused as damaged or crafted (a tensor may address only the elements its "
                                      "storage holds)")
            continue
        if not isinstance(value, (dict, list, tuple)):
            continue
        if depth >= MAX_DEPTH:
            raise CheckpointError(f"the checkpoint {where} nests containers more than {MAX_DEPTH} deep (at "
                                  f"{key[:200]}...): refused as damaged or crafted")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((item, depth + 1, f"{key}[{k!r}]") for k, item in items)


def _tensor_problem(tensor: torch.Tensor) -> str | None:
    """What is wrong with a loaded tensor's size, stride and offset against its storage, else ``None``."""
    size, stride, offset = tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
    declared = f"(size {size}, stride {stride}, offset {offset})"
    if tensor.layout != torch.strided:
        return f"has layout {tensor.layout}; a checkpoint holds dense (strided) tensors only"
    held = tensor.untyped_storage().nbytes() // max(tensor.element_size(), 1)
    if offset < 0 or any(s < 0 for s in stride):
        return f"declares a negative stride or offset {declared}"
    if tensor.numel() == 0:
        return None
    if tensor.numel() > held:
        return f"declares {tensor.numel()} elements in a storage of {held} {declared}"
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= held:
        return f"reaches element {last} of a storage of {held} {declared}"
    return None


def _describe(obj: Any) -> str:
    """A few words on what a foreign checkpoint holds."""
    if isinstance(obj, dict):
        keys = sorted(map(str, obj))
        shown = f"{keys[:8]}{' ...' if len(keys) > 8 else ''}"
        if "pytorch-lightning_version" in obj:
            return (f"a Lightning Trainer checkpoint (pytorch-lightning_version {obj['pytorch-lightning_version']}, "
                    f"keys {shown})")
        return f"a dict with keys {shown}"
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    return f"a {type(obj).__name__}"


def _archive_problem(path: Path) -> str | None:
    """What is wrong with the zip archive ``path``: cut short, or a part whose CRC fails (torch checks neither)."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError) as err:
        return f"truncated or damaged: it starts as a torch archive but its zip directory is unreadable ({err})"
    return None if bad is None else f"damaged: its part {bad!r} fails its checksum"


def _reason(err: BaseException) -> str:
    """The telling part of torch's (long) error message."""
    found = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
    if found is not None:  # without torch's advice to allowlist the class or to turn the check off
        text = re.split(r"\.\s+(?:Please use|Re-running|Check the recorded)", found.group(1).strip())[0].rstrip(".")
        return re.sub(r",? or (?:types )?allowlisted via `?add_safe_globals`?", "", text)
    lines = [line.strip() for line in str(err).splitlines() if line.strip()
             and not re.search(r"weights_only|can still be loaded|safe_globals", line)]
    return lines[0] if lines else type(err).__name__


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable, where the OS can open and sync a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder
        return
    try:
        with contextlib.suppress(OSError):  # some file systems cannot sync a folder
            os.fsync(fd)
    finally:
        os.close(fd)


# -- the saved state's structure, checked before anything is loaded ---------------------------------

#: the federation checkpoint's parts and their containers (``next_round``'s value is checked on load)
_PARTS: dict[str, type | None] = {"next_round": None, "identity": dict, "store": dict, "algorithm": dict,
                                  "clock": dict, "history": list, "callbacks": dict}


class _Unfit(Exception):
    """What is wrong with a saved state's parts (internal: :func:`check_parts` names the file)."""


def check_parts(state: Mapping[str, Any], path: str | os.PathLike,
                live: Mapping[str, Mapping[str, Any]] = ()) -> None:
    """Refuse a checkpoint (as :func:`read_state` returns it) that lacks a part or holds one of the wrong kind
    (a list where a dict belongs). ``live`` maps ``"algorithm"`` / ``"clock"`` to this run's ``state_dict()``:
    the saved state must hold each of its keys. Nothing is loaded.

    Raises:
        CheckpointError: one line naming the file and what is wrong.
    """
    _refuse_unfit(_check_parts, path, state, dict(live))


def check_store_layout(saved: Mapping[str, Any], layout: StoreLayout, path: str | os.PathLike) -> None:
    """Refuse a saved store (the checkpoint's ``"store"``) that cannot load into a store of ``layout``:
    parameter or field names, shapes, dtypes, node count or format that differ, a damaged compact record (each
    store checks its own format: :func:`~lightning_dfl.federation.store.factory.check_store_state`). Either
    backend's format is accepted by either store. The values themselves are checked elsewhere.

    Raises:
        CheckpointError: one line naming the file and what is wrong.
    """
    from lightning_dfl.federation.store.factory import check_store_state  # it imports Lightning: read_state does not

    _refuse_unfit(check_store_state, path, saved, layout)


def _refuse_unfit(check: Any, path: str | os.PathLike, *args: Any) -> None:
    try:
        check(*args)
    except (_Unfit, SavedStateError) as err:
        raise CheckpointError(f"the checkpoint {str(path)!r} is damaged or does not fit this run: {err}; it is not "
                              "loaded (resume from another checkpoint, or start afresh)") from None


def _check_parts(state: Mapping[str, Any], live: dict[str, Mapping[str, Any]]) -> None:
    missing = [k for k in _PARTS if k not in state]
    if missing:
        raise _Unfit(f"it has no {missing} (it holds {sorted(map(str, state))})")
    for key, kind in _PARTS.items():
        if kind is not None and not isinstance(state[key], kind):
            raise _Unfit(f"its {key!r} is a {type(state[key]).__name__}, expected a {kind.__name__}")
    entry = next((i for i, m in enumerate(state["history"]) if not isinstance(m, dict)), None)
    if entry is not None:
        raise _Unfit(f"its history's entry {entry} is a {type(state['history'][entry]).__name__}, expected a dict "
                     "of metrics")
    for key, value in state["callbacks"].items():
        if not isinstance(value, dict):
            raise _Unfit(f"its callbacks' state {key!r} is a {type(value).__name__}, expected a dict")
    for part, mine in live.items():
        lacking = sorted(set(mine) - set(state[part]))
        if lacking:
            raise _Unfit(f"its {part}'s state has no {lacking}")
    for key, value in state["clock"].items():
        if type(value) not in (int, float):
            raise _Unfit(f"its clock's {key!r} is {value!r}, expected a number")
