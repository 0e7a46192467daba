"""Similar-device discovery from structural masks (PRISAM Alg. 2; prisam-notes 1, 4, 5).

Devices share their BN channel masks (one bit per channel). :func:`compact` drops the
dimensions on which all masks agree (Alg. 2 lines 5-12 as corrected in notes 1: the test
belongs inside the loop over the mask's D dimensions and compares the K masks of the current
participants). :func:`group_masks` clusters the compact 0/1 vectors with scikit-learn,
deterministically for a seed, so every device that clusters "in parallel" would get the same
labels (notes 1):

* ``"kmeans"``: ``KMeans(n_clusters=num_groups, n_init=10, random_state=seed)`` (notes 4);
* ``"dbscan"``: ``DBSCAN(eps, min_samples, metric="hamming")``; noise points are singleton groups.
  ``eps="auto"`` derives eps from the masks (:func:`auto_eps`): DBSCAN's clusters at a given eps are
  a cut of its density tree, so eps is placed in the widest gap between the tree's merge heights
  (the partition that holds over the widest range of eps), and never above the k-distance rule's
  value (the smallest eps at which no device is noise). ``eps="kdist"`` is that k-distance rule
  alone; one outlier sets it for all devices (under churn it chained every group into one;
  docs/prisam.md item 21).

If no dimension differs, or there are fewer distinct masks than ``num_groups`` (strictly: with
exactly k distinct masks KMeans runs and finds them, no fallback), each distinct mask is its own
group (:attr:`Grouping.fallback` says so). Labels are renumbered in order of
first appearance, so equal partitions give equal labels.

Alg. 2 compacts and clusters the masks of all N devices (its line 7 sums over k = 1..N). Under churn
PRISAM clusters every device that has shared a mask, each by its warm-up mask (docs/prisam.md items 20,
22), and gives the round's participants their labels (:meth:`Grouping.restrict`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_dfl.checks import check_int

__all__ = ["AUTO_EPS_RULES", "GROUPING_METHODS", "Grouping", "auto_eps", "compact", "group_masks", "nearest_labels"]

#: clustering methods of :func:`group_masks`
GROUPING_METHODS = ("kmeans", "dbscan")
#: how :func:`auto_eps` derives DBSCAN's eps: ``"lifetime"`` (``eps="auto"``) or ``"kdist"`` (``eps="kdist"``)
AUTO_EPS_RULES = ("lifetime", "kdist")


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

    def restrict(self, rows: "np.ndarray | list[int]") -> Grouping:
        """The groups of the devices ``rows`` (indices into the K clustered), labels renumbered by first
        appearance among them: the round's participants when absent devices were clustered too."""
        labels = _first_appearance(self.labels[np.asarray(rows, dtype=np.int64)])
        return Grouping(labels, self.differing_dims, self.distinct_masks, self.fallback, self.eps)


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


def _hamming(dims: np.ndarray) -> np.ndarray:
    """Pairwise Hamming distances (bit counts) of ``(K, D')`` 0/1 rows, ``inf`` on the diagonal."""
    differ = (dims[:, None, :] != dims[None, :, :]).sum(axis=2).astype(np.float64)
    np.fill_diagonal(differ, np.inf)
    return differ


def merge_heights(dims: np.ndarray, min_samples: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """``(core, heights)`` of DBSCAN's density tree over ``(K, D')`` 0/1 rows, in bits: ``core[i]`` is
    the distance from device i to its ``(min_samples - 1)``-th nearest other device (at eps >= core[i]
    it is a core point), and ``heights`` the K - 1 edge lengths of the minimum spanning tree of the
    mutual reachability distance max(core[i], core[j], d(i, j)). DBSCAN's clusters of core points at
    eps are the components of that tree's edges <= eps (Campello, Moulavi and Sander 2013, DBSCAN*)."""
    differ = _hamming(np.asarray(dims, dtype=bool))
    core = np.sort(differ, axis=1)[:, min_samples - 2]
    reach = np.maximum(np.maximum(core[:, None], core[None, :]), differ)
    count = len(core)
    inside = np.zeros(count, dtype=bool)
    inside[0] = True
    best, heights = reach[0].copy(), []
    for _ in range(count - 1):  # Prim's algorithm (K is a round's devices: small)
        candidate = np.where(inside, np.inf, best)
        j = int(np.argmin(candidate))
        heights.append(float(candidate[j]))
        inside[j] = True
        best = np.minimum(best, reach[j])
    return core, np.asarray(heights)


def auto_eps(dims: np.ndarray, min_samples: int = 2, rule: str = "lifetime") -> float:
    """DBSCAN's eps from the compact masks ``(K, D')``, as a Hamming share, placed halfway to the next
    possible distance so that float rounding cannot move a pair across it; 1.0 when there are fewer
    than ``min_samples`` devices or no compact dimension (nothing to separate).

    ``"kdist"`` is the k-distance rule: the largest over devices of the distance to its
    ``(min_samples - 1)``-th nearest other device, the smallest eps at which no device is noise. One
    outlier sets it for all (its distance to its nearest device, a member of some group, often exceeds
    the distance between two groups), so a returning or joining device could chain every group into one.

    ``"lifetime"`` (``eps="auto"``, the default) places eps in the widest gap between the distinct
    non-zero merge heights of DBSCAN's density tree (:func:`merge_heights`): the partition that holds
    over the widest range of eps (the lifetime criterion for cutting a dendrogram), so an outlier whose
    link is far above the groups' own links stays noise (a group of its own). It never exceeds the
    k-distance rule: above it every device is a core point, and raising eps only joins groups; zero
    heights (devices sharing one mask, as a group's members do after aggregating, notes 2) carry no
    scale and are left out, so identical group masks keep eps below one bit, as before. Only cuts at which
    at least half of the devices are core points are candidates (docs/prisam.md item 22): a handful of
    devices gives few heights, and the widest gap was at times the one above the closest pair, leaving
    nearly every device noise (alone). With fewer than two distinct non-zero heights, or no candidate,
    there is no gap to choose: the k-distance rule."""
    if rule not in AUTO_EPS_RULES:
        raise ValueError(f"unknown auto eps rule {rule!r}; allowed: {', '.join(AUTO_EPS_RULES)}")
    dims = np.asarray(dims, dtype=bool)
    count, bits = dims.shape
    if count < min_samples or bits == 0 or min_samples < 2:
        return 1.0
    core, heights = merge_heights(dims, min_samples)
    value = core.max()
    distinct = np.unique(heights[heights > 0])
    if rule == "lifetime" and len(distinct) >= 2:
        gaps = np.diff(distinct)
        # a cut at which fewer than half of the devices are core points groups almost nobody: not a candidate
        gaps[[2 * int((core <= h).sum()) < count for h in distinct[:-1]]] = -1.0
        if gaps.max() >= 0:
            widest = int(np.argmax(gaps))  # the first of equally wide gaps: the smaller eps
            value = min(distinct[widest], value)
    return float(min((value + 0.5) / bits, 1.0))


def group_masks(vectors: np.ndarray, num_groups: int, method: str = "kmeans", seed: int = 0,
                eps: float | str = 0.1, min_samples: int = 2) -> Grouping:
    """Group K devices by their masks (``(K, D)`` 0/1): compaction, then ``method``.

    ``num_groups`` is KMeans' k (DBSCAN finds its own number); ``eps`` and ``min_samples`` are
    DBSCAN's (``eps`` a Hamming distance: the share of compact dimensions that differ, ``"auto"``:
    :func:`auto_eps` of the compact masks, or ``"kdist"``: its k-distance rule).
    """
    if method not in GROUPING_METHODS:
        raise ValueError(f"unknown grouping method {method!r}; allowed: {', '.join(GROUPING_METHODS)}")
    check_int("num_groups", num_groups, 1)
    if eps not in ("auto", "kdist") and not (isinstance(eps, (int, float)) and 0.0 < eps <= 1.0):
        raise ValueError(f"eps must be in (0, 1] (a Hamming distance), 'auto' or 'kdist', got {eps!r}")
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

        if eps in ("auto", "kdist"):
            eps = auto_eps(dims, min_samples, "lifetime" if eps == "auto" else "kdist")
        else:
            eps = float(eps)
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
