"""RigL dynamic sparse training as a Lightning callback (DisPFL Alg. 2, DA-DPFL Alg. 3).

Works in a plain ``lightning.pytorch.Trainer`` on any ``LightningModule`` and in lightning-dfl's
federation. The drop-and-regrow step itself is :func:`lightning_dfl.sparse.rigl.rigl_masks`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from itertools import islice
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_dfl.callbacks._mask_owner import MaskOwner, federated_mask, module_mask
from lightning_dfl.callbacks.base import FederatedCallback, is_federated
from lightning_dfl.checks import is_int, is_number
from lightning_dfl.errors import ConfigurationError
from lightning_dfl.seeding import MAX_SEED
from lightning_dfl.sparse.erk import DISTRIBUTIONS, initial_masks
from lightning_dfl.sparse.masks import Masks, ModelMask
from lightning_dfl.sparse.rigl import REGROWTH_MODES, cosine_drop_fraction, dense_gradients, rigl_masks

UPDATE_INTERVALS = ("step", "epoch")


class RigL(FederatedCallback):
    r"""Drop the smallest active weights and regrow as many by dense gradient, periodically.

    .. code-block:: python

        trainer = Trainer(callbacks=[RigL(density=0.3, update_every=100)])

    The mask is set up at ``on_fit_start``, once the module has built its layers (a
    :class:`~lightning_dfl.module.SparseClassifier` builds them in its ``setup`` from the
    datamodule's sizes) and a checkpoint was restored, as Lightning's ``ModelPruning`` acts on
    the module's layers. It is the module's own when ``pl_module.mask`` is a
    :class:`~lightning_dfl.sparse.masks.ModelMask` (lightning-dfl's models): a dense module's
    mask (density 1) is drawn afresh at ``density`` and ``distribution``; a sparse one is kept
    when ``density`` is None or equal to its density, and refused with both densities named
    otherwise; a fit resumed from a checkpoint keeps the checkpoint's mask (maybe pruned since).
    A module without a mask gets one from the callback over its Conv/Linear weights at
    ``density`` (0.5 when None); the callback attaches its gradient hooks and re-masks the
    weights after every optimizer step, so that momentum and weight decay cannot revive a
    dropped weight.

    Plain ``Trainer``: every ``update_every`` optimizer steps (or epochs) the mask is updated
    with ``t`` = steps (epochs) done and ``T`` = ``trainer.estimated_stepping_batches``
    (``max_epochs``); the regrowth gradient is taken on the current batch (the epoch's last
    batch with ``update_interval="epoch"``). Dropped weights are zeroed; regrown weights start
    at zero.

    Federation (``trainer.is_federated``): step and epoch updates are off; after each client's
    task (``on_client_end``, once its model was published) the client's mask is updated with
    ``t = trainer.current_round``, ``T = trainer.max_rounds`` and the gradient of
    ``gradient_batches`` batches of ``trainer.train_dataloader``.

    The loss is ``pl_module.loss(batch)`` when the module defines such a method, else the loss
    returned by ``pl_module.training_step(batch, batch_idx)`` (its ``self.log`` calls are muted
    during this pass). The gradient pass runs in eval mode, as the DisPFL authors' code does.

    Args:
        drop_fraction: ``alpha_0`` of the cosine schedule
            ``alpha_t = alpha_0 / 2 (1 + cos(pi t / T))``, in ``[0, 1]``; or a callable
            ``(t, T) -> fraction``.
        regrowth: ``"gradient"`` (RigL) or ``"random"`` (uniform among inactive positions).
        gradient_batches: batches whose dense gradient scores regrowth, at most (a client with
            fewer uses all of its own; federation only: a plain ``Trainer`` uses the current batch).
        update_every: update period in ``update_interval`` units (plain ``Trainer`` only).
        update_interval: ``"step"`` (optimizer steps) or ``"epoch"``.
        stop_fraction: no update once ``t >= stop_fraction * T`` (RigL's ``T_end``), in ``(0, 1]``.
        density: share of active weights the model trains at, in ``(0, 1]``; None: the module's
            own mask as it is (0.5 for a module without one). In a federation the clients' masks
            are drawn at the model's density: a different one here is refused.
        distribution: layer densities of a mask the callback draws: one of ``"erk"``, ``"uniform"``.
        seed: seed of the initial mask and of random regrowth, in ``[0, 2**32 - 1]``; random
            regrowth uses a generator seeded from ``(seed, t)``, or ``(seed, round, client_id)``
            in the federation, so the result does not depend on execution order.
        verbose: 0 silent, 1 one line per update, 2 also one line per layer.

    Raises:
        MisconfigurationException: if an argument is out of range or of the wrong type.
    """

    def __init__(
        self,
        drop_fraction: float | Callable[[int, int], float] = 0.5,
        regrowth: str = "gradient",
        gradient_batches: int = 1,
        update_every: int = 100,
        update_interval: str = "step",
        stop_fraction: float = 1.0,
        density: float | None = None,
        distribution: str = "erk",
        seed: int = 0,
        verbose: int = 0,
    ) -> None:
        if callable(drop_fraction):
            pass
        elif not is_number(drop_fraction) or not 0.0 <= drop_fraction <= 1.0:
            raise MisconfigurationException(
                f"`drop_fraction` must be a float in [0, 1] or a callable (t, T) -> float, got {drop_fraction!r}")
        if regrowth not in REGROWTH_MODES:
            raise MisconfigurationException(f"`regrowth` must be one of {REGROWTH_MODES}, got {regrowth!r}")
        if not is_int(gradient_batches) or gradient_batches < 1:
            raise MisconfigurationException(f"`gradient_batches` must be an int >= 1, got {gradient_batches!r}")
        if not is_int(update_every) or update_every < 1:
            raise MisconfigurationException(f"`update_every` must be an int >= 1, got {update_every!r}")
        if update_interval not in UPDATE_INTERVALS:
            raise MisconfigurationException(
                f"`update_interval` must be one of {UPDATE_INTERVALS}, got {update_interval!r}")
        if not is_number(stop_fraction) or not 0.0 < stop_fraction <= 1.0:
            raise MisconfigurationException(f"`stop_fraction` must be a float in (0, 1], got {stop_fraction!r}")
        if density is not None and (not is_number(density) or not 0.0 < density <= 1.0):
            raise MisconfigurationException(f"`density` must be a float in (0, 1] or None, got {density!r}")
        if distribution not in DISTRIBUTIONS:
            raise MisconfigurationException(f"`distribution` must be one of {DISTRIBUTIONS}, got {distribution!r}")
        if not is_int(seed) or not 0 <= seed <= MAX_SEED:
            raise MisconfigurationException(f"`seed` must be an int in [0, {MAX_SEED}], got {seed!r}")
        if not is_int(verbose) or verbose not in (0, 1, 2):
            raise MisconfigurationException(f"`verbose` must be any of (0, 1, 2), got {verbose!r}")

        self.drop_fraction = drop_fraction
        self.regrowth = regrowth
        self.gradient_batches = gradient_batches
        self.update_every = update_every
        self.update_interval = update_interval
        self.stop_fraction = float(stop_fraction)
        self.density = None if density is None else float(density)
        self.distribution = distribution
        self.seed = seed
        self.verbose = verbose

        self._masks = MaskOwner("RigL", error=MisconfigurationException)
        self._total: int | None = None  # T of the plain-Trainer schedule
        self._num_updates = 0
        self._last_update_step = 0
        self._last_batch: tuple[Any, int] | None = None
        self._restored = False  # a checkpoint state was loaded: its mask is the run's, whatever its density

    # -- the mask ------------------------------------------------------------------------
    @property
    def owns_mask(self) -> bool:
        """True when the callback built the mask (the module brought none)."""
        return self._masks.owns_mask

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if is_federated(trainer):
            mask = module_mask(pl_module)
            if mask is not None and self.density is not None and not self._same_density(mask):
                raise MisconfigurationException(
                    f"RigL(density={self.density:g}) in a federation: the clients' masks are drawn at the model's "
                    f"density {self._density_of(pl_module, mask)}; leave RigL's density unset and set model.density")
            self._check_schedule(int(trainer.max_rounds))
            return
        if (module_mask(pl_module) is None and not getattr(pl_module, "automatic_optimization", True)
                and not self._has_loss_method(pl_module)):
            raise MisconfigurationException(
                "RigL needs a loss without side effects: with manual optimization `training_step` "
                "steps the optimizer, so define `loss(batch) -> Tensor` on the module")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Set up the mask once the module built its layers (in its ``setup``) and a checkpoint was restored."""
        restored, self._restored = self._restored, False
        if is_federated(trainer):
            return
        mask = module_mask(pl_module)
        if mask is not None:
            if not restored:  # resumed: the checkpoint's mask, maybe pruned since RigL set its density
                self._set_module_density(pl_module, mask)
            return
        density = 0.5 if self.density is None else self.density
        self._masks.setup(pl_module, lambda: initial_masks(
            pl_module, density, self.distribution, generator=torch.Generator().manual_seed(self.seed)))
        self._masks.follow_device(pl_module)  # the strategy moved the module after `setup`

    def _same_density(self, mask: ModelMask) -> bool:
        """Whether ``mask`` is at :attr:`density`, up to the per-layer rounding of a drawn mask."""
        return abs(mask.density() - self.density) <= len(mask.masks) / max(mask.num_masked(), 1)

    @staticmethod
    def _density_of(pl_module: Any, mask: ModelMask) -> str:
        """The mask's density, and the module's ``density`` argument when it has one."""
        given = (getattr(pl_module, "hparams", None) or {}).get("density")
        hint = f" ({type(pl_module).__name__}(density={given:g}))" if is_number(given) else ""
        return f"{mask.density():.4g}{hint}"

    def _set_module_density(self, pl_module: Any, mask: ModelMask) -> None:
        """Draw a dense module's mask at :attr:`density`; keep one at it; refuse a sparse one at another."""
        if self.density is None or self._same_density(mask):
            return
        if mask.num_active() != mask.num_masked():
            raise MisconfigurationException(
                f"RigL(density={self.density:g}) conflicts with the module's own mask at density "
                f"{self._density_of(pl_module, mask)}: give the density once, in RigL or in the module "
                "(a dense module, density 1, trains at RigL's)")
        generator = torch.Generator().manual_seed(self.seed)
        mask.load_(initial_masks(mask.params, self.density, self.distribution, generator=generator), apply=True)
        if self.verbose >= 1:
            rank_zero_info(f"RigL: the module's dense mask drawn at density {mask.density():.4f} ({self.distribution})")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._masks.teardown()

    # -- plain Trainer -------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if is_federated(trainer):
            return
        if self.update_interval == "step":
            total = trainer.estimated_stepping_batches
        else:
            total = trainer.max_epochs if trainer.max_epochs is not None else -1
        if not (isinstance(total, int) or (isinstance(total, float) and total.is_integer())) or total < 1:
            raise MisconfigurationException(
                f"RigL's schedule needs a finite training length T, got {total!r} "
                f"({'estimated_stepping_batches' if self.update_interval == 'step' else 'max_epochs'}); "
                "set max_steps or max_epochs")
        self._total = int(total)
        self._check_schedule(self._total)

    #: the batch hooks it acts in within a federation: none (its on_train_batch_end re-applies a mask the module
    #: itself keeps there), so a batched step may train its clients (the engine reads it: federated_batch_hooks)
    federated_batch_hooks: tuple[str, ...] = ()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._masks.apply_()  # after the optimizer step; no-op when the module owns its mask
        if is_federated(trainer):
            return
        if self.update_interval == "epoch":
            self._last_batch = (batch, batch_idx)
            return
        step = trainer.global_step
        if step > self._last_update_step and step % self.update_every == 0:
            self._plain_update(trainer, pl_module, step, batch, batch_idx)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if is_federated(trainer) or self.update_interval != "epoch" or self._last_batch is None:
            return
        epoch = trainer.current_epoch + 1  # epochs done
        batch, batch_idx = self._last_batch
        self._last_batch = None
        if epoch > self._last_update_step and epoch % self.update_every == 0:
            self._plain_update(trainer, pl_module, epoch, batch, batch_idx)

    def _plain_update(self, trainer: Trainer, pl_module: LightningModule, t: int, batch: Any,
                      batch_idx: int) -> None:
        total = self._total
        if total is None or t >= self.stop_fraction * total:
            return
        self._last_update_step = t
        mask = self._masks.get(pl_module)
        ranks = getattr(trainer, "world_size", 1)
        average = None if ranks == 1 else (  # every rank's batch: the global batch's gradient, as in one process
            lambda grads: {name: trainer.strategy.reduce(g, reduce_op="mean") for name, g in grads.items()})
        new = self._search(pl_module, mask, t, total, [batch], batch_idx, (self.seed, t), average)
        if ranks > 1:  # identical masks on every rank
            new = trainer.strategy.broadcast(new, src=0)
        self._load(mask, new, f"step {t}" if self.update_interval == "step" else f"epoch {t}")

    # -- federation ----------------------------------------------------------------------
    def on_client_end(self, trainer: Any, pl_module: Any, client_id: int) -> None:
        mask = federated_mask(pl_module, "RigL")
        t, total = int(trainer.current_round), int(trainer.max_rounds)
        if t >= self.stop_fraction * total:
            return
        device = next(iter(mask.params.values())).device
        with torch.random.fork_rng(devices=[]):  # drawing batches leaves the global RNG alone
            batches = [move_data_to_device(b, device)
                       for b in islice(iter(trainer.train_dataloader), self.gradient_batches)]
        if not batches:
            raise RuntimeError(f"client {client_id} has no training batch to score regrowth with")
        new = self._search(pl_module, mask, t, total, batches, 0, (self.seed, t, int(client_id)))
        self._load(mask, new, f"round {t} client {client_id}")

    # -- shared --------------------------------------------------------------------------
    def _check_schedule(self, total: int) -> None:
        """Before training: a ``drop_fraction`` callable gives a float in [0, 1] at every ``t`` the run will use
        (``t < stop_fraction * total``), or the run is refused (:meth:`fraction` names the value)."""
        if callable(self.drop_fraction):
            for t in range(total):
                if t >= self.stop_fraction * total:
                    break
                self.fraction(t, total)

    def fraction(self, t: int, total: int) -> float:
        """The drop fraction at ``t`` of ``total`` (the cosine schedule or the user's callable)."""
        if callable(self.drop_fraction):
            value = self.drop_fraction(t, total)
            if not is_number(value) or not 0.0 <= value <= 1.0:
                name = getattr(self.drop_fraction, "__qualname__", type(self.drop_fraction).__name__)
                raise ConfigurationError(f"RigL's drop_fraction callable {name} returned {value!r} at t={t}, "
                                         f"T={total}; expected a float in [0, 1]")
            return float(value)
        return cosine_drop_fraction(self.drop_fraction, t, total)

    def _search(self, pl_module: Any, mask: ModelMask, t: int, total: int, batches: list,
                batch_idx: int, seed_key: tuple[int, ...],
                average: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None) -> Masks:
        """The new mask at ``t``; ``average`` (DDP) averages the signed dense gradients over the ranks first."""
        mask.apply_()  # magnitudes and gradients at the masked weights
        fraction = self.fraction(t, total)
        weights = {name: p.detach() for name, p in mask.params.items()}
        if self.regrowth == "gradient":
            with _muted_logging(pl_module):
                scores = dense_gradients(pl_module, mask, self._loss_fn(pl_module, batch_idx), batches,
                                         absolute=average is None)
            if average is not None:
                scores = {name: g.abs() for name, g in average(scores).items()}
            return rigl_masks(weights, mask.masks, fraction, scores=scores, mode="gradient")
        generator = torch.Generator().manual_seed(int(np.random.SeedSequence(seed_key).generate_state(1)[0]))
        return rigl_masks(weights, mask.masks, fraction, mode="random", generator=generator)

    def _load(self, mask: ModelMask, new: Masks, when: str) -> None:
        changed = ({name: (new[name].to(old.device) & ~old).count_nonzero() for name, old in mask.masks.items()}
                   if self.verbose >= 1 else {})  # counted only to be printed: reading them waits for the device
        mask.load_(new, apply=True)
        self._num_updates += 1
        if self.verbose >= 1:
            rank_zero_info(f"RigL {when}: density {mask.density():.4f}, "
                           f"{int(sum(changed.values()))} weights regrown (as many dropped)")
        if self.verbose >= 2:
            for name, m in mask.masks.items():
                rank_zero_info(f"RigL   {name}: density {m.float().mean().item():.4f}, "
                               f"{int(changed[name])} regrown")

    @staticmethod
    def _has_loss_method(pl_module: Any) -> bool:
        return inspect.isfunction(getattr(type(pl_module), "loss", None))

    def _loss_fn(self, pl_module: Any, batch_idx: int) -> Callable[[Any], Tensor]:
        if self._has_loss_method(pl_module):
            return pl_module.loss

        def training_step_loss(batch: Any) -> Tensor:
            out = pl_module.training_step(batch, batch_idx)
            if isinstance(out, Mapping):
                if "loss" not in out:
                    raise RuntimeError(f"training_step returned a dict without 'loss' (keys {sorted(out)}); "
                                       "RigL needs the loss to score regrowth")
                out = out["loss"]
            if not isinstance(out, Tensor):
                raise RuntimeError(f"training_step returned {type(out).__name__}, not a loss tensor; "
                                   "define `loss(batch) -> Tensor` on the module for RigL")
            return out

        return training_step_loss

    # -- sharded federations (lightning_dfl.federation.loop.sharded) --------------------------
    def shard_snapshot(self) -> int:
        return self._num_updates

    def shard_delta(self, snapshot: int) -> int:
        return self._num_updates - snapshot

    def shard_rollback(self, snapshot: int) -> None:
        self._num_updates = snapshot

    def shard_apply(self, delta: int) -> None:
        self._num_updates += delta

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"num_updates": self._num_updates, "last_update_step": self._last_update_step}
        masks = self._masks.state()
        if masks is not None:
            state["masks"] = masks
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._num_updates = int(state_dict.get("num_updates", 0))
        self._last_update_step = int(state_dict.get("last_update_step", 0))
        self._masks.load_state(state_dict.get("masks"))
        self._restored = True


@contextmanager
def _muted_logging(pl_module: Any) -> Iterator[None]:
    """Within this block ``pl_module.log`` and ``log_dict`` do nothing (the scoring pass)."""
    names = [name for name in ("log", "log_dict") if hasattr(pl_module, name)]
    missing = object()
    previous = {name: vars(pl_module).get(name, missing) for name in names}
    for name in names:
        setattr(pl_module, name, _no_log)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is missing:
                delattr(pl_module, name)
            else:
                setattr(pl_module, name, value)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None
