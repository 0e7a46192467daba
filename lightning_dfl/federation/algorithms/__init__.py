"""Federated algorithms: each plans its rounds on the shared engine."""

from lightning_dfl.federation.algorithms.base import (
    Algorithm,
    GossipAlgorithm,
    RoundContext,
    TaskContext,
)
from lightning_dfl.federation.algorithms.dadpfl import DADPFL
from lightning_dfl.federation.algorithms.fedavg import FedAvg
from lightning_dfl.federation.algorithms.gossip import DPSGD, DisPFL, Local
from lightning_dfl.federation.algorithms.psfl import PSFL
from lightning_dfl.registry import Registry

#: the algorithms by name (``ALGORITHMS.get(name)`` names the allowed ones for an unknown name)
ALGORITHMS: Registry = Registry("algorithm", [(cls.name, cls) for cls in (DisPFL, DADPFL, DPSGD, Local, FedAvg, PSFL)])

__all__ = ["ALGORITHMS", "Algorithm", "DADPFL", "DPSGD", "DisPFL", "FedAvg", "GossipAlgorithm", "Local", "PSFL",
           "RoundContext", "TaskContext"]
