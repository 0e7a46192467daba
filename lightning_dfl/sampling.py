"""PSFL's client samplers: who trains in a round and in which sequence (Sec. V-C, Theorem 3).

Pure numpy. A sampler turns the clients' estimated times ``t_n-hat`` (``estimates[n]``, client ids
``0..N-1``) into ``W`` sequences of ``S`` clients, all ``N0 = W S`` distinct (psfl-notes 14):

* :class:`TimeBasedSampler` ("time"): the paper's time-based partitioning and sampling. Sorted
  by estimate, the clients are cut into ``S`` groups of similar times; each sequence takes one
  client from every group, so sequences have similar total times (Theorem 2), and each client's
  chance to train is ``W / |G|``, i.e. exactly ``N0 / N`` when ``S`` divides ``N`` (Theorem 3).
* :class:`UniformSampler` ("uniform"): ``N0`` clients uniformly, split at random (the baselines').
* :class:`WeightedSampler` ("weighted"): ``N0`` clients drawn with ``p_n`` proportional to
  ``t_n-hat^(-1/2)`` (the paper's ref. [5], L332), split at random; biased towards fast clients.

Build one by name with :func:`build_sampler`; every ``sample`` takes the caller's
``numpy.random.Generator``, so a seeded generator gives a reproducible plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from lightning_dfl.checks import check_int, is_number
from lightning_dfl.registry import Registry

__all__ = ["SAMPLERS", "ClientSampler", "TimeBasedSampler", "UniformSampler", "WeightedSampler", "build_sampler"]


class ClientSampler(ABC):
    """Base class: validates :meth:`sample`'s arguments and hands a ``(W, S)`` plan to :meth:`_draw`."""

    name = "base"
    #: Whether every estimate must be > 0 (else >= 0).
    positive_estimates = False

    def sample(self, estimates: Sequence[float], num_sequences: int, length: int,
               rng: np.random.Generator) -> list[list[int]]:
        """``num_sequences`` (W) sequences of ``length`` (S) client ids, all ``W S`` distinct.

        ``estimates[n]`` is client n's estimated time (finite, >= 0; > 0 for the weighted sampler);
        ``W S`` must not exceed the number of clients ``N = len(estimates)``.
        """
        if not isinstance(rng, np.random.Generator):
            raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
        times = self._check(estimates, num_sequences, length)
        return self._draw(times, int(num_sequences), int(length), rng).tolist()

    def _check(self, estimates: Sequence[float], num_sequences: int, length: int) -> np.ndarray:
        """The estimates as a float array, once ``W``, ``S`` and every estimate are valid."""
        check_int("num_sequences", num_sequences, 1)
        check_int("length", length, 1)
        minimum = "> 0" if self.positive_estimates else ">= 0"
        try:
            times = np.asarray(estimates, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise ValueError(f"estimates must be a sequence of numbers, one per client: {err}") from None
        if times.ndim != 1:
            raise ValueError(f"estimates must be a flat sequence, one number per client, got shape {times.shape}")
        ok = np.isfinite(times) & ((times > 0) if self.positive_estimates else (times >= 0))
        if not ok.all():
            bad = [(int(n), float(times[n])) for n in np.flatnonzero(~ok)[:5]]
            raise ValueError(f"estimates must be finite numbers {minimum} for the {self.name} sampler; "
                             f"bad (client, estimate): {bad}")
        if num_sequences * length > times.size:
            raise ValueError(f"num_sequences * length (W * S = {num_sequences} * {length}) must not exceed the "
                             f"number of clients N = {times.size}")
        return times

    @abstractmethod
    def _draw(self, times: np.ndarray, num_sequences: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """The ``(W, S)`` int array of client ids; arguments already checked."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TimeBasedSampler(ClientSampler):
    """Time-based partitioning and sampling, Sec. V-C steps 1-4 and Theorem 3 (psfl-notes 14).

    1. Sort the clients by estimated time, ascending (ties by id).
    2. Cut the order into ``S`` consecutive groups of ``floor(N/S)`` or ``ceil(N/S)`` clients. The
       paper (L274) fixes only these sizes; here the ``N mod S`` larger groups come first (those of
       the fastest clients), as ``numpy.array_split`` cuts.
    3. Draw ``W`` distinct clients from every group, uniformly without replacement; the w-th draw
       of each group joins sequence w (one client per group per sequence).
    4. Permute each sequence uniformly at random.

    A client in group ``G`` trains with probability ``W / |G|`` and sits at a given position of a
    given sequence with probability ``1 / (|G| S)``: exactly ``1/N`` when ``S`` divides ``N``.
    """

    name = "time"

    def groups(self, estimates: Sequence[float], length: int) -> list[np.ndarray]:
        """Steps 1-2: the ``length`` (S) groups of client ids, fastest group first."""
        times = self._check(estimates, 1, length)
        return np.split(np.argsort(times, kind="stable"), np.cumsum(_group_sizes(times.size, length))[:-1])

    def selection_probabilities(self, estimates: Sequence[float], num_sequences: int, length: int) -> np.ndarray:
        """Each client's probability to train in a round, ``W / |G|`` for its group ``G`` (sums to ``W S``)."""
        times = self._check(estimates, num_sequences, length)
        probabilities = np.empty(times.size, dtype=np.float64)
        for group in self.groups(times, length):
            probabilities[group] = num_sequences / group.size
        return probabilities

    def _draw(self, times: np.ndarray, num_sequences: int, length: int, rng: np.random.Generator) -> np.ndarray:
        n = times.size
        sizes = _group_sizes(n, length)
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        group_of = np.repeat(np.arange(length), sizes)  # group of each sorted position
        by_time = np.argsort(times, kind="stable")
        # Sorting the positions by (group, random key) shuffles every group; its first W are a uniform
        # draw without replacement, the w-th of which joins sequence w.
        shuffled = by_time[np.lexsort((rng.random(n), group_of))]
        picks = shuffled[starts[None, :] + np.arange(num_sequences)[:, None]]  # (W, S): column s from group s
        return rng.permuted(picks, axis=1)


def _group_sizes(num_clients: int, length: int) -> np.ndarray:
    """The sizes of the S groups: ``ceil(N/S)`` for the first ``N mod S``, then ``floor(N/S)``."""
    small, extra = divmod(num_clients, length)
    sizes = np.full(length, small)
    sizes[:extra] += 1
    return sizes


class UniformSampler(ClientSampler):
    """``N0 = W S`` distinct clients uniformly at random, split at random into ``W`` sequences of ``S``."""

    name = "uniform"

    def _draw(self, times: np.ndarray, num_sequences: int, length: int, rng: np.random.Generator) -> np.ndarray:
        # An ordered sample without replacement is uniformly ordered: reshaping splits it at random.
        return rng.choice(times.size, size=num_sequences * length, replace=False).reshape(num_sequences, length)


class WeightedSampler(ClientSampler):
    """Weighted sampling (Sec. VI, L332, ref. [5]): ``N0`` distinct clients drawn one after another
    with probability proportional to ``t_n-hat^(-exponent)`` (the paper: ``exponent = 1/2``) among
    those left (``numpy``'s ``choice(replace=False, p=...)``), then split at random into ``W``
    sequences of ``S``. Biased: fast clients train more often than ``N0 / N``.
    """

    name = "weighted"
    positive_estimates = True

    def __init__(self, exponent: float = 0.5) -> None:
        if not (is_number(exponent) and exponent >= 0):
            raise ValueError(f"exponent must be a finite number >= 0, got {exponent!r}")
        self.exponent = float(exponent)

    def _draw(self, times: np.ndarray, num_sequences: int, length: int, rng: np.random.Generator) -> np.ndarray:
        # Scale by the fastest time first, so that large exponents neither overflow nor underflow to all zeros.
        weights = (times / times.min()) ** -self.exponent
        chosen = rng.choice(times.size, size=num_sequences * length, replace=False, p=weights / weights.sum())
        return rng.permutation(chosen).reshape(num_sequences, length)

    def __repr__(self) -> str:
        return f"WeightedSampler(exponent={self.exponent})"


#: Name -> sampler class (each class's ``name``).
SAMPLERS: Registry[type[ClientSampler]] = Registry(
    "sampler", [(cls.name, cls) for cls in (TimeBasedSampler, UniformSampler, WeightedSampler)]
)


def build_sampler(name: str, **kwargs: float) -> ClientSampler:
    """A sampler by name, one of :data:`SAMPLERS` (``"time"``, ``"uniform"``, ``"weighted"``);
    ``kwargs`` go to its constructor (``exponent`` for ``"weighted"``)."""
    return SAMPLERS.build(name, **kwargs)
