"""Each process of a sharded run holds only its own nodes (store/partitioned.py): rows, refusals, saved states."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_dfl.federation.loop.ownership import Ownership
from lightning_dfl.federation.store import CompactClientStore, DenseClientStore, StateField
from lightning_dfl.federation.store.factory import load_store_state
from lightning_dfl.federation.store.partitioned import PartitionedStore, interleave_rows, node_rows

TEMPLATE = {"w": torch.zeros(3, 4), "b": torch.zeros(3)}
FIELDS = [StateField("score", shape=(2,), fill=0.0), StateField("shared", shape=(), fill=0.0, published=True),
          StateField("momentum", like="weights")]


def _filled(cls, num_nodes=5, seed=0):
    """A store of ``num_nodes`` nodes with distinct models, masks and fields, one round published."""
    g = torch.Generator().manual_seed(seed)
    store = cls(TEMPLATE, ["w"], num_nodes, fields=FIELDS)
    for k in range(num_nodes):
        mask = {"w": torch.rand(3, 4, generator=g) < 0.6}
        store.initialize(k, {n: torch.randn(t.shape, generator=g) for n, t in TEMPLATE.items()}, mask)
        store.write(k, "score", torch.tensor([k, -k], dtype=torch.float32))
        store.write(k, "momentum", {n: torch.full(t.shape, float(k)) for n, t in TEMPLATE.items()})
    for k in range(0, num_nodes, 2):  # some nodes publish: their slots flip
        store.publish(k, {n: torch.randn(t.shape, generator=g) for n, t in TEMPLATE.items()},
                      {"w": torch.rand(3, 4, generator=g) < 0.5}, {"shared": float(10 + k)})
    store.end_round()
    return store


def _equal(a, b):
    if isinstance(a, dict):
        return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("cls", [DenseClientStore, CompactClientStore])
@pytest.mark.parametrize("world", [2, 3])
def test_each_process_rows_interleave_back_into_the_whole_store(cls, world):
    whole = _filled(cls)
    state = whole.state_dict()
    parts = []
    for rank in range(world):
        nodes = list(range(rank, 5, world))
        local = cls(TEMPLATE, ["w"], len(nodes), fields=FIELDS)
        load_store_state(local, node_rows(state, whole.field_specs, nodes))
        for row, k in enumerate(nodes):  # the local row holds the node's model, masks and fields
            assert _equal(local.published(row), whole.published(k)) and _equal(local.mask(row), whole.mask(k))
            assert _equal(local.read(row, "momentum"), whole.read(k, "momentum"))
            assert float(local.read(row, "shared")) == float(whole.read(k, "shared"))
        parts.append(local.state_dict())
    assert _equal(interleave_rows(parts, whole.field_specs, 5), state)


def _partitioned(rank, world=2, cls=DenseClientStore):
    whole = _filled(cls)
    nodes = list(range(rank, 5, world))
    local = cls(TEMPLATE, ["w"], len(nodes), fields=FIELDS)
    store = PartitionedStore(local, Ownership(rank=rank, world_size=world), 5)
    store.load_state_dict(whole.state_dict())
    return store, whole


def test_a_process_answers_for_its_own_nodes_by_their_global_index():
    store, whole = _partitioned(rank=1)
    assert store.owned_nodes() == [1, 3] and store.local.num_nodes == 2
    assert _equal(store.published(3), whole.published(3)) and _equal(store.mask(1), whole.mask(1))
    assert store.active_values(3) == whole.active_values(3)
    layout = store.layout()
    assert layout.num_nodes == 5 and layout.fields["score"][""][0] == (5, 2)
    assert layout.fields["shared"][""][0] == (2, 5)


def test_another_process_node_is_refused_naming_its_owner_and_its_writes_are_the_owner_s():
    store, whole = _partitioned(rank=1)
    with pytest.raises(RuntimeError, match="the current mask of node 2 is held by process 0, not by this process "
                                           r"\(1 of 2\)"):
        store.mask(2)
    with pytest.raises(RuntimeError, match="node 4's start-of-round model is not on process 1: it is held by process "
                                           "0 and was not among the sources of this process's tasks"):
        store.published(4)
    with pytest.raises(RuntimeError, match="the private field 'score' of node 0 is held by process 0"):
        store.read(0, "score")
    before = store.local.state_dict()
    store.write(0, "score", torch.tensor([9.0, 9.0]))  # node 0's owner writes the same in its set-up
    store.initialize(2, {n: torch.ones(t.shape) for n, t in TEMPLATE.items()}, None)
    assert _equal(store.local.state_dict(), before)
    with pytest.raises(RuntimeError, match="publishing the model of node 2 is held by process 0"):
        store.publish(2, {n: torch.ones(t.shape) for n, t in TEMPLATE.items()}, None)


def test_more_processes_than_nodes_is_refused_before_anything_is_allocated():
    from lightning_dfl.federation.store.factory import build_store

    with pytest.raises(ValueError, match=r"3 processes for 2 nodes \(clients plus servers\): process 2 would own "
                                         "none; use at most 2 processes"):
        build_store("dense", "cpu", {"w": torch.zeros(2)}, None, [], 2, 2, False, 0, torch.device("cpu"), 3,
                    Ownership(rank=2, world_size=3))


SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from lightning_dfl.datamodules import FederatedDataModule
    from lightning_dfl.federation import FederatedTrainer
    from lightning_dfl.federation.algorithms import DisPFL
    from lightning_dfl.module import SparseClassifier

    out, devices, store_kind = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    trainer = FederatedTrainer(algorithm=DisPFL(num_neighbors=2), rounds=2, local_epochs=None, local_steps=1,
                               accelerator="cpu", devices=devices, store=store_kind, logger=False,
                               enable_progress_bar=False, default_root_dir=str(out))
    trainer.fit(SparseClassifier("cnn_digits", density=0.5),
                FederatedDataModule(dataset="digits", num_clients=5, batch_size=16, test_samples_per_client=10))
    store = trainer.store
    local = getattr(store, "local", store)
    row = {"type": type(store).__name__, "local_nodes": local.num_nodes, "nbytes": local.nbytes(),
           "owned": store.owned_nodes() if hasattr(store, "owned_nodes") else list(range(store.num_nodes))}
    if store_kind == "dense":
        row["weight_rows"] = {n: t.shape[1] for n, t in local.weights.items()}
    try:
        store.mask((trainer.global_rank + 1) % 2)
        row["other_read"] = "allowed"
    except RuntimeError as err:
        row["other_read"] = str(err)
    (out / f"rank{trainer.global_rank}-{devices}.json").write_text(json.dumps(row))
""")


@pytest.mark.parametrize("store_kind", ["dense", "compact"])
def test_each_process_of_a_two_process_run_holds_only_its_own_clients(tmp_path, store_kind):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    for devices in (1, 2):
        done = subprocess.run([sys.executable, str(script), str(tmp_path), str(devices), store_kind],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    one = json.loads((tmp_path / "rank0-1.json").read_text())
    ranks = [json.loads((tmp_path / f"rank{r}-2.json").read_text()) for r in (0, 1)]
    assert one["type"] == "DenseClientStore" if store_kind == "dense" else one["type"] == "CompactClientStore"
    assert [r["type"] for r in ranks] == ["PartitionedStore"] * 2
    assert [r["owned"] for r in ranks] == [[0, 2, 4], [1, 3]] and [r["local_nodes"] for r in ranks] == [3, 2]
    if store_kind == "dense":  # every stacked tensor holds the process's own nodes only
        assert [set(r["weight_rows"].values()) for r in ranks] == [{3}, {2}]
        assert [r["nbytes"] for r in ranks] == [one["nbytes"] * 3 // 5, one["nbytes"] * 2 // 5]
    else:  # records of its own nodes: about its share of the one-process store
        assert sum(r["nbytes"] for r in ranks) == pytest.approx(one["nbytes"], rel=0.05)
    assert ranks[0]["other_read"].startswith("the current mask of node 1 is held by process 1")
    assert ranks[1]["other_read"].startswith("the current mask of node 0 is held by process 0")


RECEIVE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_partitioned_store import special_store
    from lightning_dfl.federation.loop.ownership import Ownership
    from lightning_dfl.federation.store import CompactClientStore, DenseClientStore
    from lightning_dfl.federation.store.factory import load_store_state
    from lightning_dfl.federation.store.partitioned import PartitionedStore, node_rows

    rank, kind, init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    cls = CompactClientStore if kind == "compact" else DenseClientStore
    whole = special_store(cls)
    own = Ownership(rank=rank, world_size=2)
    owned = list(range(rank, whole.num_nodes, 2))
    from test_partitioned_store import TEMPLATE, FIELDS
    local = cls(TEMPLATE, ["w"], len(owned), fields=FIELDS)
    load_store_state(local, node_rows(whole.state_dict(), whole.field_specs, owned))
    store = PartitionedStore(local, own, whole.num_nodes)
    others = [k for k in range(whole.num_nodes) if k % 2 != rank]
    routes = [(k, False, k % 2, rank) for k in others] + [(k, False, rank, 1 - rank) for k in owned]
    store.receive(sorted(routes, key=lambda r: r[0]))
    exact = []
    for k in others:
        mine, theirs = store.published(k), whole.published(k)
        exact.append(all(torch.equal(mine[0][n].view(torch.int32), theirs[0][n].view(torch.int32)) for n in TEMPLATE)
                     and all(torch.equal(mine[1][n], theirs[1][n]) for n in ["w"])
                     and store.active_values(k) == whole.active_values(k)
                     and float(store.read(k, "shared")) == float(whole.read(k, "shared")))
    held = store.nbytes() - local.nbytes()
    store.receive(sorted(routes, key=lambda r: r[0]))  # held already: nothing moves again
    again = store.received_bytes
    store.keep_only([(rank, others[0], False)])
    kept = sorted(k for k, _ in store._inbox)
    dist.destroy_process_group()
    print(json.dumps({"exact": exact, "held": held, "received": again, "kept": kept}))
""")


def special_store(cls):
    """:func:`_filled` with one node's inactive zeros ``-0.0`` (a bare ``p.mul_(mask)``) and another's value
    outside its mask (a server's model): what a compact record keeps beyond the active values."""
    store, g = _filled(cls), torch.Generator().manual_seed(1)
    mask = {"w": torch.tensor([[True, False, True, False]] * 3)}
    negative = {"w": torch.where(mask["w"], torch.randn(3, 4, generator=g), torch.tensor(-0.0)),
                "b": torch.randn(3, generator=g)}
    leaking = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(3, generator=g)}
    for k, weights in ((1, negative), (3, leaking)):
        store.publish(k, weights, mask, {"shared": float(k)})
    store.end_round()
    return store


@pytest.mark.parametrize("kind", ["dense", "compact"])
def test_a_received_record_is_the_owner_s_bit_for_bit_and_a_compact_one_travels_compact(tmp_path, kind):
    assert torch.signbit(special_store(CompactClientStore).published(1)[0]["w"][:, 1]).all()  # -0.0 kept
    script = tmp_path / "receive.py"
    script.write_text(RECEIVE_SCRIPT)
    init = f"file://{tmp_path / 'rendezvous'}"
    here = str(__import__("pathlib").Path(__file__).parent)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), kind, init, here], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    rows = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert [all(r["exact"]) for r in rows] == [True, True] and [len(r["exact"]) for r in rows] == [2, 3]
    dense_record = 4 * (12 + 3) + 12 + 4  # float32 weights, mask bytes, the published field
    if kind == "dense":
        assert [r["held"] for r in rows] == [2 * dense_record, 3 * dense_record]
    else:  # node 1: 6 active values of w, b, 2 bytes of mask bits, 1 of zero signs, the field; node 3's w whole
        assert rows[0]["held"] == (4 * (6 + 3) + 2 + 1 + 4) + (4 * (12 + 3) + 2 + 4)
        assert rows[1]["held"] < 3 * dense_record
    # what was received is held, and the value counts (8 bytes each); the second receive moved nothing
    assert [r["received"] for r in rows] == [rows[0]["held"] + 2 * 8, rows[1]["held"] + 3 * 8]
    assert [r["kept"] for r in rows] == [[1], [0]]


def test_tasks_per_receive_is_refused_on_one_process_and_for_a_replicated_algorithm():
    from lightning_dfl.datamodules import FederatedDataModule
    from lightning_dfl.federation import FederatedTrainer
    from lightning_dfl.federation.algorithms import DPSGD
    from lightning_dfl.module import SparseClassifier

    class Replicated(DPSGD):
        """A user's algorithm that keeps every node on every process."""

        partitionable = False

    with pytest.raises(ValueError, match=r"tasks_per_receive=4 bounds what each of several processes receives at a "
                                         r"time, but this run has one process"):
        FederatedTrainer(tasks_per_receive=4, accelerator="cpu", logger=False)
    with pytest.raises(ValueError, match=r"tasks_per_receive \(None: a whole plan level's sources at once\) must be"):
        FederatedTrainer(tasks_per_receive=0, devices=2, accelerator="cpu", logger=False)
    trainer = FederatedTrainer(algorithm=Replicated(num_neighbors=2), tasks_per_receive=4, devices=2, accelerator="cpu", logger=False,
                               enable_progress_bar=False)
    with pytest.raises(ValueError, match="tasks_per_receive=4 bounds the sources each process receives from a "
                                         "partitioned store, but Replicated keeps every node on every process"):
        trainer.fit(SparseClassifier("cnn_digits"), FederatedDataModule(dataset="digits", num_clients=4))


def test_the_partitioned_algorithms_are_the_ones_the_docs_name():
    from pathlib import Path

    from lightning_dfl.federation import ALGORITHMS

    partitioned = {n for n in ALGORITHMS.names() if ALGORITHMS.get(n).declares("partitionable")}
    assert partitioned == set(ALGORITHMS.names()) and len(partitioned) == 17  # every shipped algorithm
    docs = (Path(__file__).resolve().parents[1] / "docs" / "devices.md").read_text()
    assert "all 17 algorithms declare `partitionable = True`" in docs
