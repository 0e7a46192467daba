"""Lightning callbacks for sparse training that work in a plain ``Trainer`` and in the federation."""

from lightning_dfl.callbacks.base import FederatedCallback, is_federated
from lightning_dfl.callbacks.pqi import PQIPruning
from lightning_dfl.callbacks.rigl import RigL
from lightning_dfl.callbacks.voting import PruningTimeVoting

__all__ = ["FederatedCallback", "PQIPruning", "PruningTimeVoting", "RigL", "is_federated"]
