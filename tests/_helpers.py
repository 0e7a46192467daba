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


def assert_nested_same(a, b, same_tensor, same_types: bool = False) -> None:
    """Nested dicts (keys in order), lists and tuples equal; tensors compared by ``same_tensor(a, b)`` (which
    asserts); with ``same_types`` every level's type too."""
    import torch

    if same_types:
        assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        same_tensor(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_nested_same(a[key], b[key], same_tensor, same_types)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_nested_same(x, y, same_tensor, same_types)
    else:
        assert a == b
