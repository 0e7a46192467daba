"""``SparseClassifier``: a LightningModule that wraps a model builder with its weight mask."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_dfl.models import available_models, build_model
from lightning_dfl.models import model_options as builder_options
from lightning_dfl.sparse.erk import DISTRIBUTIONS, initial_masks
from lightning_dfl.sparse.flops import FlopsProfile, profile_flops
from lightning_dfl.sparse.masks import Masks, ModelMask, maskable_parameters

#: name parts of the 1x1 shortcut convolutions of ResNets
SHORTCUT_NAMES = ("downsample", "shortcut")


class SparseClassifier(LightningModule):
    """An image classifier whose Conv/Linear weights carry a boolean mask.

    The mask is enforced by hooks (:class:`~lightning_dfl.sparse.masks.ModelMask`): gradients of
    inactive weights are zero and the weights are re-masked after every optimizer step, in a
    plain ``Trainer`` (``optimizer_step``) and under Fabric (``on_after_optimizer_step``).

    Args:
        arch: model builder name (see :func:`lightning_dfl.models.available_models`).
        num_classes, in_channels, image_size: the input and output sizes; left ``None`` they are
            taken from the datamodule when training starts.
        density: initial share of active weights over the masked set, in (0, 1]; 1 is dense.
        distribution: how the density is spread over layers, ``"erk"`` or ``"uniform"``.
        erk_power_scale: exponent of the ERK score.
        mask_shortcuts: whether the 1x1 shortcut (downsample) convolutions of ResNets are masked.
        mask_exclude: Conv/Linear weights whose name contains one of these strings stay dense
            (e.g. ``["fc"]`` keeps ResNet18's classifier dense).
        model_options: options of the model builder (e.g. ``{"norm": "batch"}`` for VGG11 with
            BatchNorm; see :func:`lightning_dfl.models.model_options`).
        lr: SGD learning rate at round (or epoch) 0.
        lr_decay: multiplicative decay per round (federation) or per epoch (plain ``Trainer``).
        momentum, weight_decay: SGD settings (papers: momentum 0, weight decay 5e-4).
        seed: seed of the initial weights and the initial mask.
    """

    def __init__(
        self,
        arch: str = "cnn_digits",
        num_classes: int | None = None,
        in_channels: int | None = None,
        image_size: int | None = None,
        density: float = 1.0,
        distribution: str = "erk",
        erk_power_scale: float = 1.0,
        mask_shortcuts: bool = True,
        mask_exclude: list[str] | None = None,
        model_options: dict[str, Any] | None = None,
        lr: float = 0.1,
        lr_decay: float = 0.998,
        momentum: float = 0.0,
        weight_decay: float = 5e-4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if arch not in available_models():
            raise ValueError(f"unknown arch {arch!r}; allowed: {', '.join(available_models())}")
        unknown = sorted(set(model_options or {}) - set(builder_options(arch)))
        if unknown:
            raise ValueError(f"model {arch!r} has no option(s) {unknown}; its options are {builder_options(arch)}")
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"unknown distribution {distribution!r}; allowed: {', '.join(DISTRIBUTIONS)}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0.0 < lr_decay <= 1.0:
            raise ValueError(f"lr_decay must be in (0, 1], got {lr_decay}")
        if momentum < 0 or weight_decay < 0:
            raise ValueError(f"momentum and weight_decay must be >= 0, got {momentum} and {weight_decay}")
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels), ("image_size", image_size)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        self.mask: ModelMask | None = None
        self._flops: FlopsProfile | None = None
        if num_classes is not None and in_channels is not None and image_size is not None:
            self.build(num_classes, in_channels, image_size)

    # -- construction ------------------------------------------------------------------
    @property
    def is_built(self) -> bool:
        return self.model is not None

    def build(self, num_classes: int, in_channels: int, image_size: int) -> None:
        """Build the model, its initial mask and FLOPs profile (idempotent for equal sizes)."""
        if self.model is not None:
            wanted = (num_classes, in_channels, image_size)
            if wanted != self.input_spec:
                raise ValueError(f"model was built for (classes, channels, size) = {self.input_spec}, "
                                 f"the data needs {wanted}")
            return
        hp = self.hparams
        hp.num_classes, hp.in_channels, hp.image_size = num_classes, in_channels, image_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)
            self.model = build_model(hp.arch, num_classes=num_classes, in_channels=in_channels, image_size=image_size,
                                     **(hp.model_options or {}))
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        generator = torch.Generator().manual_seed(hp.seed)
        self.mask = ModelMask(self.model, self.initial_masks(generator)).attach()
        self._flops = profile_flops(self.model, (in_channels, image_size, image_size))

    @property
    def input_spec(self) -> tuple[int, int, int]:
        hp = self.hparams
        return (hp.num_classes, hp.in_channels, hp.image_size)

    def maskable_parameters(self) -> dict[str, nn.Parameter]:
        """The masked parameters, named relative to :attr:`model`."""
        patterns = list(self.hparams.mask_exclude or [])
        if not self.hparams.mask_shortcuts:
            patterns += list(SHORTCUT_NAMES)
        return maskable_parameters(self.model, exclude=(lambda name: any(p in name for p in patterns))
                                   if patterns else None)

    def initial_masks(self, generator: torch.Generator, density: float | None = None) -> Masks:
        """A fresh random mask at ``density`` (default: the module's) with its distribution.

        Names are those of :attr:`mask` (relative to :attr:`model`).
        """
        return initial_masks(
            self.maskable_parameters(),
            self.hparams.density if density is None else density,
            distribution=self.hparams.distribution,
            generator=generator,
            erk_power_scale=self.hparams.erk_power_scale,
        )

    def setup(self, stage: str) -> None:
        """In a plain ``Trainer``, build from the datamodule's sizes when not built yet."""
        if self.model is None:
            dm = getattr(self.trainer, "datamodule", None)
            if dm is None or not hasattr(dm, "num_classes"):
                raise ValueError("SparseClassifier needs num_classes, in_channels and image_size, "
                                 "or a datamodule that provides them")
            dm.setup(stage)
            self.build(dm.num_classes, dm.in_channels, dm.image_size)

    # -- accounting --------------------------------------------------------------------
    def forward_flops(self) -> float:
        """Forward FLOPs per sample at the current mask (Conv/Linear, active weights, 2 per MAC)."""
        assert self._flops is not None and self.mask is not None
        return self._flops.forward_flops(self.mask.masks)

    @property
    def flops_profile(self) -> FlopsProfile:
        assert self._flops is not None
        return self._flops

    # -- steps --------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Cross-entropy of one ``(x, y)`` batch (also RigL's regrowth loss)."""
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int = 0) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        if self._trainer is not None:
            self.train_acc(logits, y)
            self.log("train/loss", loss, prog_bar=True)
            self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int = 0) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y))
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int = 0) -> None:
        self.validation_step(batch, batch_idx)

    @torch.no_grad()
    def evaluate(self, batches: Any) -> tuple[int, int, float]:
        """``(correct, total, summed loss)`` over ``batches`` in eval mode (federated evaluation)."""
        was_training = self.training
        self.eval()
        correct, total, loss_sum = 0, 0, 0.0
        for x, y in batches:
            logits = self(x)
            loss_sum += float(F.cross_entropy(logits.float(), y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
            total += int(y.numel())
        self.train(was_training)
        return correct, total, loss_sum

    # -- optimisation -------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        """The learning rate after ``step`` decays: lr x lr_decay^step."""
        return self.hparams.lr * self.hparams.lr_decay**step

    def make_optimizer(self) -> torch.optim.SGD:
        hp = self.hparams
        return torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)

    def configure_optimizers(self) -> Any:
        optimizer = self.make_optimizer()
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=self.hparams.lr_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self.mask.apply_()

    def on_after_optimizer_step(self, strategy: Any = None, optimizer: Any = None) -> None:
        """Fabric callback hook: re-mask the weights after every optimizer step."""
        self.mask.apply_()

    # -- checkpoints --------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["masks"] = self.mask.state() if self.mask is not None else None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        masks = checkpoint.get("masks")
        if masks is not None and self.mask is not None:
            self.mask.load_(masks)
