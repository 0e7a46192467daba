"""The client store: what every node publishes, its current mask and its declared fields, kept off the worker.

* :mod:`~.protocol`: :class:`ClientStore`, what a store is, with the logic both stores share;
* :mod:`~.fields`: :class:`StateField` (a declared per-node value), :class:`ClientState`, :class:`ClientFields`;
* :mod:`~.dense`: :class:`DenseClientStore` (``store="dense"``, the default), two dense slots per node;
* :mod:`~.compact`: :class:`CompactClientStore` (``store="compact"``), active values plus packed mask bits;
* :mod:`~.records`: the compact record codec (checkpoints and ``export`` read saved stores through it) and the
  compact format's check; :mod:`~.saved_state`: a saved store's layout and the checks both formats share;
* :mod:`~.memory`: where a store lives and whether it fits; :mod:`~.factory`: the run's store, built.
"""

from lightning_dfl.federation.store.compact import CompactClientStore
from lightning_dfl.federation.store.dense import DenseClientStore
from lightning_dfl.federation.store.fields import ClientFields, ClientState, StateField
from lightning_dfl.federation.store.protocol import ClientStore

__all__ = ["ClientFields", "ClientState", "ClientStore", "CompactClientStore", "DenseClientStore", "StateField"]
