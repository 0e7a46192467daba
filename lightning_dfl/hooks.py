"""``is_overridden``: whether an object's class defines a hook itself, not only as one of its defaults have it.

The one way the engine asks "is this hook overridden?" of an algorithm (:meth:`Algorithm.overrides
<lightning_dfl.federation.algorithms.base.Algorithm.overrides>`), a callback
(:func:`~lightning_dfl.federation.loop.callback_hooks.defined_hooks`) or a module. Lightning's own
``lightning.pytorch.utilities.model_helpers.is_overridden`` compares against one parent that must define the
hook; a federated callback's hooks are defined by neither of Lightning's bases, so this one takes several
defaults, any of which may lack the hook. Pure Python.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_overridden"]


def _function(attribute: Any) -> Any:
    """The plain function behind a method, classmethod or staticmethod (``None`` stays ``None``)."""
    return getattr(attribute, "__func__", attribute)


def is_overridden(hook: str, obj: Any, *defaults: type) -> bool:
    """Whether ``obj`` (an instance or a class) has ``hook`` and its class's ``hook`` is none of ``defaults``'
    (classes that may lack it). With no ``defaults``: whether it has ``hook`` at all."""
    cls = obj if isinstance(obj, type) else type(obj)
    own = _function(getattr(cls, hook, None))
    if own is None:
        return False
    return all(own is not _function(getattr(default, hook, None)) for default in defaults)
