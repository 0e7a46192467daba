"""What a config may import and call: jsonargparse's import-path policy, and the safe mode for configs from
elsewhere (docs/command-line.md, "What a config may run").

A config is as trusted as a Python file: a ``class_path`` imports its module, a callable-valued setting is
called during the run. Two policies, both jsonargparse's own (``set_parsing_settings``'s
``import_path_denylist`` / ``import_path_allowlist``, checked before a module named by a value is imported):

* **always**: jsonargparse's default denylist is enforced (its default only warns): a value may not name what
  runs commands or code, loads pickles, installs packages or ends the process (``os``, ``subprocess``,
  ``builtins.exec``, ``pickle``, ``importlib``, ``functools``, ``shutil``, ``atexit``, ...), so
  ``schedule: os._exit`` is refused before anything runs (it ended a run with exit code 0 and no results);
* **safe mode** (``--safe``, or ``LIGHTNING_DFL_SAFE=1``), for a config from elsewhere: a value may name only
  ``lightning_dfl``, ``torch``, ``torchvision``, ``lightning`` and the modules the user trusts by name
  (``--trust MODULE``, repeatable, or ``LIGHTNING_DFL_TRUST="mod1 mod2"``), and a callable-valued setting only a
  function of ``lightning_dfl`` or a trusted module (``builtins.print`` as a LambdaCallback hook, or any torch
  function as PQI's schedule, is refused: a callable where a value is expected).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

SAFE_FLAG, TRUST_FLAG = "--safe", "--trust"
SAFE_ENV, TRUST_ENV = "LIGHTNING_DFL_SAFE", "LIGHTNING_DFL_TRUST"
#: the packages safe mode lets a value name
SAFE_PACKAGES = ("lightning_dfl", "torch", "torchvision", "lightning")
#: the packages whose functions safe mode lets a callable-valued setting take
SAFE_CALLABLES = ("lightning_dfl",)

__all__ = ["Policy", "applied", "check_callables", "policy_of", "strip_flags"]


@dataclass(frozen=True)
class Policy:
    """Whether the command runs in safe mode, and the modules the user trusts by name."""

    safe: bool = False
    trusted: tuple[str, ...] = ()

    def describe(self) -> str:
        named = f" and the trusted {', '.join(self.trusted)}" if self.trusted else ""
        return f"safe mode lets a config name only {', '.join(SAFE_PACKAGES)}{named}"


_active = Policy()


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def _module_name(value: str, where: str) -> str:
    from lightning_dfl.errors import ConfigurationError

    if not value or not all(part.isidentifier() for part in value.split(".")):
        raise ConfigurationError(f"{where}: {value!r} is not a module name (a dot path of identifiers, e.g. myalgo)")
    if value == "jsonargparse" or value.startswith("jsonargparse."):
        raise ConfigurationError(f"{where}: {value!r} cannot be trusted: a value naming jsonargparse could change "
                                 "what a config may import")
    return value


def strip_flags(args: Sequence[str]) -> tuple[list[str], Policy]:
    """``args`` without ``--safe`` and ``--trust MODULE`` (``--trust=MODULE``), and the policy they and the
    environment (``LIGHTNING_DFL_SAFE``, ``LIGHTNING_DFL_TRUST``) ask for."""
    from lightning_dfl.errors import ConfigurationError

    rest: list[str] = []
    safe, trusted = _truthy(os.environ.get(SAFE_ENV)), []
    trusted += [_module_name(m, TRUST_ENV) for m in os.environ.get(TRUST_ENV, "").replace(",", " ").split()]
    items = iter(args)
    for arg in items:
        if arg == SAFE_FLAG:
            safe = True
        elif arg == TRUST_FLAG or arg.startswith(f"{TRUST_FLAG}="):
            value = arg.partition("=")[2] if "=" in arg else next(items, "")
            if not value or value.startswith("-"):
                raise ConfigurationError(f"{TRUST_FLAG} needs a module name (--trust myalgo), got {value or 'nothing'}")
            trusted.append(_module_name(value, TRUST_FLAG))
        else:
            rest.append(arg)
    if trusted and not safe:
        raise ConfigurationError(f"{TRUST_FLAG} ({', '.join(trusted)}) widens safe mode: give it with {SAFE_FLAG} "
                                 f"(or {SAFE_ENV}=1); without safe mode every module may be named")
    return rest, Policy(safe, tuple(dict.fromkeys(trusted)))


@contextlib.contextmanager
def applied(policy: Policy) -> Iterator[None]:
    """Within this block jsonargparse's import-path policy is ``policy``'s (module docstring); after it, the one
    before (jsonargparse only adds entries, so a command run in a process that runs others, as a test's, must
    not leave safe mode behind)."""
    global _active
    from jsonargparse import _common, set_parsing_settings

    settings = getattr(_common, "parsing_settings", {})
    saved = {k: settings[k] for k in ("import_path_verdicts", "import_paths_enforced") if k in settings}
    previous, _active = _active, policy
    try:
        if policy.safe:
            set_parsing_settings(import_path_denylist=["*"], import_path_allowlist=[*SAFE_PACKAGES, *policy.trusted])
        else:
            set_parsing_settings(import_path_denylist=[])  # enforce jsonargparse's default denylist (it only warned)
        yield
    except BaseException as err:
        err._lightning_dfl_policy = policy  # type: ignore[attr-defined]  (its one-line message names it)
        raise
    finally:
        settings.update(saved)
        _active = previous


def policy_of() -> Policy:
    """The policy :func:`applied` set (the default one where none was)."""
    return _active


def _callables(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    from jsonargparse import Namespace

    if isinstance(node, Namespace):
        node = vars(node)
    if isinstance(node, dict):
        for name, value in node.items():
            yield from _callables(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _callables(value, f"{key}[{i}]")
    elif inspect.isfunction(node) or inspect.isbuiltin(node) or isinstance(node, functools.partial):
        yield key, node


def check_callables(config: Any, policy: Policy | None = None) -> None:
    """In safe mode, refuse a callable-valued setting whose function is not of ``lightning_dfl`` or a trusted
    module (jsonargparse resolved it from an allowed package, e.g. a torch function), naming the setting."""
    policy = policy_of() if policy is None else policy
    if not policy.safe:
        return
    allowed = (*SAFE_CALLABLES, *policy.trusted)
    for key, value in _callables(config, ""):
        target = value.func if isinstance(value, functools.partial) else value
        module = getattr(target, "__module__", None) or ""
        if not any(module == a or module.startswith(f"{a}.") for a in allowed):
            from lightning_dfl.errors import ConfigurationError

            name = f"{module}.{getattr(target, '__qualname__', target)}"
            raise ConfigurationError(f"{key}: {name} is a callable from {module or 'an unknown module'}; safe mode "
                                     f"calls only functions of {', '.join(allowed)} (a value where a callable is "
                                     f"accepted: give a number or list, or run it trusted: without {SAFE_FLAG})")
