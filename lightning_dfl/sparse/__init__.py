"""Sparse-training primitives in pure PyTorch: masks, ERK, RigL, the PQ index, FLOPs counting."""

from lightning_dfl.sparse.erk import (
                                      erk_densities,
                                      initial_masks,
                                      random_masks,
                                      uniform_densities,
)
from lightning_dfl.sparse.flops import FlopsProfile, profile_flops
from lightning_dfl.sparse.masks import (
                                      Masks,
                                      ModelMask,
                                      count_active,
                                      density,
                                      maskable_parameters,
                                      sparsity,
)
from lightning_dfl.sparse.pqi import (
                                      pq_index,
                                      pqi_keep_bound,
                                      pqi_prune_count,
                                      pqi_prune_masks,
                                      prune_budget,
)
from lightning_dfl.sparse.rigl import cosine_drop_fraction, dense_gradients, rigl_masks

__all__ = [
    "FlopsProfile", "Masks", "ModelMask", "cosine_drop_fraction", "count_active", "dense_gradients", "density",
    "erk_densities", "initial_masks", "maskable_parameters", "pq_index", "pqi_keep_bound", "pqi_prune_count",
    "pqi_prune_masks", "profile_flops", "prune_budget", "random_masks", "rigl_masks", "sparsity",
    "uniform_densities",
]
