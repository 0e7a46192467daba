"""Machines that do not meet within ``rendezvous_timeout`` stop the run in one line; machines that meet train as
before (the two-machine run that reproduces one process bit for bit: tests/test_sharding.py)."""

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_dfl.errors import ConfigurationError, MachinesDidNotMeet
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.loop.rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT, meet_machines
from lightning_dfl.federation.loop.sharded import check_machines_meet
from lightning_dfl.federation.trainer.settings import RunSettings

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
#: far below torch's default process-group timeout (30 min), far above what a refusal takes (about 15 s here)
BOUND_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine(rank: int, port: int) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(rank)}


# -- the setting ---------------------------------------------------------------------------------------------------
def test_the_timeout_is_a_number_of_seconds_above_zero():
    assert RunSettings().rendezvous_timeout == DEFAULT_RENDEZVOUS_TIMEOUT == 600.0
    assert RunSettings(rendezvous_timeout=5).rendezvous_timeout == 5.0
    for bad in (0, -1, float("nan"), float("inf"), True, "10", None):
        with pytest.raises(ConfigurationError, match=rf"rendezvous_timeout .*must be a finite number > 0, got {bad!r}"):
            FederatedTrainer(rendezvous_timeout=bad, logger=False)
    with pytest.raises(ConfigurationError, match=r"rendezvous_timeout must be at most 604800 seconds .*got 1000000000\.0"):
        RunSettings(rendezvous_timeout=1e9)


def test_a_node_rank_or_port_that_cannot_be_is_refused():
    from lightning.fabric.plugins.environments import LightningEnvironment

    plain = LightningEnvironment()
    with pytest.raises(ValueError, match=r"NODE_RANK='2': with num_nodes=2 each machine's NODE_RANK is one of 0 \.\. 1"):
        check_machines_meet(2, plain, _machine(2, 29500))
    with pytest.raises(ValueError, match=r"GROUP_RANK='x'"):
        check_machines_meet(2, plain, {"GROUP_RANK": "x", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    for port in ("0", "65536", "http"):
        with pytest.raises(ValueError, match=rf"MASTER_PORT='{port}' is no TCP port: give an integer in 1 \.\. 65535"):
            check_machines_meet(2, plain, {**_machine(0, 1), "MASTER_PORT": port})


# -- meeting, in this process --------------------------------------------------------------------------------------
@pytest.fixture
def environment(monkeypatch):
    """Lightning's plain environment of a machine: ``environment(rank, port)`` sets its variables."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    def make(rank, port):
        for name, value in _machine(rank, port).items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        return LightningEnvironment()

    return make


def test_nothing_to_meet_on_one_machine_or_under_a_scheduler_or_in_a_launched_process(environment, monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    plain = environment(1, _free_port())  # nobody listens: meeting would wait
    assert meet_machines(1, plain, 0.1) is None
    assert meet_machines(2, SLURMEnvironment(), 0.1) is None
    monkeypatch.setenv("LOCAL_RANK", "1")  # started by its machine's launcher after the meeting
    assert meet_machines(2, plain, 0.1) is None


def test_the_first_machine_alone_stops_naming_the_others_and_their_command(environment, capfd):
    port = _free_port()
    started = time.monotonic()
    with pytest.raises(MachinesDidNotMeet) as refused:
        meet_machines(3, environment(0, port), 1.0)
    assert time.monotonic() - started < BOUND_S
    message = str(refused.value)
    assert message.startswith("num_nodes=3: machines NODE_RANK=1, 2 did not join within rendezvous_timeout=1 s at "
                              f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}")
    assert f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} NODE_RANK=<1, 2>" in message
    assert "Several machines" in message and "trainer.rendezvous_timeout" in message and "\n" not in message
    assert "c10d" not in capfd.readouterr().err  # torch's C++ log lines were set aside


def test_a_machine_whose_first_machine_never_answers_stops(environment, capfd):
    port = _free_port()
    started = time.monotonic()
    with pytest.raises(MachinesDidNotMeet, match=r"num_nodes=2: the first machine \(NODE_RANK=0\) did not answer "
                                                 rf"within rendezvous_timeout=1 s at MASTER_ADDR=127.0.0.1 "
                                                 rf"MASTER_PORT={port}; start the same command there with .*"
                                                 rf"NODE_RANK=0"):
        meet_machines(2, environment(1, port), 1.0)
    assert time.monotonic() - started < BOUND_S
    err = capfd.readouterr().err
    assert "c10d" not in err and "Exception raised from" not in err  # the connection retries' C++ stacks


def test_a_first_machine_whose_port_is_taken_says_so(environment):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MachinesDidNotMeet, match=rf"this machine \(NODE_RANK=0\) cannot serve the rendezvous at "
                                                     rf"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} \(.*in use.*\); set "
                                                     "MASTER_PORT to a free port"):
            meet_machines(2, environment(0, port), 5.0)


# -- machines in processes of their own ----------------------------------------------------------------------------
_MACHINE = """
import sys, time
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning_dfl.errors import MachinesDidNotMeet
from lightning_dfl.federation.loop.rendezvous import meet_machines

num_nodes, timeout, slow = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
fabric = Fabric(accelerator="cpu", devices=1, num_nodes=num_nodes, strategy="ddp")
try:  # as build_federation: meet, then Fabric's launch (init_process_group)
    meeting = meet_machines(num_nodes, fabric.strategy.cluster_environment, timeout)
except MachinesDidNotMeet as err:
    print(err, file=sys.stderr)
    sys.exit(2)
fabric.launch()
del meeting
rank = fabric.global_rank
for step in range(2):  # a local round longer than the rendezvous timeout between transfers
    if rank == 1:
        time.sleep(slow)
    box = torch.full((4,), float(rank))
    ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, box, 1 - rank)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2 and box.eq(0).all(), (total, box)
    fabric.barrier()
print("trained")
"""


def _machines(tmp_path, ranks, num_nodes, timeout, slow=0.0):
    script = tmp_path / "machine.py"
    script.write_text(textwrap.dedent(_MACHINE))
    port = _free_port()
    machines = [subprocess.Popen([sys.executable, str(script), str(num_nodes), str(timeout), str(slow)],
                                 env={**os.environ, **_machine(rank, port)}, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for rank in ranks]
    return [(m.returncode, out, err) for m in machines for out, err in [m.communicate(timeout=300)]]


def test_machines_that_met_keep_the_long_timeout_for_transfers(tmp_path):
    """Met within 2 s, the machines then wait 5 s for each other's transfers (point to point and collective): the
    rendezvous timeout does not bound them (an init_process_group timeout of 2 s would)."""
    done = _machines(tmp_path, [1, 0], num_nodes=2, timeout=2.0, slow=5.0)
    assert [code for code, _, _ in done] == [0, 0], [err[-2000:] for _, _, err in done]
    assert all("trained" in out for _, out, _ in done)


def test_a_machine_missing_among_three_is_named_by_the_others(tmp_path):
    done = _machines(tmp_path, [0, 1], num_nodes=3, timeout=3.0)
    assert [code for code, _, _ in done] == [2, 2], [err[-2000:] for _, _, err in done]
    for _, _, err in done:  # the first times out; the second too, or sees the first give up
        assert "NODE_RANK=2" in err and "Traceback" not in err and "c10d" not in err, err


# -- the command line ----------------------------------------------------------------------------------------------
def test_the_command_stops_in_one_line_when_the_other_machine_never_starts(tmp_path):
    """issue 49 §3: MASTER_ADDR, MASTER_PORT and NODE_RANK set, the other machine never started: the first machine
    (or a second whose first never answers) stops within about the timeout, not torch's 30 minutes."""
    port = {0: _free_port(), 1: _free_port()}
    args = [sys.executable, "-m", "lightning_dfl", "fit", "--config", str(CONFIGS / "dispfl_digits.yaml"),
            "--trainer.rounds", "3", "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.accelerator",
            "cpu", "--trainer.rendezvous_timeout", "3", "--trainer.default_root_dir", str(tmp_path / "runs")]
    started = time.monotonic()
    alone = {rank: subprocess.Popen(args, env={**os.environ, **_machine(rank, port[rank])}, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for rank in (0, 1)}
    done = {rank: (m.communicate(timeout=300), m.returncode) for rank, m in alone.items()}
    assert time.monotonic() - started < BOUND_S
    expected = {0: f"machine NODE_RANK=1 did not join within rendezvous_timeout=3 s at MASTER_ADDR=127.0.0.1 "
                   f"MASTER_PORT={port[0]}; start the same command on it with MASTER_ADDR=127.0.0.1 "
                   f"MASTER_PORT={port[0]} NODE_RANK=1",
                1: f"the first machine (NODE_RANK=0) did not answer within rendezvous_timeout=3 s at "
                   f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port[1]}; start the same command there with "
                   f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port[1]} NODE_RANK=0"}
    for rank, ((_, err), code) in done.items():
        assert code == 2, err[-3000:]
        lines = err.strip().splitlines()
        assert len(lines) == 1, err[-3000:]  # no traceback, no C++ log of torch's
        assert lines[0].startswith("lightning-dfl: error: num_nodes=2: ") and expected[rank] in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()  # nothing written: the run never started
