"""A DA-DPFL round gives the same result in any valid dependency order of its plan.

The reference run walks ``plan.levels()`` (the serial executor); the second run walks, per round, a
seeded random topological order of the same plan (uniform among the ready tasks), with voting and PQI
firing. Stores and metrics must match bit for bit, and every waiting client must have aggregated the
models its prior neighbours trained in this round (their fresh slot), not their start-of-round models.
"""

import random
import warnings

import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, RoundPlan, Task
from lightning_dfl.federation.algorithms import DADPFL
from lightning_dfl.federation.loop.executor import PlanRun, SerialExecutor
from lightning_dfl.federation.metrics.accounting import RoundAccounting
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

NUM_CLIENTS = 6
ROUNDS = 4


def random_topological_order(plan: RoundPlan, rng: random.Random) -> list[Task]:
    """A topological order of ``plan``: at each step one of the ready tasks, drawn uniformly."""
    waits = {t.node: set(t.waits_for()) for t in plan.tasks}
    by_node = {t.node: t for t in plan.tasks}
    done: set[int] = set()
    order: list[Task] = []
    while len(order) < len(plan.tasks):
        ready = sorted(n for n in by_node if n not in done and waits[n] <= done)
        node = rng.choice(ready)
        done.add(node)
        order.append(by_node[node])
    return order


def _nodes(tasks):
    return [t.node for t in tasks]


class ShuffledExecutor(SerialExecutor):
    """Runs each round's tasks in a seeded random topological order that differs, where the plan
    allows one, from both ``plan.order()`` and the reference executor's ``levels()`` walk."""

    def __init__(self, state, seed=1234, tries=50):
        super().__init__(state)
        self.rng = random.Random(seed)
        self.tries = tries
        self.walks = []  # per round: (plan.order(), levels walk, the order run, whether some task waits)

    def run(self, plan, evaluate, accounting=None, exchange=0):
        reference = _nodes(plan.order())
        by_levels = _nodes(task for level in plan.levels() for task in level)
        for _ in range(self.tries):
            order = random_topological_order(plan, self.rng)
            if _nodes(order) not in (reference, by_levels):
                break
        done = set()
        for task in order:  # a valid dependency order
            assert task.waits_for() <= done, (plan.round_idx, task.node, task.waits_for(), done)
            done.add(task.node)
        self.walks.append((reference, by_levels, _nodes(order), any(t.waits_for() for t in plan.tasks)))
        accounting = accounting if accounting is not None else RoundAccounting(plan.round_idx)
        for task in order:
            self.run_task(task, PlanRun(accounting, evaluate, exchange))
        self.state.progress.end_tasks()
        return accounting


class ModelsOfTheRound(FederatedCallback):
    """Snapshots each client's start-of-round model and the model it trained (and publishes) this round."""

    def __init__(self):
        self.start = {}
        self.trained = {}

    def on_federated_round_start(self, trainer, pl_module):
        self.start = {k: {n: t.clone() for n, t in trainer.store.published(k)[0].items()}
                      for k in range(trainer.num_clients)}
        self.trained = {}

    def on_client_train_end(self, trainer, pl_module, client_id):
        # runs after the algorithm's callbacks (voting, PQI): the worker holds the model published next
        self.trained[int(client_id)] = ({n: t.detach().clone() for n, t in trainer.worker_tensors.items()},
                                        {n: m.clone() for n, m in pl_module.mask.masks.items()})


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


class RecordingDADPFL(DADPFL):
    """DA-DPFL that records, per aggregation, what each source's message held."""

    def __init__(self, models, **kwargs):
        super().__init__(**kwargs)
        self._models = models
        self._reads = []  # (round, receiver, source, fresh, == trained this round, == start of round, mask ok)

    def aggregate(self, ctx, messages):
        assert [m.sender for m in messages] == [s.node for s in ctx.task.sources]
        for source, message in zip(ctx.task.sources, messages):
            j = source.node
            start = _same(message.weights, self._models.start[j])
            if source.fresh:
                assert j in self._models.trained, f"client {ctx.node} read {j}'s fresh model before {j} trained"
                weights, mask = self._models.trained[j]
                stored, stored_mask = ctx.store.published(j, fresh=True)
                trained = _same(message.weights, weights) and _same(message.weights, stored)
                mask_ok = _same(message.mask, mask) and _same(message.mask, stored_mask)
            else:
                trained = j in self._models.trained and _same(message.weights, self._models.trained[j][0])
                mask_ok = _same(message.mask, ctx.store.published(j)[1])
            self._reads.append((ctx.round_idx, ctx.node, j, source.fresh, trained, start, mask_ok))
        return super().aggregate(ctx, messages)


def _run(shuffled):
    models = ModelsOfTheRound()
    algorithm = RecordingDADPFL(models, num_neighbors=3, max_wait=2, delta_pr=1000.0, target_sparsity=0.7)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=ROUNDS, local_epochs=1, logger=False, accelerator="cpu",
                               enable_progress_bar=False, callbacks=[models], seed=3)
    if shuffled:
        trainer.executor_factory = ShuffledExecutor
    dm = FederatedDataModule(dataset="digits", num_clients=NUM_CLIENTS, batch_size=32, test_samples_per_client=30)
    trainer.fit(SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05), dm)
    return trainer


def _assert_identical(a, b, where):
    """``a`` and ``b`` hold the same plain data and tensors, bit for bit (dict order aside)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(a), sorted(b))
        for key in a:
            _assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, (where, a, b)


def _by_task(state):
    """Event logs (PQI's ``history``) list events in the order tasks ran: compare them by (round, client)."""
    if isinstance(state, dict):
        return {k: _by_task(v) for k, v in state.items()}
    if isinstance(state, list) and state and all(isinstance(e, dict) and {"round_idx", "client"} <= set(e)
                                                 for e in state):
        return sorted(state, key=lambda e: (e["round_idx"], e["client"]))
    return state


def _store_tensors(store):
    out = {}
    for group in ("weights", "published_masks", "masks"):
        out.update({f"{group}/{n}": t for n, t in getattr(store, group).items()})
    for name, parts in store.fields.items():
        out.update({f"fields/{name}/{part}": t for part, t in parts.items()})
    out["slot"], out["active"] = store.slot, store.active
    return out


def test_any_valid_dependency_order_gives_bit_identical_rounds():
    reference = _run(shuffled=False)
    shuffled = _run(shuffled=True)

    # the second run really walked other valid orders, in rounds where clients wait for fresh models
    walks = shuffled.executor.walks
    assert len(walks) == ROUNDS
    assert any(waits and order != ref for ref, _, order, waits in walks)
    assert any(waits and order != ref and order != levels for ref, levels, order, waits in walks)
    # voting decided t* and PQI pruned within the run
    assert any("voting/t_star" in m for m in shuffled.history)
    assert any(m.get("pqi/pruned_clients", 0) > 0 for m in shuffled.history)
    assert shuffled.history[-1]["density/mean"] < shuffled.history[0]["density/mean"]

    # bit-identical stores: weights, masks, published masks, every declared field, slots
    mine, theirs = _store_tensors(shuffled.store), _store_tensors(reference.store)
    assert sorted(mine) == sorted(theirs)
    assert set(mine) >= {f"fields/{name}/{part}" for name, parts in reference.store.fields.items() for part in parts}
    differing = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert not differing, f"store tensors differ with another dependency order: {differing}"
    # and the callbacks' state (voting's Delta history and t*, PQI's events, RigL's), bit for bit
    assert [c.state_key for c in shuffled.callbacks] == [c.state_key for c in reference.callbacks]
    for mine_cb, theirs_cb in zip(shuffled.callbacks, reference.callbacks):
        _assert_identical(_by_task(mine_cb.state_dict()), _by_task(theirs_cb.state_dict()), mine_cb.state_key)

    # bit-identical metrics, every key but the wall time
    def comparable(history):
        return [{k: v for k, v in m.items() if k != "time/wall_round_s"} for m in history]

    for round_idx, (a, b) in enumerate(zip(comparable(shuffled.history), comparable(reference.history))):
        assert a.keys() == b.keys(), round_idx
        differing = {k: (a[k], b[k]) for k in a if a[k] != b[k] and not (a[k] != a[k] and b[k] != b[k])}
        assert not differing, f"round {round_idx}: metrics differ with another dependency order: {differing}"
    assert len(shuffled.history) == len(reference.history) == ROUNDS

    # each waiting client aggregated its prior neighbours' models of this round, in either order
    for trainer in (reference, shuffled):
        reads = trainer.algorithm._reads
        fresh = [r for r in reads if r[3]]
        assert fresh, "no client waited for a prior neighbour"
        bad_fresh = [r for r in fresh if not r[4] or r[5] or not r[6]]
        assert not bad_fresh, f"(round, client, source, fresh, ==trained, ==start, mask ok): {bad_fresh}"
        stale = [r for r in reads if not r[3]]
        bad_stale = [r for r in stale if not r[5] or not r[6]]
        assert not bad_stale, f"start-of-round reads that did not get the start-of-round model: {bad_stale}"
    assert shuffled.algorithm._reads != reference.algorithm._reads  # another order, same reads per client
    assert sorted(shuffled.algorithm._reads) == sorted(reference.algorithm._reads)
