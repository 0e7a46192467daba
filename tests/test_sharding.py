"""Clients sharded across 2 CPU processes (gloo): bit-identical to one process, and what is refused."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dfl.callbacks import PQIPruning, PruningTimeVoting
from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DisPFL, FedFomo
from lightning_dfl.federation.loop.sharded import check_shardable
from lightning_dfl.federation.trainer.checkpoint_file import read_state

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
COMMON = ["--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", "--data.test_samples_per_client",
          "40", "--data.batch_size", "32", "--data.num_clients", "6", "--trainer.local_epochs", "1"]
RUNS = {
    "dispfl": ("dispfl_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.num_neighbors", "2"]),
    # voting decides t* in round 1 and PQI prunes in round 2 (the golden record's DA-DPFL settings)
    "dadpfl": ("dadpfl_digits.yaml", ["--trainer.rounds", "4", "--trainer.algorithm.init_args.num_neighbors", "2",
                                      "--trainer.algorithm.init_args.max_wait", "2",
                                      "--trainer.algorithm.init_args.delta_pr", "1000.0",
                                      "--trainer.algorithm.init_args.target_sparsity", "0.7",
                                      "--trainer.client_speeds", "[1.0,2.0,0.5,1.0,1.5,1.0]"]),
    # a server node (K) and sampled clients: the server's task is sharded like a client's
    "fedavg": ("fedavg_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.clients_per_round", "4"]),
    "prisam": ("prisam_digits.yaml", ["--trainer.rounds", "3", "--trainer.local_steps", "2", "--trainer.local_epochs", "null", "--data.num_groups", "3",
                                      "--trainer.algorithm.init_args.num_groups", "3",
                                      "--trainer.algorithm.init_args.warmup_rounds", "1"]),
    "dpsgd": ("dpsgd_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.num_neighbors", "2"]),
    "local": ("local_digits.yaml", ["--trainer.rounds", "2"]),
    "beer": ("beer_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.num_neighbors", "2"]),
    "dfedavgm": ("dfedavgm_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.num_neighbors", "2"]),
    # Q = 2 gossip steps: two exchanges per round, each one's published models read by the next
    "dfedsam": ("dfedsam_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.num_neighbors", "2",
                                        "--trainer.algorithm.init_args.gossip_steps", "2"]),
    "ditto": ("ditto_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.clients_per_round", "4",
                                    "--trainer.algorithm.init_args.global_epochs", "1",
                                    "--trainer.algorithm.init_args.personal_epochs", "1"]),
    # readjustments in rounds 1 and 2 (the clients' regrowth FLOPs and the server's changed mask travel)
    "feddst": ("feddst_digits.yaml", ["--trainer.rounds", "3", "--trainer.algorithm.init_args.clients_per_round", "4",
                                      "--trainer.algorithm.init_args.readjust_every", "1"]),
    "fedfomo": ("fedfomo_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.num_neighbors", "2"]),
    "fedavg_ft": ("fedavg_ft_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.clients_per_round",
                                            "4"]),
    "dpsgd_ft": ("dpsgd_ft_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.num_neighbors", "2"]),
    "gossipfl": ("gossipfl_digits.yaml", ["--trainer.rounds", "2"]),
    # two warm-up rounds (each client's gradient statistics travel to the warm server's process), then W* solved
    "psfl": ("psfl_digits.yaml", ["--trainer.rounds", "3", "--trainer.algorithm.init_args.clients_per_round", "4",
                                  "--trainer.algorithm.init_args.warmup_rounds", "2", "--trainer.local_epochs", "null",
                                  "--trainer.local_steps", "3"]),
    # W = 2 chains of S = 2 clients: each chain's second client reads the first's fresh model from the other process
    "psfl_chains": ("psfl_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.clients_per_round",
                                         "4", "--trainer.algorithm.init_args.sequences", "2",
                                         "--trainer.local_epochs", "null", "--trainer.local_steps", "3"]),
    # every client's mask change is tried (dist_thresh 0) and kept (acc_thresh 0): accepted prunings travel
    "subfedavg": ("subfedavg_digits.yaml", ["--trainer.rounds", "2", "--trainer.algorithm.init_args.clients_per_round",
                                            "4", "--trainer.algorithm.init_args.acc_thresh", "0.0",
                                            "--trainer.algorithm.init_args.dist_thresh", "0.0",
                                            "--trainer.local_epochs", "2"]),
}
# partitioned stores in the other format and received in groups of tasks: what travels changes, results do not
RUNS["dispfl_compact"] = (RUNS["dispfl"][0], [*RUNS["dispfl"][1], "--trainer.store", "compact"])
RUNS["dadpfl_compact"] = (RUNS["dadpfl"][0], [*RUNS["dadpfl"][1], "--trainer.store", "compact"])
RUNS["psfl_chains_one_task_a_time"] = RUNS["psfl_chains"]
# a third of the clients drop out each round: BEER mixes in the replicas it holds of absent neighbours (they travel
# as its tasks' replicas); FedFomo picks among the clients present
RUNS["beer_dropout"] = (RUNS["beer"][0], ["--trainer.rounds", "3", *RUNS["beer"][1][2:], "--trainer.dropout", "0.34"])
RUNS["fedfomo_dropout"] = (RUNS["fedfomo"][0], [*RUNS["fedfomo"][1], "--trainer.dropout", "0.34"])
# the masks shared for grouping are computed from each client's published model by its owner
RUNS["prisam_grouping_ratio"] = (RUNS["prisam"][0], [*RUNS["prisam"][1],
                                                     "--trainer.algorithm.init_args.grouping_ratio", "0.5"])
#: per run, settings of the two-process run only (one process refuses them)
TWO_ONLY = {"dadpfl_compact": ["--trainer.tasks_per_receive", "1"],
            "psfl_chains_one_task_a_time": ["--trainer.tasks_per_receive", "1"]}
#: per run, a metric that shows the run exercised what must travel between processes: (column, round, > value)
EXERCISED = {
    "feddst": ("flops/readjust", 0, 0.0), "fedfomo": ("flops/validation", 0, 0.0),
    "subfedavg": ("subfedavg/pruned_clients", 0, 0.0), "psfl": ("psfl/B", 2, 0.0), "psfl_chains": ("psfl/S", 0, 1.0),
    "psfl_chains_one_task_a_time": ("psfl/S", 0, 1.0),
}


def _fit(root: Path, config: str, extra: list[str], devices: int, two_only: tuple[str, ...] = ()) -> Path:
    rounds = extra[extra.index("--trainer.rounds") + 1]
    extra = [*extra, *(two_only if devices > 1 else ())]
    args = [sys.executable, "-m", "lightning_dfl", "fit", "--config", str(CONFIGS / config), *COMMON, *extra,
            "--trainer.devices", str(devices), "--trainer.checkpoint_every", rounds,
            "--trainer.default_root_dir", str(root)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(root.glob("*/version_*"))
    assert len(runs) == 1, runs  # one run folder, written by process 0 only
    return runs[0]


def _rows(path: Path) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if "wall" not in k} for row in csv.DictReader(path.open())]


def _differences(a, b, path=""):
    if isinstance(a, dict):
        assert set(a) == set(b), path
        return [d for k in a for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, torch.Tensor):
        return [] if torch.equal(a, b) else [path]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    if path.startswith("/history") and "wall" in path:
        return []
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_two_processes_reproduce_one_bit_for_bit(tmp_path, name):
    config, extra = RUNS[name]
    one = _fit(tmp_path / "one", config, extra, devices=1)
    two = _fit(tmp_path / "two", config, extra, devices=2, two_only=tuple(TWO_ONLY.get(name, ())))
    assert _rows(one / "metrics.csv") == _rows(two / "metrics.csv")
    assert _rows(one / "clients.csv") == _rows(two / "clients.csv")
    a, b = read_state(one / "checkpoints" / "last.ckpt"), read_state(two / "checkpoints" / "last.ckpt")
    for part in ("store", "algorithm", "callbacks", "clock"):
        assert _differences(a[part], b[part], part) == []
    if (one / "diagnostics" / "bytes.csv").is_file():  # who sent what to whom, gathered from both processes
        assert (one / "diagnostics" / "bytes.csv").read_text() == (two / "diagnostics" / "bytes.csv").read_text()
    rows = _rows(one / "metrics.csv")  # the run exercised what must travel between processes
    if name.startswith("dadpfl"):
        assert any(float(r["pqi/pruned_clients"] or 0) > 0 for r in rows)
        assert rows[-1]["voting/t_star"] != ""
    if name in EXERCISED:
        column, round_idx, floor = EXERCISED[name]
        assert float(rows[round_idx][column]) > floor, (column, rows[round_idx][column])


def test_every_registered_algorithm_runs_sharded_and_is_tested_here():
    from lightning_dfl.federation import ALGORITHMS

    for name in ALGORITHMS.names():
        check_shardable(ALGORITHMS.get(name)(), [])
    assert set(ALGORITHMS.names()) <= set(RUNS)


# -- what is refused ----------------------------------------------------------------------------------
def test_an_algorithm_that_has_not_opted_in_is_refused_with_the_ones_that_have():
    class Unsharded(FedFomo):  # opted out
        shardable = False

    with pytest.raises(ValueError, match="Unsharded cannot shard its clients across processes yet; use devices=1, "
                                         "or one of: DisPFL, DADPFL, DPSGD, Local, FedAvg, PSFL, FedAvgFT, DPSGDFT, "
                                         "Ditto, DFedAvgM, DFedSAM, FedDST, SubFedAvg, FedFomo, GossipFL, BEER, "
                                         "PRISAM$"):  # the names --trainer.algorithm takes
        check_shardable(Unsharded(), [])


# -- the class flags: inherited by a plain subclass, re-declared by one that changes behaviour --------------
class RenamedDisPFL(DisPFL):
    """A plain subclass: new defaults and a title, nothing a task does changes."""

    title = "DisPFL (M = 2)"

    def __init__(self, num_neighbors: int = 2, **kwargs):
        super().__init__(num_neighbors=num_neighbors, **kwargs)


class CountingDisPFL(DisPFL):
    """Changes a hook (task state of its own): it loses both flags unless it says them again."""

    def aggregate(self, ctx, messages):
        self.calls = getattr(self, "calls", 0) + 1
        return super().aggregate(ctx, messages)


class RedeclaredDisPFL(CountingDisPFL):
    shardable = True
    reads_only_sources = True
    partitionable = True


class OptedOutDisPFL(DisPFL):
    shardable = False


def test_a_plain_subclass_inherits_the_class_flags():
    for flag in ("shardable", "reads_only_sources", "partitionable"):
        assert RenamedDisPFL.declares(flag) and DisPFL.declares(flag)
    check_shardable(RenamedDisPFL(), [])


def test_a_subclass_that_changes_behaviour_declares_the_flags_again():
    for flag in ("shardable", "reads_only_sources", "partitionable"):
        assert not CountingDisPFL.declares(flag)
        assert RedeclaredDisPFL.declares(flag)
    with pytest.raises(ValueError, match="CountingDisPFL cannot shard"):
        check_shardable(CountingDisPFL(), [])
    check_shardable(RedeclaredDisPFL(), [])
    assert not OptedOutDisPFL.declares("shardable") and OptedOutDisPFL.declares("reads_only_sources")
    with pytest.raises(ValueError, match="OptedOutDisPFL cannot shard"):
        check_shardable(OptedOutDisPFL(), [])
    with pytest.raises(ValueError, match="unknown flag 'sharded'"):
        DisPFL.declares("sharded")


def test_the_registered_algorithms_flags_are_their_own_declarations():
    """Every registered algorithm declares the flags it has in its own body (none relies on inheriting)."""
    from lightning_dfl.federation import ALGORITHMS

    for name in ALGORITHMS.names():
        cls = ALGORITHMS.get(name)
        for flag in ("shardable", "reads_only_sources", "partitionable"):
            assert cls.declares(flag) == bool(vars(cls).get(flag, False)), (name, flag)


def test_a_callback_with_task_state_but_no_protocol_is_refused():
    class CountsClients(FederatedCallback):
        def on_client_end(self, trainer, pl_module, client_id):
            self.seen = client_id

    class RoundOnly(FederatedCallback):
        def on_federated_round_end(self, trainer, pl_module):
            pass

    check_shardable(DisPFL(), [RoundOnly(), PQIPruning(), PruningTimeVoting()])
    with pytest.raises(ValueError, match="callback CountsClients changes state in task hooks \\(on_client_end\\)"):
        check_shardable(DisPFL(), [CountsClients()])


@pytest.mark.parametrize("kwargs,match", [
    ({"devices": 0}, "devices \\(processes per node\\) must be an integer >= 1, got 0"),
    ({"devices": 2, "strategy": "fsdp"}, "strategy='fsdp' with 2 process\\(es\\).*allowed: 'auto', 'ddp'"),
    ({"strategy": "ddp"}, "strategy='ddp' with 1 process\\(es\\).*allowed: 'auto', 'single_device'"),
    ({"num_nodes": 0}, "num_nodes must be an integer >= 1, got 0"),
])
def test_bad_process_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FederatedTrainer(logger=False, **kwargs)


def test_pqi_deltas_replay_in_task_order():
    pqi = PQIPruning()
    start = pqi.shard_snapshot()
    pqi.history.append("event of task 1")
    pqi._round_sparsity.append((1, 0.5))
    pqi._round_events += 1
    delta = pqi.shard_delta(start)
    pqi.shard_rollback(start)
    assert pqi.history == [] and pqi._round_sparsity == [] and pqi._round_events == 0
    pqi.shard_apply((["event of task 0"], [(0, 0.4)], 1, 7))  # task 0 ran on the other process
    pqi.shard_apply(delta)
    assert pqi.history == ["event of task 0", "event of task 1"]
    assert pqi._round_sparsity == [(0, 0.4), (1, 0.5)] and pqi._round_events == 2 and pqi._round_pruned == 7


# -- an algorithm's task state: a round's tally, PSFL's warm-up sums --------------------------------------
def _shard_level(obj, tasks, world_size=2):
    """What the sharded executor does with ``obj`` over one level of ``tasks`` (callables run as tasks), on each
    of ``world_size`` processes (fresh copies of ``obj``); returns those copies."""
    import copy

    processes = [copy.deepcopy(obj) for _ in range(world_size)]
    deltas = {}
    for rank, proc in enumerate(processes):
        before = proc.shard_snapshot()
        for position, task in enumerate(tasks):
            if position % world_size == rank:
                mark = proc.shard_snapshot()
                task(proc)
                deltas[position] = proc.shard_delta(mark)
        proc.shard_rollback(before)
    for proc in processes:
        for position in range(len(tasks)):
            proc.shard_apply(deltas[position])
    return processes


def test_a_round_tally_replayed_across_processes_sums_in_task_order_bit_for_bit():
    from lightning_dfl.federation.algorithms.tally import RoundTally

    amounts = [0.1, 0.2, 0.3]
    serial = RoundTally(flops=0.0, tasks=0)
    for a in amounts:
        serial.add(flops=a, tasks=1)
    assert serial["flops"] == 0.6000000000000001  # ((0.1 + 0.2) + 0.3): another order gives 0.6
    for proc in _shard_level(RoundTally(flops=0.0, tasks=0), [lambda t, a=a: t.add(flops=a, tasks=1) for a in amounts]):
        assert proc.totals == serial.totals
        assert proc.take() == {"flops": 0.6000000000000001, "tasks": 3} and proc.totals == {"flops": 0.0, "tasks": 0}
    with pytest.raises(KeyError, match="unknown sum\\(s\\) flop; this tally keeps: flops, tasks"):
        serial.add(flop=1.0)


def test_psfl_warmup_sums_replayed_across_processes_equal_one_process():
    from lightning_dfl.federation.algorithms import PSFL

    gradients = [{"w": torch.tensor([0.1, 1e8]), "b": torch.tensor([0.3])},
                 {"w": torch.tensor([0.2, -1e8]), "b": torch.tensor([0.7])},
                 {"w": torch.tensor([0.3, 1.0]), "b": torch.tensor([-0.1])}]
    tasks = [lambda p, k=k, g=g: p._add_gradient(0, k, 0.5 * k, 0.1 * k, float(k), g) for k, g in enumerate(gradients)]
    serial = PSFL(clients_per_round=3)
    for task in tasks:
        task(serial)
    for proc in _shard_level(PSFL(clients_per_round=3), tasks, world_size=2):
        assert all(torch.equal(proc._grad_sum[n], serial._grad_sum[n]) for n in ("w", "b"))
        assert proc._grad_norms == serial._grad_norms and list(proc._grad_norms) == [0, 1, 2]  # task order
        assert proc._sigma2 == serial._sigma2 and proc._sigma2_minibatch == serial._sigma2_minibatch
    # the warm server's step (a task too) empties the sums and keeps B on every process
    (proc,) = _shard_level(serial, [lambda p: p._end_warm_step(2.5)], world_size=1)
    assert proc._b == [2.5] and proc._grad_sum is None and proc._grad_norms == {}


# -- each process evaluates the clients it owns ----------------------------------------------------------
PROBE = '''
import json, os

import torch.distributed as dist

from lightning_dfl.federation.algorithms import FedAvgFT


class ProbeFedAvgFT(FedAvgFT):
    """FedAvg-FT that writes, per process and round, the clients whose test sets the process read."""

    shardable = True

    def evaluate_round(self, ctx):
        worker = ctx.worker
        if not hasattr(worker, "probe"):  # from here on, every test-set read of this process is written down
            worker.probe, original = [], worker.test_batches
            worker.test_batches = lambda client: (worker.probe.append(client), original(client))[1]
        out = super().evaluate_round(ctx)
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.path.join(os.environ["PROBE_DIR"], f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"round": ctx.round_idx, "tested": worker.probe}) + "\\n")
        worker.probe = []
        return out
'''


def test_each_process_evaluates_only_the_clients_it_owns(tmp_path, monkeypatch):
    import json

    (tmp_path / "probe_algorithm.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    run = _fit(tmp_path / "runs", "fedavg_ft_digits.yaml",
               ["--trainer.rounds", "2", "--trainer.algorithm", "probe_algorithm.ProbeFedAvgFT",
                "--trainer.algorithm.init_args.clients_per_round", "4"], devices=2)
    assert (run / "metrics.csv").is_file()
    for rank in (0, 1):
        rows = [json.loads(line) for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()]
        own = [k for k in range(6) if k % 2 == rank]
        assert rows[0] == {"round": 0, "tested": own}  # the fine-tuned models, on the owned clients' test sets
        # round 1: the tasks' own evaluations (on the process that ran them), the consensus model, the fine-tuned ones
        assert set(rows[1]["tested"]) <= set(own) and rows[1]["tested"][-2 * len(own):] == own + own


EXIT_PROBE = '''
import atexit, os

import torch.distributed as dist
from lightning.pytorch import Callback


class AtExit(Callback):
    """Writes, per process, whether the process group exists when fit ends and when the interpreter exits (its
    handler, registered before the run's, runs after it: atexit is last in, first out)."""

    def __init__(self):
        self.path = os.path.join(os.environ["PROBE_DIR"], "rank" + os.environ.get("LOCAL_RANK", "0"))
        atexit.register(lambda: open(self.path, "a").write(f"exit {dist.is_initialized()}\\n"))

    def on_fit_end(self, trainer, pl_module):
        open(self.path, "a").write(f"fit_end {dist.is_initialized()}\\n")
'''


def test_a_sharded_run_destroys_its_process_group_at_exit_not_before(tmp_path, monkeypatch):
    """Each process of a finished 2-process run destroys the gloo group when the interpreter exits (left to its
    destructor at finalization it aborted a process once in a while: "terminate called without an active
    exception", exit -6), and the group still exists when fit ends."""
    (tmp_path / "exit_probe.py").write_text(EXIT_PROBE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    config, extra = RUNS["dispfl"]
    _fit(tmp_path / "runs", config, [*extra, "--trainer.callbacks+=exit_probe.AtExit"], devices=2)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text().splitlines() == ["fit_end True", "exit False"], rank


def test_ownership_is_round_robin_and_one_process_owns_everything():
    from lightning_dfl.federation.loop.ownership import Ownership, owner_of

    second = Ownership(rank=1, world_size=3)
    assert [owner_of(k, 3) for k in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert second.owned(range(7)) == [1, 4] and second.owns(4) and not second.owns(6)
    alone = Ownership()
    assert alone.owned([5, 0, 3]) == [5, 0, 3]
    assert alone.gather({2: "b", 0: "a"}, [0, 2]) == ["a", "b"]  # one process: its own values, in node order


# -- two machines: Fabric's launcher with num_nodes, here both on this host ---------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_reproduce_one_process_bit_for_bit(tmp_path):
    """docs/devices.md's two-machine commands (num_nodes 2, one process each, MASTER_ADDR/PORT, NODE_RANK)."""
    import os

    config, extra = RUNS["dispfl"]
    one = _fit(tmp_path / "one", config, extra, devices=1)
    args = [sys.executable, "-m", "lightning_dfl", "fit", "--config", str(CONFIGS / config), *COMMON, *extra,
            "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.checkpoint_every", "2",
            "--trainer.default_root_dir", str(tmp_path / "two")]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    machines = [subprocess.Popen(args, env={**env, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    outputs = [m.communicate(timeout=600) for m in machines]
    assert [m.returncode for m in machines] == [0, 0], [err[-2000:] for _, err in outputs]
    (two,) = sorted((tmp_path / "two").glob("*/version_*"))  # written by the first machine's process alone
    assert _rows(one / "metrics.csv") == _rows(two / "metrics.csv")
    assert _rows(one / "clients.csv") == _rows(two / "clients.csv")
    a, b = read_state(one / "checkpoints" / "last.ckpt"), read_state(two / "checkpoints" / "last.ckpt")
    for part in ("store", "algorithm", "callbacks", "clock"):
        assert _differences(a[part], b[part], part) == []


def test_a_checkpoint_resumes_with_another_number_of_processes(tmp_path):
    """One checkpoint file, written by process 0, holds the whole federation: 2 processes resume 1's, and back."""
    config, extra = RUNS["dispfl"]  # 2 rounds, then resumed to 3

    def resumed(name, first, then):
        start = _fit(tmp_path / f"{name}-start", config, extra, devices=first)
        more = [*extra[:extra.index("--trainer.rounds")], "--trainer.rounds", "3",
                *extra[extra.index("--trainer.rounds") + 2:], "--ckpt_path", str(start / "checkpoints" / "last.ckpt")]
        return _fit(tmp_path / f"{name}-end", config, more, devices=then)

    same, fewer, more = resumed("1-1", 1, 1), resumed("2-1", 2, 1), resumed("1-2", 1, 2)
    for other in (fewer, more):
        assert _rows(same / "metrics.csv") == _rows(other / "metrics.csv")
        a, b = read_state(same / "checkpoints" / "last.ckpt"), read_state(other / "checkpoints" / "last.ckpt")
        for part in ("store", "algorithm", "callbacks", "clock"):
            assert _differences(a[part], b[part], part) == []


def test_several_machines_without_their_addresses_are_refused_before_waiting():
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    from lightning_dfl.federation.loop.sharded import check_machines_meet

    plain = LightningEnvironment()
    check_machines_meet(1, plain, {})  # one machine needs nothing
    check_machines_meet(2, plain, {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    check_machines_meet(2, plain, {"GROUP_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    check_machines_meet(2, SLURMEnvironment(), {})  # a scheduler sets the ranks itself
    with pytest.raises(ValueError, match="num_nodes=2: NODE_RANK not set.*NODE_RANK=<0 on the first"):
        check_machines_meet(2, plain, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    with pytest.raises(ValueError, match="num_nodes=2: MASTER_PORT not set"):  # each machine would pick its own
        check_machines_meet(2, plain, {"NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"})
    with pytest.raises(ValueError, match="num_nodes=3: NODE_RANK, MASTER_ADDR and MASTER_PORT not set"):
        check_machines_meet(3, plain, {})
