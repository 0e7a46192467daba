"""Federated algorithms: each plans its rounds on the shared engine."""

from lightning_dfl.federation.algorithms.base import (
    Algorithm,
    RoundContext,
    TaskContext,
    TopologyAlgorithm,
)
from lightning_dfl.federation.algorithms.beer import BEER
from lightning_dfl.federation.algorithms.dadpfl import DADPFL
from lightning_dfl.federation.algorithms.dfedavgm import DFedAvgM
from lightning_dfl.federation.algorithms.dfedsam import DFedSAM
from lightning_dfl.federation.algorithms.ditto import Ditto
from lightning_dfl.federation.algorithms.fedavg import FedAvg
from lightning_dfl.federation.algorithms.feddst import FedDST
from lightning_dfl.federation.algorithms.fedfomo import FedFomo
from lightning_dfl.federation.algorithms.finetune import DPSGDFT, FedAvgFT
from lightning_dfl.federation.algorithms.gossip import DPSGD, DisPFL, Local
from lightning_dfl.federation.algorithms.gossipfl import GossipFL
from lightning_dfl.federation.algorithms.prisam import PRISAM
from lightning_dfl.federation.algorithms.psfl import PSFL
from lightning_dfl.federation.algorithms.subfedavg import SubFedAvg
from lightning_dfl.registry import Registry

#: the algorithms by name (``ALGORITHMS.get(name)`` names the allowed ones for an unknown name)
_ALL = (DisPFL, DADPFL, DPSGD, Local, FedAvg, PSFL, FedAvgFT, DPSGDFT, Ditto, DFedAvgM, DFedSAM, FedDST, SubFedAvg,
        FedFomo, GossipFL, BEER, PRISAM)
ALGORITHMS: Registry = Registry("algorithm", [(cls.name, cls) for cls in _ALL])

__all__ = ["ALGORITHMS", "Algorithm", "BEER", "DADPFL", "DFedAvgM", "DFedSAM", "DPSGD", "DPSGDFT", "DisPFL", "Ditto", "FedAvg",
           "FedAvgFT", "FedDST", "FedFomo", "TopologyAlgorithm", "GossipFL", "Local", "PRISAM", "PSFL", "RoundContext", "SubFedAvg", "TaskContext"]

#: the earlier name of :class:`TopologyAlgorithm` (it means "has a topology": DisPFL and Local derive from it), kept
#: so that user code written against it runs; new code names ``TopologyAlgorithm``
GossipAlgorithm = TopologyAlgorithm
