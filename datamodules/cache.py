"""Decoded data sets cached on disk: a data set's uint8 arrays are decoded from its source files once.

An entry is one file in the cache folder (default ``~/.cache/lightning-dfl/decoded``, ``$LIGHTNING_DFL_CACHE``, or a
loader's / the data module's ``cache`` option; ``off`` or ``False`` disables it): a JSON header, then the raw
arrays, each with its CRC-32. It is keyed by :data:`FORMAT_VERSION`, the data set, its root and options
(``image_size``), and the name, size and modification time of every source file read: a changed, added or removed
source file gives another key, and the entry of the old files is deleted when the new one is written. Entries are
written to a temporary file and renamed into place, so a killed run leaves no partial entry; an entry that cannot
be read whole with its checksums (corrupt, truncated, foreign) is ignored and rebuilt. Caching never makes a load
fail: a cache folder that cannot be written only costs the speed-up (with a warning).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = ["CACHE_ENV", "FORMAT_VERSION", "cache_dir", "cached_arrays", "default_cache_dir", "read_entry",
           "source_key", "write_entry"]

#: bump when what an entry holds, or how a loader decodes, changes: every older entry is then a miss
FORMAT_VERSION = 1
#: environment variable naming the cache folder; ``off`` (or ``0``, ``false``, ``no``, ``none``) disables the cache
CACHE_ENV = "LIGHTNING_DFL_CACHE"
_OFF = ("0", "off", "false", "no", "none", "disable", "disabled")
_MAGIC = b"LDFLDEC\x00"
_SUFFIX = ".decoded"
_ALIGN = 64
_STALE_TMP_SECONDS = 24 * 3600


def default_cache_dir() -> Path:
    """``~/.cache/lightning-dfl/decoded``."""
    return Path("~/.cache/lightning-dfl/decoded").expanduser()


def cache_dir(cache: str | os.PathLike | bool | None = None) -> Path | None:
    """The cache folder to use, or None when caching is off.

    ``cache``: ``None`` or ``True`` -- ``$LIGHTNING_DFL_CACHE`` if set, else :func:`default_cache_dir`;
    ``False`` or ``"off"`` -- no cache; a path -- that folder. ``$LIGHTNING_DFL_CACHE=off`` turns the
    default off (an explicit folder still caches).
    """
    if cache is False:
        return None
    if cache is None or cache is True:
        cache = os.environ.get(CACHE_ENV, "").strip() or default_cache_dir()
    if not isinstance(cache, (str, os.PathLike)):
        raise ValueError(f"cache must be a folder, True/None (the default folder) or False (off), got {cache!r}")
    if str(cache).strip().lower() in _OFF:
        return None
    return Path(cache).expanduser()


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def source_key(kind: str, root: str | os.PathLike, files: Sequence[str | os.PathLike],
               params: Mapping[str, object] | None = None) -> tuple[str, str]:
    """``(slot, key)`` of a data set's entry: the slot names the data set, its root and options (the entry of
    changed files replaces the slot's old one), the key adds :data:`FORMAT_VERSION` and every source file's name
    (relative to ``root`` where it lies under it), size and modification time, in order. Raises OSError
    (FileNotFoundError) for a missing source file."""
    base = os.path.abspath(os.path.expanduser(os.fspath(root)))
    slot = _digest({"kind": kind, "root": base, "params": dict(params or {})})
    key = hashlib.sha256(f"{slot}\n{FORMAT_VERSION}\n".encode())
    prefix = base.rstrip(os.sep) + os.sep
    for file in files:
        path = os.fspath(file)
        st = os.stat(path)
        name = path[len(prefix):] if path.startswith(prefix) else path
        key.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return f"{kind}-{slot[:16]}", key.hexdigest()


def write_entry(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], header: Mapping[str, object]) -> None:
    """Write ``arrays`` and ``header`` (JSON-able) to ``path`` atomically: a temporary file in the same folder,
    flushed to disk, then renamed over ``path``."""
    path = Path(path)
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    layout, offset = [], 0
    for name, a in arrays.items():
        layout.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
                       "nbytes": int(a.nbytes), "crc32": zlib.crc32(memoryview(a).cast("B"))})
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    head = json.dumps({**header, "arrays": layout}).encode()
    start = -(-(len(_MAGIC) + 8 + len(head)) // _ALIGN) * _ALIGN
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + struct.pack("<Q", len(head)) + head)
            for entry, a in zip(layout, arrays.values()):
                f.seek(start + entry["offset"])
                f.write(memoryview(a).cast("B"))
            f.truncate(start + (layout[-1]["offset"] + layout[-1]["nbytes"] if layout else 0))  # no padding at the end
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_entry(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and header of the entry at ``path``; ValueError (or OSError) unless it is whole: its magic,
    header, size and every array's CRC-32 checked."""
    with open(path, "rb") as f:
        lead = f.read(len(_MAGIC) + 8)
        if len(lead) != len(_MAGIC) + 8 or lead[:len(_MAGIC)] != _MAGIC:
            raise ValueError(f"{path} is not a decoded-data cache entry")
        (size,) = struct.unpack("<Q", lead[len(_MAGIC):])
        if size > 1 << 30:
            raise ValueError(f"{path}: implausible header size {size}")
        header = json.loads(f.read(size).decode())
        start = -(-(len(_MAGIC) + 8 + size) // _ALIGN) * _ALIGN
        arrays = {}
        for entry in header["arrays"]:
            a = np.empty(entry["shape"], dtype=np.dtype(entry["dtype"]))
            if a.nbytes != entry["nbytes"]:
                raise ValueError(f"{path}: array {entry['name']!r} does not match its shape")
            f.seek(start + entry["offset"])
            view = memoryview(a).cast("B")
            if a.nbytes and f.readinto(view) != a.nbytes:
                raise ValueError(f"{path} is truncated")
            if zlib.crc32(view) != entry["crc32"]:
                raise ValueError(f"{path}: array {entry['name']!r} fails its checksum")
            arrays[entry["name"]] = a
    return arrays, header


def _drop_stale(folder: Path, slot: str, keep: Path) -> None:
    """Delete the slot's entries of older source files, and temporary files left by killed runs."""
    now = time.time()
    for other in folder.iterdir():
        try:
            old_entry = other.name.startswith(f"{slot}-") and other.name.endswith(_SUFFIX) and other != keep
            old_tmp = other.name.startswith(".") and other.name.endswith(".tmp") and (
                now - other.stat().st_mtime > _STALE_TMP_SECONDS)
            if old_entry or old_tmp:
                other.unlink()
        except OSError:  # another process removed or replaced it first
            pass


def _wrong_arrays(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None) -> str | None:
    """What of ``arrays`` is not as ``dtypes`` says (a missing array, another dtype), or None."""
    for name, dtype in (dtypes or {}).items():
        if name not in arrays:
            return f"no array {name!r} (it holds {sorted(arrays)})"
        if arrays[name].dtype != np.dtype(dtype):
            return f"{name} as {arrays[name].dtype}, not {np.dtype(dtype)}"
    return None


def cached_arrays(kind: str, root: str | os.PathLike, files: Sequence[str | os.PathLike],
                  build: Callable[[], tuple[dict[str, np.ndarray], dict]], params: Mapping[str, object] | None = None,
                  cache: str | os.PathLike | bool | None = None,
                  dtypes: Mapping[str, str] | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays (and JSON-able metadata) that ``build`` decodes from ``files``, served from the cache when an
    entry of these very files (names, sizes, times), ``params`` and :data:`FORMAT_VERSION` exists, and holds the
    arrays ``dtypes`` names with those dtypes (numpy names: ``"uint8"``); an entry that does not (written by
    other code, or by hand) is decoded again, with a warning naming it.

    ``build`` returns ``(arrays, meta)``: numpy arrays by name and a JSON-able dict (class names, ...).
    With the cache off, or a source file missing (a download still to come), ``build`` runs uncached.
    """
    folder = cache_dir(cache)
    if folder is None:
        return build()
    try:
        slot, key = source_key(kind, root, files, params)
    except OSError:
        return build()
    path = folder / f"{slot}-{key[:16]}{_SUFFIX}"
    wrong = None
    try:
        arrays, header = read_entry(path)
        if header.get("key") == key and header.get("version") == FORMAT_VERSION:
            wrong = _wrong_arrays(arrays, dtypes)
            if wrong is None:
                return arrays, header["meta"]
    except Exception:  # absent, or corrupt, truncated, foreign: rebuilt below
        pass
    if wrong is not None:
        warnings.warn(f"the decoded-data cache entry '{path}' holds {wrong}: it is decoded again from the source "
                      "files and replaced", stacklevel=2)
    arrays, meta = build()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_entry(path, arrays, {"version": FORMAT_VERSION, "key": key, "kind": kind, "meta": meta})
        _drop_stale(folder, slot, path)
    except OSError as err:
        warnings.warn(f"could not cache the decoded {kind} data set in {folder} ({err}); it is decoded again on "
                      f"every start (set {CACHE_ENV}=off to silence this, or point it to a writable folder)",
                      stacklevel=2)
    return arrays, meta
