"""Where the client store lives (``store_device``): the choice, and a store on another device than its inputs.

This machine has no GPU. The store's device handling is checked on a *simulated* one: :class:`SimCuda`
runs every operation on CPU tensors but wraps the results of operations on ``cuda:0`` in :class:`Sim`, a
tensor that says it is on ``cuda:0``. As on a real GPU, an operation that mixes a ``cuda:0`` tensor with a
CPU tensor (other than a 0-dim one) fails with "Expected all tensors to be on the same device", a
``cuda:0`` tensor cannot become a numpy array, and copies across devices (``copy_``, ``to``) work. The
store thus takes the code paths it takes on a GPU (torch's bit packing, ``masked_select``), and any tensor
that enters without being moved to the store's device fails as on the H100 (``zero_inactive_``:
"Expected all tensors to be on the same device, cuda:0 and cpu", from ``initialize``). Pinned host memory
is simulated too (``pin_memory=True`` at allocation, ``is_pinned``), and so are asynchronous copies: the
host side of a ``non_blocking`` copy is "in flight" until the stream is synchronized, and any CPU
operation on it before then fails (what a real GPU would silently get wrong).
"""

import warnings

import pytest
import torch
from _helpers import assert_nested_same
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import lightning_dfl.federation.store.memory as store_memory
import lightning_dfl.transfers as transfers
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DisPFL
from lightning_dfl.federation.store import CompactClientStore, DenseClientStore, StateField
from lightning_dfl.federation.store.factory import load_store_state
from lightning_dfl.federation.store.memory import (
    AUTO_KEEP_MIN_BYTES,
    GIB,
    STORE_DEVICES,
    compact_store_bytes,
    dense_store_bytes,
    fields_bytes,
    pin_store_memory,
    resolve_store_device,
    store_bytes,
)
from lightning_dfl.module import SparseClassifier
from lightning_dfl.sparse.masks import ModelMask
from lightning_dfl.transfers import copy_all_

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

aten = torch.ops.aten
GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")

# -- a simulated GPU ------------------------------------------------------------------------------------


class Sim(torch.Tensor):
    """A CPU tensor (``elem``) that says it is on ``cuda:0``."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=GPU, requires_grad=False)
        r.elem = elem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _STATE.dispatch(func, args, kwargs)

    # what a CUDA tensor allows from Python (the bindings would enter a real CUDA device guard)
    def item(self):
        return self.elem.item()

    def __int__(self):
        return int(self.elem)

    def __float__(self):
        return float(self.elem)

    def __bool__(self):
        return bool(self.elem)

    def __index__(self):
        return self.elem.__index__()

    def tolist(self):
        return self.elem.tolist()

    def copy_(self, src, non_blocking=False):  # the binding enters a device guard when non_blocking
        return aten.copy_.default(self, src, non_blocking)

    def __invert__(self):
        return aten.bitwise_not.default(self)

    def nonzero(self, *, as_tuple=False):
        return aten.nonzero.default(self).unbind(1) if as_tuple else aten.nonzero.default(self)

    # indexing (a view, or a gather by an index tensor on either device, as CUDA allows)
    def __getitem__(self, key):
        return Sim(self.elem[_unwrap(key)])

    def __setitem__(self, key, value):
        self.elem[_unwrap(key)] = value.elem if isinstance(value, Sim) else value

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")

    def __repr__(self):
        return f"Sim({self.elem!r})"

    __str__ = __repr__


def _ptr(t):
    return t.untyped_storage().data_ptr()


def _unwrap(key):
    return tree_map(lambda k: k.elem if isinstance(k, Sim) else k, key)


class SimCuda(TorchDispatchMode):
    """The simulated GPU (see the module docstring); ``async_copies`` counts ``non_blocking`` copies and
    ``syncs`` the stream synchronizations."""

    def __init__(self):
        super().__init__()
        self.pinned: set[int] = set()  # storages allocated with pin_memory=True
        self.pending: set[int] = set()  # host storages of non_blocking copies not yet synchronized
        self.staged: list[torch.Tensor] = []  # pinned host tensors of queued uploads, kept until synchronized
        self.async_copies = 0
        self.blocking_uploads = 0  # copies from pageable host memory to the GPU: a real one waits for its queue
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.dispatch(func, args, kwargs)

    def synchronize(self, device):
        assert device.type == "cuda", device
        self.syncs += 1
        self.pending.clear()
        self.staged.clear()

    def dispatch(self, func, args, kwargs):
        kwargs = dict(kwargs or {})
        devices = set()

        def unwrap(x):
            if isinstance(x, Sim):
                devices.add("cuda")
                return x.elem
            if isinstance(x, torch.Tensor):
                in_flight = x.device.type == "cpu" and x.numel() and _ptr(x) in self.pending
                if in_flight and func is not aten.is_pinned.default:
                    raise AssertionError(f"{func} touched host memory of an asynchronous copy before the stream was "
                                         "synchronized")
                if x.dim() > 0:  # a 0-dim CPU tensor may join a GPU operation
                    devices.add(x.device.type)
            return x

        uargs, ukwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        target = kwargs.get("device")
        if func is aten.is_pinned.default:
            return not isinstance(args[0], Sim) and args[0].numel() > 0 and _ptr(args[0]) in self.pinned
        if func is aten._pin_memory.default:  # Tensor.pin_memory(): a pinned host copy
            assert not isinstance(args[0], Sim), "only host memory can be pinned"
            out = uargs[0].clone()
            if out.numel():
                self.pinned.add(_ptr(out))
            return out
        upload = func is aten._to_copy.default and not isinstance(args[0], Sim) and target is not None \
            and torch.device(target).type == "cuda"
        if upload and kwargs.get("non_blocking", False):  # queued: the host memory is in flight, kept alive
            assert args[0].numel() == 0 or _ptr(args[0]) in self.pinned, "a non_blocking copy of pageable memory"
            self.async_copies += 1
            if args[0].numel():
                self.pending.add(_ptr(args[0]))
                self.staged.append(args[0])
            ukwargs["non_blocking"] = False
        elif upload or (func is aten.copy_.default and isinstance(args[0], Sim) and not isinstance(args[1], Sim)
                        and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))):
            self.blocking_uploads += 1
        pin = bool(ukwargs.pop("pin_memory", False))
        if func is aten.copy_.default:
            out_gpu = isinstance(args[0], Sim)
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if non_blocking:
                host = args[1] if out_gpu else args[0]
                assert isinstance(args[0], Sim) != isinstance(args[1], Sim), "a non_blocking copy on one device"
                assert not isinstance(host, Sim) and _ptr(host) in self.pinned, "a non_blocking copy of pageable memory"
        elif func is aten._to_copy.default:
            out_gpu = torch.device(target).type == "cuda" if target is not None else isinstance(args[0], Sim)
        elif target is not None:  # a factory function
            out_gpu = torch.device(target).type == "cuda"
            if devices - {"cuda" if out_gpu else "cpu"}:
                raise RuntimeError(f"Expected all tensors to be on the same device ({func})")
        else:
            if len(devices) > 1:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"cuda:0 and cpu! ({func})")
            out_gpu = devices == {"cuda"}
        if target is not None and torch.device(target).type == "cuda":
            ukwargs["device"] = CPU
        out = func(*uargs, **ukwargs)
        if pin:
            assert not out_gpu, "pinned memory is host memory"
            self.pinned.add(_ptr(out))
        if func is aten.copy_.default and non_blocking:
            self.async_copies += 1
            self.pending.add(_ptr(args[1] if out_gpu else args[0]))
        if not out_gpu or not func._schema.returns:  # a host result, or none (the foreach in-place ops)
            return out
        first = func._schema.arguments[0] if func._schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write:
            return args[0]  # in place: the same tensor
        return tree_map(lambda t: Sim(t) if isinstance(t, torch.Tensor) else t, out)


_STATE = SimCuda()


@pytest.fixture
def gpu(monkeypatch):
    """The simulated GPU, active for the test."""
    global _STATE
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)  # nothing to initialize: no GPU is touched
    _STATE = SimCuda()
    monkeypatch.setattr(transfers, "synchronize", _STATE.synchronize)
    with _STATE:
        yield _STATE


def test_the_simulated_gpu_refuses_what_a_real_one_refuses(gpu):
    x = torch.zeros(4, device=GPU)
    assert isinstance(x, Sim) and x.device == GPU
    with pytest.raises(RuntimeError, match="same device"):
        x.mul_(torch.tensor([True, False, True, True]))  # the H100's error in zero_inactive_
    with pytest.raises(TypeError, match="numpy"):
        x.numpy()
    x.mul_(torch.tensor(2.0))  # a 0-dim CPU tensor is allowed
    assert type(x.cpu()) is torch.Tensor and int(x.count_nonzero()) == 0
    pinned = torch.ones(4, pin_memory=True)
    assert pinned.is_pinned() and not torch.ones(4).is_pinned()
    x.copy_(pinned, non_blocking=True)
    with pytest.raises(AssertionError, match="before the stream was synchronized"):
        pinned.add_(1)  # the host overwrites a source still being copied
    transfers.synchronize(GPU)
    pinned.add_(1)
    with pytest.raises(AssertionError, match="pageable"):
        x.copy_(torch.ones(4), non_blocking=True)


# -- the choice -----------------------------------------------------------------------------------------


def test_auto_puts_the_store_on_the_gpu_when_it_fits_with_room_for_training():
    device, reason = resolve_store_device("auto", "cuda:0", 10 * GIB, free_bytes=20 * GIB)
    assert device == GPU and reason.startswith("the client store fits in cuda:0's memory")
    assert "10.00 GiB for 20.00 GiB free, 5.00 GiB of it kept for training" in reason  # a quarter of the free memory
    device, reason = resolve_store_device("auto", "cuda:0", 16 * GIB, free_bytes=20 * GIB)
    assert device == CPU and "does not fit" in reason
    # on a small GPU at least 2 GiB are kept
    assert resolve_store_device("auto", "cuda:0", 3 * GIB // 2, free_bytes=3 * GIB)[0] == CPU
    assert resolve_store_device("auto", "cuda:0", 1 * GIB, free_bytes=AUTO_KEEP_MIN_BYTES + GIB)[0] == GPU


def test_auto_measures_the_free_gpu_memory_and_never_on_a_cpu_worker(monkeypatch):
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 8 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert resolve_store_device("auto", "cpu", 1)[0] == CPU
    assert resolve_store_device("auto", torch.device("cpu"), 0, free_bytes=80 * GIB) == \
        (CPU, "the worker is on the cpu, not a GPU")
    assert asked == []
    assert resolve_store_device("auto", "cuda:0", 5 * GIB)[0] == GPU
    assert resolve_store_device("auto", "cuda:0", 7 * GIB)[0] == CPU
    assert asked == [GPU, GPU]


def test_explicit_values_are_kept_and_others_refused():
    assert resolve_store_device("cpu", "cuda:0", 1, free_bytes=80 * GIB) == (CPU, "store_device is 'cpu'")
    assert resolve_store_device("worker", "cuda:0", 100 * GIB, free_bytes=GIB) == (GPU, "store_device is 'worker'")
    assert resolve_store_device("worker", "cpu", 1)[0] == CPU
    for bad in ("gpu", "cuda", None, "CPU"):
        with pytest.raises(ValueError, match=rf"store_device must be one of 'auto', 'cpu', 'worker', got {bad!r}"):
            resolve_store_device(bad, "cpu", 1)
    with pytest.raises(ValueError, match="got 'gpu'"):
        FederatedTrainer(store_device="gpu", logger=False)
    assert FederatedTrainer(logger=False).store_device == "auto" and STORE_DEVICES == ("auto", "cpu", "worker")


def test_the_estimate_is_what_the_store_allocates(monkeypatch):
    dense = DenseClientStore(TEMPLATE, MASKED, 5, fields=FIELDS)
    assert fields_bytes(FIELDS, TEMPLATE, MASKED, 5) == sum(t.numel() * t.element_size()
                                                            for parts in dense.fields.values() for t in parts.values())
    assert store_bytes("dense", TEMPLATE, MASKED, 5, 0.5, FIELDS) == dense.nbytes()
    assert (store_bytes("compact", TEMPLATE, MASKED, 5, 0.5, FIELDS)
            == 2 * compact_store_bytes(TEMPLATE, MASKED, 5, 0.5) + fields_bytes(FIELDS, TEMPLATE, MASKED, 5))
    assert store_bytes("dense", TEMPLATE, MASKED, 5, 0.5) == dense_store_bytes(TEMPLATE, MASKED, 5)
    # pinned only for a CPU store serving a GPU worker, and only when twice it fits (power-of-two blocks)
    monkeypatch.setattr(store_memory, "available_bytes", lambda: 10 * GIB)
    assert pin_store_memory("cpu", GPU, 4 * GIB)
    assert not pin_store_memory("cpu", GPU, 4 * GIB, processes=2)
    assert not pin_store_memory("cpu", GPU, 6 * GIB)
    assert not pin_store_memory("cpu", "cpu", 1) and not pin_store_memory(GPU, GPU, 1)


# -- a store on another device than what it is given ---------------------------------------------------

TEMPLATE = {"conv.weight": torch.zeros(4, 3, 3, 3), "conv.bias": torch.zeros(4), "fc.weight": torch.zeros(10, 36),
            "fc.bias": torch.zeros(10), "bn.running_var": torch.zeros(4, dtype=torch.float64)}
MASKED = ["conv.weight", "fc.weight"]
FIELDS = [StateField("x/scalar", fill=float("nan")), StateField("x/pub", shape=(3,), published=True),
          StateField("x/momentum", like="weights"), StateField("x/hist", like="mask", dtype=torch.float16),
          StateField("x/pubw", like="weights", published=True), StateField("x/flag", dtype=torch.bool)]
NODES = 5


def _model(gen, density=0.5):
    weights = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in TEMPLATE.items()}
    masks = {n: torch.rand(weights[n].shape, generator=gen) < density for n in MASKED}
    for n, m in masks.items():
        weights[n].mul_(m)  # -0.0 where a negative weight is pruned
    return weights, masks


def _host(t):
    """A CPU copy (``cpu()`` of a CPU store's view is the view, which later writes change)."""
    return t.to(CPU, copy=True)


def _drive(store, worker, check=lambda: None):
    """Initialize, then three rounds of publishing, masks, field writes and reads, as the engine does: the
    weights and masks the worker trains with on ``worker``, the initial masks and some field values on the
    CPU. Returns everything read back, on the CPU."""
    def on(d):
        return {n: t.to(worker) for n, t in d.items()}

    gen = torch.Generator().manual_seed(1)
    reads = []
    for node in range(NODES):
        weights, masks = _model(gen)
        store.initialize(node, on(weights), masks if node else None)  # the trainer's initial masks: CPU
        check()
    for round_idx in range(3):
        writers = [k for k in range(NODES) if (k + round_idx) % 2 == 0]
        for k in writers:
            weights, masks = _model(gen, density=0.5 - 0.1 * round_idx)
            nxt = {n: torch.rand(m.shape, generator=gen) < 0.4 for n, m in masks.items()}
            momentum = torch.randn(TEMPLATE["fc.weight"].shape, generator=gen)
            fields = {"x/pub": torch.full((3,), float(k + round_idx)), "x/pubw": on(weights)} if k != 4 else None
            store.publish(k, on(weights), on(masks) if k != 3 else None, fields)
            check()
            if k != 1:
                store.set_mask(k, on(nxt))
                check()
            store.write(k, "x/scalar", float(round_idx))
            store.write(k, "x/flag", torch.tensor(True).to(worker))  # a 0-dim tensor from the worker
            store.write(k, "x/hist", {n: m.half() for n, m in nxt.items()})  # from the CPU
            check()
            store.read(k, "x/momentum")["fc.weight"].copy_(momentum.to(worker))  # a view, written in place
        sources = [(k, False) for k in range(NODES)] + [(k, True) for k in writers]
        weights, masks = store.gather(sources)
        reads.append(({n: [_host(t) for t in ts] for n, ts in weights.items()},
                      {n: [_host(t) for t in ts] for n, ts in masks.items()}))
        for ts in [*weights.values(), *masks.values()]:
            assert all(t.device == store.device for t in ts)
        store.end_round()
    for node in range(NODES):
        weights, masks = store.published(node)
        mask = store.mask(node)
        assert all(t.device == store.device for t in [*weights.values(), *masks.values(), *mask.values()])
        reads.append(({n: _host(t) for n, t in weights.items()}, {n: _host(t) for n, t in masks.items()},
                      {n: _host(t) for n, t in mask.items()}, store.active_values(node)))
        for name in store.fields:
            value = store.read(node, name)
            for t in value.values() if isinstance(value, dict) else [value]:
                assert t.device == store.device
                reads.append(_host(t))
    return reads


def _raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_cpu_tensor(a, b):
    assert type(a) is torch.Tensor and type(b) is torch.Tensor and a.device == b.device == CPU
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_raw(a), _raw(b))


def _assert_same(a, b):
    """Nested reads equal bit for bit (``-0.0`` differs from ``0.0``)."""
    assert_nested_same(a, b, _same_cpu_tensor)


def _held(store):
    """Every tensor the store keeps (the dense store's stacks, the compact store's records, the fields)."""
    if isinstance(store, CompactClientStore):
        tensors = list(store._tensors())
    else:
        tensors = [*store.weights.values(), *store.published_masks.values(), *store.masks.values()]
    return tensors + [t for parts in store.fields.values() for t in parts.values()]


def _cpu_state(state):
    """Every tensor of a ``state_dict`` is a plain CPU tensor."""
    leaves = []
    tree_map(lambda x: leaves.append(x) if isinstance(x, torch.Tensor) else None, state)
    assert leaves and all(type(t) is torch.Tensor and t.device == CPU for t in leaves)


STORES = {"dense": DenseClientStore, "compact": CompactClientStore}


@pytest.mark.parametrize("kind", list(STORES))
def test_a_store_on_the_gpu_takes_cpu_masks_and_matches_a_cpu_store_bit_for_bit(kind, gpu):
    expected = _drive(STORES[kind](TEMPLATE, MASKED, NODES, fields=FIELDS), CPU)
    store = STORES[kind](TEMPLATE, MASKED, NODES, device="cuda:0", fields=FIELDS)
    got = _drive(store, GPU)  # on the H100 before the fix: "Expected all tensors to be on the same device"
    _assert_same(expected, got)
    assert all(isinstance(t, Sim) for t in _held(store))
    # a checkpoint holds CPU tensors, and either store on the GPU loads it (as checkpoint.py: the store's device)
    state = store.state_dict()
    _cpu_state(state)
    for other in STORES.values():
        restored = other(TEMPLATE, MASKED, NODES, device="cuda:0", fields=FIELDS)
        load_store_state(restored, state)
        assert all(isinstance(t, Sim) for t in _held(restored))
        for node in range(NODES):
            _assert_same([{n: t.cpu() for n, t in part.items()} for part in store.published(node)],
                         [{n: t.cpu() for n, t in part.items()} for part in restored.published(node)])
        # and back to a CPU store: the same state
        on_cpu = STORES[kind](TEMPLATE, MASKED, NODES, fields=FIELDS)
        load_store_state(on_cpu, restored.state_dict())
        for node in range(NODES):
            _assert_same(store.state(node).weights, on_cpu.state(node).weights)
            _assert_same(store.state(node).extras, on_cpu.state(node).extras)


def test_a_compact_checkpoint_from_the_gpu_keeps_its_shared_tensors_shared(gpu):
    store = CompactClientStore(TEMPLATE, MASKED, NODES, device="cuda:0", fields=FIELDS)
    gen = torch.Generator().manual_seed(2)
    for node in range(NODES):
        weights, masks = _model(gen)
        store.initialize(node, {n: t.to(GPU) for n, t in weights.items()}, masks)
    weights, _ = _model(gen)
    store.publish(2, {n: t.to(GPU) for n, t in weights.items()}, store.mask(2))  # trained with its current mask
    store.end_round()
    state = store.state_dict()
    _cpu_state(state)
    for k in range(NODES):  # each node's current mask is the one it published: one tensor, saved once
        for n in MASKED:
            assert store.current_bits[k][n] is store.records[k]["bits"][n]
            assert state["current_bits"][k][n] is state["records"][k]["bits"][n]


@pytest.mark.parametrize("kind", list(STORES))
def test_a_pinned_cpu_store_copies_to_and_from_the_gpu_asynchronously_and_safely(kind, gpu):
    expected = _drive(STORES[kind](TEMPLATE, MASKED, NODES, fields=FIELDS), CPU)
    store = STORES[kind](TEMPLATE, MASKED, NODES, fields=FIELDS, pin_memory=True)
    assert store.device == CPU and store.pin_memory
    pinned = [t for parts in store.fields.values() for t in parts.values()]
    if kind == "dense":  # the compact store pins its fields only (its records are built by numpy)
        pinned += [*store.weights.values(), *store.published_masks.values(), *store.masks.values()]
    assert pinned and all(t.is_pinned() for t in pinned)

    def nothing_in_flight():  # every store method returns with its copies done
        assert not gpu.pending

    got = _drive(store, GPU, nothing_in_flight)
    _assert_same(expected, got)
    assert gpu.async_copies > 0 and gpu.syncs > 0
    assert all(type(t) is torch.Tensor for t in _held(store))
    _cpu_state(store.state_dict())
    # a GPU store ignores pin_memory
    assert not STORES[kind](TEMPLATE, MASKED, NODES, device="cuda:0", pin_memory=True).pin_memory


def test_copies_from_pageable_memory_or_on_one_device_stay_synchronous(gpu):
    pairs = [(torch.zeros(3, device=GPU), torch.ones(3)), (torch.zeros(3), torch.ones(3, device=GPU)),
             (torch.zeros(3), torch.ones(3, pin_memory=True)), (torch.zeros(3, device=GPU), torch.ones(3, device=GPU))]
    copy_all_(pairs)
    assert gpu.async_copies == 0 and gpu.syncs == 0
    assert all(bool(dst.eq(1).all()) for dst, _ in pairs)
    pinned = [torch.zeros(3, pin_memory=True), torch.ones(3, pin_memory=True)]
    copy_all_([(pinned[0], torch.full((3,), 2.0, device=GPU)), (torch.zeros(3, device=GPU), pinned[1])])
    assert gpu.async_copies == 2 and gpu.syncs == 1 and not gpu.pending  # one synchronization for both
    assert pinned[0].tolist() == [2.0, 2.0, 2.0]


def test_the_worker_loads_masks_from_a_pinned_store_asynchronously(gpu):
    layer = torch.nn.Linear(4, 3)
    masks = ModelMask(layer, {"weight": torch.ones(3, 4, dtype=torch.bool)})
    masks.masks = {"weight": masks.masks["weight"].to(GPU)}  # the worker's masks on the GPU (ModelMask.to)
    stored = torch.zeros(3, 4, dtype=torch.bool, pin_memory=True)
    stored[0, 1] = True
    masks.load_({"weight": stored}, apply=False)
    assert gpu.async_copies == 1 and gpu.syncs == 1 and not gpu.pending
    assert torch.equal(masks.masks["weight"].cpu(), stored)


# -- a CPU run ----------------------------------------------------------------------------------------------


def _fit(store_device, store, tmp_path):
    dm = FederatedDataModule(dataset="digits", num_clients=6, batch_size=32, test_samples_per_client=40,
                             partition="dirichlet", alpha=0.5, seed=1)
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05, seed=1)
    trainer = FederatedTrainer(algorithm=DisPFL(num_neighbors=2), rounds=2, local_epochs=1, accelerator="cpu",
                               enable_progress_bar=False, seed=3, default_root_dir=str(tmp_path / store_device),
                               cpu_threads=1, logger=False, store_device=store_device, store=store)
    trainer.fit(model, dm)
    return trainer


@pytest.mark.parametrize("store", ["dense", "compact"])
def test_on_a_cpu_run_worker_and_auto_are_the_cpu_bit_for_bit(store, tmp_path, capsys, caplog):
    runs = {d: _fit(d, store, tmp_path) for d in ("cpu", "worker", "auto")}
    reference = runs["cpu"]
    for name, trainer in runs.items():
        assert trainer.store.device == CPU and not trainer.store.pin_memory, name
        assert [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in trainer.history] == \
               [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in reference.history], name
        for node in range(reference.store.num_nodes):
            _assert_same(trainer.store.state(node).weights, reference.store.state(node).weights)
            _assert_same(trainer.store.state(node).mask, reference.store.state(node).mask)
    # the choice is not reported on a CPU run
    out = capsys.readouterr()
    assert "Client store on" not in out.out + out.err + caplog.text


@pytest.mark.parametrize("store", ["dense", "compact"])
def test_a_fit_with_the_store_on_the_gpu_matches_the_cpu_store(store, gpu, monkeypatch, tmp_path):
    """The H100's crash path: ``_setup`` initializes a store on the GPU with the CPU's initial masks. The worker
    stays on the CPU here (a real GPU worker cannot be simulated), so the run also checks that the engine
    moves what it takes from the store to the worker and back (and the diagnostics read it on its device)."""
    import lightning_dfl.federation.store.factory as store_factory

    def on_device(make):  # data constructors on the simulated GPU: built on the CPU, then copied
        def build(data, *args, device=None, **kwargs):
            out = make(data, *args, **kwargs)
            return out.to(device) if device is not None and torch.device(device).type == "cuda" else out
        return build

    monkeypatch.setattr(torch, "tensor", on_device(torch.tensor))
    monkeypatch.setattr(torch, "as_tensor", on_device(torch.as_tensor))
    runs = {}
    for where in ("cpu", "gpu"):
        if where == "gpu":
            monkeypatch.setattr(store_factory, "resolve_store_device", lambda *args: (GPU, "simulated"))
        dm = FederatedDataModule(dataset="digits", num_clients=4, batch_size=64, test_samples_per_client=20,
                                 partition="dirichlet", alpha=0.5, seed=1)
        model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05, seed=1)
        trainer = FederatedTrainer(algorithm=DisPFL(num_neighbors=2), rounds=2, local_steps=2,
                                   accelerator="cpu", enable_progress_bar=False, seed=3, logger=False, cpu_threads=1,
                                   store=store, diagnostics=True, default_root_dir=str(tmp_path / where))
        trainer.fit(model, dm)
        runs[where] = trainer
    assert runs["gpu"].store.device == GPU and all(isinstance(t, Sim) for t in _held(runs["gpu"].store))
    assert runs["cpu"].store.device == CPU
    strip = [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in runs["cpu"].history]
    assert [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in runs["gpu"].history] == strip
    for node in range(runs["cpu"].store.num_nodes):
        _assert_same(runs["gpu"].store.state(node).weights, runs["cpu"].store.state(node).weights)


# -- uploads the host does not wait for ------------------------------------------------------------------------


def test_to_device_uploads_from_pinned_memory_without_waiting(gpu):
    source = torch.arange(6.0)
    up = transfers.to_device(source, GPU)
    assert isinstance(up, Sim) and up.cpu().tolist() == source.tolist()
    assert gpu.async_copies == 1 and gpu.blocking_uploads == 0 and not source.is_pinned()
    source.add_(1)  # the staged copy, not the caller's tensor, is in flight
    assert up.cpu().tolist() == list(range(6))
    torch.arange(3.0).to(GPU)  # what it replaces: a copy of pageable memory, which a real GPU waits for
    assert gpu.blocking_uploads == 1


def test_augmented_batches_on_a_gpu_upload_without_waiting_and_equal_the_cpus(gpu):
    from lightning_dfl.datamodules.federated import TensorBatches
    from lightning_dfl.datamodules.transforms import BatchAugment, Normalize

    images = torch.randint(0, 256, (50, 3, 8, 8), dtype=torch.uint8)
    labels = torch.randint(0, 10, (50,))
    normalize = Normalize([0.5, 0.4, 0.3], [0.2, 0.25, 0.3])
    normalize(transfers.to_device(images[:1], GPU))  # its per-device constants, uploaded once

    def batches(device):
        return list(TensorBatches(transfers.to_device(images, device), transfers.to_device(labels, device), 16,
                                  normalize, augment=BatchAugment(4, True), generator=torch.Generator().manual_seed(3),
                                  shuffle=True))

    before = gpu.blocking_uploads
    on_gpu = batches(GPU)
    assert gpu.blocking_uploads == before  # the images, labels, the epoch's order, each batch's draws: all queued
    assert gpu.async_copies == 1 + 2 + 1 + 4  # the constants' probe, images and labels, the order, one per batch
    on_cpu = batches(CPU)
    for (x, y), (cx, cy) in zip(on_gpu, on_cpu, strict=True):
        assert isinstance(x, Sim) and torch.equal(x.cpu(), cx) and torch.equal(y.cpu(), cy)
