"""Small pieces several test files share."""

from lightning_dfl.callbacks.base import FederatedCallback


class Kill(FederatedCallback):
    """Stops the run (as a crash would: ``KeyboardInterrupt`` by default) when round ``at_round`` starts."""

    def __init__(self, at_round, error=KeyboardInterrupt):
        self.at_round = at_round
        self.error = error

    def on_federated_round_start(self, trainer, pl_module):
        if trainer.current_round == self.at_round:
            raise self.error("killed")
