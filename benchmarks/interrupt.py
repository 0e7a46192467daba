"""A callback for benchmarks: press Ctrl-C (send SIGINT to this process) at the end of a given round.

The trainer then does what it does for a user's Ctrl-C: it finishes the round, writes its checkpoint and
exits with code 130; the run keeps its ``rounds`` (so its schedules) unchanged, and a resume from that
checkpoint must reproduce the uninterrupted run. ``gpu_check.py`` passes it on the command line:

    --trainer.callbacks+='{"class_path": "benchmarks.interrupt.InterruptAfterRound", "init_args": {"round": 2}}'
"""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning_dfl.callbacks import FederatedCallback


class InterruptAfterRound(FederatedCallback):
    """Send SIGINT to this process when round ``round`` (1-based) ends."""

    def __init__(self, round: int) -> None:
        self.round = round

    def on_federated_round_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_round + 1 == self.round:
            os.kill(os.getpid(), signal.SIGINT)
