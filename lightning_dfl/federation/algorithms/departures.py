"""Which of an algorithm's options depart from the original method, and how a run's label names them.

Every argument of an algorithm's ``__init__`` is one of two kinds (declared on the class, merged along its
bases):

* a *setting* (``settings``): it sets up the experiment, which the papers vary (how many clients per round or
  neighbours, the graph, a paper's swept threshold), and is never named in the label;
* a *rule option* (every other argument): it changes the method's rule. Its *reference* is the original
  method's value: the class's ``reference`` entry where it has one (the default is not the original's), else
  the argument's default, which the algorithm's docstring gives as the paper's or its authors' code's. A run
  whose value differs is labelled with it, ``"{name} {value}"`` or the class's ``phrases`` entry (a format of
  ``value``), e.g. "DFedAvgM (rule da, message_dtype float16)", unless the option has no effect with the
  run's other options (:meth:`~lightning_dfl.federation.algorithms.base.Algorithm.inert_options`: top-k's
  ratio under another compressor).

The options are those of the nearest class in the method resolution order that classified them: a class of
this package, or one that declares ``settings``, ``reference`` or ``phrases`` in its own body. A subclass that
adds arguments of its own (a test's recorder, a user's extension) without declaring them is labelled by its
base's options; it declares them to have them named.

:func:`departures` lists them; :meth:`~lightning_dfl.federation.algorithms.base.Algorithm.deviations` returns
them (plus what a class adds) and :meth:`~lightning_dfl.federation.algorithms.base.Algorithm.label` writes
them into ``summary.json``'s ``label``, the comparison tables and the plots' legends.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["classifying", "departures", "merged", "options", "rule_options"]


def merged(cls: type, attribute: str) -> Any:
    """A class attribute merged along ``cls``'s bases, the most derived winning: the union of the tuples
    (``settings``) or the dict of every base's entries (``reference``, ``phrases``)."""
    values = [vars(base)[attribute] for base in reversed(cls.__mro__) if attribute in vars(base)]
    if values and isinstance(values[0], dict):
        out: dict[str, Any] = {}
        for value in values:
            out.update(value)
        return out
    return tuple(dict.fromkeys(name for value in values for name in value))


_DECLARATIONS = ("settings", "reference", "phrases")


def classifying(cls: type) -> type:
    """The nearest class along ``cls``'s bases (``cls`` itself first) whose options are classified: one of this
    package's, or one that declares ``settings``, ``reference`` or ``phrases`` in its own body."""
    for base in cls.__mro__:
        if base.__module__.split(".")[0] == "lightning_dfl" or any(a in vars(base) for a in _DECLARATIONS):
            return base
    return cls


def options(cls: type) -> dict[str, Any]:
    """The named arguments of the ``__init__`` of ``cls``'s :func:`classifying` class with their defaults
    (``inspect.Parameter.empty`` where none), in order; ``*args`` and ``**kwargs`` are not options."""
    parameters = list(inspect.signature(classifying(cls).__init__).parameters.values())[1:]
    return {p.name: p.default for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def rule_options(cls: type) -> dict[str, Any]:
    """The options of ``cls`` that change its rule, each with its reference value (module docstring)."""
    settings, reference = set(merged(cls, "settings")), merged(cls, "reference")
    return {name: reference.get(name, default) for name, default in options(cls).items() if name not in settings}


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _same(value: Any, reference: Any) -> bool:
    if isinstance(value, bool) or isinstance(reference, bool):
        return value is reference
    if isinstance(value, (int, float)) and isinstance(reference, (int, float)):
        return float(value) == float(reference)
    return value == reference


def departures(algorithm: Any) -> list[str]:
    """The rule options of ``algorithm`` whose value is not the reference, named as the label names them (in
    the order of its ``__init__`` arguments), leaving out those its :meth:`inert_options` say do nothing."""
    cls = type(algorithm)
    phrases, inert = merged(cls, "phrases"), set(algorithm.inert_options())
    out = []
    for name, reference in rule_options(cls).items():
        value = getattr(algorithm, name)
        if name in inert or _same(value, reference):
            continue
        phrase = phrases.get(name, "{name} {value}")
        out.append(phrase.format(name=name, value=_shown(value)))
    return out
