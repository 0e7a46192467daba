"""Named registries: models, data sets, partitions, topologies and algorithms by name.

Pure Python, importable from every layer. A :class:`Registry` is a mutable mapping from name to
object (a class, a function, any value) that refuses a name twice and names the allowed choices
when asked for an unknown one::

    TOPOLOGIES = Registry("topology")

    @TOPOLOGIES.register("ring")
    class RingTopology: ...

    TOPOLOGIES.get("star")  # ValueError: unknown topology 'star'; allowed: ring
    MODELS = Registry("model", {"resnet18": resnet18, "vgg11": vgg11})  # or (name, obj) pairs
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_MISSING: Any = object()

__all__ = ["Registry"]


class Registry(MutableMapping[str, T], Generic[T]):
    """Name -> object, in registration order; ``kind`` (e.g. ``"model"``) names the entries in errors.

    :meth:`add` and :meth:`register` refuse a taken name; :meth:`get` of an unknown name raises
    ``ValueError`` listing the allowed names. As a mapping it behaves like a ``dict``: ``registry[name]``
    of an unknown name raises ``KeyError`` and ``registry[name] = obj`` adds or replaces an entry (for
    callers that re-register on purpose, e.g. a benchmark's temporary data set).
    """

    def __init__(self, kind: str, entries: Mapping[str, T] | Iterable[tuple[str, T]] = ()) -> None:
        """An empty registry of ``kind``, or one holding ``entries`` (a mapping or ``(name, obj)`` pairs)."""
        self.kind = kind
        self._entries: dict[str, T] = {}
        for name, obj in entries.items() if isinstance(entries, Mapping) else entries:
            self.add(name, obj)

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` as ``name``; a name already taken raises ``ValueError``. Returns ``obj``."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`, for a class or a function: ``@registry.register("name")``."""

        def decorator(obj: T) -> T:
            return self.add(name, obj)

        return decorator

    def get(self, name: str, default: Any = _MISSING) -> T:
        """The object registered as ``name``; an unknown name raises ``ValueError`` unless ``default`` is given."""
        if name in self._entries:
            return self._entries[name]
        if default is not _MISSING:
            return default
        raise ValueError(self._unknown(name))

    def build(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the object registered as ``name`` (a class or a factory) with ``args`` and ``kwargs``."""
        return self.get(name)(*args, **kwargs)  # type: ignore[operator]

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def _unknown(self, name: object) -> str:
        return f"unknown {self.kind} {name!r}; allowed: {', '.join(sorted(self._entries))}"

    # -- mapping protocol ----------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self._unknown(name)) from None

    def __setitem__(self, name: str, obj: T) -> None:
        """Add or replace ``name`` (``dict`` semantics; :meth:`add` refuses a taken name)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        self._entries[name] = obj

    def __delitem__(self, name: str) -> None:
        """Remove ``name`` (e.g. a test's temporary entry)."""
        try:
            del self._entries[name]
        except KeyError:
            raise KeyError(self._unknown(name)) from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
