"""How a training split is divided among clients, and each client's personal test set.

One small class per scheme (Flower-Datasets style): a :class:`Partitioner` maps the training
labels, the number of clients and a seed to one sorted index array per client, disjoint.
DisPFL App. B.1 uses the Dirichlet partition of Hsu et al. (2019) and the pathological
partition; PSFL's ExDir(C, alpha) is :class:`ExDirPartitioner`; PRISAM's cluster partitions
(clients in groups, label skew between the groups, IID within) are :class:`ClusterPartitioner`.
New schemes are new subclasses registered with :func:`register_partitioner`.
:func:`personal_test_indices` draws a client's test set from the official test split with the
client's training label proportions (DisPFL App. B.1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from lightning_dfl.checks import check_int, check_positive
from lightning_dfl.registry import Registry

__all__ = [
    "PARTITIONERS",
    "ClusterPartitioner",
    "DirichletPartitioner",
    "EqualDirichletPartitioner",
    "ExDirPartitioner",
    "IIDPartitioner",
    "PathologicalPartitioner",
    "Partitioner",
    "allocate_counts",
    "build_partitioner",
    "personal_test_indices",
    "register_partitioner",
]


class Partitioner(ABC):
    """``partitioner(labels, num_clients, seed)`` -> one sorted ``int64`` index array per client.

    The arrays index the training split and are pairwise disjoint; the same arguments always
    give the same result (all randomness comes from ``numpy.random.default_rng(seed)``).
    """

    #: Registry name, set by :func:`register_partitioner`.
    name: str = ""

    def __call__(self, labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
        labels = np.asarray(labels)
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be a 1-D integer array, got dtype {labels.dtype} and shape {labels.shape}")
        num_clients, seed = check_int("num_clients", num_clients, 1), check_int("seed", seed, 0)
        if len(labels) == 0:
            raise ValueError("labels is empty: there are no training samples to partition")
        parts = self._partition(labels, num_clients, np.random.default_rng(seed))
        return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]

    @abstractmethod
    def _partition(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        """Index arrays (any order) for ``num_clients`` clients."""


#: Name -> partitioner class.
PARTITIONERS: Registry[type[Partitioner]] = Registry("partition")


def register_partitioner(name: str) -> Callable[[type[Partitioner]], type[Partitioner]]:
    """Class decorator adding a :class:`Partitioner` subclass to :data:`PARTITIONERS` and setting its ``name``."""

    def wrap(cls: type[Partitioner]) -> type[Partitioner]:
        PARTITIONERS.add(name, cls)
        cls.name = name
        return cls

    return wrap


def build_partitioner(name: str, **kwargs) -> Partitioner:
    """Instantiate the partitioner registered as ``name`` with its own keyword arguments."""
    return PARTITIONERS.build(name, **kwargs)


def _check_enough_samples(labels: np.ndarray, num_clients: int) -> None:
    if len(labels) < num_clients:
        raise ValueError(f"cannot give each of {num_clients} clients a sample: only {len(labels)} samples; "
                         f"use at most {len(labels)} clients")


@register_partitioner("iid")
class IIDPartitioner(Partitioner):
    """A random permutation cut into ``num_clients`` shards whose sizes differ by at most one."""

    def _partition(self, labels, num_clients, rng):
        _check_enough_samples(labels, num_clients)
        return np.array_split(rng.permutation(len(labels)), num_clients)


@register_partitioner("dirichlet")
class DirichletPartitioner(Partitioner):
    """Hsu et al. (2019) label skew, with DisPFL's equal-quota rule.

    For each class in turn: draw client proportions ``q ~ Dir(alpha * 1_K)``, zero ``q_k`` for
    every client already holding at least ``N / K`` samples, renormalise and cut the class's
    shuffled samples at ``cumsum(q) * n_c``. Everything is redrawn until every client holds at
    least ``min_size`` samples (at most ``max_attempts`` times). Smaller ``alpha``: more skew.
    """

    def __init__(self, alpha: float, min_size: int = 10, max_attempts: int = 1000) -> None:
        self.alpha = check_positive("alpha", alpha)
        self.min_size = check_int("min_size", min_size, 0)
        self.max_attempts = check_int("max_attempts", max_attempts, 1)

    def __repr__(self) -> str:
        return f"DirichletPartitioner(alpha={self.alpha}, min_size={self.min_size})"

    def _partition(self, labels, num_clients, rng):
        n = len(labels)
        if n < num_clients * self.min_size:
            raise ValueError(
                f"cannot give each of {num_clients} clients min_size={self.min_size} samples: only {n} samples "
                f"(need {num_clients * self.min_size}); lower min_size or num_clients"
            )
        by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        quota = n / num_clients
        for _ in range(self.max_attempts):
            parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
            sizes = np.zeros(num_clients, dtype=np.int64)
            for members in by_class:
                members = rng.permutation(members)
                q = rng.dirichlet(np.full(num_clients, self.alpha))
                open_ = sizes < quota  # never empty: fewer than N samples are handed out so far
                q = q * open_
                if q.sum() > 0:
                    q = q / q.sum()
                else:  # tiny alpha: all mass fell on full clients; Dir's alpha -> 0 limit, one open client
                    q = np.zeros(num_clients)
                    q[rng.choice(np.flatnonzero(open_))] = 1.0
                cum = np.cumsum(q)
                # cum[-1] may be 1 - 1ulp: then the last open client's cut falls one short of the end
                # and a closed client (q = 0) after it gets a sample; scaled, that cut is exactly n_c
                cuts = (cum / cum[-1] * len(members)).astype(np.int64)[:-1]
                for k, piece in enumerate(np.split(members, cuts)):
                    parts[k].append(piece)
                    sizes[k] += len(piece)
            if sizes.min() >= self.min_size:
                return [np.concatenate(p) for p in parts]
        raise ValueError(
            f"Dirichlet partition (alpha={self.alpha}) found no draw giving every one of {num_clients} clients "
            f"min_size={self.min_size} samples in {self.max_attempts} attempts; raise alpha or lower min_size"
        )


@register_partitioner("dirichlet_equal")
class EqualDirichletPartitioner(Partitioner):
    """Equal client sizes with Dirichlet class mixes (the DisPFL and DA-DPFL authors' code).

    Every client gets ``floor`` or ``ceil(N / K)`` samples. In a random client order, each client
    draws class proportions ``p ~ Dir(alpha * 1_C)`` and takes its size in proportion to ``p``
    (largest-remainder rounding) from the samples still unassigned; a class that runs out passes
    its share to the client's other classes. Smaller ``alpha`` gives more skewed clients.
    """

    def __init__(self, alpha: float) -> None:
        self.alpha = check_positive("alpha", alpha)

    def __repr__(self) -> str:
        return f"EqualDirichletPartitioner(alpha={self.alpha})"

    def _partition(self, labels, num_clients, rng):
        _check_enough_samples(labels, num_clients)
        classes = np.unique(labels)
        pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
        taken = np.zeros(len(classes), dtype=np.int64)
        sizes = _largest_remainder(np.ones(num_clients), len(labels))
        parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
        for client in rng.permutation(num_clients):
            mix = rng.dirichlet(np.full(len(classes), self.alpha))
            capacity = np.array([len(p) for p in pools]) - taken
            counts = allocate_counts(mix + 1e-12, int(sizes[client]), capacity=capacity)
            parts[client] = np.concatenate([pools[c][taken[c]:taken[c] + n] for c, n in enumerate(counts)])
            taken += counts
        return parts


@register_partitioner("pathological")
class PathologicalPartitioner(Partitioner):
    """Each client holds exactly ``classes_per_client`` distinct classes (DisPFL App. B.1).

    Clients pick, in turn, the classes used by the fewest clients so far (ties broken at
    random), so every class is used by ``floor`` or ``ceil(K * n / C)`` clients. Each class's
    shuffled samples are cut into equal shards (sizes differ by at most one) among its
    holders; classes held by nobody (``K * n < C``) stay unused.
    """

    def __init__(self, classes_per_client: int) -> None:
        self.classes_per_client = check_int("classes_per_client", classes_per_client, 1)

    def __repr__(self) -> str:
        return f"PathologicalPartitioner(classes_per_client={self.classes_per_client})"

    def _partition(self, labels, num_clients, rng):
        classes = np.unique(labels)
        n = self.classes_per_client
        if n > len(classes):
            raise ValueError(f"classes_per_client={n} exceeds the number of classes in the labels ({len(classes)})")
        usage = np.zeros(len(classes), dtype=np.int64)
        holders: list[list[int]] = [[] for _ in classes]
        for k in range(num_clients):
            chosen = np.lexsort((rng.random(len(classes)), usage))[:n]  # fewest users first, random ties
            usage[chosen] += 1
            for c in chosen:
                holders[c].append(k)
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c, clients in enumerate(holders):
            if not clients:
                continue
            members = rng.permutation(np.flatnonzero(labels == classes[c]))
            if len(members) < len(clients):
                raise ValueError(
                    f"class {classes[c]} has {len(members)} samples, fewer than the {len(clients)} clients holding it; "
                    "lower num_clients or classes_per_client"
                )
            for k, shard in zip(clients, np.array_split(members, len(clients))):
                parts[k].append(shard)
        return [np.concatenate(p) for p in parts]


@register_partitioner("exdir")
class ExDirPartitioner(Partitioner):
    """ExDir(C, alpha), PSFL's extended Dirichlet partition (psfl-notes 16), as in the code of PSFL's ref. [25].

    Ref. [25] is Li and Lyu, "Convergence analysis of sequential federated learning on heterogeneous data"
    (NeurIPS); its code is ``liyipeng00/convergence``, ``sim/data/partition.py``. With K clients, L classes
    and N samples:

    1. Classes: each client draws ``classes_per_client`` (C) distinct classes uniformly at random. The whole
       draw is repeated until every class has at least ``max(C K // L // 5, 1)`` holders ([25]'s rule), so
       every class is drawn. If ``C K < L`` no draw can cover the classes: no cover is asked for, and the
       samples of the classes nobody drew stay unassigned (as in ``pathological``).
    2. Samples: for each class c in turn (ascending labels), ``q_c ~ Dir(alpha)`` over the clients holding c
       (a Dirichlet per class across its holders, not per client across its classes); a holder that already
       has at least the mean size N / K gets ``q = 0`` (the cap: [25]'s "balance" rule, the same stop rule
       as ``dirichlet``; a client can end above N / K by at most the share of the class that took it there);
       renormalise and cut the class's shuffled samples at ``cumsum(q) n_c``. If every holder of c is full,
       the cap yields and all of them share c; if a tiny alpha puts all mass on full holders, one random open
       holder takes c. Step 2 is redrawn, the classes kept (as in [25]), until every client holds at least
       ``min_size`` samples (10 in [25] and PSFL), at most ``max_attempts`` times; step 1, a cheap draw
       that few clients (e.g. C K = L, an exact cover) make unlikely to pass, at most ``100 max_attempts``.

    So a client holds at most C classes and every sample of a drawn class goes to exactly one client.
    Smaller ``alpha``: more uneven shares among a class's holders, hence more unequal client sizes.
    """

    def __init__(self, classes_per_client: int, alpha: float, min_size: int = 10, max_attempts: int = 1000) -> None:
        self.classes_per_client = check_int("classes_per_client", classes_per_client, 1)
        self.alpha = check_positive("alpha", alpha)
        self.min_size = check_int("min_size", min_size, 0)
        self.max_attempts = check_int("max_attempts", max_attempts, 1)

    def __repr__(self) -> str:
        return (f"ExDirPartitioner(classes_per_client={self.classes_per_client}, alpha={self.alpha}, "
                f"min_size={self.min_size})")

    def _partition(self, labels, num_clients, rng):
        classes = np.unique(labels)
        n, c = len(labels), self.classes_per_client
        if c > len(classes):
            raise ValueError(f"classes_per_client={c} exceeds the number of classes in the labels ({len(classes)})")
        if n < num_clients * self.min_size:
            raise ValueError(
                f"cannot give each of {num_clients} clients min_size={self.min_size} samples: only {n} samples "
                f"(need {num_clients * self.min_size}); lower min_size or num_clients"
            )
        holders = self._draw_classes(num_clients, len(classes), rng)
        by_class = [np.flatnonzero(labels == k) for k in classes]
        mean = n / num_clients
        for _ in range(self.max_attempts):
            owner = np.full(n, -1, dtype=np.int64)
            sizes = np.zeros(num_clients, dtype=np.int64)
            for members, clients in zip(by_class, holders):
                if len(clients) == 0:
                    continue  # drawn by nobody (only when C K < L): its samples stay unassigned
                q = rng.dirichlet(np.full(len(clients), self.alpha))
                open_ = sizes[clients] < mean
                if open_.any():  # else every holder is full and the cap yields
                    q = q * open_
                    if q.sum() == 0:  # tiny alpha: all mass on full holders; one open holder (Dir's alpha -> 0)
                        q = np.zeros(len(clients))
                        q[rng.choice(np.flatnonzero(open_))] = 1.0
                cum = np.cumsum(q)
                cuts = (cum / cum[-1] * len(members)).astype(np.int64)  # last cut exactly n_c
                counts = np.diff(cuts, prepend=0)
                owner[rng.permutation(members)] = np.repeat(clients, counts)
                sizes[clients] += counts
            if sizes.min() >= self.min_size:
                order = np.argsort(owner, kind="stable")[np.count_nonzero(owner < 0):]
                return np.split(order, np.cumsum(sizes)[:-1])
        raise ValueError(
            f"ExDir partition (classes_per_client={c}, alpha={self.alpha}) found no draw giving every one of "
            f"{num_clients} clients min_size={self.min_size} samples in {self.max_attempts} attempts; raise alpha "
            "or classes_per_client, or lower min_size or num_clients"
        )

    def _draw_classes(self, num_clients: int, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
        """Each client's C distinct classes, redrawn until every class has [25]'s least number of holders."""
        c = self.classes_per_client
        need = max(c * num_clients // num_classes // 5, 1) if c * num_clients >= num_classes else 0
        rows = np.arange(num_clients)[:, None]
        for _ in range(100 * self.max_attempts):
            held = np.zeros((num_clients, num_classes), dtype=bool)
            held[rows, np.argsort(rng.random((num_clients, num_classes)), axis=1)[:, :c]] = True
            if held.sum(axis=0).min() >= need:
                return [np.flatnonzero(col) for col in held.T]  # holders of each class, ascending
        raise ValueError(
            f"ExDir partition: no draw of classes_per_client={c} classes for each of {num_clients} clients gave "
            f"every one of the {num_classes} classes at least {need} holder(s) in {100 * self.max_attempts} attempts; "
            "raise num_clients or classes_per_client"
        )


@register_partitioner("cluster")
class ClusterPartitioner(Partitioner):
    """PRISAM's cluster partition (PRISAM Sec. V; prisam-notes item 17): label skew between groups, IID within.

    The K clients form ``num_groups`` (k) groups of contiguous clients: client ``c`` is in group
    ``c * k // K`` (see :meth:`groups`), so group sizes differ by at most one and are equal when k
    divides K (the paper: 200 devices in 5 groups of 40). The training samples are first divided
    among the groups, then each group's samples are shuffled and cut into equal shares (sizes
    differ by at most one) among its clients, in client order. Between the groups, ``between``:

    - ``"dirichlet"``: for each class in turn (ascending labels), group proportions
      ``q ~ Dir(alpha * 1_k)``; the class's shuffled samples go to the groups in counts proportional
      to ``q`` (largest-remainder rounding). Every sample is assigned. The whole draw is repeated
      (at most ``max_attempts`` times) until every group holds at least one sample per client,
      so no client is empty (the paper gives no such rule; tiny ``alpha`` with many groups needs it).
      The paper uses ``alpha`` 0.2 and 1.
    - ``"pathological"``: a random permutation of the classes gives group g the classes
      ``perm[g * n : (g + 1) * n]`` with ``n = classes_per_group`` (the paper: 2; 20 for CIFAR-100),
      disjoint across groups; all samples of a class go to its group. ``n * k`` must not exceed the
      number of classes; classes of no group (``n * k < C``) stay unassigned, as in ``pathological``.

    All draws come from the seed's generator: the class-to-group draw, then the within-group shuffles.
    """

    #: The allowed values of ``between``.
    BETWEEN = ("dirichlet", "pathological")

    def __init__(self, num_groups: int, between: str = "dirichlet", alpha: float = 0.2, classes_per_group: int = 2,
                 max_attempts: int = 1000) -> None:
        self.num_groups = check_int("num_groups", num_groups, 1)
        if between not in self.BETWEEN:
            raise ValueError(f"between must be one of {', '.join(repr(b) for b in self.BETWEEN)} (how classes are "
                             f"split between the groups), got {between!r}")
        self.between = between
        self.alpha = check_positive("alpha", alpha)
        self.classes_per_group = check_int("classes_per_group", classes_per_group, 1)
        self.max_attempts = check_int("max_attempts", max_attempts, 1)

    def __repr__(self) -> str:
        detail = f"alpha={self.alpha}" if self.between == "dirichlet" else f"classes_per_group={self.classes_per_group}"
        return f"ClusterPartitioner(num_groups={self.num_groups}, between={self.between!r}, {detail})"

    def groups(self, num_clients: int) -> np.ndarray:
        """The group of each of ``num_clients`` clients, ``int64`` of shape ``[num_clients]``: ``c * k // K``."""
        num_clients = check_int("num_clients", num_clients, 1)
        if num_clients < self.num_groups:
            raise ValueError(f"num_groups={self.num_groups} exceeds num_clients={num_clients}: every group needs a "
                             f"client; use at most {num_clients} groups")
        return np.arange(num_clients, dtype=np.int64) * self.num_groups // num_clients

    def _partition(self, labels, num_clients, rng):
        groups = self.groups(num_clients)
        _check_enough_samples(labels, num_clients)
        members = [np.flatnonzero(groups == g) for g in range(self.num_groups)]
        need = np.array([len(m) for m in members])
        if self.between == "dirichlet":
            owner = self._dirichlet_groups(labels, need, rng)
        else:
            owner = self._pathological_groups(labels, need, rng)
        parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
        for g, clients in enumerate(members):
            pool = rng.permutation(np.flatnonzero(owner == g))
            for c, share in zip(clients, np.array_split(pool, len(clients))):
                parts[c] = share
        return parts

    def _dirichlet_groups(self, labels: np.ndarray, need: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Each sample's group: per class, ``Dir(alpha)`` proportions over the groups, redrawn until no group is short."""
        k = self.num_groups
        by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        for _ in range(self.max_attempts):
            owner = np.full(len(labels), -1, dtype=np.int64)
            for samples in by_class:
                samples = rng.permutation(samples)
                q = rng.dirichlet(np.full(k, self.alpha))
                if not (np.isfinite(q).all() and q.sum() > 0):  # underflow at tiny alpha: Dir's alpha -> 0 limit
                    q = np.zeros(k)
                    q[rng.integers(k)] = 1.0
                owner[samples] = np.repeat(np.arange(k), _largest_remainder(q, len(samples)))
            if (np.bincount(owner, minlength=k) >= need).all():
                return owner
        raise ValueError(
            f"cluster partition (between='dirichlet', alpha={self.alpha}) found no draw giving each of the "
            f"{k} groups at least one sample per client ({need.max()} for the largest group) in "
            f"{self.max_attempts} attempts; raise alpha or lower num_groups or num_clients"
        )

    def _pathological_groups(self, labels: np.ndarray, need: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Each sample's group (-1: unassigned): ``classes_per_group`` random, disjoint classes per group."""
        classes = np.unique(labels)
        k, n = self.num_groups, self.classes_per_group
        if n * k > len(classes):
            raise ValueError(
                f"classes_per_group={n} x num_groups={k} = {n * k} exceeds the {len(classes)} classes in the labels: "
                f"the groups' classes must be disjoint; lower classes_per_group or num_groups"
            )
        chosen = rng.permutation(classes)[: n * k].reshape(k, n)
        owner = np.full(len(labels), -1, dtype=np.int64)
        for g, group_classes in enumerate(chosen):
            owner[np.isin(labels, group_classes)] = g
        sizes = np.bincount(owner[owner >= 0], minlength=k)
        short = np.flatnonzero(sizes < need)
        if len(short):
            g = int(short[0])
            raise ValueError(
                f"cluster partition (between='pathological'): group {g} holds {sizes[g]} samples (classes "
                f"{sorted(chosen[g].tolist())}), fewer than its {need[g]} clients; lower num_clients"
            )
        return owner


# --------------------------------------------------------------------------- personal test sets


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integers proportional to ``weights`` summing to ``total`` (Hamilton's method)."""
    quotas = weights / weights.sum() * total
    counts = np.floor(quotas).astype(np.int64)
    order = np.argsort(-(quotas - counts), kind="stable")  # largest remainders first, ties by index
    counts[order[: total - counts.sum()]] += 1
    return counts


def allocate_counts(weights, total: int, capacity=None) -> np.ndarray:
    """Split ``total`` over classes in proportion to ``weights`` (largest-remainder rounding).

    A class never gets more than its ``capacity``; what it cannot take goes to the other
    classes of positive weight in proportion to their weights. The result sums to ``total``
    unless the capacities of the positive-weight classes sum to less, in which case each of
    them gets its full capacity. Zero-weight classes always get 0.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 1 or (weights < 0).any() or not np.isfinite(weights).all():
        raise ValueError(f"weights must be a 1-D array of finite values >= 0, got {weights}")
    total = check_int("total", total, 0)
    cap = np.full(len(weights), np.iinfo(np.int64).max) if capacity is None else np.asarray(capacity, np.int64)
    if cap.shape != weights.shape or (cap < 0).any():
        raise ValueError(f"capacity must hold one integer >= 0 per weight, got {capacity}")
    counts = np.zeros(len(weights), dtype=np.int64)
    remaining = int(total)
    while remaining > 0:
        open_ = (weights > 0) & (counts < cap)
        if not open_.any():
            break
        share = _largest_remainder(np.where(open_, weights, 0.0), remaining)
        taken = np.minimum(counts + share, cap) - counts
        counts += taken
        remaining -= int(taken.sum())
    return counts


def personal_test_indices(
    train_label_counts, test_labels: np.ndarray, num_samples: int, rng: np.random.Generator
) -> np.ndarray:
    """A client's test set: ``num_samples`` indices into the test split (DisPFL App. B.1).

    Per class, ``allocate_counts(train_label_counts, num_samples, capacity=test class sizes)``
    samples drawn without replacement from that class's test samples; sorted. Each client
    draws on its own, so two clients' test sets may share samples (as in the DisPFL code).
    """
    test_labels = np.asarray(test_labels)
    counts = np.asarray(train_label_counts)
    pools = [np.flatnonzero(test_labels == c) for c in range(len(counts))]
    if counts.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    take = allocate_counts(counts, num_samples, capacity=[len(p) for p in pools])
    chosen = [rng.choice(pool, size=t, replace=False) for pool, t in zip(pools, take) if t > 0]
    return np.sort(np.concatenate(chosen).astype(np.int64)) if chosen else np.zeros(0, dtype=np.int64)
