"""Similar-device discovery from structural masks (PRISAM Alg. 2; prisam-notes 1, 4, 5).

Devices share their BN channel masks (one bit per channel). :func:`compact` drops the
dimensions on which all masks agree (Alg. 2 lines 5-12 as corrected in notes 1: the test
belongs inside the loop over the mask's D dimensions and compares the K masks of the current
participants). :func:`group_masks` clusters the compact 0/1 vectors with scikit-learn,
deterministically for a seed, so every device that clusters "in parallel" would get the same
labels (notes 1):

* ``"kmeans"``: ``KMeans(n_clusters=num_groups, n_init=10, random_state=seed)`` (notes 4);
* ``"dbscan"``: ``DBSCAN(eps, min_samples, metric="hamming")``; noise points are singleton groups.
  ``eps="auto"`` derives eps from the masks (:func:`auto_eps`): the smallest Hamming distance at
  which every device has ``min_samples - 1`` others within reach (the k-distance rule), so no
  device is left as noise while the groups stay apart.

If no dimension differs, or there are fewer distinct masks than ``num_groups`` (strictly: with
exactly k distinct masks KMeans runs and finds them, no fallback), each distinct mask is its own
group (:attr:`Grouping.fallback` says so). Labels are renumbered in order of
first appearance, so equal partitions give equal labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_dfl.checks import check_int

__all__ = ["GROUPING_METHODS", "Grouping", "auto_eps", "compact", "group_masks", "nearest_labels"]

#: clustering methods of :func:`group_masks`
GROUPING_METHODS = ("kmeans", "dbscan")


@dataclass(frozen=True)
class Grouping:
    """Group labels of K devices and what the clustering saw."""

    #: group id per device, ``0..num_groups-1`` in order of first appearance
    labels: np.ndarray
    #: mask dimensions on which not all devices agree (the compact length; PRISAM L200 logs 13)
    differing_dims: int
    #: distinct masks among the K
    distinct_masks: int
    #: each distinct mask became its own group (no dimension differs, or fewer distinct masks than k)
    fallback: bool
    #: the eps DBSCAN ran with (derived with ``eps="auto"``); ``None`` for KMeans or a fallback
    eps: float | None = None

    @property
    def num_groups(self) -> int:
        return int(self.labels.max()) + 1 if self.labels.size else 0

    def members(self) -> list[list[int]]:
        """Per group the indices (into the K devices) of its members, in increasing order."""
        return [np.flatnonzero(self.labels == g).tolist() for g in range(self.num_groups)]


def compact(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop the dimensions on which all K masks agree: ``(K, D') bool`` and the kept dimensions."""
    vectors = np.asarray(vectors, dtype=bool)
    if vectors.ndim != 2:
        raise ValueError(f"expected a (devices, bits) array of masks, got shape {vectors.shape}")
    differs = vectors.any(axis=0) & ~vectors.all(axis=0)
    return vectors[:, differs], np.flatnonzero(differs)


def _first_appearance(labels: np.ndarray) -> np.ndarray:
    """Renumber labels 0, 1, ... in order of first appearance."""
    mapping: dict[int, int] = {}
    return np.array([mapping.setdefault(int(v), len(mapping)) for v in labels], dtype=np.int64)


def auto_eps(dims: np.ndarray, min_samples: int = 2) -> float:
    """DBSCAN's eps from the compact masks ``(K, D')``: the largest over devices of the Hamming
    distance to its ``(min_samples - 1)``-th nearest other device (the k-distance rule: the smallest
    eps at which every device is a core point), placed halfway to the next possible distance so that
    float rounding cannot move a pair across it. 1.0 when there are fewer than ``min_samples``
    devices or no compact dimension (nothing to separate)."""
    dims = np.asarray(dims, dtype=bool)
    count, bits = dims.shape
    if count < min_samples or bits == 0 or min_samples < 2:
        return 1.0
    differ = (dims[:, None, :] != dims[None, :, :]).sum(axis=2).astype(np.float64)
    np.fill_diagonal(differ, np.inf)
    kth = np.sort(differ, axis=1)[:, min_samples - 2]
    return float(min((kth.max() + 0.5) / bits, 1.0))


def group_masks(vectors: np.ndarray, num_groups: int, method: str = "kmeans", seed: int = 0,
                eps: float | str = 0.1, min_samples: int = 2) -> Grouping:
    """Group K devices by their masks (``(K, D)`` 0/1): compaction, then ``method``.

    ``num_groups`` is KMeans' k (DBSCAN finds its own number); ``eps`` and ``min_samples`` are
    DBSCAN's (``eps`` a Hamming distance: the share of compact dimensions that differ, or
    ``"auto"``: :func:`auto_eps` of the compact masks).
    """
    if method not in GROUPING_METHODS:
        raise ValueError(f"unknown grouping method {method!r}; allowed: {', '.join(GROUPING_METHODS)}")
    check_int("num_groups", num_groups, 1)
    if eps != "auto" and not (isinstance(eps, (int, float)) and 0.0 < eps <= 1.0):
        raise ValueError(f"eps must be in (0, 1] (a Hamming distance) or 'auto', got {eps!r}")
    check_int("min_samples", min_samples, 1)
    dims, _ = compact(vectors)
    if dims.shape[0] == 0:
        return Grouping(np.zeros(0, dtype=np.int64), 0, 0, False)
    distinct, inverse = np.unique(dims, axis=0, return_inverse=True)
    inverse = np.asarray(inverse).reshape(-1)
    if dims.shape[1] == 0 or (method == "kmeans" and len(distinct) < num_groups):  # k distinct masks: KMeans
        return Grouping(_first_appearance(inverse), dims.shape[1], len(distinct), True)
    if method == "kmeans":
        from sklearn.cluster import KMeans

        labels = KMeans(n_clusters=num_groups, n_init=10, random_state=seed).fit_predict(dims.astype(np.float64))
    else:
        from sklearn.cluster import DBSCAN

        eps = auto_eps(dims, min_samples) if eps == "auto" else float(eps)
        labels = DBSCAN(eps=eps, min_samples=min_samples, metric="hamming").fit_predict(dims)
        noise = np.flatnonzero(labels < 0)
        labels[noise] = labels.max(initial=-1) + 1 + np.arange(len(noise))
        return Grouping(_first_appearance(labels), dims.shape[1], len(distinct), False, eps)
    return Grouping(_first_appearance(labels), dims.shape[1], len(distinct), False)


def nearest_labels(known: np.ndarray, known_labels: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """The label of the nearest known mask (Hamming distance; ties: the lowest index) per query:
    how a device joining after the groups were frozen finds its group."""
    known = np.asarray(known, dtype=bool)
    queries = np.asarray(queries, dtype=bool)
    if known.shape[0] == 0:
        raise ValueError("no labelled masks to compare with")
    distance = (queries[:, None, :] != known[None, :, :]).sum(axis=2)
    return np.asarray(known_labels)[distance.argmin(axis=1)]
