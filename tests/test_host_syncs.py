"""A task never waits for the device per batch or per layer: losses, accuracies, densities and FLOPs stay on
the device until the round reads them together (``lightning_dfl.deferred``).

On a CPU nothing waits, so the accelerators' paths are taken on the CPU (``device_paths_on_cpu``) and every
host read of a tensor's value (``item``, ``bool``, ``float``, ``int``, ``tolist``, ``numpy``, ``nonzero``) is
counted, as a GPU would wait at each. They must also give the very results of the CPU's paths.
"""

import collections
import traceback

import pytest
import torch
from _graph_sim import SimulatedGraphs

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.deferred import device_paths_on_cpu, read_values
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DisPFL
from lightning_dfl.federation.loop import step_graphs
from lightning_dfl.federation.loop.executor import SerialExecutor
from lightning_dfl.federation.store import DenseClientStore
from lightning_dfl.module import SparseClassifier
from lightning_dfl.sparse.rigl import rigl_masks
from lightning_dfl.sparse.select import smallest_k_mask

#: tensor methods that read a value on the host (a GPU waits for its queue at each; ``masked_select`` sizes its
#: output by a read)
_READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "nonzero", "masked_select")


class HostReads:
    """Counts host reads of tensor values while ``active``, by the project line that made them."""

    def __init__(self, monkeypatch):
        self.active = False
        self.where = collections.Counter()
        for name in _READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name), name))
        for name in ("nonzero", "equal", "masked_select"):
            monkeypatch.setattr(torch, name, self._counting(getattr(torch, name), f"torch.{name}"))

    def _counting(self, original, name):
        def counted(*args, **kwargs):
            if self.active and not self._on_host(args[0] if args else None):
                frames = [f for f in traceback.extract_stack()[:-1] if "lightning_dfl" in f.filename
                          or "callbacks" in f.filename or "datamodules" in f.filename]
                where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else "?"
                self.where[(name, where)] += 1
            return original(*args, **kwargs)

        return counted

    #: storages that live on the host whatever the device (the store's slot and value-count bookkeeping)
    host_storages: set = set()

    def _on_host(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() in self.host_storages

    @property
    def total(self) -> int:
        return sum(self.where.values())

    def in_round_one(self, method):
        """``method(executor, ...)`` counting while it runs in round 1 (the store's host-side bookkeeping not
        counted: the dense store's ``_active``, as its ``active`` would read the counts still on the device)."""

        def counted(executor, *args, **kwargs):
            store = executor.state.store
            self.host_storages = {t.untyped_storage().data_ptr() for t in (store.slot, getattr(store, "_active", store.slot))}
            self.active = executor.state.progress.round_idx == 1
            try:
                return method(executor, *args, **kwargs)
            finally:
                self.active = False

        return counted


def _fit(tmp_path, batch_size=16, rounds=2, count=None, store="dense", regrowth="random", cuda_graphs=False,
         batched=False):
    """A DisPFL run on digits (random regrowth unless said); with ``count``, the host reads of round 1's tasks."""
    dm = FederatedDataModule(dataset="digits", num_clients=4, batch_size=batch_size, test_samples_per_client=40)
    trainer = FederatedTrainer(DisPFL(num_neighbors=2, regrowth=regrowth), rounds=rounds, local_epochs=1,
                               accelerator="cpu", logger=False, enable_progress_bar=False, diagnostics=False,
                               default_root_dir=str(tmp_path), store=store, cuda_graphs=cuda_graphs,
                               batched_clients=batched)
    if count is not None:
        run_task = SerialExecutor.run_task
        SerialExecutor.run_task = count.in_round_one(run_task)
        try:
            trainer.fit(SparseClassifier("cnn_digits", density=0.5), dm)
        finally:
            SerialExecutor.run_task = run_task
    else:
        trainer.fit(SparseClassifier("cnn_digits", density=0.5), dm)
    return trainer


#: the reads left in a task, one each, by file: none with the dense store and gradient regrowth (the papers'
#: setting: the finite check that fault containment depends on is selected on, not read, RigL's drop counts are
#: computed on the device and the store keeps its value counts there until the round's end); with random regrowth
#: RigL's active counts of every layer (the size of its random draw, made on the host so that a seed draws the
#: same masks on any device); the compact store reads the published model's value count (the size of its record)
#: with whether any weight lies outside its mask, for all layers at once (compact.py), and compares the published
#: and the next mask with the last ones, to share their bytes (records.py, twice).
TASK_READS = {("dense", "random"): ["masks.py"],
              ("dense", "gradient"): [],
              ("compact", "random"): ["compact.py", "records.py", "records.py", "masks.py"],
              ("compact", "gradient"): ["compact.py", "records.py", "records.py"]}


@pytest.mark.parametrize("store, cuda_graphs, regrowth", [("dense", False, "random"), ("compact", False, "random"),
                                                          ("dense", True, "random"), ("dense", False, "gradient"),
                                                          ("compact", True, "gradient")])
def test_a_task_reads_the_device_a_fixed_few_times_whatever_its_batches(monkeypatch, tmp_path, store, cuda_graphs,
                                                                         regrowth):
    """Every task of a round (a later one must not read what an earlier one left on the device). Also with its steps replayed from graphs (``cuda_graphs``, through the CPU stand-in ``tests/_graph_sim.py``)."""
    monkeypatch.setattr(step_graphs, "graph_backend", lambda device: SimulatedGraphs())
    counts = {}
    for batch_size in (64, 8):  # 4-5 vs 30+ training batches, 1 vs 1 evaluation batch
        reads = HostReads(monkeypatch)
        with device_paths_on_cpu():
            trainer = _fit(tmp_path / str(batch_size), batch_size=batch_size, count=reads, store=store,
                           cuda_graphs=cuda_graphs, regrowth=regrowth)
        counts[batch_size] = reads
        if cuda_graphs:
            assert trainer.federation.worker.step_graphs.counts["replayed"] > 0
    few, many = counts[64], counts[8]
    assert few.total == many.total, (few.where, many.where)  # nothing per batch, nothing per layer
    assert sorted(where.split(":")[0] for (_, where), n in many.where.items() for _ in range(n)) == \
        sorted(TASK_READS[store, regrowth] * 4), many.where  # each of the round's 4 tasks alike


@pytest.mark.parametrize("store, regrowth, batched", [("dense", "random", False), ("compact", "random", False),
                                                      ("dense", "gradient", False), ("dense", "gradient", True)])
def test_the_device_paths_give_the_cpu_paths_results_bit_for_bit(tmp_path, store, regrowth, batched):
    plain = _fit(tmp_path / "plain", store=store, regrowth=regrowth, batched=batched)
    with device_paths_on_cpu():
        device = _fit(tmp_path / "device", store=store, regrowth=regrowth, batched=batched)
    strip = [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in plain.history]
    assert strip == [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in device.history]
    for node in range(4):
        a, b = plain.store.state(node), device.store.state(node)
        for part in ("weights", "mask", "published_mask"):
            for name, tensor in getattr(a, part).items():
                assert torch.equal(tensor, getattr(b, part)[name]), (node, part, name)


@pytest.mark.parametrize("regrowth, reads", [("gradient", {}), ("random", {"masks.py": 4})])
def test_batched_clients_read_the_device_as_serial_tasks_do(monkeypatch, tmp_path, regrowth, reads):
    """A level of 4 clients trained together (``batched_clients``): the same reads as 4 serial tasks, none by
    gradient (after the first round, which sizes the groups from a measured step)."""
    from lightning_dfl.federation.loop.batched import BatchedExecutor

    count = HostReads(monkeypatch)
    monkeypatch.setattr(BatchedExecutor, "run", count.in_round_one(BatchedExecutor.run))
    with device_paths_on_cpu():
        trainer = _fit(tmp_path, regrowth=regrowth, batched=True)
    assert type(trainer.executor) is BatchedExecutor
    found = collections.Counter()
    for (_, where), n in count.where.items():
        found[where.split(":")[0]] += n
    assert dict(found) == reads, count.where


def test_the_dense_store_reads_a_rounds_value_counts_once_at_its_end(monkeypatch):
    """On an accelerator a published model's value count (its messages' bytes) stays on the device: publishing reads
    nothing, the round's end reads every count at once, and the counts are the masks' (plus unmasked entries)."""
    template = {"w": torch.zeros(4, 5), "b": torch.zeros(5)}
    gen = torch.Generator().manual_seed(0)
    masks = [{"w": torch.rand(4, 5, generator=gen) < 0.5} for _ in range(3)]
    reads = HostReads(monkeypatch)
    with device_paths_on_cpu():
        store = DenseClientStore(template, ["w"], num_nodes=3)
        for node in range(3):
            store.initialize(node, template, masks[node])
        store.end_round()
        reads.host_storages = {t.untyped_storage().data_ptr() for t in (store.slot, store.active)}  # host-side
        reads.active = True
        for node in range(3):
            store.publish(node, template, {"w": ~masks[node]["w"]})
        assert reads.total == 0, reads.where
        store.end_round()
        assert reads.total == 1
        reads.active = False
    assert [store.active_values(node) for node in range(3)] == [int((~m["w"]).sum()) + 5 for m in masks]
    store.publish(0, template, None)  # no mask: every entry, known on the host
    assert store.active_values(0, fresh=True) == 25


@pytest.mark.parametrize("k", [0, 1, 3, 7, 10])
def test_selection_by_stable_sort_equals_the_host_selection(k):
    values = torch.tensor([3.0, float("nan"), 1.0, 1.0, 2.0, 1.0, -4.0, 1.0, float("nan"), 0.5])
    host = smallest_k_mask(values, k)
    with device_paths_on_cpu():
        assert torch.equal(smallest_k_mask(values, k), host)
    assert int(host.sum()) == k
    if k == 3:  # -4, 0.5 and the first of the four 1.0s (ties by position)
        assert host.nonzero().flatten().tolist() == [2, 6, 9]


def test_random_regrowth_on_the_device_path_draws_the_same_masks():
    torch.manual_seed(0)
    weights = {"w": torch.randn(6, 5), "v": torch.randn(40)}
    masks = {"w": torch.rand(6, 5) < 0.5, "v": torch.rand(40) < 0.3}
    host = rigl_masks(weights, masks, 0.4, mode="random", generator=torch.Generator().manual_seed(1))
    with device_paths_on_cpu():
        device = rigl_masks(weights, masks, 0.4, mode="random", generator=torch.Generator().manual_seed(1))
    for name in masks:
        assert torch.equal(host[name], device[name])
        assert int(host[name].sum()) == int(masks[name].sum())  # RigL keeps each layer's density


def test_read_values_reads_tensors_and_keeps_numbers():
    values = [torch.tensor(3, dtype=torch.int64), 0.25, None, torch.tensor(0.1, dtype=torch.float64), float("nan")]
    out = read_values(values)
    assert out[:4] == [3.0, 0.25, None, 0.1]
    assert out[4] != out[4]  # NaN kept
    assert all(not isinstance(v, torch.Tensor) for v in out)
