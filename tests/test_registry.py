from __future__ import annotations

import pytest

from lightning_dfl.registry import Registry


def test_register_get_and_mapping_protocol():
    reg: Registry[object] = Registry("topology")
    assert reg.add("ring", 1) == 1
    reg.add("full", 2)
    assert reg.get("ring") == 1 and reg["full"] == 2
    assert "ring" in reg and "star" not in reg
    assert len(reg) == 2 and list(reg) == ["ring", "full"] and dict(reg) == {"ring": 1, "full": 2}
    assert reg.get("star", None) is None  # an explicit default, as dict.get


def test_unknown_name_lists_the_allowed_ones():
    reg = Registry("topology", {"ring": 1, "full": 2, "time_varying": 3})
    with pytest.raises(ValueError, match=r"^unknown topology 'star'; allowed: full, ring, time_varying$"):
        reg.get("star")
    with pytest.raises(ValueError, match="unknown topology 'star'"):
        reg.build("star")
    with pytest.raises(KeyError, match="unknown topology 'star'"):
        reg["star"]


def test_a_name_twice_is_refused():
    reg = Registry("algorithm", [("dispfl", 1)])
    with pytest.raises(ValueError, match="algorithm 'dispfl' is already registered"):
        reg.add("dispfl", 2)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("dispfl")(object)
    with pytest.raises(ValueError, match="already registered"):
        Registry("model", [("a", 1), ("a", 2)])
    assert reg.get("dispfl") == 1
    with pytest.raises(ValueError, match="non-empty string"):
        reg.add("", 3)


def test_item_assignment_replaces_and_del_removes():
    reg = Registry("dataset", {"digits": 1, "mnist": 2})
    reg["digits"] = 3  # dict semantics: replaces in place
    assert reg.names() == ["digits", "mnist"] and reg["digits"] == 3
    assert reg.pop("digits") == 3 and reg.names() == ["mnist"]
    assert reg.pop("digits", None) is None


def test_decorator_on_a_class_and_on_a_function():
    reg = Registry("partition")

    @reg.register("iid")
    class IID:
        def __init__(self, k: int = 1) -> None:
            self.k = k

    @reg.register("double")
    def double(x: int) -> int:
        return 2 * x

    assert reg.get("iid") is IID and reg.get("double") is double  # the decorator returns the object itself
    assert reg.build("iid", k=3).k == 3 and reg.build("double", 4) == 8


def test_names_in_registration_order():
    reg = Registry("model")
    for name in ("vgg11", "alexnet", "resnet18"):
        reg.add(name, name.upper())
    assert reg.names() == ["vgg11", "alexnet", "resnet18"]
    assert list(reg.values()) == ["VGG11", "ALEXNET", "RESNET18"]
    assert "model" in repr(reg) and "alexnet" in repr(reg)


def test_project_registries_are_registries():
    from lightning_dfl.datamodules.datasets import DATASETS
    from lightning_dfl.datamodules.partition import PARTITIONERS
    from lightning_dfl.federation.exchange.topology import TOPOLOGIES, FullTopology, RingTopology, build_topology
    from lightning_dfl.models import MODELS

    for reg, kind in ((MODELS, "model"), (DATASETS, "dataset"), (PARTITIONERS, "partition"),
                      (TOPOLOGIES, "topology")):
        assert isinstance(reg, Registry) and reg.kind == kind
    assert TOPOLOGIES.names() == ["time_varying", "time_varying_in_degree", "ring", "full"]
    assert isinstance(build_topology("full", 3), FullTopology)
    assert build_topology("ring", 4).num_neighbors == 4 and TOPOLOGIES.get("ring") is RingTopology
    assert all(cls.name == name for name, cls in PARTITIONERS.items())
