"""The engine's extension points: declared store fields and the algorithm hooks, each in a run."""

import gc
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, RoundPlan, Source, Task, masked_average
from lightning_dfl.federation.algorithms import DPSGD, FedAvg, Local, TopologyAlgorithm
from lightning_dfl.federation.algorithms.base import average_messages, parallel_plan
from lightning_dfl.federation.exchange.messages import TopKCodec
from lightning_dfl.federation.store import DenseClientStore, StateField
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


def _run(algorithm, rounds=2, density=1.0, callbacks=None, momentum=0.0, **trainer_kw):
    dm = FederatedDataModule(dataset="digits", num_clients=5, batch_size=32, test_samples_per_client=30)
    model = SparseClassifier(arch="cnn_digits", density=density, lr=0.05, momentum=momentum)
    if trainer_kw.get("local_steps") is None:
        trainer_kw.setdefault("local_epochs", 1)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, logger=False, accelerator="cpu",
                               enable_progress_bar=False, callbacks=callbacks, **trainer_kw)
    trainer.fit(model, dm)
    return trainer


# -- the store's declared fields ---------------------------------------------------------------
def test_store_fields_private_per_parameter_and_published():
    template = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}
    fields = [StateField("count", dtype=torch.int64), StateField("personal", like="weights", dtype=None, fill=math.nan),
              StateField("history", like="mask", dtype=torch.bool), StateField("age", published=True, fill=1.0)]
    store = DenseClientStore(template, ["w"], num_nodes=3, fields=fields)
    assert store.read(0, "count").item() == 0 and torch.isnan(store.read(1, "personal")["w"]).all()
    assert store.read(2, "history")["w"].shape == (2, 3) and set(store.read(2, "history")) == {"w"}
    store.write(1, "count", 7)
    store.write(1, "personal", {"w": torch.ones(2, 3), "b": torch.full((2,), 2.0)})
    assert store.read(1, "count").item() == 7 and store.read(0, "count").item() == 0  # per node
    assert store.read(1, "personal")["b"].tolist() == [2.0, 2.0]
    with pytest.raises(RuntimeError, match="published"):
        store.write(0, "age", 3.0)
    with pytest.raises(KeyError, match="no state field 'nope'"):
        store.read(0, "nope")
    # a published field follows the model's slots: start-of-round value until the round ends
    store.publish(0, template, None, fields={"age": 5.0})
    store.publish(1, template, None)  # not given: keeps its start-of-round value
    assert store.read(0, "age").item() == 1.0 and store.read(0, "age", fresh=True).item() == 5.0
    store.end_round()
    assert store.read(0, "age").item() == 5.0 and store.read(1, "age").item() == 1.0
    # saved and restored with the store; another field set is refused by name
    other = DenseClientStore(template, ["w"], num_nodes=3, fields=fields)
    other.load_state_dict(store.state_dict())
    assert other.read(1, "count").item() == 7 and other.read(0, "age").item() == 5.0
    with pytest.raises(ValueError, match="state fields"):
        DenseClientStore(template, ["w"], num_nodes=3).load_state_dict(store.state_dict())
    with pytest.raises(ValueError, match="declared twice"):
        DenseClientStore(template, ["w"], 1, fields=[StateField("a"), StateField("a")])


# -- the algorithm of docs/writing-algorithms.md (Ditto) ------------------------------------------
def _readme_block(marker: str) -> str:
    text = (Path(__file__).resolve().parents[1] / "docs" / "writing-algorithms.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return next(b for b in blocks if marker in b)


def test_readme_ditto_keeps_a_personal_model_trained_with_a_proximal_term():
    """The example's ``Ditto`` is a second Algorithm subclass of that name while it lives: it is dropped at the end
    (collected), so that the command line's ``--trainer.algorithm.help=Ditto`` in later tests names one class."""
    namespace = {}
    exec(_readme_block("class Ditto"), namespace)
    try:
        _check_ditto(namespace["Ditto"])
    finally:
        namespace.clear()
        gc.collect()
    from lightning_dfl.federation import Algorithm

    assert [c for c in _subclasses(Algorithm) if c.__name__ == "Ditto" and c.__module__ == "builtins"] == []


def _subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]


def _check_ditto(Ditto: type) -> None:  # noqa: N803 (the example's class)
    trainer = _run(Ditto(num_neighbors=2, lam=0.1), rounds=2)
    store = trainer.store
    personal = [store.read(k, "ditto/personal") for k in range(5)]
    assert all(not torch.isnan(p[n]).any() for p in personal for n in p)  # every client trained one
    shared, _ = store.published(0)
    assert any(not torch.equal(personal[0][n], shared[n]) for n in shared)  # v is not w
    assert trainer.history[-1]["acc/personal_mean"] > 0.5  # scored by v; chance is 0.1
    # lam changes v only (w is trained as without Ditto): the proximal term is in the loss
    loose = _run(Ditto(num_neighbors=2, lam=0.0), rounds=2).store
    for n in shared:
        assert torch.equal(loose.published(0)[0][n], shared[n])
    assert any(not torch.equal(loose.read(0, "ditto/personal")[n], personal[0][n]) for n in shared)


# -- training hooks ------------------------------------------------------------------------------
class TwoPass(Local):
    """A SAM-shaped step: the closure runs twice per optimizer step."""

    def __init__(self):
        self.losses = 0

    def loss(self, ctx, batch):
        self.losses += 1
        return super().loss(ctx, batch)

    def optimizer_step(self, ctx, closure):
        closure()
        loss = closure()
        ctx.optimizer.step()
        return loss


class CountSteps(FederatedCallback):
    def __init__(self):
        self.steps = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        key = (trainer.current_round, trainer.current_client)
        self.steps[key] = self.steps.get(key, 0) + 1


def test_closure_steps_and_local_steps():
    counter = CountSteps()
    algo = TwoPass()
    trainer = _run(algo, rounds=1, callbacks=[counter], local_steps=7)
    assert set(counter.steps.values()) == {7}  # exactly 7 steps per client, passes restart as needed
    assert algo.losses == 2 * 7 * 5  # two closure calls per step
    sizes = [trainer.datamodule.client_train_size(k) for k in range(5)]
    assert any(s < 7 * 32 for s in sizes)  # some client needed more than one pass
    with pytest.raises(ValueError, match="local_steps .None: local_epochs epochs. must be an integer >= 1, got 0"):
        FederatedTrainer(local_steps=0)


class KeptMomentum(Local):
    keep_optimizer_state = ("momentum_buffer",)


class SeeOptimizer(FederatedCallback):
    def __init__(self):
        self.first_state = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0 and trainer.current_client == 0 and trainer.current_round not in self.first_state:
            state = trainer.optimizer.state
            self.first_state[trainer.current_round] = {id(p): s["momentum_buffer"].clone() for p, s in state.items()}


def test_kept_optimizer_state_travels_with_the_client_across_rounds():
    seen = SeeOptimizer()
    trainer = _run(KeptMomentum(), rounds=2, momentum=0.9, callbacks=[seen])
    assert seen.first_state[0] == {}  # fresh in its first round
    buffers = trainer.store.read(0, "optimizer/momentum_buffer")
    assert all(b.abs().sum() > 0 for n, b in buffers.items() if "weight" in n)
    assert len(seen.first_state[1]) == len(list(trainer.module.parameters()))  # restored in round 1
    fresh = _run(Local(), rounds=2, momentum=0.9)
    name = next(iter(buffers))
    assert not torch.equal(fresh.store.published(0)[0][name], trainer.store.published(0)[0][name])


# -- aggregation, messages, server step ------------------------------------------------------------
class NoAggregation(TopologyAlgorithm):
    name = "no_aggregation"

    def plan_round(self, ctx):
        return parallel_plan(ctx, self.neighbors(ctx))

    def aggregate(self, ctx, messages):
        return None


def test_aggregate_none_keeps_the_own_model_while_messages_are_counted():
    kept = _run(NoAggregation(num_neighbors=2), rounds=2)
    local = _run(Local(), rounds=2)
    for n in local.store.names:
        assert torch.equal(kept.store.weights[n], local.store.weights[n])
    assert kept.history[0]["comm/busiest_bytes"] > 0 and local.history[0]["comm/busiest_bytes"] == 0


class TopKGossip(DPSGD):
    def message(self, ctx, source):
        weights, mask = ctx.store.published(source.node, source.fresh)
        return TopKCodec(0.1).encode(weights, mask, sender=source.node, masked_names=ctx.store.masked_names)


def test_communication_counts_what_the_codec_sends():
    trainer = _run(TopKGossip(num_neighbors=2), rounds=1)
    shapes = [t.numel() for t in trainer.store.published(0)[0].values()]
    values = sum(math.ceil(n / 10) for n in shapes)  # top 10% of every tensor
    m = trainer.history[0]
    assert m["comm/busiest_bytes"] == 2 * values * 4  # M = 2 messages in and out, 4 B per value
    assert m["comm/busiest_mask_bytes"] == 2 * values * 4  # 4 B per index
    dense = _run(DPSGD(num_neighbors=2), rounds=1).history[0]["comm/busiest_bytes"]
    assert m["comm/busiest_bytes"] < 0.15 * dense


class UniformServer(FedAvg):
    def server_step(self, ctx, messages):
        return average_messages(messages, ctx.store.mask(ctx.node), None)


def test_server_step_replaces_the_servers_average():
    trainer = _run(UniformServer(clients_per_round=3), rounds=1)
    store = trainer.store
    trained = [k for k in range(5) if int(store.slot[k]) == 1]
    expected = masked_average(*store.gather([(k, False) for k in trained]))  # uniform, not by sample count
    got, _ = store.published(5)
    for n in expected:
        assert torch.allclose(got[n], expected[n], atol=1e-6)


# -- evaluation and participation ------------------------------------------------------------------
class Order(FederatedCallback):
    def __init__(self, log):
        self.log = log

    def on_client_train_end(self, trainer, pl_module, client_id):
        self.log.append(("train_end", client_id))


class Stages(Local):
    def __init__(self, log):
        self.log = log

    def evaluate(self, ctx, stage):
        self.log.append((stage, ctx.node))
        return 0.25 if stage == "trained" else 0.5


def test_evaluate_hook_scores_the_published_model_after_the_train_end_hooks():
    log = []
    trainer = _run(Stages(log), rounds=1, callbacks=[Order(log)])
    for k in range(5):
        assert log.index(("aggregated", k)) < log.index(("train_end", k)) < log.index(("trained", k))
    assert trainer.history[0]["acc/personal_mean"] == 0.25 and trainer.history[0]["acc/aggregated_mean"] == 0.5


class Some(Local):
    def __init__(self, chosen):
        self.chosen = chosen

    def participants(self, ctx):
        return self.chosen


def test_participants_take_part_and_the_others_keep_their_state():
    trainer = _run(Some([0, 2]), rounds=1)
    assert [int(s) for s in trainer.store.slot[:5]] == [1, 0, 1, 0, 0]
    assert trainer.history[0]["samples/train"] == sum(trainer.datamodule.client_train_size(k) for k in (0, 2))
    with pytest.raises(ValueError, match="participants returned \\[0, 9\\]"):
        _run(Some([0, 9]), rounds=1)


# -- several exchanges per round (gossip steps) ------------------------------------------------------
class TrainThenMix(Local):
    """Exchange 0: local training; exchanges 1-2: every client averages all clients' models (a
    gossip step: an aggregation-only task reading the previous exchange's models)."""

    exchanges_per_round = 3

    def plan_round(self, ctx):
        if ctx.exchange == 0:
            return super().plan_round(ctx)
        return RoundPlan(ctx.round_idx, [Task(node=k, sources=tuple(Source(j) for j in range(ctx.num_clients)),
                                               train=False) for k in range(ctx.num_clients)])


def test_gossip_steps_are_exchanges_within_one_round():
    seen = CountSteps()
    mixed = _run(TrainThenMix(), rounds=1, callbacks=[seen])
    local = _run(Local(), rounds=1)
    store = mixed.store
    expected = masked_average(*local.store.gather([(k, False) for k in range(5)]))  # the trained models' mean
    for k in range(5):
        for n, t in store.published(k)[0].items():
            assert torch.allclose(t, expected[n], atol=1e-6)  # a second mean of equal models changes nothing
    assert len({(r, c) for r, c in seen.steps}) == 5  # each client trained once
    m, one_model = mixed.history[0], store.active_values(0) * 4
    assert m["comm/busiest_bytes"] == 2 * 4 * one_model  # two exchanges, 4 models in per client
    assert m["time/duration"] == 1.0  # the mixing steps take no compute time
    assert m["samples/train"] == local.history[0]["samples/train"]
    with pytest.raises(ValueError, match="exchanges_per_round"):
        bad = TrainThenMix()
        bad.exchanges_per_round = 0
        bad.validate(5)


class RePrune(TopologyAlgorithm):
    """Aggregates as DisPFL, then keeps only the larger half of every layer's active weights (a
    receiver mask chosen after aggregating, as PRISAM re-prunes)."""

    name = "re_prune"
    personal_masks = True

    def plan_round(self, ctx):
        return parallel_plan(ctx, self.neighbors(ctx))

    def aggregate(self, ctx, messages):
        averaged = super().aggregate(ctx, messages)
        mask = ctx.module.mask
        new = {}
        for name, m in mask.masks.items():
            values = averaged[name].abs().masked_fill(~m, -1.0).flatten()
            keep = torch.zeros_like(values, dtype=torch.bool)
            keep[values.topk(int(m.sum()) // 2).indices] = True
            new[name] = keep.view_as(m)
        mask.load_(new, apply=False)
        return averaged


def test_aggregate_may_choose_the_receiver_mask_it_trains_and_publishes_with():
    trainer = _run(RePrune(num_neighbors=2), rounds=1, density=0.5)
    store = trainer.store
    for k in range(5):
        weights, published = store.published(k)
        assert all(torch.equal(published[n], store.mask(k)[n]) for n in published)  # no RigL: trained = next
        for n, m in published.items():
            assert (weights[n][~m] == 0).all()
    assert trainer.history[0]["density/mean"] == pytest.approx(0.25, abs=0.01)  # half of ERK 0.5


# -- round-level hooks: init_state and evaluate_round ---------------------------------------------
class _ClientZeroEverywhere(Local):
    """Local training with an evaluation of its own: client 0's model tested on every client, and a
    declared field set from the initial models by init_state."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool]] = []

    def state_fields(self):
        return [StateField("probe/initial_sum", dtype=torch.float64)]

    def init_state(self, store, num_clients):
        for k in range(num_clients):
            weights, _ = store.published(k)
            store.write(k, "probe/initial_sum", float(sum(t.double().sum() for t in weights.values())))

    def evaluate_round(self, ctx):
        self.calls.append((ctx.round_idx, ctx.evaluates))
        if not ctx.evaluates:
            return {"probe/rounds": float(ctx.round_idx)}
        weights, mask = ctx.store.published(0)
        ctx.load(weights, mask)
        accs = [ctx.test(k) for k in range(ctx.num_clients)]
        return {"probe/client0_on_all": sum(accs) / len(accs)}


def test_evaluate_round_runs_every_round_and_its_metrics_reach_the_row():
    algorithm = _ClientZeroEverywhere()
    trainer = _run(algorithm, rounds=3, eval_every=2)
    assert algorithm.calls == [(0, False), (1, True), (2, True)]  # every round; evaluated: every 2nd and the last
    assert trainer.history[0]["probe/rounds"] == 0.0 and "probe/client0_on_all" not in trainer.history[0]
    store = trainer.store
    assert 0.0 <= trainer.history[2]["probe/client0_on_all"] <= 1.0
    initial = [store.read(k, "probe/initial_sum").item() for k in range(5)]
    assert len(set(initial)) == 1 and initial[0] != 0.0  # Local: every client starts from the same model


def test_evaluate_round_tests_the_model_it_loads():
    """ctx.load + ctx.test of each client's published model give the engine's own "trained" accuracies."""
    seen = []

    class Probe(Local):
        def evaluate_round(self, ctx):
            for k in range(ctx.num_clients):
                weights, mask = ctx.store.published(k)
                ctx.load(weights, mask)
                seen.append(ctx.test(k))
            return {}

    trainer = _run(Probe(), rounds=1, density=0.5)
    assert sum(seen) / len(seen) == pytest.approx(trainer.history[-1]["acc/personal_mean"], abs=1e-12)
    assert max(seen) == pytest.approx(trainer.history[-1]["acc/personal_max"], abs=1e-12)


# -- staged task writes -------------------------------------------------------------------------
class _CountingLocal(Local):
    """Local training that counts its tasks in a private field; client 2 stages an infinite value in
    round 1 (its weights stay finite)."""

    def state_fields(self):
        return [StateField("probe/tasks", dtype=torch.float64), StateField("probe/bad", dtype=torch.float64)]

    def local_train(self, ctx):
        loss = super().local_train(ctx)
        ctx.write("probe/tasks", ctx.read("probe/tasks") + 1)
        assert ctx.read("probe/tasks") == ctx.store.read(ctx.node, "probe/tasks") + 1  # staged, not yet in the store
        if ctx.node == 2 and ctx.round_idx == 1:
            ctx.write("probe/bad", torch.tensor(float("inf"), dtype=torch.float64))
        return loss


def test_staged_field_writes_are_committed_with_the_update_and_contained_with_it():
    trainer = _run(_CountingLocal(), rounds=3)
    store = trainer.store
    assert [store.read(k, "probe/tasks").item() for k in range(5)] == [3.0, 3.0, 2.0, 3.0, 3.0]
    assert store.read(2, "probe/bad").item() == 0.0  # the infinite write never reached the store
    assert trainer.history[1]["faults/nonfinite_clients"] == 1.0  # its task was contained, its sender named
    assert trainer.history[2]["faults/nonfinite_clients"] == 0.0


def test_a_callbacks_client_end_runs_with_autograd_as_in_a_plain_trainer():
    """``on_client_end`` (a mask search may take a gradient, as RigL's regrowth does) runs with autograd enabled, as
    Lightning's hooks do, whichever way the task's ending was chosen."""
    seen = []

    class GradAtEnd(FederatedCallback):
        def on_client_end(self, trainer, pl_module, client_id):
            seen.append(torch.is_grad_enabled())

    trainer = FederatedTrainer(algorithm=Local(), rounds=1, local_epochs=1, logger=False, enable_progress_bar=False,
                               accelerator="cpu", callbacks=[GradAtEnd()])
    trainer.fit(SparseClassifier(arch="cnn_digits", density=0.5), FederatedDataModule(num_clients=3))
    assert seen == [True, True, True]


def test_a_hook_given_as_a_callable_must_take_the_hooks_arguments():
    from lightning.pytorch.callbacks import LambdaCallback

    from lightning_dfl.errors import ConfigurationError
    from lightning_dfl.federation.loop.callback_hooks import check_supported

    check_supported([LambdaCallback(on_fit_start=lambda trainer, pl_module: None, on_train_end=print)])
    with pytest.raises(ConfigurationError, match="LambdaCallback's on_train_batch_end=.*<lambda> cannot be called with "
                                                 "the hook's arguments \\(trainer, pl_module, outputs, batch, "
                                                 "batch_idx\\)"):
        check_supported([LambdaCallback(on_train_batch_end=lambda trainer, pl_module: None)])


def test_stateless_callbacks_of_one_class_may_repeat_stateful_ones_may_not():
    from lightning.pytorch.callbacks import LambdaCallback

    from lightning_dfl.callbacks import RigL
    from lightning_dfl.federation.loop.callback_hooks import merge_callbacks

    first, second = LambdaCallback(on_fit_start=lambda *a: None), LambdaCallback(on_fit_end=lambda *a: None)
    assert merge_callbacks([], [first, second]) == [first, second]
    mine = RigL()
    assert merge_callbacks([RigL()], [mine]) == [mine]  # the user's takes the algorithm's place
    with pytest.raises(ValueError, match=r"two RigL callbacks would share one checkpoint entry \('RigL'\)"):
        merge_callbacks([], [RigL(), RigL()])
