"""Kill a federation at a round, resume from its checkpoint, and finish bit for bit the same."""

import csv
import logging
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from _helpers import Kill

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import Clock, FederatedTrainer
from lightning_dfl.federation.algorithms import DADPFL, DisPFL
from lightning_dfl.federation.trainer.checkpoint_file import CheckpointError, read_state
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


class Started(FederatedCallback):
    """Records which hooks of the run started: ``"fit"`` and the round indices."""

    def __init__(self):
        self.events = []

    def on_fit_start(self, trainer, pl_module):
        self.events.append("fit")

    def on_federated_round_start(self, trainer, pl_module):
        self.events.append(trainer.current_round)


def _trainer(tmp_path, callbacks=None, rounds=6, logger=False, algorithm=None, **kwargs):
    if algorithm is None:
        algorithm = DADPFL(num_neighbors=2, max_wait=2, delta_pr=1000.0, target_sparsity=0.7)
    return FederatedTrainer(algorithm=algorithm, rounds=rounds, local_epochs=1, logger=logger, accelerator="cpu",
                            enable_progress_bar=False, default_root_dir=str(tmp_path), callbacks=callbacks,
                            **kwargs)


NUM_CLIENTS = 5
MODEL = {"arch": "cnn_digits", "density": 0.5, "lr": 0.05}
DATA = {"dataset": "digits", "num_clients": NUM_CLIENTS, "batch_size": 32, "test_samples_per_client": 30,
        "partition": "dirichlet", "alpha": 0.3}


def _parts(model=None, data=None):
    dm = FederatedDataModule(**{**DATA, **(data or {})})
    return SparseClassifier(**{**MODEL, **(model or {})}), dm


def _comparable(history):
    return [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in history]


def test_resume_after_a_kill_finishes_identically(tmp_path):
    straight = _trainer(tmp_path / "a")
    straight.fit(*_parts())

    killed = _trainer(tmp_path / "b", callbacks=[Kill(at_round=3)], checkpoint_every=1)
    with pytest.raises(KeyboardInterrupt):
        killed.fit(*_parts())
    ckpt = killed.checkpoint_path
    assert ckpt.is_file() and not ckpt.with_name(ckpt.name + ".tmp").exists()

    resumed = _trainer(tmp_path / "b")
    resumed.fit(*_parts(), ckpt_path=str(ckpt))
    for name in straight.store.names:
        assert torch.equal(straight.store.weights[name], resumed.store.weights[name])
    for name in straight.store.masked_names:
        assert torch.equal(straight.store.masks[name], resumed.store.masks[name])
    assert _comparable(resumed.history) == _comparable(straight.history)
    assert resumed.history[-1]["density/mean"] < 0.5  # the pruning state came back too


def test_resume_refuses_another_configuration_and_missing_files(tmp_path):
    first = _trainer(tmp_path, checkpoint_every=2, rounds=2)
    first.fit(*_parts())
    assert read_state(first.checkpoint_path)["next_round"] == 2  # plain data, read weights-only
    other = FederatedTrainer(algorithm=DADPFL(num_neighbors=2, max_wait=1), rounds=2, local_epochs=1, logger=False,
                             enable_progress_bar=False)
    with pytest.raises(ValueError, match="another configuration"):
        other.fit(*_parts(), ckpt_path=str(first.checkpoint_path))
    with pytest.raises(CheckpointError, match="no checkpoint at .*nope.ckpt"):
        _trainer(tmp_path).fit(*_parts(), ckpt_path=str(tmp_path / "nope.ckpt"))
    with pytest.raises(ValueError, match="checkpoint_every"):
        _trainer(tmp_path, checkpoint_every=-1)


# -- a shared 2-round checkpoint -------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-round DA-DPFL run checkpointed after every round: (checkpoint path, its history). It has a
    ``Started`` callback, since a resumed run needs a saved state for each of its callbacks."""
    trainer = _trainer(tmp_path_factory.mktemp("saved"), callbacks=[Started()], rounds=2, checkpoint_every=1)
    trainer.fit(*_parts())
    return trainer.checkpoint_path, list(trainer.history)


CHANGES = {  # identity key: (settings of the resumed run, the checkpoint's value, the new value)
    "model/lr": ({"model": {"lr": 0.1}}, 0.05, 0.1),
    "model/density": ({"model": {"density": 0.6}}, 0.5, 0.6),
    "data/partition": ({"data": {"partition": "iid"}}, "dirichlet", "iid"),
    "data/alpha": ({"data": {"alpha": 0.5}}, 0.3, 0.5),
}


@pytest.mark.parametrize("keys", [[k] for k in CHANGES] + [list(CHANGES)], ids=[*CHANGES, "all"])
def test_resume_refuses_changed_model_and_data_settings_before_training(saved, tmp_path, keys):
    ckpt, _ = saved
    settings = {"model": {}, "data": {}}
    for key in keys:
        for part, values in CHANGES[key][0].items():
            settings[part].update(values)
    started = Started()
    trainer = _trainer(tmp_path, callbacks=[started], rounds=3)  # rounds may change: not named
    with pytest.raises(ValueError, match="another configuration") as info:
        trainer.fit(*_parts(**settings), ckpt_path=str(ckpt))
    message = str(info.value)
    for key in keys:
        _, before, now = CHANGES[key]
        assert f"{key}: checkpoint={before!r} now={now!r}" in message
    for key in set(CHANGES) - set(keys):
        assert key not in message
    assert "rounds" not in message
    assert f"allow={sorted(keys)}" in message
    assert started.events == [] and trainer.history == []  # refused before any training
    assert read_state(ckpt)["next_round"] == 2  # the checkpoint is left as it was


def test_resume_allow_accepts_a_named_change_and_refuses_unknown_keys(saved, tmp_path, caplog):
    ckpt, history = saved
    started = Started()
    trainer = _trainer(tmp_path, callbacks=[started], rounds=3, resume_allow=["model/lr"])
    model, dm = _parts(model={"lr": 0.1})
    with caplog.at_level(logging.INFO):
        trainer.fit(model, dm, ckpt_path=str(ckpt))
    assert "model/lr: checkpoint=0.05 now=0.1" in caplog.text  # the accepted change is logged
    assert started.events == ["fit", 2]
    assert len(trainer.history) == 3 and trainer.history[:2] == history
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(model.lr_at(2))  # the new lr trained

    other = _trainer(tmp_path / "other", callbacks=[Started()], rounds=3, resume_allow=["lr", "model/lr"])
    with pytest.raises(ValueError, match=r"cannot allow \['lr'\]: not identity keys") as info:
        other.fit(*_parts(model={"lr": 0.1}), ckpt_path=str(ckpt))
    for valid in ("model/lr", "model/density", "data/partition", "data/alpha", "rounds", "seed"):
        assert repr(valid) in str(info.value)  # the valid keys are named
    assert other.callbacks[-1].events == [] and other.history == []


def test_extending_rounds_on_resume_runs_only_the_new_rounds(saved, tmp_path, caplog):
    ckpt, history = saved
    started = Started()
    trainer = _trainer(tmp_path, callbacks=[started], rounds=3, checkpoint_every=1)
    with caplog.at_level(logging.INFO):
        summary = trainer.fit(*_parts(), ckpt_path=str(ckpt))
    assert "rounds: checkpoint=2 now=3" in caplog.text  # the log says the schedules follow the new length
    assert "follow the new rounds from here" in caplog.text
    assert started.events == ["fit", 2]  # exactly one more round
    assert len(trainer.history) == 3 and trainer.history[:2] == history
    assert summary.rounds == 3
    assert read_state(trainer.checkpoint_path)["next_round"] == 3
    assert trainer.checkpoint_path != ckpt  # this run wrote its own checkpoint


def test_checkpoint_file_is_plain_data_read_weights_only(saved):
    ckpt, history = saved
    state = torch.load(ckpt, weights_only=True)
    assert {"next_round", "identity", "store", "algorithm", "clock", "history", "callbacks"} <= set(state)
    assert state["next_round"] == 2
    assert "fields" in state["store"]
    assert {"weights", "masks", "published_masks", "slot"} <= set(state["store"])
    assert state["history"] == history
    assert state["identity"]["model/lr"] == 0.05 and state["identity"]["data/partition"] == "dirichlet"
    assert set(state["callbacks"]) == {"PruningTimeVoting", "PQIPruning", "RigL", "Started"}
    assert "elapsed" in state["clock"]


# -- logs of killed and resumed runs ---------------------------------------------------------


def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_killed_run_keeps_its_metrics(tmp_path):
    killed = _trainer(tmp_path, callbacks=[Kill(at_round=2)], rounds=3, logger=True)
    with pytest.raises(KeyboardInterrupt):
        killed.fit(*_parts())
    rows = _csv_rows(Path(killed.log_dir) / "metrics.csv")  # flushed every round, no finalize needed
    assert sorted(int(r["step"]) for r in rows) == [0, 1]
    for row, metrics in zip(sorted(rows, key=lambda r: int(r["step"])), killed.history):
        assert float(row["acc/personal_mean"]) == metrics["acc/personal_mean"]
        assert float(row["density/mean"]) == metrics["density/mean"]


def test_a_resumed_run_logs_and_summarizes_every_round(tmp_path):
    killed = _trainer(tmp_path, callbacks=[Kill(at_round=2)], rounds=4, logger=True, checkpoint_every=1)
    with pytest.raises(KeyboardInterrupt):
        killed.fit(*_parts())
    earlier_wall = sum(m["time/wall_round_s"] for m in killed.history)
    assert len(killed.history) == 2

    resumed = _trainer(tmp_path, rounds=4, logger=True, checkpoint_every=1)
    summary = resumed.fit(*_parts(), ckpt_path=str(Path(killed.log_dir) / "checkpoints" / "last.ckpt"))
    assert resumed.log_dir != killed.log_dir

    rows = sorted(_csv_rows(Path(resumed.log_dir) / "metrics.csv"), key=lambda r: int(r["step"]))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    for row, metrics in zip(rows, resumed.history):
        assert float(row["acc/personal_mean"]) == metrics["acc/personal_mean"]
    for row, metrics in zip(rows[:2], killed.history):  # the replayed rounds are the killed run's
        assert float(row["acc/personal_mean"]) == metrics["acc/personal_mean"]
        assert float(row["time/wall_round_s"]) == metrics["time/wall_round_s"]

    clients = _csv_rows(Path(resumed.log_dir) / "clients.csv")
    assert Counter(int(r["round"]) for r in clients) == {r: NUM_CLIENTS for r in range(4)}
    assert {(int(r["round"]), int(r["client"])) for r in clients} == {
        (r, k) for r in range(4) for k in range(NUM_CLIENTS)}
    first = _csv_rows(Path(killed.log_dir) / "clients.csv")
    assert [r for r in clients if int(r["round"]) < 2] == first  # copied from the killed run

    assert summary.rounds == 4
    assert summary.wall_time_s >= earlier_wall
    assert summary.wall_time_s >= sum(m["time/wall_round_s"] for m in resumed.history)
    assert summary.log_dir == resumed.log_dir


# -- the algorithm's and the clock's state ---------------------------------------------------


class CountingDisPFL(DisPFL):
    """DisPFL with its own state across rounds: a counter incremented in every ``plan_round``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._counter = torch.zeros((), dtype=torch.long)  # private: not part of repr (the identity)

    def plan_round(self, ctx):
        self._counter += 1
        return super().plan_round(ctx)

    def state_dict(self):
        return {"counter": self._counter.clone()}

    def load_state_dict(self, state):
        self._counter = state["counter"].clone()


def _clocked(tmp_path, **kwargs):
    return _trainer(tmp_path, rounds=3, algorithm=CountingDisPFL(num_neighbors=2),
                    clock=Clock(distribution="uniform", noise=0.2), **kwargs)


def test_the_algorithms_and_the_clocks_state_are_restored(tmp_path):
    straight = _clocked(tmp_path / "a")
    straight.fit(*_parts())

    killed = _clocked(tmp_path / "b", callbacks=[Kill(at_round=2)], checkpoint_every=1)
    with pytest.raises(KeyboardInterrupt):
        killed.fit(*_parts())
    assert int(killed.algorithm._counter) == 3  # round 2 was planned, but not checkpointed
    assert int(read_state(killed.checkpoint_path)["algorithm"]["counter"]) == 2

    resumed = _clocked(tmp_path / "b")
    resumed.fit(*_parts(), ckpt_path=str(killed.checkpoint_path))
    assert torch.equal(resumed.algorithm._counter, straight.algorithm._counter)
    assert int(resumed.algorithm._counter) == 3
    assert resumed.clock.elapsed == straight.clock.elapsed > 0

    def times(history):
        return [{k: v for k, v in m.items() if k.startswith("time/") and k != "time/wall_round_s"} for m in history]

    assert len(resumed.history) == len(straight.history) == 3
    assert times(resumed.history) == times(straight.history)
    assert all(t["time/duration"] > 0 for t in times(straight.history))
    assert len({t["time/duration"] for t in times(straight.history)}) == 3  # the per-round noise is drawn
    for name in straight.store.names:
        assert torch.equal(straight.store.weights[name], resumed.store.weights[name])


# -- a poisoned checkpoint is refused on load ----------------------------------------------------


def _poisoned(source, target, poison):
    from lightning_dfl.federation.trainer.checkpoint_file import write_state

    state = read_state(source)
    poison(state)
    return write_state(target, state)


def _nan_client_3(state):
    weights = state["store"]["weights"]
    name = sorted(weights)[0]
    weights[name][0, 3].view(-1)[0] = float("nan")
    weights[name][1, 3].view(-1)[0] = float("nan")
    return name


@pytest.mark.parametrize("store", ["dense", "compact"])
def test_a_checkpoint_with_non_finite_weights_is_refused_naming_client_and_parameter(tmp_path, store):
    trainer = _trainer(tmp_path / "saved", callbacks=[Started()], rounds=1, checkpoint_every=1, store=store)
    trainer.fit(*_parts())
    named = {}

    def poison(state):
        if store == "dense":
            named["name"] = _nan_client_3(state)
        else:
            values = state["store"]["records"][3]["values"]
            named["name"] = sorted(values)[0]
            values[named["name"]].view(-1)[0] = float("inf")

    ckpt = _poisoned(trainer.checkpoint_path, tmp_path / "nan.ckpt", poison)
    started = Started()
    resumed = _trainer(tmp_path / "resumed", callbacks=[started], rounds=2, store=store)
    with pytest.raises(CheckpointError, match="non-finite") as info:
        resumed.fit(*_parts(), ckpt_path=str(ckpt))
    message = str(info.value)
    assert "\n" not in message and "client 3" in message and repr(named["name"]) in message, message
    assert started.events == [] and resumed.history == []  # refused before any training


def test_a_checkpoint_with_non_finite_field_or_algorithm_state_is_refused(saved, tmp_path):
    ckpt, _ = saved

    def poison(state):
        state["algorithm"]["poison"] = torch.tensor([1.0, float("inf")])

    bad = _poisoned(ckpt, tmp_path / "inf.ckpt", poison)
    with pytest.raises(CheckpointError, match=r"non-finite .*the algorithm's state\['poison'\]"):
        _trainer(tmp_path / "r", callbacks=[Started()], rounds=3).fit(*_parts(), ckpt_path=str(bad))


# -- a checkpoint that says what it cannot be; a resume that changes what the results depend on ---------


@pytest.mark.parametrize("next_round", [10**9, 0, 1.5], ids=["1e9", "0", "float"])
def test_a_checkpoint_whose_next_round_disagrees_with_its_history_is_refused(saved, tmp_path, next_round):
    ckpt, _ = saved
    bad = _poisoned(ckpt, tmp_path / "next.ckpt", lambda state: state.update(next_round=next_round))
    started = Started()
    with pytest.raises(CheckpointError, match=rf"next_round={next_round!r} but holds the metrics of 2 rounds"):
        _trainer(tmp_path / "r", callbacks=[started], rounds=3).fit(*_parts(), ckpt_path=str(bad))
    assert started.events == []


def test_a_checkpoint_with_an_all_false_mask_is_refused_naming_the_client(saved, tmp_path):
    ckpt, _ = saved

    def empty_client_2(state):
        for mask in state["store"]["masks"].values():
            mask[2] = False

    bad = _poisoned(ckpt, tmp_path / "empty.ckpt", empty_client_2)
    started = Started()
    with pytest.raises(CheckpointError, match="empty mask .*client 2"):
        _trainer(tmp_path / "r", callbacks=[started], rounds=3).fit(*_parts(), ckpt_path=str(bad))
    assert started.events == []


def test_resume_refuses_another_cpu_threads(tmp_path):
    """A CPU run's results depend on its thread count (5 columns of metrics.csv differed after such a resume):
    the count it computed with is in the identity, and a resume with another is refused naming it."""
    threads = torch.get_num_threads()
    try:
        first = _trainer(tmp_path, rounds=1, checkpoint_every=1, cpu_threads=1)
        first.fit(*_parts())
        assert read_state(first.checkpoint_path)["identity"]["cpu_threads"] == 1
        started = Started()
        with pytest.raises(ValueError, match="another configuration") as info:
            _trainer(tmp_path / "r", callbacks=[started], rounds=2, cpu_threads=2).fit(
                *_parts(), ckpt_path=str(first.checkpoint_path))
        assert "cpu_threads: checkpoint=1 now=2" in str(info.value) and started.events == []
    finally:
        torch.set_num_threads(threads)


RESULT_SETTINGS = {"dropout": (0.0, 0.3), "deadline": (None, 5.0), "batched_clients": (False, True),
                   "memory_format": ("auto", "contiguous"), "matmul_precision": ("auto", "highest")}


@pytest.mark.parametrize("key", list(RESULT_SETTINGS))
def test_resume_refuses_a_changed_setting_that_changes_results(saved, tmp_path, key):
    ckpt, _ = saved
    before, now = RESULT_SETTINGS[key]
    started = Started()
    trainer = _trainer(tmp_path, callbacks=[started], rounds=3, **{key: now})
    with pytest.raises(ValueError, match="another configuration") as info:
        trainer.fit(*_parts(), ckpt_path=str(ckpt))
    assert f"{key}: checkpoint={before!r} now={now!r}" in str(info.value)
    assert started.events == []


def test_resume_allow_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"resume_allow=\['model/lr'\] applies only when resuming"):
        _trainer(tmp_path, rounds=1, resume_allow=["model/lr"]).fit(*_parts())


# -- a checkpoint of the wrong structure is refused before anything is loaded ------------------------


@pytest.fixture(scope="module")
def saved_compact(tmp_path_factory):
    """A 1-round DA-DPFL run with the compact store, checkpointed: its path."""
    trainer = _trainer(tmp_path_factory.mktemp("compact"), callbacks=[Started()], rounds=1, checkpoint_every=1,
                       store="compact")
    trainer.fit(*_parts())
    return trainer.checkpoint_path


def _first(mapping):
    return next(iter(mapping))


def _rename_first(weights):
    weights["conv9.weight"] = weights.pop(_first(weights))


def _slice(key, index):
    def edit(state):
        state["store"][key] = {n: t[index] for n, t in state["store"][key].items()}
    return edit


STRUCTURE = {  # case: (store that saved, edit, what the one line says)
    **{f"no {key}": ("dense", lambda s, key=key: s.pop(key), rf"it has no \['{key}'\]")
       for key in ("store", "identity", "next_round", "history", "callbacks", "algorithm", "clock")},
    "store a list": ("dense", lambda s: s.update(store=[1, 2]), "its 'store' is a list, expected a dict"),
    "identity a list": ("dense", lambda s: s.update(identity=["a"]), "its 'identity' is a list, expected a dict"),
    "history a dict": ("dense", lambda s: s.update(history={"0": {}}), "its 'history' is a dict, expected a list"),
    "history entry": ("dense", lambda s: s["history"].__setitem__(0, 5), "its history's entry 0 is a int"),
    "callbacks a list": ("dense", lambda s: s.update(callbacks=[]), "its 'callbacks' is a list, expected a dict"),
    "callback state": ("dense", lambda s: s["callbacks"].update(Started=[1]),
                       "its callbacks' state 'Started' is a list, expected a dict"),
    "clock empty": ("dense", lambda s: s.update(clock={}), r"its clock's state has no \['elapsed'\]"),
    "clock text": ("dense", lambda s: s["clock"].update(elapsed="x"), "its clock's 'elapsed' is 'x', expected a number"),
    "parameter names": ("dense", lambda s: _rename_first(s["store"]["weights"]),
                        r"its store's weights lack \['features.0.weight'\] and hold unknown \['conv9.weight'\]"),
    "shapes": ("dense", _slice("weights", (slice(None), slice(None), slice(0, 1))),
               r"its store's weights 'features.0.weight' has shape \(2, 5, 1, 1, 3, 3\), this run's store "
               r"\(2, 5, 32, 1, 3, 3\)"),
    "nodes": ("dense", _slice("weights", (slice(None), slice(0, 4))),
              "its store's weights 'features.0.weight' hold 4 nodes, this run has 5"),
    "dtype": ("dense", lambda s: s["store"]["weights"].update({n: t.double() for n, t in s["store"]["weights"].items()}),
              "has dtype torch.float64, this run's store torch.float32"),
    "masks a list": ("dense", lambda s: s["store"].update(masks=[]), "its store's masks are a list, expected a dict"),
    "slots": ("dense", lambda s: s["store"]["slot"].__setitem__(0, 7), r"its store's slots hold \[0, 7\]"),
    "field missing": ("dense", lambda s: s["store"]["fields"].pop("voting/vote"),
                      r"its store's state fields lack \['voting/vote'\]"),
    "field dtype": ("dense", lambda s: s["store"]["fields"]["pqi/sparsity"].update({"": torch.zeros(5)}),
                    "its field 'pqi/sparsity' has dtype torch.float32, this run's store torch.float64"),
    "unknown format": ("dense", lambda s: s["store"].update(format="sparse"), "its store has format 'sparse'"),
    "dense marked compact": ("dense", lambda s: s["store"].update(format="compact"), "its compact store has no"),
    "compact unmarked": ("compact", lambda s: s["store"].pop("format"),
                         "its store has no .*neither a dense store nor a compact one"),
    "compact nodes": ("compact", lambda s: s["store"]["records"].pop(),
                      "its compact store holds records of 4 nodes, this run has 5"),
    "compact record": ("compact", lambda s: s["store"]["records"].__setitem__(2, None),
                       "its record of node 2 is NoneType"),
    "compact values": ("compact", lambda s: s["store"]["records"][1]["values"].update(
        {"classifier.0.weight": torch.zeros(3)}), r"its record of node 1: values of 'classifier.0.weight' "
                                                        r"has shape \(3,\)"),
    "compact bits": ("compact", lambda s: s["store"]["current_bits"][3].update(
        {"features.2.weight": torch.zeros(3, dtype=torch.uint8)}),
        r"its current mask bits of node 3 'features.2.weight' has shape \(3,\)"),
    "compact names": ("compact", lambda s: s["store"].update(names=s["store"]["names"][::-1]),
                      r"its compact store's names are .* \(in this order\)"),
}


@pytest.mark.parametrize("case", list(STRUCTURE))
def test_a_checkpoint_of_the_wrong_structure_is_one_line_before_anything_loads(saved, saved_compact, tmp_path,
                                                                                monkeypatch, case):
    from lightning_dfl.federation.store import CompactClientStore, DenseClientStore

    store, edit, message = STRUCTURE[case]
    bad = _poisoned(saved[0] if store == "dense" else saved_compact, tmp_path / "bad.ckpt", edit)
    loads = []
    for cls in (DenseClientStore, CompactClientStore):
        monkeypatch.setattr(cls, "load_state_dict", lambda self, state: loads.append(state))
    started = Started()
    trainer = _trainer(tmp_path / "r", callbacks=[started], rounds=3, store=store)
    with pytest.raises(CheckpointError, match=message) as info:
        trainer.fit(*_parts(), ckpt_path=str(bad))
    text = str(info.value)
    assert "\n" not in text and repr(str(bad)) in text and "is damaged or does not fit this run" in text, text
    assert loads == [] and started.events == [] and trainer.history == []  # validated first, nothing loaded


@pytest.mark.parametrize(("saved_by", "resumed_by"), [("dense", "compact"), ("compact", "dense")])
def test_either_store_resumes_the_others_checkpoint(saved, saved_compact, tmp_path, saved_by, resumed_by):
    ckpt = saved[0] if saved_by == "dense" else saved_compact
    trainer = _trainer(tmp_path, callbacks=[Started()], rounds=3, store=resumed_by)
    trainer.fit(*_parts(), ckpt_path=str(ckpt))
    assert len(trainer.history) == 3
