"""Each store checks its own saved format (ClientStore.check_saved_state), before anything loads: either
backend's state fits a store of either backend's layout, and what does not fit is one SavedStateError."""

import pytest
import torch

from lightning_dfl.federation.store import CompactClientStore, DenseClientStore, StateField
from lightning_dfl.federation.store.factory import check_store_state
from lightning_dfl.federation.store.saved_state import SavedStateError, StoreLayout

TEMPLATE = {"fc.weight": torch.zeros(6, 5), "fc.bias": torch.zeros(6)}
FIELDS = [StateField("x/pub", shape=(3,), published=True)]


def _stores(nodes=4):
    gen = torch.Generator().manual_seed(0)
    stores = [cls(TEMPLATE, ["fc.weight"], nodes, fields=FIELDS) for cls in (DenseClientStore, CompactClientStore)]
    for k in range(nodes):
        weights = {n: torch.randn(t.shape, generator=gen) for n, t in TEMPLATE.items()}
        mask = {"fc.weight": torch.rand(6, 5, generator=gen) < 0.5}
        for store in stores:
            store.initialize(k, weights, mask)
    return stores


def test_either_backends_state_fits_either_layout():
    dense, compact = _stores()
    for saved in (dense.state_dict(), compact.state_dict()):
        for store in (dense, compact):
            check_store_state(saved, StoreLayout.of(store))
    DenseClientStore.check_saved_state(dense.state_dict(), StoreLayout.of(compact))
    CompactClientStore.check_saved_state(compact.state_dict(), StoreLayout.of(dense))


def test_what_does_not_fit_is_one_line_from_the_stores_own_check():
    dense, compact = _stores()
    layout = StoreLayout.of(_stores(nodes=5)[0])
    with pytest.raises(SavedStateError, match="its store's weights 'fc.weight' hold 4 nodes, this run has 5"):
        DenseClientStore.check_saved_state(dense.state_dict(), layout)
    with pytest.raises(SavedStateError, match="its compact store holds records of 4 nodes, this run has 5"):
        CompactClientStore.check_saved_state(compact.state_dict(), layout)
    damaged = compact.state_dict()
    damaged["records"][1] = {**damaged["records"][1], "active": -1}
    with pytest.raises(SavedStateError, match=r"its record of node 1: active count -1, expected an int >= 0"):
        check_store_state(damaged, StoreLayout.of(compact))
    with pytest.raises(SavedStateError, match="its store has format 'sparse'"):
        check_store_state({**dense.state_dict(), "format": "sparse"}, StoreLayout.of(dense))
    unmarked = {k: v for k, v in compact.state_dict().items() if k != "format"}
    with pytest.raises(SavedStateError, match="neither a dense store nor a compact one"):
        check_store_state(unmarked, StoreLayout.of(dense))
    assert issubclass(SavedStateError, ValueError)
