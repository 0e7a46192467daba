"""Federated algorithms: each plans its rounds on the shared engine.

The classes and :data:`ALGORITHMS` are imported on first use, so that the pure modules beside them
(:mod:`~.dadpfl_waits`, :mod:`~.psfl_structure`) load without torch (the command line's analysis tools).
"""

from __future__ import annotations

import importlib
from typing import Any

#: class name -> the module (of this package) that defines it, in the registry's order
_CLASSES = {
    "DisPFL": "dispfl", "DADPFL": "dadpfl", "DPSGD": "dpsgd", "Local": "local", "FedAvg": "fedavg", "PSFL": "psfl",
    "FedAvgFT": "finetune", "DPSGDFT": "finetune", "Ditto": "ditto", "DFedAvgM": "dfedavgm", "DFedSAM": "dfedsam",
    "FedDST": "feddst", "SubFedAvg": "subfedavg", "FedFomo": "fedfomo", "GossipFL": "gossipfl", "BEER": "beer",
    "PRISAM": "prisam",
}
_BASE = {"Algorithm": "base", "TopologyAlgorithm": "base", "RoundContext": "context", "TaskContext": "context",
         "EvaluationContext": "context"}

__all__ = sorted(["ALGORITHMS", *_CLASSES, *_BASE])


def _registry() -> Any:
    """:data:`ALGORITHMS`: the algorithms by name (``ALGORITHMS.get(name)`` names the allowed ones for an
    unknown name)."""
    from lightning_dfl.registry import Registry

    classes = [__getattr__(name) for name in _CLASSES]
    return Registry("algorithm", [(cls.name, cls) for cls in classes])


def __getattr__(name: str) -> Any:
    if name == "ALGORITHMS":
        value = _registry()
    elif name in _CLASSES or name in _BASE:
        module = importlib.import_module(f"{__name__}.{(_CLASSES | _BASE)[name]}")
        value = getattr(module, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
