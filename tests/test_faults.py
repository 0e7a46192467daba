"""Faults a federation survives: non-finite updates, dropout, stragglers, Ctrl-C and SIGTERM."""

import math
import os
import signal
import warnings

import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import Clock, FederatedTrainer
from lightning_dfl.federation.algorithms import DADPFL, DPSGD, DisPFL, FedAvg
from lightning_dfl.federation.trainer.checkpoint_file import read_state
from lightning_dfl.federation.trainer.interrupts import Interrupted, resume_command
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


def _trainer(algorithm, rounds=3, callbacks=None, **kw):
    kw.setdefault("logger", False)
    return FederatedTrainer(algorithm=algorithm, rounds=rounds, local_epochs=1, accelerator="cpu",
                            enable_progress_bar=False, callbacks=callbacks, **kw)


def _parts(num_clients=6):
    dm = FederatedDataModule(dataset="digits", num_clients=num_clients, batch_size=32, test_samples_per_client=30)
    return SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05), dm


def _flagged(run_root):
    """(round, client) of every row of the run's clients.csv flagged ``nonfinite``."""
    rows = (run_root / "version_0" / "clients.csv").read_text().splitlines()
    header = rows[0].split(",")
    flagged = [r.split(",") for r in rows[1:] if r.split(",")[header.index("nonfinite")] == "1"]
    return [(int(r[0]), int(r[1])) for r in flagged]


def _all_finite(store):
    return all(bool(torch.isfinite(t).all()) for t in store.weights.values())


class Poison(FederatedCallback):
    """Makes the given clients' weights NaN during their local training in ``round_idx``."""

    def __init__(self, clients, round_idx=1):
        self.clients, self.round_idx = set(clients), round_idx
        self.received = []

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_round == self.round_idx and trainer.current_client in self.clients:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))


def test_a_client_whose_update_is_not_finite_is_contained(tmp_path):
    model, dm = _parts()
    seen = {"finite_rounds": []}

    class Watch(FederatedCallback):
        def on_client_before_aggregation(self, trainer, pl_module, client_id):
            if client_id == 2 and trainer.current_round in (1, 2):  # its model at the start of rounds 1 and 2
                seen[trainer.current_round] = {n: t.clone() for n, t in trainer.store.published(2)[0].items()}

        def on_federated_round_end(self, trainer, pl_module):
            seen["finite_rounds"].append(_all_finite(trainer.store))

    trainer = _trainer(DisPFL(num_neighbors=2), callbacks=[Poison({2}), Watch()], checkpoint_every=1,
                       default_root_dir=str(tmp_path), logger=True)
    trainer.fit(model, dm)
    assert [m["faults/nonfinite_clients"] for m in trainer.history] == [0.0, 1.0, 0.0]
    assert _flagged(tmp_path / "dispfl") == [(1, 2)]  # round 1, client 2
    for n, t in seen[1].items():  # in round 1 client 2 published its start-of-round model
        assert torch.equal(seen[2][n], t)
    assert seen["finite_rounds"] == [True, True, True]  # no neighbour ever received a non-finite value
    assert all(math.isfinite(m["acc/personal_mean"]) for m in trainer.history)
    state = read_state(trainer.checkpoint_path)
    assert all(bool(torch.isfinite(t).all()) for t in state["store"]["weights"].values())
    assert trainer.history[-1]["acc/personal_mean"] > 0.3


class Huge(Poison):
    """Makes the given clients' weights finite but huge (3e38, near float32's largest) in ``round_idx``."""

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_round == self.round_idx and trainer.current_client in self.clients:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(3e38)


def test_a_client_publishing_finite_but_huge_weights_is_contained_and_named_as_the_sender(tmp_path):
    """Its receivers' aggregates would overflow to inf; the sender is flagged, not its neighbours."""
    model, dm = _parts()
    bounded = []

    class Watch(FederatedCallback):
        def on_federated_round_end(self, trainer, pl_module):
            bounded.append(all(bool(t.abs().max() <= 1e30) for t in trainer.store.weights.values()))

    trainer = _trainer(DisPFL(num_neighbors=4), callbacks=[Huge({2}), Watch()], default_root_dir=str(tmp_path),
                       logger=True)
    trainer.fit(model, dm)
    assert [m["faults/nonfinite_clients"] for m in trainer.history] == [0.0, 1.0, 0.0]
    assert _flagged(tmp_path / "dispfl") == [(1, 2)]  # round 1, client 2: the sender
    assert bounded == [True, True, True]  # no neighbour ever received the huge model
    assert all(math.isfinite(m["acc/personal_mean"]) for m in trainer.history)


def test_a_round_in_which_every_client_fails_stops_the_run_naming_them():
    model, dm = _parts(4)
    trainer = _trainer(DisPFL(num_neighbors=2), callbacks=[Poison({0, 1, 2, 3})])
    with pytest.raises(FloatingPointError, match=r"round 2 of \d+: every client that trained \(4: \[0, 1, 2, 3\]\)"):
        trainer.fit(model, dm)


def test_a_diverging_learning_rate_is_contained_not_propagated():
    model, dm = _parts(4)
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=1e30)
    trainer = _trainer(DPSGD(num_neighbors=2), rounds=1)
    with pytest.raises(FloatingPointError, match="learning rate is probably too high"):
        trainer.fit(model, dm)


@pytest.mark.parametrize("algorithm", [DisPFL(num_neighbors=2), DADPFL(num_neighbors=2, max_wait=2),
                                       DPSGD(num_neighbors=2), FedAvg(clients_per_round=3)],
                         ids=["dispfl", "dadpfl", "dpsgd", "fedavg"])
def test_dropout_half_the_clients_runs_to_the_end(algorithm):
    model, dm = _parts(8)
    plans = []
    original = type(algorithm).plan_round

    def spy(self, ctx):
        plan = original(self, ctx)
        plans.append((ctx.participants, plan))
        return plan

    type(algorithm).plan_round, restore = spy, original
    try:
        trainer = _trainer(algorithm, rounds=4, dropout=0.5)
        trainer.fit(model, dm)
    finally:
        type(algorithm).plan_round = restore
    shares = [m["clients/active_share"] for m in trainer.history]
    assert all(0 <= s <= 1 for s in shares) and min(shares) < 1 and 0.25 < sum(shares) / len(shares) < 0.75
    for participants, plan in plans:  # an inactive client neither trains nor sends
        active = set(participants)
        for task in plan.tasks:
            if task.node < 8:
                assert task.node in active
            assert {s.node for s in task.sources if s.node < 8} <= active
    assert _all_finite(trainer.store)


def test_dropout_is_validated():
    with pytest.raises(ValueError, match="dropout must be a probability in \\[0, 1\\), got 1.0"):
        FederatedTrainer(dropout=1.0)
    with pytest.raises(ValueError, match="deadline must be a time > 0"):
        FederatedTrainer(deadline=0)


@pytest.mark.parametrize("algorithm", [DisPFL(num_neighbors=2), DADPFL(num_neighbors=3, max_wait=2)],
                         ids=["dispfl", "dadpfl"])
def test_a_deadline_drops_the_stragglers(algorithm):
    model, dm = _parts(8)
    clock = Clock(distribution="uniform", low=0.5, high=4.5, noise=0.2)
    trainer = _trainer(algorithm, rounds=3, clock=clock, deadline=3.0)
    trainer.fit(model, dm)
    for r, m in enumerate(trainer.history):
        assert m["time/duration"] <= 3.0 + 1e-9  # every task met the deadline
        times = clock.compute_times(r)
        late = sum(t > 3.0 for t in times[:8])  # cannot finish even when starting at once
        if isinstance(algorithm, DADPFL):
            assert m["faults/stragglers"] >= late  # and those whose waits make them late
        else:
            assert m["faults/stragglers"] == late
        assert m["clients/active_share"] == pytest.approx(1 - m["faults/stragglers"] / 8)
    assert sum(m["faults/stragglers"] for m in trainer.history) > 0


class SendSignal(FederatedCallback):
    """Sends ``signals`` to this process during client 1's task of ``round_idx``."""

    def __init__(self, signals, round_idx=1):
        self.signals, self.round_idx = list(signals), round_idx

    def on_client_train_end(self, trainer, pl_module, client_id):
        if trainer.current_round == self.round_idx and client_id == 1:
            for sig in self.signals:
                os.kill(os.getpid(), sig)


def _stores_equal(a, b):
    for part in ("weights", "masks", "published_masks"):
        for n, t in getattr(a.store, part).items():
            assert torch.equal(t, getattr(b.store, part)[n]), (part, n)
    for name, parts in a.store.fields.items():
        for n, t in parts.items():
            assert torch.equal(t, b.store.fields[name][n]) or (t.isnan() == b.store.fields[name][n].isnan()).all()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_a_signal_finishes_the_round_checkpoints_and_resumes_bit_identical(tmp_path, sig, code):
    algo = lambda: DADPFL(num_neighbors=2, max_wait=2, delta_pr=1000.0, target_sparsity=0.7)  # noqa: E731
    model, dm = _parts()
    straight = _trainer(algo(), rounds=4, callbacks=[SendSignal([])])
    straight.fit(model, dm)

    model, dm = _parts()
    stopped = _trainer(algo(), rounds=4, callbacks=[SendSignal([sig])], default_root_dir=str(tmp_path))
    before = signal.getsignal(sig), signal.getsignal(signal.SIGINT)  # SIG_IGN in a background job, else Python's
    with pytest.raises(Interrupted) as info:
        stopped.fit(model, dm)
    assert info.value.exit_code == code
    assert len(stopped.history) == 2  # round 1 was finished, not abandoned
    assert info.value.checkpoint == stopped.checkpoint_path and "ckpt_path=" in info.value.resume_hint
    assert (signal.getsignal(sig), signal.getsignal(signal.SIGINT)) == before  # the handlers are given back

    model, dm = _parts()
    resumed = _trainer(algo(), rounds=4, callbacks=[SendSignal([])])
    resumed.fit(model, dm, ckpt_path=str(info.value.checkpoint))
    _stores_equal(straight, resumed)
    for a, b in zip(straight.history, resumed.history):
        assert {k: v for k, v in a.items() if k != "time/wall_round_s"} == \
               {k: v for k, v in b.items() if k != "time/wall_round_s"}


def test_a_second_signal_abandons_the_round_at_once(tmp_path):
    model, dm = _parts()
    trainer = _trainer(DisPFL(num_neighbors=2), rounds=3, callbacks=[SendSignal([signal.SIGINT, signal.SIGINT])],
                       default_root_dir=str(tmp_path), checkpoint_every=1)
    with pytest.raises(Interrupted) as info:
        trainer.fit(model, dm)
    assert info.value.exit_code == 130 and len(trainer.history) == 1  # round 1 abandoned
    assert read_state(info.value.checkpoint)["next_round"] == 1  # the last checkpoint on disk


@pytest.mark.parametrize("signals, message", [([signal.SIGINT], "stopped after round 2 of 3"),
                                             ([signal.SIGINT, signal.SIGINT], "abandoned round 2 of 3")],
                         ids=["stopped", "abandoned"])
def test_the_interrupt_message_counts_rounds_as_the_progress_bar(tmp_path, signals, message):
    """Rounds count from 1 in what the user reads, as in the progress bar's "round 2/3" (metrics.csv from 0)."""
    model, dm = _parts()
    trainer = _trainer(DisPFL(num_neighbors=2), rounds=3, callbacks=[SendSignal(signals, round_idx=1)],
                       default_root_dir=str(tmp_path), checkpoint_every=1)
    with pytest.raises(Interrupted) as info:
        trainer.fit(model, dm)
    assert str(info.value).startswith(message + "; checkpoint ")


def test_the_resume_command_replaces_the_checkpoint_option():
    cmd = resume_command("runs/x/last.ckpt", ["lightning-dfl", "fit", "--config", "a b.yaml", "--ckpt_path", "old"])
    assert cmd == "lightning-dfl fit --config 'a b.yaml' --ckpt_path runs/x/last.ckpt"
    assert resume_command("c.ckpt", None) == "trainer.fit(model, datamodule, ckpt_path='c.ckpt')"


def test_personal_mean_over_the_clients_that_met_the_deadline_is_counted_and_said_once():
    model, dm = _parts(8)
    clock = Clock(distribution="uniform", low=0.5, high=4.5, noise=0.2)
    trainer = _trainer(DisPFL(num_neighbors=2), rounds=3, clock=clock, deadline=3.0)
    with pytest.warns(UserWarning, match=r"missed the deadline; acc/personal_mean averages only the \d+ of 8") as seen:
        trainer.fit(model, dm)
    assert sum("missed the deadline" in str(w.message) for w in seen) == 1  # once per run, not every round
    for m in trainer.history:
        assert m["acc/personal_count"] == 8 - m["faults/stragglers"]


def test_a_run_in_which_no_client_meets_the_deadline_warns_that_it_has_no_accuracy():
    model, dm = _parts(8)
    trainer = _trainer(DisPFL(num_neighbors=2), rounds=2, clock=Clock(), deadline=0.5)  # every task takes 1
    with pytest.warns(UserWarning) as seen:
        trainer.fit(model, dm)
    messages = [str(w.message) for w in seen]
    assert any("8 client(s) missed the deadline; no client was evaluated" in m for m in messages), messages
    assert any("no accuracy (final_accuracy is null" in m and "deadline (0.5)" in m for m in messages), messages
    assert math.isnan(trainer.summary.final_accuracy)
    assert all("acc/personal_mean" not in m and m["faults/stragglers"] == 8 for m in trainer.history)


def test_a_second_signal_during_the_checkpoint_write_waits_for_the_file_and_names_it(tmp_path, monkeypatch):
    import lightning_dfl.federation.trainer.checkpoint as checkpoint

    write = checkpoint.write_state
    written = []

    def interrupted_write(path, state):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while the file is being written
        written.append(state["next_round"])
        return write(path, state)

    monkeypatch.setattr(checkpoint, "write_state", interrupted_write)
    model, dm = _parts()
    trainer = _trainer(DisPFL(num_neighbors=2), rounds=3, callbacks=[SendSignal([signal.SIGINT], round_idx=0)],
                       default_root_dir=str(tmp_path))
    with pytest.raises(Interrupted) as info:
        trainer.fit(model, dm)
    assert info.value.exit_code == 130 and written == [1] and len(trainer.history) == 1
    assert read_state(info.value.checkpoint)["next_round"] == 1  # the write completed
    assert "--ckpt_path" in info.value.resume_hint or "ckpt_path=" in info.value.resume_hint
    assert "stopped after round 1 of 3" in str(info.value)


@pytest.mark.parametrize("fault, algorithm, selects", [
    (Poison, lambda: DisPFL(num_neighbors=2, regrowth="gradient"), True),
    (Huge, lambda: DisPFL(num_neighbors=2, regrowth="gradient"), True),
    (Poison, lambda: DADPFL(num_neighbors=2, max_wait=2), False),  # PQI prunes after training: it reads first
], ids=["nan", "huge", "dadpfl"])
def test_containment_selected_on_the_device_equals_containment_after_reading(tmp_path, monkeypatch, fault, algorithm,
                                                                             selects):
    """On an accelerator a DisPFL task (RigL by gradient) does not read its finite check: it publishes the trained
    or the start-of-round model by selection on the device, keeps its mask when contained, and the round takes back
    RigL's count of the discarded search. The run equals the CPU's, which reads and branches: metrics, clients.csv,
    every stored model and mask, RigL's state. A DA-DPFL task, whose callbacks change the trained model, reads."""
    from lightning_dfl.deferred import device_paths_on_cpu
    from lightning_dfl.federation.loop.executor import SerialExecutor

    def run(folder):
        model, dm = _parts()
        trainer = _trainer(algorithm(), callbacks=[fault({2})], logger=True, default_root_dir=str(folder),
                           checkpoint_every=1)
        trainer.fit(model, dm)
        return trainer

    host = run(tmp_path / "host")
    selected = []
    publish = SerialExecutor._publish

    def counting(self, ctx, record, run, ok, fields):  # a device flag: chosen by selection
        if isinstance(ok, torch.Tensor):
            selected.append(ctx.node)
        return publish(self, ctx, record, run, ok, fields)

    monkeypatch.setattr(SerialExecutor, "_publish", counting)
    with device_paths_on_cpu():
        device = run(tmp_path / "device")
    assert len(selected) == (3 * 6 if selects else 0)  # every task of every round, the contained one included
    assert [m["faults/nonfinite_clients"] for m in device.history] == [0.0, 1.0, 0.0]
    strip = [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in host.history]
    assert [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in device.history] == strip
    csv = [next(f.rglob("clients.csv")).read_text() for f in (tmp_path / "host", tmp_path / "device")]
    assert csv[0] == csv[1]
    for part in ("weights", "published_masks", "masks"):
        for name, tensor in getattr(host.store, part).items():
            assert torch.equal(tensor, getattr(device.store, part)[name]), (part, name)
    assert torch.equal(host.store.active, device.store.active)
    rigl = [next(c for c in t.callbacks if type(c).__name__ == "RigL") for t in (host, device)]
    assert rigl[0].state_dict() == rigl[1].state_dict()
    if selects:
        assert rigl[1].state_dict()["num_updates"] == 3 * 6 - 1  # the contained task's search taken back


def test_a_vote_without_a_first_distance_keeps_the_checkpoint_finite_and_resumable(tmp_path, monkeypatch):
    """Eq. 4 divides by Delta_1; a client that did not move in its first round (Delta_1 = 0) then scores inf. Its
    vote is "not stable", its record holds NaN ("no score"), the score mean leaves it out, and the run's own
    checkpoint resumes (an inf in voting/score made the next --ckpt_path refuse it)."""
    from lightning_dfl.callbacks import PruningTimeVoting

    original = PruningTimeVoting._delta

    def still_at_first(self, trainer, pl_module, client):  # client 2 did not move in round 0
        delta = original(self, trainer, pl_module, client)
        return 0.0 if client == 2 and trainer.current_round == 0 else delta

    monkeypatch.setattr(PruningTimeVoting, "_delta", still_at_first)

    model, dm = _parts()
    straight = _trainer(DADPFL(num_neighbors=3, max_wait=3), rounds=3, checkpoint_every=1,
                        default_root_dir=str(tmp_path))
    straight.fit(model, dm)
    assert all(m["faults/nonfinite_clients"] == 0 for m in straight.history)  # an undefined score is no fault
    state = read_state(straight.checkpoint_path)
    score = state["store"]["fields"]["voting/score"][""]
    assert math.isnan(float(score[2])) and bool(torch.isfinite(score[[0, 1, 3, 4, 5]]).all())
    assert all(math.isfinite(m.get("voting/score_mean", 0.0)) for m in straight.history)
    votes = state["store"]["fields"]["voting/vote"][""]
    assert int(votes[2]) == 0  # "not stable"
    model, dm = _parts()
    resumed = _trainer(DADPFL(num_neighbors=3, max_wait=3), rounds=4,
                       default_root_dir=str(tmp_path / "b"))
    resumed.fit(model, dm, ckpt_path=str(straight.checkpoint_path))  # refused before: inf in voting/score
    assert len(resumed.history) == 4


class Recorder(FederatedCallback):
    """Keeps one float per client in the store; writes ``bad`` for client 2 in round 1 (a callback's fault)."""

    def __init__(self, bad):
        self.bad = bad

    def client_state_fields(self, trainer, pl_module):
        return [{"name": "probe/value", "dtype": torch.float64, "fill": 0.0}]

    def on_client_train_end(self, trainer, pl_module, client_id):
        record = trainer.client_state(client_id)
        value = self.bad if client_id == 2 and trainer.current_round == 1 else float(record["probe/value"]) + 1.0
        record["probe/value"] = value
        assert float(record["probe/value"]) == value or math.isnan(value)  # the task reads its own write


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_callbacks_non_finite_record_is_contained_with_its_task(tmp_path, bad):
    """A callback's per-client write during a task is staged with the task's update: a non-finite one contains the
    task (flagged, named), the store keeps the client's previous value, and the checkpoint stays loadable."""
    model, dm = _parts()
    trainer = _trainer(DisPFL(num_neighbors=2), callbacks=[Recorder(bad)], checkpoint_every=1,
                       default_root_dir=str(tmp_path))
    trainer.fit(model, dm)
    assert [m["faults/nonfinite_clients"] for m in trainer.history] == [0.0, 1.0, 0.0]
    values = [float(trainer.store.read(k, "probe/value")) for k in range(6)]
    assert values == [3.0, 3.0, 2.0, 3.0, 3.0, 3.0]  # client 2's round-1 write was discarded with its update
    state = read_state(trainer.checkpoint_path)
    assert bool(torch.isfinite(state["store"]["fields"]["probe/value"][""]).all())


class Large(Poison):
    """Sets the given clients' first parameter to ``value`` at the end of their local training in ``round_idx``."""

    def __init__(self, clients, value, round_idx=1):
        super().__init__(clients, round_idx)
        self.value = value

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_round == self.round_idx and trainer.current_client in self.clients:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(self.value)


@pytest.mark.parametrize("options", [{"message_dtype": "float16"}, {"rule": "da"}], ids=["float16_messages", "da_deltas"])
def test_a_model_beyond_its_messages_float16_range_is_contained_at_the_sender(tmp_path, options):
    """1e6 is finite in float32 but beyond float16's 65504: sent as float16 (the model, or DA's delta field) it would
    reach the neighbours as inf, and they, not the sender, were flagged; the send-time bound is the message's dtype."""
    from lightning_dfl.federation.algorithms import DFedAvgM

    model, dm = _parts()
    trainer = _trainer(DFedAvgM(num_neighbors=3, **options), rounds=3, callbacks=[Large({2}, 1e6)],
                       default_root_dir=str(tmp_path), logger=True)
    trainer.fit(model, dm)
    assert [m["faults/nonfinite_clients"] for m in trainer.history] == [0.0, 1.0, 0.0]
    assert _flagged(tmp_path / "dfedavgm") == [(1, 2)]  # the sender
    assert all(bool((t.abs() <= 65504).all()) for t in trainer.store.weights.values())
    for parts in trainer.store.fields.values():
        assert all(bool(torch.isfinite(t).all()) for t in parts.values())


@pytest.mark.parametrize("value", [1e31, 3e38])
def test_a_checkpoint_holding_weights_beyond_the_publish_bound_is_refused(tmp_path, value):
    """Finite but huge weights in a checkpoint (edited, or from an older version) would spread from the resumed
    round on: refused at load with the bound applied at send time, naming the client and the parameter."""
    from lightning_dfl.federation.trainer.checkpoint_file import CheckpointError

    model, dm = _parts()
    trainer = _trainer(DisPFL(num_neighbors=2), rounds=2, checkpoint_every=1, default_root_dir=str(tmp_path))
    trainer.fit(model, dm)
    state = torch.load(trainer.checkpoint_path, weights_only=False)
    name = next(iter(state["store"]["weights"]))
    state["store"]["weights"][name][:, 3].flatten(1)[:, 0] = value
    torch.save(state, tmp_path / "edited.ckpt")
    model, dm = _parts()
    again = _trainer(DisPFL(num_neighbors=2), rounds=3, default_root_dir=str(tmp_path / "b"))
    with pytest.raises(CheckpointError, match=f"weights above 1e\\+30 .*client 3.*{name}"):
        again.fit(model, dm, ckpt_path=str(tmp_path / "edited.ckpt"))
