"""The machines of a several-machine run meet within a bounded time (``rendezvous_timeout``), or the run stops.

Fabric's launcher process on each machine (``num_nodes`` > 1, Lightning's plain environment: ``MASTER_ADDR``,
``MASTER_PORT``, ``NODE_RANK``) calls :func:`meet_machines` before ``fabric.launch()``. It meets the others on
torch.distributed's own ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``: the first machine (``NODE_RANK=0``) serves
it, each machine sets its key there, and all wait until every machine's key is set, for ``rendezvous_timeout``
seconds at most (a machine never started, a wrong address or port: one line, naming the machines missing and
the command that starts them). The store is the one torch's process group then uses: the first machine
serves it multi-tenant, and ``init_process_group`` (``env://``) reuses that server on the same port. So only
the meeting is bounded: the process group keeps Fabric's timeout (30 min) for every collective and
point-to-point transfer after it, and a long local round between them is not cut short (a shorter
``init_process_group`` timeout would bound them all, and ``torch.distributed.set_timeout`` after it does not
reach gloo's point-to-point transfers, which keep the transport's first timeout). The local processes of a machine
(``devices`` > 1) are started by its launcher process after the meeting and join the process group as before.

While the machines meet, c10d's C++ log lines (a connection retry, each with a C++ stack) go to a temporary file,
not to stderr: a run that meets prints nothing of them, and one that does not prints its one line.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

from lightning_dfl.checks import check_positive
from lightning_dfl.errors import ConfigurationError, MachinesDidNotMeet

__all__ = ["DEFAULT_RENDEZVOUS_TIMEOUT", "MAX_RENDEZVOUS_TIMEOUT", "check_rendezvous_timeout", "meet_machines"]

#: seconds the machines of a run have to meet (``FederatedTrainer(rendezvous_timeout=...)``'s default)
DEFAULT_RENDEZVOUS_TIMEOUT = 600.0
#: the longest ``rendezvous_timeout`` (a week, in seconds)
MAX_RENDEZVOUS_TIMEOUT = 7 * 24 * 3600.0
#: the store keys the machines set, one per ``NODE_RANK``
_KEY = "lightning_dfl/rendezvous/node/{}"
#: seconds between two looks at the store for the machines still missing
_POLL = 0.1
_DOCS = '(docs/devices.md, "Several machines")'


def check_rendezvous_timeout(value: object) -> float:
    """``value`` (seconds) as a float if it is a finite number in ``(0, MAX_RENDEZVOUS_TIMEOUT]``, else a
    ``ConfigurationError`` naming it."""
    seconds = check_positive("rendezvous_timeout (seconds the machines have to meet)", value)
    if seconds > MAX_RENDEZVOUS_TIMEOUT:
        raise ConfigurationError(f"rendezvous_timeout must be at most {MAX_RENDEZVOUS_TIMEOUT:.0f} seconds (a week), "
                                 f"got {value!r}")
    return seconds


def _seconds(value: float) -> str:
    return f"{value:g} s"


@contextlib.contextmanager
def _c10d_log_aside() -> Iterator[None]:
    """c10d's C++ log lines (written to file descriptor 2) go to a temporary file until the block ends."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no stderr to set aside: leave it
        yield
        return
    try:
        with tempfile.TemporaryFile() as aside:
            os.dup2(aside.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def meet_machines(num_nodes: int, environment: Any, timeout: float, environ: Mapping[str, str] = os.environ) -> Any:
    """Wait until the launcher processes of all ``num_nodes`` machines meet at ``MASTER_ADDR:MASTER_PORT``, at most
    ``timeout`` seconds; raise :class:`~lightning_dfl.errors.MachinesDidNotMeet` (one line: the machines missing,
    how to start them) when they do not. Returns the store (the first machine's serves the process group's: keep
    it until ``fabric.launch()`` returns), or ``None`` where nothing is to meet: one machine, a cluster scheduler's
    environment (SLURM, torchelastic: their own rendezvous), or a process the launcher started (``LOCAL_RANK``)."""
    if (num_nodes == 1 or type(environment).__name__ != "LightningEnvironment"
            or environment.creates_processes_externally):
        return None
    import torch.distributed as dist

    node, address, port = environment.node_rank(), environment.main_address, environment.main_port
    where = f"MASTER_ADDR={address} MASTER_PORT={port}"
    within = f"within rendezvous_timeout={_seconds(timeout)}"
    keys = [_KEY.format(n) for n in range(num_nodes)]
    missing = [n for n in range(num_nodes) if n != node]
    started = time.monotonic()
    with _c10d_log_aside():
        try:
            # multi-tenant, with the libuv choice init_process_group makes: the process group reuses this server
            store = dist.TCPStore(address, port, None, node == 0, timedelta(seconds=timeout), wait_for_workers=False,
                                  multi_tenant=True, use_libuv=environ.get("USE_LIBUV", "1") == "1")
        except dist.DistError as err:
            raise MachinesDidNotMeet(_not_reached(err, num_nodes, node, where, within)) from None
        try:
            store.set(keys[node], "1")
            while True:
                missing = [n for n in missing if not store.check([keys[n]])]
                if not missing:
                    return store
                if time.monotonic() - started >= timeout:
                    break
                time.sleep(_POLL)
        except dist.DistError as err:  # the first machine's server went away: it gave up, or stopped
            raise MachinesDidNotMeet(
                f"num_nodes={num_nodes}: the first machine (NODE_RANK=0, {where}) stopped before all machines met "
                f"(NODE_RANK={_ranks(missing)} had not joined; {_first_line(err)}); start them, then this machine "
                f"again {_DOCS}") from None
    ranks = _ranks(missing)
    rank = f"<{ranks}>" if len(missing) > 1 else ranks
    raise MachinesDidNotMeet(
        f"num_nodes={num_nodes}: {'machines' if len(missing) > 1 else 'machine'} NODE_RANK={ranks} did not join "
        f"{within} at {where}; start the same command on {'each of them' if len(missing) > 1 else 'it'} with "
        f"{where} NODE_RANK={rank} {_DOCS}, or raise trainer.rendezvous_timeout")


def _ranks(nodes: list[int]) -> str:
    return ", ".join(str(n) for n in nodes)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _not_reached(err: BaseException, num_nodes: int, node: int, where: str, within: str) -> str:
    """The line for a store that could not be served (the first machine) or reached (the others)."""
    cause = _first_line(err)
    if node == 0:
        return (f"num_nodes={num_nodes}: this machine (NODE_RANK=0) cannot serve the rendezvous at {where} "
                f"({cause}); set MASTER_PORT to a free port of this machine, and MASTER_ADDR to its address, the "
                f"same on every machine {_DOCS}")
    if "timed out" in cause.lower():
        return (f"num_nodes={num_nodes}: the first machine (NODE_RANK=0) did not answer {within} at {where}; start "
                f"the same command there with {where} NODE_RANK=0, check that this machine reaches that address "
                f"and port {_DOCS}, or raise trainer.rendezvous_timeout")
    return (f"num_nodes={num_nodes}: the first machine (NODE_RANK=0) cannot be reached at {where} ({cause}); "
            f"check MASTER_ADDR and MASTER_PORT {_DOCS}")
