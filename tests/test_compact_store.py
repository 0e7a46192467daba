"""The compact client store (``store="compact"``): the dense store's API and results, bit for bit, in less memory."""

import contextlib
import importlib.util
import re
import warnings
from pathlib import Path

import pytest
import torch
from _helpers import Kill

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.deferred import device_paths_on_cpu
from lightning_dfl.federation import FederatedTrainer, RoundPlan, Source, Task
from lightning_dfl.federation.algorithms import BEER, DADPFL, PRISAM, PSFL, DFedAvgM, DFedSAM, DisPFL, GossipFL
from lightning_dfl.federation.loop.start_reads import StartReads
from lightning_dfl.federation.metrics.spread import (
    consensus_distances,
    flip_fractions,
    jaccard_matrix,
    jaccard_pairs,
    packed_masks,
    popcount,
)
from lightning_dfl.federation.store import CompactClientStore, DenseClientStore, StateField
from lightning_dfl.federation.store.factory import STORE_KINDS, check_store_kind, load_store_state
from lightning_dfl.federation.store.memory import check_store_fits, compact_store_bytes, dense_store_bytes
from lightning_dfl.federation.store.records import BIT_ORDER, checkpoint_weights, pack_bits_all
from lightning_dfl.federation.trainer.checkpoint_file import read_state
from lightning_dfl.module import SparseClassifier
from lightning_dfl.sparse.bits import pack_bits, unpack_bits

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

_spec = importlib.util.spec_from_file_location("golden_record", Path(__file__).parent / "golden" / "record.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


def bits_of(t):
    """A tensor's raw bytes (``-0.0`` differs from ``0.0``, NaN payloads count)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits_of(a), bits_of(b)), what


FIELDS = [StateField("x/scalar", fill=float("nan")), StateField("x/pub", shape=(3,), published=True),
          StateField("x/momentum", like="weights"), StateField("x/hist", like="mask", dtype=torch.float16),
          StateField("x/pubw", like="weights", published=True)]


def _template():
    return {"conv.weight": torch.zeros(4, 3, 3, 3), "conv.bias": torch.zeros(4), "fc.weight": torch.zeros(10, 36),
            "fc.bias": torch.zeros(10), "bn.running_var": torch.zeros(4, dtype=torch.float64)}


MASKED = ["conv.weight", "fc.weight"]


def _pair(nodes=5, fields=FIELDS):
    template = _template()
    return (DenseClientStore(template, MASKED, nodes, fields=fields),
            CompactClientStore(template, MASKED, nodes, fields=fields))


def _model(gen, density=0.5, negative_zeros=True, leak=False):
    weights = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in _template().items()}
    masks = {n: torch.rand(weights[n].shape, generator=gen) < density for n in MASKED}
    for n, m in masks.items():
        if negative_zeros:
            weights[n].mul_(m)  # as the module's apply_: -0.0 where a negative weight is pruned
        else:
            weights[n].masked_fill_(~m, 0.0)
    if leak:  # a value outside the mask (a server's average, a mask changed without zeroing)
        weights["fc.weight"].view(-1)[(~masks["fc.weight"]).view(-1).nonzero()[0]] = 0.25
    return weights, masks


def assert_same(dense, compact, fresh_nodes=()):
    assert compact.names == dense.names and compact.masked_names == dense.masked_names
    assert compact.masked_size() == dense.masked_size()
    for node in range(dense.num_nodes):
        for fresh in (False, True) if node in fresh_nodes else (False,):
            (wd, md), (wc, mc) = dense.published(node, fresh), compact.published(node, fresh)
            assert list(wc) == list(wd) and list(mc) == list(md)
            for n in wd:
                assert_bitwise(wd[n], wc[n], (node, fresh, n))
            for n in md:
                assert_bitwise(md[n], mc[n], (node, fresh, n))
            assert compact.active_values(node, fresh) == dense.active_values(node, fresh)
        for n, m in dense.mask(node).items():
            assert_bitwise(m, compact.mask(node)[n], (node, "mask", n))
        for name in dense.fields:
            d, c = dense.read(node, name), compact.read(node, name)
            for part in (d if isinstance(d, dict) else {"": d}):
                assert_bitwise(d[part] if isinstance(d, dict) else d, c[part] if isinstance(c, dict) else c)


def test_bits_round_trip_and_pack_like_numpy():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 64, 1001):
        b = torch.rand(n, generator=gen) < 0.3
        packed = pack_bits(b, BIT_ORDER)
        assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
        assert torch.equal(unpack_bits(packed, n, BIT_ORDER), b)
        expected = sum(int(b[i]) << (i % 8) for i in range(min(n, 8)))
        assert int(packed[0]) == expected  # little-endian within a byte
        with device_paths_on_cpu():  # the path of a store on a GPU
            assert torch.equal(pack_bits(b, BIT_ORDER), packed)
            assert torch.equal(unpack_bits(packed, n, BIT_ORDER), b)


@pytest.mark.parametrize("device_paths", [False, True], ids=["cpu-paths", "accelerator-paths"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_keep_their_bits(dtype, device_paths):
    with device_paths_on_cpu() if device_paths else contextlib.nullcontext():
        _other_dtypes_keep_their_bits(dtype)


def _other_dtypes_keep_their_bits(dtype):
    template = {"w": torch.zeros(7, 9, dtype=dtype), "b": torch.zeros(7, dtype=dtype)}
    dense, compact = (cls(template, ["w"], 2) for cls in (DenseClientStore, CompactClientStore))
    gen = torch.Generator().manual_seed(6)
    for node in range(2):
        weights = {n: torch.randn(t.shape, generator=gen).to(dtype) for n, t in template.items()}
        mask = {"w": torch.rand(7, 9, generator=gen) < 0.4}
        for store in (dense, compact):
            store.initialize(node, weights, mask)
    assert_same(dense, compact)
    assert not any(compact.records[k]["neg"] for k in range(2))  # pruned weights are stored as +0.0
    for node in range(2):
        weights = {n: torch.randn(t.shape, generator=gen).to(dtype) for n, t in template.items()}
        weights["w"].mul_(mask["w"])  # a bare product: -0.0 where a negative weight is masked
        for store in (dense, compact):
            store.publish(node, weights, mask)
    assert_same(dense, compact, fresh_nodes=(0, 1))
    assert all(compact.fresh_records[k]["neg"] for k in range(2))  # their -0.0 are kept


def test_a_model_of_several_dtypes_and_kept_tensors_expands_bit_for_bit_on_the_accelerator_paths():
    """The accelerators' expansion (every mask unpacked at once, one buffer per dtype): masked parameters of two
    dtypes, one dense-kept (a value outside its mask), one all-active, one with -0.0 outside its mask."""
    template = {"a": torch.zeros(5, 7), "b": torch.zeros(3, 11, dtype=torch.float64), "c": torch.zeros(13),
                "d": torch.zeros(2, 9), "e": torch.zeros(4, 4), "bias": torch.zeros(6)}
    masked = ["a", "b", "c", "d", "e"]
    gen = torch.Generator().manual_seed(4)
    weights = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in template.items()}
    masks = {n: torch.rand(template[n].shape, generator=gen) < 0.5 for n in masked}
    masks["d"][:] = True  # all active
    for n in masked:
        weights[n].masked_fill_(~masks[n], 0.0)
    weights["c"][(~masks["c"]).nonzero()[0]] = 0.5  # a value outside the mask: kept whole
    weights["e"][~masks["e"]] = -0.0  # signed zeros outside the mask
    dense = DenseClientStore(template, masked, 1)
    with device_paths_on_cpu():
        compact = CompactClientStore(template, masked, 1)
        for store in (dense, compact):
            store.initialize(0, weights, masks)
            store.publish(0, weights, masks)  # as trained: the leak and the signed zeros kept
        record = compact.fresh_records[0]
        assert record["values"]["c"].numel() == 13 and "e" in record["neg"] and record["values"]["d"].numel() == 18
        (wd, md), (wc, mc) = dense.published(0, fresh=True), compact.published(0, fresh=True)
    for n in template:
        assert_bitwise(wd[n], wc[n], n)
    for n in masked:
        assert_bitwise(md[n], mc[n], n)


def test_store_kind_is_validated_with_the_allowed_values():
    assert STORE_KINDS == ("dense", "compact") and check_store_kind("compact") == "compact"
    with pytest.raises(ValueError, match="store must be one of 'dense', 'compact', got 'sparse'"):
        FederatedTrainer(store="sparse", accelerator="cpu", logger=False, enable_progress_bar=False)


@pytest.mark.parametrize("device_paths", [False, True], ids=["cpu-paths", "accelerator-paths"])
def test_every_read_matches_the_dense_store_bit_for_bit_over_rounds(device_paths):
    with device_paths_on_cpu() if device_paths else contextlib.nullcontext():
        _every_read_matches_the_dense_store_bit_for_bit_over_rounds()


def _every_read_matches_the_dense_store_bit_for_bit_over_rounds():
    dense, compact = _pair()
    gen = torch.Generator().manual_seed(1)
    for node in range(5):
        weights, masks = _model(gen)
        for store in (dense, compact):
            store.initialize(node, weights, masks if node else None)
    assert_same(dense, compact)
    for round_idx in range(3):
        writers = [k for k in range(5) if (k + round_idx) % 2 == 0]
        for k in writers:
            weights, masks = _model(gen, density=0.5 - 0.1 * round_idx, negative_zeros=k % 2 == 0, leak=k == 2)
            fields = {"x/pub": torch.full((3,), float(k + round_idx)), "x/pubw": weights} if k != 4 else None
            nxt = {n: torch.rand(m.shape, generator=gen) < 0.4 for n, m in masks.items()}
            momentum = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in weights.items()}
            for store in (dense, compact):
                store.publish(k, weights, masks if k != 3 else None, fields)
                if k != 1:  # node 1 keeps training with the mask it published
                    store.set_mask(k, nxt)
                store.write(k, "x/scalar", float(round_idx))
                store.read(k, "x/momentum")["fc.weight"].mul_(0.0).add_(momentum["fc.weight"])  # written in place
                store.write(k, "x/hist", {n: m.half() for n, m in nxt.items()})
        assert_same(dense, compact, fresh_nodes=writers)
        sources = [(k, False) for k in range(5)] + [(k, True) for k in writers]
        (wd, md), (wc, mc) = dense.gather(sources), compact.gather(sources)
        for n in wd:
            for a, b in zip(wd[n], wc[n]):
                assert_bitwise(a, b)
        for n in md:
            for a, b in zip(md[n], mc[n]):
                assert_bitwise(a, b)
        for store in (dense, compact):
            store.end_round()
        assert_same(dense, compact)
        state_d, state_c = dense.state(2), compact.state(2)
        for part in ("weights", "published_mask", "mask"):
            for n, t in getattr(state_d, part).items():
                assert_bitwise(t, getattr(state_c, part)[n])


@pytest.mark.parametrize("device_paths", [False, True], ids=["cpu-paths", "accelerator-paths"])
def test_diagnostics_read_the_compact_store_like_the_dense_one(device_paths):
    with device_paths_on_cpu() if device_paths else contextlib.nullcontext():
        _diagnostics_read_the_compact_store_like_the_dense_one()


def _diagnostics_read_the_compact_store_like_the_dense_one():
    dense, compact = _pair(7)
    gen = torch.Generator().manual_seed(2)
    for node in range(7):
        weights, masks = _model(gen, leak=node == 3)
        for store in (dense, compact):
            store.initialize(node, weights, masks)
    clients, pairs = list(range(7)), [(0, 1), (2, 5), (6, 3)]
    names = ["conv.weight", "fc.weight", "fc.bias"]
    assert consensus_distances(dense, clients, names, pairs) == consensus_distances(compact, clients, names, pairs)
    assert torch.equal(jaccard_matrix(dense, clients), jaccard_matrix(compact, clients))
    # the compact store packs its own way (its records' bits, no decoding): the popcounts are the same
    every = [(i, j) for i in clients for j in clients if i < j]
    before = {id(store): packed_masks(store, clients) for store in (dense, compact)}
    assert torch.equal(popcount(before[id(dense)]), popcount(before[id(compact)]))
    assert torch.equal(jaccard_pairs(before[id(dense)], every), jaccard_pairs(before[id(compact)], every))
    for node in (1, 4):
        weights, masks = _model(gen)
        for store in (dense, compact):
            store.publish(node, weights, masks)
            store.end_round()
    flips = [flip_fractions(before[id(store)], packed_masks(store, clients), store.masked_size())
             for store in (dense, compact)]
    assert torch.equal(flips[0], flips[1]) and flips[0][[1, 4]].gt(0.3).all() and flips[0][[0, 2, 3]].eq(0).all()
    # -0.0 outside a mask (a bare product, not the engine's): the block reader takes that row the long way
    weights, masks = _model(gen)
    for store in (dense, compact):
        store.publish(2, weights, masks)
        store.end_round()
    assert compact.records[2]["neg"]
    assert consensus_distances(dense, clients, names, pairs) == consensus_distances(compact, clients, names, pairs)
    for name in MASKED:  # column blocks on and off byte boundaries, weights and masks
        for step in (13, 24, 64):
            for mask in (False, True):
                blocks_d = list(dense.column_blocks(clients, name, mask, step))
                blocks_c = list(compact.column_blocks(clients, name, mask, step))
                assert [s for s, _ in blocks_d] == [s for s, _ in blocks_c] and len(blocks_d) > 1
                for (_, block_d), (_, block_c) in zip(blocks_d, blocks_c):
                    assert_bitwise(block_d, block_c, name)


def test_diagnostics_on_the_accelerator_paths_read_the_host_once_per_masked_block(monkeypatch):
    """A GPU waits at every host read: the consensus distances of a compact store read one count per block of
    a masked parameter (to slice each record's values) and their two results; the packed masks none."""
    dense, compact = _pair(7)
    gen = torch.Generator().manual_seed(5)
    for node in range(7):
        weights, masks = _model(gen, negative_zeros=node != 2, leak=node == 3)
        for store in (dense, compact):
            store.initialize(node, weights, masks)
    reads = []
    for method in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda *a, _o=original, _m=method, **k: (reads.append(_m), _o(*a, **k))[1])
    names = ["conv.weight", "fc.weight", "fc.bias"]
    with device_paths_on_cpu():
        reads.clear()
        got = consensus_distances(compact, list(range(7)), names, [(0, 1), (2, 5), (6, 3)])
        assert sorted(reads) == ["__float__", "__float__", "tolist", "tolist"], reads  # conv, fc: one block each
        reads.clear()
        packed = packed_masks(compact, list(range(7)))
        assert reads == []
    assert got == consensus_distances(dense, list(range(7)), names, [(0, 1), (2, 5), (6, 3)])
    assert torch.equal(popcount(packed), popcount(packed_masks(dense, list(range(7)))))


def test_errors_match_the_dense_store():
    dense, compact = _pair(3)
    gen = torch.Generator().manual_seed(3)
    weights, masks = _model(gen)
    for store in (dense, compact):
        with pytest.raises(RuntimeError, match="read before it was published"):
            store.published(0, fresh=True)
        store.publish(0, weights, masks)
        with pytest.raises(RuntimeError, match="published twice"):
            store.publish(0, weights, masks)
        with pytest.raises(RuntimeError, match="between rounds only"):
            store.state_dict()
        with pytest.raises(RuntimeError, match="write it with publish"):
            store.write(0, "x/pub", torch.zeros(3))


def _ran(dense_or_compact, gen_seed=4, nodes=4):
    store = dense_or_compact
    gen = torch.Generator().manual_seed(gen_seed)
    for node in range(nodes):
        store.initialize(node, *_model(gen))
    for k in (0, 2):
        weights, masks = _model(gen, leak=k == 2)
        store.publish(k, weights, masks, {"x/pub": torch.ones(3) * k})
        store.set_mask(k, {n: ~m for n, m in masks.items()})
        store.write(k, "x/scalar", 7.0)
    store.end_round()
    return store


def test_checkpoints_are_compact_and_either_store_loads_the_others(tmp_path):
    dense, compact = (_ran(s) for s in _pair(4))
    state = compact.state_dict()
    assert state["format"] == "compact" and "weights" not in state
    path = tmp_path / "store.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    for target in _pair(4):  # a dense and a compact store, fresh
        load_store_state(target, loaded)
        assert_same(dense, target)
    with pytest.raises(ValueError, match="a compact store's: load it with store.factory.load_store_state"):
        _pair(4)[0].load_state_dict(loaded)
    compact_from_dense = _pair(4)[1]
    compact_from_dense.load_state_dict(dense.state_dict())
    assert_same(dense, compact_from_dense)
    for node in range(4):
        wd, _ = dense.published(node)
        for n, t in checkpoint_weights(state, node).items():
            assert_bitwise(wd[n], t)
        for n, t in checkpoint_weights(dense.state_dict(), node).items():
            assert_bitwise(wd[n], t)
    other = CompactClientStore({"fc.weight": torch.zeros(10, 36)}, ["fc.weight"], 4, fields=FIELDS)
    with pytest.raises(ValueError, match="does not fit this store"):
        other.load_state_dict(state)


def test_task_views_carry_a_task_between_processes():
    """What sharding does: the owner's task_views are copied into another process's, which marks it published."""
    (_, owner), (_, other) = _pair(4), _pair(4)
    gen = torch.Generator().manual_seed(5)
    for node in range(4):
        weights, masks = _model(gen)
        owner.initialize(node, weights, masks)
        other.initialize(node, weights, masks)
    weights, masks = _model(gen, leak=True)
    owner.publish(1, weights, masks, {"x/pub": torch.arange(3.0)})
    owner.set_mask(1, {n: ~m for n, m in masks.items()})
    owner.write(1, "x/scalar", 3.0)
    sent, received = owner.task_views(1), other.task_views(1)
    assert [t.shape for t in sent] == [t.shape for t in received]
    for source, target in zip(sent, received):
        target.copy_(source)
    other.mark_published(1)
    assert_same(owner, other, fresh_nodes=[1])
    for store in (owner, other):
        store.end_round()
    assert_same(owner, other)


def _erk_store(kind, nodes, arch="cnn_cifar", density=0.5):
    module = SparseClassifier(arch, num_classes=10, in_channels=3, image_size=32, density=density,
                              distribution="erk", seed=0)
    template = {n: t for n, t in module.model.state_dict().items() if t.is_floating_point()}
    store = (CompactClientStore if kind == "compact" else DenseClientStore)(template, list(module.mask.masks), nodes)
    for node in range(nodes):
        store.initialize(node, template, module.draw_initial_masks(torch.Generator().manual_seed(node)))
    dense_fp32 = nodes * sum(t.numel() * 4 for t in template.values())
    return store, module, template, dense_fp32


def test_memory_at_density_half_and_falling_as_masks_shrink():
    store, module, template, dense_fp32 = _erk_store("compact", 4)
    assert store.nbytes() <= 0.55 * dense_fp32
    full = _erk_store("dense", 4)[0].nbytes()
    assert store.nbytes() < 0.2 * full
    before = store.nbytes()
    for node in range(4):  # pruned further (as DA-DPFL's PQI does): half the active weights dropped
        weights, mask = store.published(node)
        pruned = {n: m & (torch.rand(m.shape, generator=torch.Generator().manual_seed(node)) < 0.5)
                  for n, m in mask.items()}
        store.publish(node, {n: w * pruned[n] if n in pruned else w for n, w in weights.items()}, pruned)
        store.set_mask(node, pruned)
    store.end_round()
    assert store.nbytes() < 0.65 * before
    parts = store.breakdown()
    assert sum(parts.values()) == store.nbytes() and parts["current_mask_bits"] == 0  # shared with the published


# -- start-of-round records freed after their last reader ------------------------------------------------


def _ring(k):
    """Every node aggregates itself and its two ring neighbours' start-of-round models."""
    return RoundPlan(0, [Task(n, sources=(Source(n), Source((n - 1) % k), Source((n + 1) % k))) for n in range(k)])


def test_start_reads_release_a_model_after_its_last_reader():
    plan, released, after = _ring(4), [], []
    reads = StartReads(plan, released.append)
    for task in plan.order():
        reads.started(task)
        reads.finished(task)
        after.append(list(released))
    # node 1 is read by tasks 0 and 2 and runs its own task 1: free after task 2; node 2 (read by 1 and 3)
    # and node 0 (read by 3 and 1) when task 3 has read them; node 3 when its own task ends
    assert after == [[], [], [1], [1, 2, 0, 3]]
    chain = RoundPlan(0, [Task(0), Task(1, sources=(Source(0, fresh=True),)), Task(2, sources=(Source(1),))])
    released.clear()
    reads = StartReads(chain, released.append)
    for task in chain.order():  # a fresh read does not hold node 0's start-of-round model; task 2 holds node 1's
        reads.started(task)
        reads.finished(task)
        released.append("|")
    assert released == [0, "|", "|", 1, 2, "|"]
    # a replica is held until its reader ends; one of a node without a task (dropped out) is never released
    replicas = RoundPlan(0, [Task(0, sources=(Source(0), Source(1))), Task(1), Task(2, replicas=(1, 3))])
    released.clear()
    reads = StartReads(replicas, released.append)
    for task in replicas.order():
        reads.started(task)
        released.append("s")
        reads.finished(task)
        released.append("|")
    assert released == ["s", 0, "|", "s", "|", "s", 1, 2, "|"]  # 1: held after its own task, until task 2 ended


def test_the_compact_store_frees_read_models_and_refuses_to_read_them_again():
    k = 8
    dense = DenseClientStore(_template(), MASKED, k)
    compact = CompactClientStore(_template(), MASKED, k)
    gen = torch.Generator().manual_seed(0)
    for node in range(k):
        weights, masks = _model(gen, negative_zeros=False)
        for store in (dense, compact):
            store.initialize(node, weights, masks)
    one_record = compact.nbytes() / k
    plan = _ring(k)
    reads = StartReads(plan, compact.release_start)  # the executor follows the plan's reads of start-of-round models
    peak, freed = 0, []
    for task in plan.order():
        sources = [(s.node, s.fresh) for s in task.sources]
        wd, wc = dense.gather(sources)[0], compact.gather(sources)[0]
        for n in wd:
            for a, b in zip(wd[n], wc[n]):
                assert_bitwise(a, b)
        reads.started(task)
        weights, masks = _model(gen, negative_zeros=False)
        for store in (dense, compact):
            store.publish(task.node, weights, masks)
        peak = max(peak, compact.nbytes())
        reads.finished(task)
        freed.append(sum(r is None for r in compact.records))
    assert freed == [0, 0, 1, 2, 3, 4, 5, 8]  # node n - 1 freed once task n + 1 read it
    assert peak < (k + 3.5) * one_record  # the dense store's semantics hold 2 k models at the end
    with pytest.raises(RuntimeError, match="node 0's start-of-round model was read after it was freed"):
        compact.published(0)
    (wd, md), (wc, mc) = dense.published(0, fresh=True), compact.published(0, fresh=True)
    for n in wd:
        assert_bitwise(wd[n], wc[n])
    for n in md:
        assert_bitwise(md[n], mc[n])
    for store in (dense, compact):
        store.end_round()
    assert_same(dense, compact)
    assert compact.nbytes() < (k + 0.5) * one_record


class FreedRecords(FederatedCallback):
    """The most start-of-round records freed at once, and the store's largest size, at each task's end."""

    def __init__(self):
        self.most_freed, self.peak = 0, 0

    def on_client_end(self, trainer, pl_module, client_id):
        self.most_freed = max(self.most_freed, sum(r is None for r in trainer.store.records))
        self.peak = max(self.peak, trainer.store.nbytes())


def _digits(k=6):
    return FederatedDataModule(dataset="digits", num_clients=k, batch_size=32, test_samples_per_client=20,
                               partition="dirichlet", alpha=0.5, seed=1)


def _fit(algorithm, store, model, callbacks=(), k=6, rounds=3):
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, local_steps=2, logger=False,
                               accelerator="cpu", enable_progress_bar=False, seed=3, store=store,
                               callbacks=list(callbacks))
    trainer.fit(model, _digits(k))
    return trainer


def assert_same_runs(dense, compact):
    assert _no_walls(compact.history) == _no_walls(dense.history)
    for node in range(dense.store.num_nodes):
        (wd, md), (wc, mc) = dense.store.published(node), compact.store.published(node)
        for n in wd:
            assert_bitwise(wd[n], wc[n], (node, n))
        for n in md:
            assert_bitwise(md[n], mc[n], (node, n))


def test_a_ring_round_frees_most_start_models_before_it_ends():
    seen = FreedRecords()

    def model():
        return SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05, seed=1)

    compact = _fit(DisPFL(num_neighbors=2, topology="ring"), "compact", model(), [seen], k=8)
    dense = _fit(DisPFL(num_neighbors=2, topology="ring"), "dense", model(), k=8)
    assert_same_runs(dense, compact)
    assert seen.most_freed >= 5
    assert not any(r["neg"] for r in compact.store.records)  # the engine's pruned weights are +0.0: no sign bits
    assert seen.peak < 1.5 * compact.store.nbytes()  # two records per node would be about 2 x


#: algorithms whose start-of-round records are freed after their last reader, beyond the golden runs'
FREEING = {
    "psfl": lambda: PSFL(clients_per_round=4, sequences=2, sampler="uniform"),  # two chains of two, a server
    "prisam": lambda: PRISAM(ratio=0.5, num_groups=2, warmup_rounds=1, num_neighbors=2),
    "dfedavgm": lambda: DFedAvgM(num_neighbors=2),  # kept momentum, a delta field
    "dfedsam": lambda: DFedSAM(num_neighbors=2, gossip_steps=2),  # two exchanges per round
    "gossipfl": lambda: GossipFL(compress_ratio=0.1),
    "beer": lambda: BEER(gradient_difference="fresh"),  # compressed tracking fields
}


@pytest.mark.parametrize("name", list(FREEING))
def test_other_algorithms_are_bit_identical_to_the_dense_store(name):
    assert vars(type(FREEING[name]())).get("reads_only_sources")  # the class itself opts in

    def make():
        arch = "resnet20" if name == "prisam" else "cnn_digits"
        return FREEING[name](), SparseClassifier(arch=arch, density=1.0, lr=0.05, seed=1)

    runs = {}
    for store in ("dense", "compact"):
        algorithm, model = make()
        runs[store] = _fit(algorithm, store, model)
    assert_same_runs(runs["dense"], runs["compact"])


# -- whole runs: DisPFL and DA-DPFL (voting and PQI firing) on digits, dense vs compact ----------------------


def _run(name, store, root):
    factory, rounds, density, options = golden.RUNS[name]
    golden.RUNS[f"{name}-{store}"] = (factory, rounds, density, {**options, "store": store})
    try:
        return golden.run(f"{name}-{store}", root)
    finally:
        del golden.RUNS[f"{name}-{store}"]


def _no_walls(metrics):
    return [{k: v for k, v in m.items() if "wall" not in k} for m in metrics]


@pytest.mark.parametrize("name", list(golden.RUNS))
def test_runs_are_bit_identical_to_the_dense_store(name, tmp_path):
    dense, compact = _run(name, "dense", str(tmp_path)), _run(name, "compact", str(tmp_path))
    assert len(compact["metrics"]) == len(dense["metrics"]) == golden.RUNS[name][1]
    for round_idx, (d, c) in enumerate(zip(_no_walls(dense["metrics"]), _no_walls(compact["metrics"]))):
        assert c == d, f"round {round_idx}: {sorted(set(d.items()) ^ set(c.items()))}"
    assert compact["clients"] == dense["clients"]
    assert compact["nodes"] == dense["nodes"]  # every node's published weights, published mask, mask: SHA-256
    if name == "dadpfl":  # the voting and PQI callbacks fired
        last = dense["metrics"][-1]
        assert any(m.get("pqi/pruned_clients", 0) > 0 for m in dense["metrics"])
        assert last["voting/share"] > 0 and last["density/mean"] < 0.5


def _trainer(root, callbacks=None, **kwargs):
    """tests/test_checkpoint.py's DA-DPFL run (voting and PQI firing)."""
    return FederatedTrainer(algorithm=DADPFL(num_neighbors=2, max_wait=2, delta_pr=1000.0, target_sparsity=0.7),
                            rounds=6, local_epochs=1, logger=False, accelerator="cpu", enable_progress_bar=False,
                            default_root_dir=str(root), callbacks=callbacks, **kwargs)


def _parts():
    dm = FederatedDataModule(dataset="digits", num_clients=5, batch_size=32, test_samples_per_client=30,
                             partition="dirichlet", alpha=0.3)
    return SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05), dm


def _comparable(history):
    return [{k: v for k, v in m.items() if "wall" not in k} for m in history]


def test_a_resumed_compact_run_is_bit_identical(tmp_path):
    straight = _trainer(tmp_path / "a", store="compact")
    straight.fit(*_parts())
    dense = _trainer(tmp_path / "d")
    dense.fit(*_parts())
    killed = _trainer(tmp_path / "b", callbacks=[Kill(at_round=3)], checkpoint_every=1, store="compact")
    with pytest.raises(KeyboardInterrupt):
        killed.fit(*_parts())
    saved = read_state(killed.checkpoint_path)["store"]
    assert saved["format"] == "compact"
    resumed = _trainer(tmp_path / "b", store="compact")
    resumed.fit(*_parts(), ckpt_path=str(killed.checkpoint_path))
    assert _comparable(resumed.history) == _comparable(straight.history)
    assert _comparable(straight.history) == _comparable(dense.history)
    assert resumed.history[-1]["density/mean"] < 0.5
    for node in range(dense.store.num_nodes):
        for ref in (straight, dense):
            (wr, mr), (w, m) = ref.store.published(node), resumed.store.published(node)
            for n in wr:
                assert_bitwise(wr[n], w[n], (node, n))
            for n in mr:
                assert_bitwise(mr[n], m[n], (node, n))
            for n, t in ref.store.mask(node).items():
                assert_bitwise(t, resumed.store.mask(node)[n])


def test_two_processes_with_the_compact_store_reproduce_one(tmp_path):
    """Sharding (2 gloo processes) carries compact records between processes: DA-DPFL with voting and PQI."""
    spec = importlib.util.spec_from_file_location("sharding_tests", Path(__file__).parent / "test_sharding.py")
    sharding = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sharding)
    config, extra = sharding.RUNS["dadpfl"]
    dense = sharding._fit(tmp_path / "dense", config, extra, devices=1)
    one = sharding._fit(tmp_path / "one", config, [*extra, "--trainer.store", "compact"], devices=1)
    two = sharding._fit(tmp_path / "two", config, [*extra, "--trainer.store", "compact"], devices=2)
    assert sharding._rows(one / "metrics.csv") == sharding._rows(two / "metrics.csv")
    assert sharding._rows(dense / "metrics.csv") == sharding._rows(one / "metrics.csv")
    assert sharding._rows(one / "clients.csv") == sharding._rows(two / "clients.csv")
    a, b = read_state(one / "checkpoints" / "last.ckpt"), read_state(two / "checkpoints" / "last.ckpt")
    assert a["store"]["format"] == "compact"
    for part in ("store", "algorithm", "callbacks", "clock"):
        assert sharding._differences(a[part], b[part], part) == []


# -- a dense store that does not fit is refused before it is allocated ------------------------------------


def test_store_sizes_are_computed_from_the_layout():
    # float32 entries 108 + 4 + 360 + 10, float64 running_var 4: 1,960 bytes a model; 468 masked entries
    assert dense_store_bytes(_template(), MASKED, 5) == 5 * (2 * 1960 + 3 * 468)
    assert dense_store_bytes(_template(), MASKED, 5) <= DenseClientStore(_template(), MASKED, 5).nbytes()
    # half the masked values, the unmasked ones whole, two packed masks (468 / 4 bytes)
    assert compact_store_bytes(_template(), MASKED, 5, 0.5) == int(5 * (0.5 * 468 * 4 + 14 * 4 + 32 + 117))


def test_a_dense_store_larger_than_the_memory_is_refused_with_the_compact_alternative(monkeypatch, tmp_path):
    import lightning_dfl.federation.store.memory as store_memory
    import lightning_dfl.federation.trainer.build as build

    monkeypatch.setattr(store_memory, "available_bytes", lambda: 4096)
    monkeypatch.setattr(build, "check_least_store_fits", lambda *args: None)  # this test is about the exact check
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05, seed=1)
    with pytest.raises(MemoryError, match=r"the dense client store of 6 nodes needs (\d+\.\d) MiB but only 4\.0 KiB of "
                                          r"memory are available: set trainer.store: compact \(about (\d+\.\d) MiB "
                                          r"between rounds at density 0\.50") as refused:
        _fit(DisPFL(num_neighbors=2), "dense", model, rounds=1)
    template = {n: t for n, t in model.model.state_dict().items() if t.is_floating_point()}
    masked = list(model.mask.masks)
    need, compact = (float(x) for x in re.search(r"needs (\S+) MiB.*about (\S+) MiB", str(refused.value)).groups())
    assert need == round(dense_store_bytes(template, masked, 6) / 2**20, 1)
    assert compact == round(compact_store_bytes(template, masked, 6, model.mask.density()) / 2**20, 1)
    compact = _fit(DisPFL(num_neighbors=2), "compact", SparseClassifier(arch="cnn_digits", density=0.5, seed=1),
                   rounds=1)
    assert len(compact.history) == 1  # the compact store is not refused


def test_every_process_of_a_sharded_run_holds_its_own_dense_store(monkeypatch):
    import lightning_dfl.federation.store.memory as store_memory

    need = dense_store_bytes(_template(), MASKED, 5)
    monkeypatch.setattr(store_memory, "available_bytes", lambda: int(1.5 * need))
    check_store_fits("dense", _template(), MASKED, 5, 0.5, "cpu")  # one copy fits
    with pytest.raises(MemoryError, match=r"\(2 processes, a copy each\)"):
        check_store_fits("dense", _template(), MASKED, 5, 0.5, "cpu", processes=2)
    check_store_fits("compact", _template(), MASKED, 5, 0.5, "cpu", processes=2)  # not checked
    monkeypatch.setattr(store_memory, "available_bytes", lambda: None)  # no /proc/meminfo: nothing to check
    check_store_fits("dense", _template(), MASKED, 5, 0.5, "cpu", processes=2)


def test_the_accelerators_records_of_all_layers_at_once_equal_the_hosts():
    """On an accelerator a write checks, packs, selects and compares every layer at once (masks of a multiple of
    8 entries packed together); the records are the host's byte for byte: -0.0 outside one mask, a value outside
    another, an all-active and an all-inactive layer, a current mask partly equal to the published one."""
    template = {"a": torch.zeros(8, 3, 3, 3), "b": torch.zeros(10, 32), "c": torch.zeros(16, 8), "d": torch.zeros(24),
                "e": torch.zeros(40), "bias": torch.zeros(6)}
    masked = ["a", "b", "c", "d", "e"]
    gen = torch.Generator().manual_seed(9)
    weights = {n: torch.randn(t.shape, generator=gen) for n, t in template.items()}
    masks = {n: torch.rand(template[n].shape, generator=gen) < 0.5 for n in masked}
    masks["d"][:] = True
    masks["e"][:] = False
    for n in masked:
        weights[n].mul_(masks[n])  # -0.0 where a negative weight is pruned
    weights["b"][~masks["b"]] = 0.0
    weights["c"][~masks["c"]] = 0.0
    weights["c"][(~masks["c"]).nonzero()[0].tolist()] = 0.5  # a value outside the mask
    weights["e"].zero_()
    nxt = {n: m.clone() for n, m in masks.items()}
    nxt["a"] = torch.rand(template["a"].shape, generator=gen) < 0.5  # only a changes
    records = []
    for paths in (contextlib.nullcontext(), device_paths_on_cpu()):
        with paths:
            store = CompactClientStore(template, masked, 1)
            store.initialize(0, weights, masks)
            store.publish(0, weights, masks)
            store.set_mask(0, nxt)
            records.append((store.fresh_records[0], store.current_bits[0]))
    (host, host_bits), (device, device_bits) = records
    assert "a" in host["neg"] and host["values"]["c"].numel() == 128 and host["values"]["e"].numel() == 0
    for part in ("values", "bits", "neg"):
        assert list(device[part]) == list(host[part])
        for n in host[part]:
            if host[part][n].numel() == 0:  # (numpy's empty selection has no stride to view bytes through)
                assert device[part][n].shape == host[part][n].shape and device[part][n].dtype == host[part][n].dtype
                continue
            assert_bitwise(device[part][n], host[part][n], (part, n))
    assert device["active"] == host["active"]
    for n in masked:  # the current mask shares the published bytes where equal
        assert_bitwise(device_bits[n], host_bits[n], n)
        assert (device_bits[n] is device["bits"][n]) == (n != "a")
    with device_paths_on_cpu():
        parts = pack_bits_all({n: masks[n] for n in masked})
    assert list(parts) == masked and all(torch.equal(parts[n], pack_bits(masks[n], BIT_ORDER)) for n in masked)


def test_the_shared_models_sources_are_streamed_a_few_at_a_time_with_the_same_average():
    """``stream_published`` (the shared model's sources) brings ``per_fetch`` sources at a time and rebuilds one
    at a time; the average is the one of all sources gathered at once, bit for bit."""
    from lightning_dfl.federation.exchange.aggregation import masked_average
    from lightning_dfl.federation.store.protocol import stream_published

    class Counting(CompactClientStore):
        held, most, groups, rebuilt = set(), 0, [], 0

        def fetch(self, sources):
            sources = list(sources)
            self.groups.append(sources)
            self.held |= set(sources)
            self.most = max(self.most, len(self.held))

        def forget(self, sources):
            self.held -= set(sources)

        def published(self, node, fresh=False):
            self.rebuilt += 1
            return super().published(node, fresh)

    k = 11
    store = Counting(_template(), MASKED, k)
    gen = torch.Generator().manual_seed(3)
    for node in range(k):
        store.initialize(node, *_model(gen, negative_zeros=False))
    pairs = [(node, False) for node in range(k)]
    expected = masked_average(*store.gather(pairs))
    store.rebuilt = 0
    with stream_published(store, pairs, per_fetch=4) as (weights, masks):
        got = masked_average(weights, masks)
    assert store.groups == [pairs[0:4], pairs[4:8], pairs[8:11]] and store.most == 4 and not store.held
    assert store.rebuilt == k  # each source rebuilt once, whatever the number of names read of it
    for name in expected:
        assert_bitwise(got[name], expected[name], name)
