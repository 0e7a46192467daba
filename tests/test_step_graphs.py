"""``cuda_graphs``: local steps replayed from captured graphs give the ordinary steps' results bit for bit.

No GPU here: the captures are replayed by ``tests/_graph_sim.py``, which binds recorded operator calls to their
tensors and Python values as a CUDA graph binds its kernels, so a step that a graph would replay wrongly (a tensor
replaced by another object, a learning rate baked in) gives other numbers here too.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from _graph_sim import RecordedGraph, SimulatedGraphs
from _helpers import Kill

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import BEER, DADPFL, PSFL, DisPFL, Ditto, FedAvg, Local, SubFedAvg
from lightning_dfl.federation.loop import step_graphs
from lightning_dfl.federation.loop.step_graphs import StepGraphs, check_graphable
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


@pytest.fixture
def simulated(monkeypatch):
    """Graphs on the CPU through the simulator; returns the list of backends made."""
    made = []

    def backend(device):
        made.append(SimulatedGraphs())
        return made[-1]

    monkeypatch.setattr(step_graphs, "graph_backend", backend)
    return made


def _fit(algorithm, cuda_graphs, rounds=2, local_epochs=2, momentum=0.0, arch="cnn_digits", model_options=None,
         callbacks=None, ckpt_path=None, **kw):
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, local_epochs=None if kw.get("local_steps") else
                               local_epochs, seed=0, accelerator="cpu", logger=False, enable_progress_bar=False,
                               cuda_graphs=cuda_graphs, callbacks=callbacks, **kw)
    model = SparseClassifier(arch=arch, density=0.5, lr=0.05, lr_decay=0.9, momentum=momentum,
                             model_options=model_options)
    # Dirichlet sizes: clients of several batch counts, most with a shorter last batch
    dm = FederatedDataModule(dataset="digits", num_clients=5, batch_size=16, test_samples_per_client=20,
                             max_train_samples=400)
    trainer.fit(model, dm, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return trainer


def _assert_same_run(a, b):
    strip = [{k: v for k, v in m.items() if "wall" not in k} for m in a.history]
    assert [{k: v for k, v in m.items() if "wall" not in k} for m in b.history] == strip
    for node in range(5):
        (wa, ma), (wb, mb) = a.store.published(node), b.store.published(node)
        assert all(torch.equal(wa[n].view(torch.uint8), wb[n].view(torch.uint8)) for n in wa), node
        assert all(torch.equal(ma[n], mb[n]) for n in ma), node


@pytest.mark.parametrize("case", [
    {"algorithm": lambda: DisPFL(num_neighbors=2)},
    {"algorithm": lambda: DisPFL(num_neighbors=2), "momentum": 0.5},
    {"algorithm": lambda: DADPFL(num_neighbors=2, max_wait=1), "store": "compact"},
    {"algorithm": lambda: Local(), "arch": "resnet20", "local_epochs": 1},  # BatchNorm's running statistics
    {"algorithm": lambda: Local(), "local_steps": 7},
    {"algorithm": lambda: DisPFL(num_neighbors=2), "precision": "bf16-mixed", "rounds": 1},
    {"algorithm": lambda: FedAvg(clients_per_round=3)},
    {"algorithm": lambda: SubFedAvg(clients_per_round=3)},
    {"algorithm": lambda: PSFL(clients_per_round=4, warmup_rounds=2), "rounds": 3, "local_epochs": 1},
    {"algorithm": lambda: _Adam()},  # the update runs after the replay: any optimizer
], ids=["dispfl", "momentum", "dadpfl-compact", "batchnorm", "local-steps", "bf16-mixed", "fedavg", "subfedavg",
        "psfl", "adam"])
def test_replayed_steps_give_the_ordinary_steps_results_bit_for_bit(simulated, case):
    case = dict(case)
    algorithm = case.pop("algorithm")
    ordinary = _fit(algorithm(), False, **case)
    graphed = _fit(algorithm(), True, **case)
    _assert_same_run(ordinary, graphed)
    counts = graphed.federation.worker.step_graphs.counts
    assert counts["captured"] >= 1 and counts["replayed"] > counts["ordinary"], counts


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_each_shape_is_captured_once_per_run_whatever_the_rate_and_momentum(simulated, caplog, momentum):
    """The papers' schedule changes the learning rate every round, and momentum buffers are made by each task's
    first step: the update runs after the replay, so neither drops a graph; every shape is warmed up and captured
    once in the run, and every other step is replayed."""
    with caplog.at_level("INFO"):
        trainer = _fit(DisPFL(num_neighbors=2), True, rounds=3, local_epochs=3, momentum=momentum)
    counts = trainer.federation.worker.step_graphs.counts
    shapes = len(trainer.federation.worker.step_graphs._seen)
    assert shapes >= 3
    assert counts["captured"] == shapes
    assert counts["ordinary"] == 2 * shapes
    assert (f"CUDA graphs: {counts['replayed']} local steps replayed, {counts['captured']} captured, "
            f"{counts['ordinary']} ordinary") in caplog.text


def test_a_run_resumed_with_graphs_finishes_as_the_straight_run_without(simulated, tmp_path):
    """A checkpoint loads into the worker's tensors in place: a resumed run replays as before."""
    straight = _fit(DisPFL(num_neighbors=2), False, rounds=3, local_epochs=1)
    with pytest.raises(KeyboardInterrupt):
        _fit(DisPFL(num_neighbors=2), True, rounds=3, local_epochs=1, callbacks=[Kill(at_round=2)],
             checkpoint_every=1, default_root_dir=str(tmp_path))
    resumed = _fit(DisPFL(num_neighbors=2), True, rounds=3, local_epochs=1, default_root_dir=str(tmp_path),
                   ckpt_path=next(tmp_path.rglob("last.ckpt")))
    _assert_same_run(straight, resumed)
    assert resumed.federation.worker.step_graphs.counts["replayed"] > 0


class _GradientNorms(FederatedCallback):
    """Reads every step's gradients after the step (``on_train_batch_end``, which runs outside a graph)."""

    def __init__(self):
        self.norms = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.norms.append(torch.stack([p.grad.norm() for p in pl_module.parameters() if p.grad is not None]))


def test_after_a_replayed_step_the_gradients_are_that_steps(simulated):
    """Each graph writes its own gradient tensors: after a replay ``param.grad`` is pointed at them, as an ordinary
    step leaves them (a callback reading them after the step sees this step's, whatever graph ran before)."""
    ordinary, graphed = _GradientNorms(), _GradientNorms()
    _fit(DisPFL(num_neighbors=2), False, callbacks=[ordinary])
    trainer = _fit(DisPFL(num_neighbors=2), True, callbacks=[graphed])
    assert trainer.federation.worker.step_graphs.counts["replayed"] > 10 and len(trainer.federation.worker.step_graphs._seen) > 2
    assert len(ordinary.norms) == len(graphed.norms)
    assert all(torch.equal(a, b) for a, b in zip(ordinary.norms, graphed.norms))


class _ReadsTheDevice(FederatedCallback):
    """Puts a forward hook on the worker's model that reads a value on the host: a CUDA capture fails there."""

    def setup(self, trainer, pl_module, stage):
        pl_module.model.register_forward_hook(self.read)

    @staticmethod
    def read(module, args, out):
        float(out.detach().sum())  # returns None: the output stays as it is


def test_a_capture_that_fails_is_reported_and_the_run_goes_on_with_ordinary_steps(simulated):
    ordinary = _fit(DisPFL(num_neighbors=2), False, callbacks=[_ReadsTheDevice()])
    with pytest.warns(UserWarning, match=r"cuda_graphs: capturing a local step failed \(RuntimeError: .*reads the "
                                         r"device on the host.*\); the run goes on with ordinary steps"):
        graphed = _fit(DisPFL(num_neighbors=2), True, callbacks=[_ReadsTheDevice()])
    _assert_same_run(ordinary, graphed)
    graphs = graphed.federation.worker.step_graphs
    assert graphs.failed and graphs.counts["captured"] == graphs.counts["replayed"] == 0
    assert graphs.counts["ordinary"] > 2  # the warm-up, the step whose capture failed, and every later one


def test_an_algorithm_with_its_own_loop_is_told_that_nothing_was_captured(simulated):
    with pytest.warns(UserWarning, match="cuda_graphs: BEER took no step through the default local loop"):
        trainer = _fit(BEER(num_neighbors=2, topology="ring", gamma=0.1), True, rounds=1)
    assert trainer.federation.worker.step_graphs.counts == {"replayed": 0, "captured": 0, "ordinary": 0}


def _module_and_optimizer():
    module = SparseClassifier(arch="cnn_digits", density=0.5, num_classes=10, in_channels=1, image_size=8)
    module.mask.attach()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, weight_decay=5e-4)
    return module, optimizer


def _closure_and_update(module, optimizer):
    def backward(batch):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module.model(batch[0]), batch[1])
        loss.backward()
        return loss

    def update():
        optimizer.step()
        module.mask.apply_()
    return backward, update


def _step(module, optimizer):
    backward, update = _closure_and_update(module, optimizer)

    def run(batch):
        loss = backward(batch)
        update()
        return loss
    return run


def _batches(n, size=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 1, 8, 8, generator=g), torch.randint(0, 10, (size,), generator=g)) for _ in range(n)]


def _graphed_and_reference():
    """Step graphs of a worker whose task has begun, its closure and update, and a reference worker's ordinary step."""
    module, optimizer = _module_and_optimizer()
    graphs = StepGraphs(SimulatedGraphs(), module, optimizer)
    graphs.begin()
    reference_module, reference_optimizer = _module_and_optimizer()
    return (graphs, module, optimizer, *_closure_and_update(module, optimizer), reference_module, reference_optimizer,
            _step(reference_module, reference_optimizer))


def test_a_replaced_mask_drops_the_graphs_and_a_changed_rate_does_not():
    graphs, module, optimizer, backward, update, reference_module, reference_optimizer, reference = \
        _graphed_and_reference()
    for batch in _batches(5):
        graphs.step(batch, backward, update)
        reference(batch)
    assert graphs.counts == {"replayed": 3, "captured": 1, "ordinary": 2}  # two warm-up steps, then captured
    for opt in (optimizer, reference_optimizer):
        opt.param_groups[0]["lr"] = 0.05
    graphs.step(_batches(1)[0], backward, update)  # the new rate is read by the update after the replay
    reference(_batches(1)[0])
    assert graphs.counts == {"replayed": 4, "captured": 1, "ordinary": 2} and graphs.backend.synchronizations == 0
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), reference_module.parameters()))
    name = next(iter(module.mask.masks))
    module.mask.masks[name] = module.mask.masks[name].clone()  # another object: another address
    graphs.step(_batches(1)[0], backward, update)  # the worker's addresses are taken when a task begins
    assert graphs.counts["replayed"] == 5
    graphs.begin()
    graphs.step(_batches(1)[0], backward, update)
    assert graphs.counts["ordinary"] == 3 and not graphs._graphs
    assert graphs.backend.synchronizations == 1  # the device ran the graphs before they were dropped
    graphs.step(_batches(1)[0], backward, update)  # the shape is warm: captured at once
    assert graphs.counts["captured"] == 2
    graphs.step(_batches(1, size=4)[0], backward, update)  # a new shape: warmed up first
    assert graphs.counts == {"replayed": 6, "captured": 2, "ordinary": 4}  # a capture is replayed at once


def test_tensors_made_after_a_task_began_are_seen_before_a_capture():
    """Mask casts dropped (``mask.to``) after the task began are made again by its first step: the worker's addresses
    are taken again before capturing, so the capture reads the new ones."""
    graphs, module, _, backward, update, reference_module, _, reference = _graphed_and_reference()
    module.mask.to("cpu")  # the casts go, and come back at the next step
    for batch in _batches(5):
        graphs.step(batch, backward, update)
        reference(batch)
    assert graphs.counts == {"replayed": 2, "captured": 1, "ordinary": 3}
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), reference_module.parameters()))


def test_the_simulator_replays_by_address_and_catches_what_a_gpu_would_get_wrong():
    """The test double must fail where a CUDA graph would: a replaced tensor or a changed Python value is not seen
    by a replay; a host read during a capture raises; a capture changes nothing."""
    module, optimizer = _module_and_optimizer()
    run = _step(module, optimizer)
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    run((x, y))
    before = [p.detach().clone() for p in module.parameters()]
    graph = RecordedGraph()
    losses = []
    graph.capture(lambda: losses.append(run((x, y))))
    assert all(torch.equal(a, p) for a, p in zip(before, module.parameters()))  # recorded, not run
    assert torch.isnan(losses[0])  # what a capture makes holds nothing until a replay
    reference_module, reference_optimizer = _module_and_optimizer()
    reference_module.load_state_dict(module.state_dict())
    reference = _step(reference_module, reference_optimizer)
    for batch in _batches(3):
        x.copy_(batch[0])
        y.copy_(batch[1])
        graph.replay()
        reference(batch)
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), reference_module.parameters()))
    optimizer.param_groups[0]["lr"] = 0.01  # baked into the recording: a replay still steps with 0.1
    reference_optimizer.param_groups[0]["lr"] = 0.01
    graph.replay()
    reference((x, y))
    assert not all(torch.equal(a, b) for a, b in zip(module.parameters(), reference_module.parameters()))
    with pytest.raises(RuntimeError, match="reads the device on the host"):
        RecordedGraph().capture(lambda: bool(run((x, y)) > 0))


class _Adam(Local):
    def make_optimizer(self, module):
        return torch.optim.Adam(module.parameters(), lr=1e-3)


class _AfterBackward(FederatedCallback):
    def on_after_backward(self, trainer, pl_module):
        pass


class _OwnBackwardHook(SparseClassifier):
    def on_before_backward(self, loss):
        pass


class _OwnLoss(SparseClassifier):
    def loss(self, batch):
        return super().loss(batch) * 2


@pytest.mark.parametrize("settings, model_class, match", [
    ({"algorithm": Ditto(clients_per_round=3)}, SparseClassifier, "Ditto has its own loss"),
    ({"callbacks": [_AfterBackward()]}, SparseClassifier, "callback _AfterBackward defines on_after_backward"),
    ({}, _OwnBackwardHook, "_OwnBackwardHook defines on_before_backward"),
    ({}, _OwnLoss, "_OwnLoss has its own loss"),
])
def test_what_a_graph_cannot_hold_is_refused_before_training(simulated, settings, model_class, match):
    trainer = FederatedTrainer(rounds=1, accelerator="cpu", logger=False, enable_progress_bar=False, cuda_graphs=True,
                               **{"algorithm": Local(), **settings})
    model = model_class(arch="cnn_digits", density=0.5)
    dm = FederatedDataModule(dataset="digits", num_clients=3, batch_size=16, max_train_samples=90)
    with pytest.raises(ValueError, match=match):
        trainer.fit(model, dm)
    assert not trainer.history


def test_graphs_with_batched_clients_are_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError, match="batched_clients trains clients with its own batched step"):
        FederatedTrainer(rounds=1, accelerator="cpu", logger=False, cuda_graphs=True, batched_clients=True)


def test_sixteen_bit_mixed_precision_is_refused():
    with pytest.raises(ValueError, match="precision '16-mixed' scales the loss with a gradient scaler"):
        check_graphable(Local(), SparseClassifier(), "16-mixed", [])


def test_cuda_graphs_on_a_cpu_is_refused_with_the_device_named():
    trainer = FederatedTrainer(algorithm=Local(), rounds=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                               cuda_graphs=True)
    dm = FederatedDataModule(dataset="digits", num_clients=3, batch_size=16, max_train_samples=90)
    with pytest.raises(ValueError, match="cuda_graphs: true needs a CUDA GPU; this run's device is cpu"):
        trainer.fit(SparseClassifier(arch="cnn_digits", density=0.5), dm)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        FederatedTrainer(cuda_graphs="yes")


def test_the_cuda_graph_calls_exist_in_this_torch():
    """What :class:`CudaGraphs` calls, checked against this torch's API (no GPU here to call it)."""
    import inspect

    assert {"pool", "capture_error_mode"} <= set(inspect.signature(torch.cuda.CUDAGraph.capture_begin).parameters)
    assert all(callable(getattr(torch.cuda.CUDAGraph, name)) for name in ("capture_end", "replay"))
    assert all(callable(getattr(torch.cuda, name)) for name in ("graph_pool_handle", "current_stream", "stream",
                                                                "synchronize", "Stream"))
    assert step_graphs.graph_backend(torch.device("cpu")) is None
