"""The federated engine: a round as data flowing one way, from the plan to the published models.

Its public face::

    from lightning_dfl.federation import FederatedTrainer, Algorithm, RoundPlan, Task, Source, StateField, Clock

The packages, top to bottom (a lower one never imports a higher one; ``tests/test_layers.py`` checks it):
``trainer`` (settings, set-up, checkpoints), ``loop`` (rounds, clock, executors), ``algorithms`` (with the
contexts they see and the local training loop), then ``metrics``, ``exchange`` (plans, topology, messages,
aggregation) and ``store`` (the client store and its fields).
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module that defines it (imported on first use: ``import lightning_dfl.federation.store``
#: stays light)
_PUBLIC = {
    "FederatedTrainer": "lightning_dfl.federation.trainer.trainer",
    "RunSettings": "lightning_dfl.federation.trainer.settings",
    "Algorithm": "lightning_dfl.federation.algorithms.base",
    "TopologyAlgorithm": "lightning_dfl.federation.algorithms.base",
    "ALGORITHMS": "lightning_dfl.federation.algorithms",
    "RoundContext": "lightning_dfl.federation.algorithms.context",
    "TaskContext": "lightning_dfl.federation.algorithms.context",
    "EvaluationContext": "lightning_dfl.federation.algorithms.context",
    "RoundPlan": "lightning_dfl.federation.exchange.plan",
    "Task": "lightning_dfl.federation.exchange.plan",
    "Source": "lightning_dfl.federation.exchange.plan",
    "Message": "lightning_dfl.federation.exchange.messages",
    "Topology": "lightning_dfl.federation.exchange.topology",
    "masked_average": "lightning_dfl.federation.exchange.aggregation",
    "StateField": "lightning_dfl.federation.store.fields",
    "ClientStore": "lightning_dfl.federation.store.protocol",
    "Clock": "lightning_dfl.federation.loop.clock",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
