"""Evaluation on clients' personal test sets: a model's accuracy, and a shared model on every client."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor

from lightning_dfl.deferred import accumulator_dtype, read_values
from lightning_dfl.stats import mean_std


def accuracy(module: Any, fabric: Any, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
    """The worker's accuracy on ``batches`` under the precision's autocast (NaN for no sample)."""
    return read_values([deferred_accuracy(module, fabric, batches)])[0]


def deferred_accuracy(module: Any, fabric: Any, batches: Iterable[tuple[Tensor, Tensor]]) -> Tensor | float:
    """:func:`accuracy` as a 0-dim tensor on the worker's device, not waited for (NaN for no sample;
    :mod:`lightning_dfl.deferred`)."""
    with fabric.autocast():
        correct, total, _ = module.evaluate_sums(batches)
    return correct.to(accumulator_dtype(correct.device)) / total if total else float("nan")


def shared_model_metrics(module: Any, fabric: Any, num_clients: int,
                         test_batches: Callable[[int], Iterable[tuple[Tensor, Tensor]]],
                         prefix: str = "acc/consensus", owners: Any = None) -> dict[str, float]:
    """The model loaded in the worker tested on every client's test set: mean and std over clients. With
    ``owners`` (a :class:`~lightning_dfl.federation.loop.ownership.Ownership`) each process tests the clients it
    owns and the accuracies are gathered in client order."""
    clients = range(num_clients) if owners is None else owners.owned(range(num_clients))
    mine = dict(zip(clients, read_values([deferred_accuracy(module, fabric, test_batches(k)) for k in clients])))
    accs = [mine[k] for k in range(num_clients)] if owners is None else owners.gather(mine, range(num_clients))
    mean, std = mean_std(accs)
    return {f"{prefix}_mean": mean, f"{prefix}_std": std}


def global_test_metrics(module: Any, fabric: Any, batches: Iterable[tuple[Tensor, Tensor]]) -> dict[str, float]:
    """The model loaded in the worker on the official test split (PSFL's metric, psfl-notes 17)."""
    with fabric.autocast():
        correct, total, loss_sum = module.evaluate(batches)
    if not total:
        return {}
    return {"acc/global": correct / total, "loss/global": loss_sum / total}
