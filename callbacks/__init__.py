"""Lightning callbacks for sparse training that work in a plain ``Trainer`` and in the federation."""

from lightning_dfl.callbacks.base import FederatedCallback, is_federated
from lightning_dfl.callbacks.rigl import RigL

__all__ = ["FederatedCallback", "RigL", "is_federated"]
