"""``SparseClassifier``: a LightningModule that wraps a model builder with its weight mask."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_dfl.checks import check_bool, check_int, is_int, is_number
from lightning_dfl.deferred import accumulator_dtype, host_reads_are_cheap
from lightning_dfl.models import available_models, build_model, check_model
from lightning_dfl.models import model_options as builder_options
from lightning_dfl.seeding import MAX_SEED
from lightning_dfl.sparse.erk import DISTRIBUTIONS, initial_masks
from lightning_dfl.sparse.flops import FlopsProfile, profile_flops
from lightning_dfl.sparse.masks import Masks, ModelMask, active_counts, count_active_together, maskable_parameters
from lightning_dfl.sparse.masks import density as mask_density

#: name parts of the 1x1 shortcut convolutions of ResNets
SHORTCUT_NAMES = ("downsample", "shortcut")
#: the sizes a model is built for, in the order of :attr:`SparseClassifier.input_spec`
_SPEC_NAMES = ("num_classes", "in_channels", "image_size")


def _check_real(name: str, value: object, low: float, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float if it is a finite number in the interval; else ValueError naming it."""
    ok = is_number(value) and (value > low if low_open else value >= low)
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if ok:
        return float(value)
    if high is None:
        allowed = f"a finite number {'>' if low_open else '>='} {low:g}"
    else:
        allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _mismatch(name: str, given: int | None, built: int | None, theirs: int, data: str) -> str:
    """``model.<name>=<given> but <data> has <theirs> ...``; for a model built for other data
    without sizes given, ``the model was built for <name>=<built> but ...``."""
    if name == "num_classes":
        what = f"{theirs} classes"
    elif name == "in_channels":
        what = f"{theirs} channel(s) per image"
    else:
        what = f"images of {theirs}x{theirs} pixels"
        if given is not None:
            what += f" (data.image_size={given} resizes them)"
    if given is None:
        return f"the model was built for {name}={built} but {data} has {what}"
    return f"model.{name}={given} but {data} has {what}"


class SparseClassifier(LightningModule):
    """An image classifier whose Conv/Linear weights carry a boolean mask.

    The mask is enforced by hooks (:class:`~lightning_dfl.sparse.masks.ModelMask`): gradients of
    inactive weights are zero and the weights are re-masked after every optimizer step, in a
    plain ``Trainer`` (``optimizer_step``) and under Fabric (``on_after_optimizer_step``).

    Args:
        arch: model builder name (see :func:`lightning_dfl.models.available_models`).
        num_classes, in_channels, image_size: the input and output sizes; left ``None`` they are
            taken from the datamodule when training starts. Given, they must equal the data's:
            a model for 5 classes is refused on 10-class data, not silently rebuilt.
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
        momentum, weight_decay: SGD settings, momentum in [0, 1), weight decay >= 0 (papers: momentum 0,
            weight decay 5e-4).
        seed: seed of the initial weights and mask (0 to 2**32 - 1).
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
        if not isinstance(arch, str) or arch not in available_models():
            raise ValueError(f"unknown arch {arch!r}; allowed: {', '.join(available_models())}")
        if model_options is not None and not isinstance(model_options, Mapping):
            raise ValueError(f"model_options must be a mapping of option names to values or None, "
                             f"got {model_options!r}")
        unknown = sorted(set(model_options or {}) - set(builder_options(arch)))
        if unknown:
            raise ValueError(f"model {arch!r} has no option(s) {unknown}; its options are {builder_options(arch)}")
        _check_real("density", density, 0.0, 1.0, low_open=True)
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"unknown distribution {distribution!r}; allowed: {', '.join(DISTRIBUTIONS)}")
        _check_real("erk_power_scale", erk_power_scale, 0.0)
        check_bool("mask_shortcuts", mask_shortcuts)
        if mask_exclude is not None and (isinstance(mask_exclude, str) or not isinstance(mask_exclude, (list, tuple))
                                         or not all(isinstance(p, str) and p for p in mask_exclude)):
            raise ValueError(f"mask_exclude must be a list of non-empty name parts (e.g. ['fc']) or None, "
                             f"got {mask_exclude!r}")
        _check_real("lr", lr, 0.0, low_open=True)
        _check_real("lr_decay", lr_decay, 0.0, 1.0, low_open=True)
        _check_real("momentum", momentum, 0.0, 1.0, high_open=True)
        _check_real("weight_decay", weight_decay, 0.0)
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels), ("image_size", image_size)):
            if value is not None and not (is_int(value) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, or None to take it from the data; got {value!r}")
        check_int("seed", seed, 0, MAX_SEED)
        #: the sizes given here (None: take them from the data); ``build`` refuses data that differs
        self._requested_spec = (num_classes, in_channels, image_size)
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        self.mask: ModelMask | None = None
        self._dense_init: dict[str, Tensor] = {}
        self._flops: FlopsProfile | None = None
        if num_classes is not None and in_channels is not None and image_size is not None:
            self.build(num_classes, in_channels, image_size)

    # -- construction ------------------------------------------------------------------
    def build(self, num_classes: int, in_channels: int, image_size: int, data: str = "the data") -> None:
        """Build the model, its initial mask and FLOPs profile for data of these sizes.

        Idempotent for equal sizes. Sizes given to the constructor must match the data's:
        otherwise (and for a model already built for other sizes) a ValueError names both,
        ``data`` naming the data in the message (e.g. ``"the data set digits"``).
        """
        wanted = (num_classes, in_channels, image_size)
        for name, value in zip(_SPEC_NAMES, wanted):
            if not (is_int(value) and value >= 1):
                raise ValueError(f"{data} gives {name}={value!r}; it must be an integer >= 1")
        built = self.input_spec if self.model is not None else (None, None, None)
        clashes = [_mismatch(name, given, mine, theirs, data)
                   for name, given, mine, theirs in zip(_SPEC_NAMES, self._requested_spec, built, wanted)
                   if (mine if mine is not None else given) not in (None, theirs)]
        if clashes:
            given = [f"model.{name}" for name, mine, theirs in zip(_SPEC_NAMES, self._requested_spec, wanted)
                     if mine not in (None, theirs)]
            hint = (f"leave {' and '.join(given)} unset (None) to take {'it' if len(given) == 1 else 'them'} "
                    "from the data" if given else "build a new model for this data")
            raise ValueError(f"{'; '.join(clashes)}; {hint}")
        if self.model is not None:
            return
        hp = self.hparams
        hp.num_classes, hp.in_channels, hp.image_size = num_classes, in_channels, image_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)
            self.model = build_model(hp.arch, num_classes=num_classes, in_channels=in_channels, image_size=image_size,
                                     **(hp.model_options or {}))
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        self._check_mask_exclude()
        generator = torch.Generator().manual_seed(hp.seed)
        masks = self.draw_initial_masks(generator)
        empty = [name for name, m in masks.items() if not bool(m.any())]
        if empty:
            raise ValueError(f"density={hp.density:g} leaves {len(empty)} masked layer(s) of {hp.arch} with no active "
                             f"weight (first: {empty[0]!r}, {masks[empty[0]].numel()} weights); raise model.density or "
                             "keep such layers dense with model.mask_exclude")
        # the shared dense init w0 before the module's own mask zeroes it (DisPFL Alg. 1 line 2: a federation's
        # client k starts from w0 * m_k, its own mask; see :meth:`shared_initialization`)
        self._dense_init = {n: p.detach().clone() for n, p in self.maskable_parameters().items()}
        self.mask = ModelMask(self.model, masks).attach()
        self._flops = profile_flops(self.model, (in_channels, image_size, image_size))

    def _check_mask_exclude(self) -> None:
        """Refuse a ``mask_exclude`` pattern that matches no Conv/Linear weight (a typo would keep all masked)."""
        names = list(maskable_parameters(self.model))
        unmatched = [p for p in self.hparams.mask_exclude or [] if not any(p in name for name in names)]
        if unmatched:
            raise ValueError(f"mask_exclude pattern(s) {unmatched} match no masked layer of {self.hparams.arch}; "
                             f"its layers: {', '.join(names)}")

    def check_optimizer_range(self, dtype: torch.dtype) -> None:
        """Refuse an ``lr`` or ``weight_decay`` that the parameters' ``dtype`` cannot represent (the optimizer
        step would overflow) or that is below its smallest normal number (a subnormal: no update), naming the value
        and the bound."""
        largest, smallest = torch.finfo(dtype).max, torch.finfo(dtype).tiny
        kind = str(dtype).removeprefix("torch.")
        for name in ("lr", "weight_decay"):
            value = self.hparams[name]
            if value > largest:
                raise ValueError(f"model.{name}={value:g} cannot be represented in the model's {kind} parameters; "
                                 f"allowed: at most {largest:g} (and far less trains)")
            if 0 < value < smallest:
                raise ValueError(f"model.{name}={value:g} is below the smallest normal number of the model's {kind} "
                                 f"parameters ({smallest:g}): every update would round to 0; allowed: at least "
                                 f"{smallest:g}" + (" (or 0)" if name == "weight_decay" else ""))

    def dense_init(self) -> dict[str, Tensor]:
        """The masked weights as the builder initialized them, before the module's own mask zeroed any:
        the masked part of the shared dense initialization w0 (copies on the CPU, named as :attr:`mask`)."""
        return {n: t.clone() for n, t in self._dense_init.items()}

    @torch.no_grad()
    def shared_initialization(self, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The shared dense initialization w0 that every client of a federation is masked from: DisPFL
        Alg. 1 line 2 (and DA-DPFL Alg. 1) starts client k from w0 * m_k, m_k its own mask.

        ``weights`` is the model's floating state (the worker's tensors, on any device and dtype); the
        result holds the same tensors, except that each masked weight takes the dense initial value
        (:meth:`dense_init`) wherever the module's own mask zeroed it: the module's mask is its own at
        its density (a plain ``Trainer`` trains under it) and must not zero entries of w0 that another
        client's mask keeps. Where the module's mask keeps a weight its current value is kept, so a
        client with the module's mask starts exactly from the module's weights.
        """
        assert self.mask is not None, "build the module first"
        out = dict(weights)
        for name, dense in self._dense_init.items():
            current = weights[name]
            keep = self.mask.masks[name].to(current.device)
            out[name] = torch.where(keep, current, dense.to(device=current.device, dtype=current.dtype))
        return out

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

    def draw_initial_masks(self, generator: torch.Generator, density: float | None = None) -> Masks:
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
            self.build_for(dm)

    def check_for(self, datamodule: Any) -> int | None:
        """Before ``datamodule`` loads its data: refuse a model that would be too large for it
        (:func:`~lightning_dfl.models.check_model`: parameter count, the weights' memory), counted for the least
        input it can give (two classes, its :meth:`smallest_input`), so that nothing it would accept is refused; the
        sizes given to this module win. Returns that least parameter count; ``None`` (nothing checked) where the
        data's size is not known before loading."""
        smallest = getattr(datamodule, "smallest_input", lambda: None)()
        if smallest is None or self.model is not None:
            return None
        classes, channels, size = (given if given is not None else least
                                   for given, least in zip(self._requested_spec, (2, *smallest)))
        return check_model(self.hparams.arch, classes, channels, size, **(self.hparams.model_options or {}))

    def build_for(self, datamodule: Any) -> None:
        """:meth:`build` for ``datamodule``'s sizes, naming its data set in a mismatch error."""
        name = getattr(datamodule, "dataset", None)
        data = f"the data set {name}" if isinstance(name, str) else "the data"
        self.build(datamodule.num_classes, datamodule.in_channels, datamodule.image_size, data=data)

    # -- accounting --------------------------------------------------------------------
    def forward_flops(self) -> float:
        """Forward FLOPs per sample at the current mask (Conv/Linear, active weights, 2 per MAC)."""
        assert self._flops is not None and self.mask is not None
        return self._flops.forward_flops(self.mask.masks)

    def density_and_flops(self) -> tuple[float | Tensor, float | Tensor]:
        """The mask's density and the forward FLOPs per sample at it: numbers from one read of its active
        counts on the CPU; on an accelerator 0-dim float64 tensors on it, not waited for
        (:mod:`lightning_dfl.deferred`)."""
        assert self._flops is not None and self.mask is not None
        masks = self.mask.masks
        if not masks or host_reads_are_cheap(next(iter(masks.values())).device):
            counts = active_counts(masks)
            return mask_density(masks, counts), self._flops.forward_flops(counts)
        together = count_active_together(masks)  # on the device, counted once (a few kernels for all layers)
        density = together.sum().to(torch.float64) / sum(m.numel() for m in masks.values())
        return density, self._flops.deferred_forward_flops(dict(zip(masks, together.unbind())))

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
        self._score(batch, "val", self.val_acc)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int = 0) -> None:
        self._score(batch, "test", self.test_acc)

    def _score(self, batch: tuple[Tensor, Tensor], stage: str, accuracy: MulticlassAccuracy) -> None:
        """Log ``{stage}/loss`` and ``{stage}/acc`` of one batch (a plain ``Trainer``'s validation or test)."""
        x, y = batch
        logits = self(x)
        accuracy(logits, y)
        self.log(f"{stage}/loss", F.cross_entropy(logits, y), sync_dist=True)  # each rank's shard, averaged
        self.log(f"{stage}/acc", accuracy, prog_bar=True)

    def predict_step(self, batch: Any, batch_idx: int = 0) -> Tensor:
        """The logits of a batch ``x`` or ``(x, y)`` (the datamodule's loaders give ``(x, y)``)."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)

    @torch.no_grad()
    def evaluate(self, batches: Any) -> tuple[int, int, float]:
        """``(correct, total, summed loss)`` over ``batches`` in eval mode (federated evaluation)."""
        correct, total, loss_sum = self.evaluate_sums(batches)
        return int(correct), total, float(loss_sum)

    @torch.no_grad()
    def evaluate_sums(self, batches: Any) -> tuple[Tensor, int, Tensor]:
        """:meth:`evaluate` without waiting for the device: ``correct`` and the summed loss are 0-dim
        tensors on the batches' device (:mod:`lightning_dfl.deferred`), ``total`` a Python int."""
        was_training = self.training
        self.eval()
        correct: Tensor | None = None
        loss_sum: Tensor | None = None
        total = 0
        for x, y in batches:
            logits = self(x)
            loss = F.cross_entropy(logits.float(), y, reduction="sum").to(accumulator_dtype(y.device))
            hits = (logits.argmax(dim=1) == y).sum()
            correct = hits if correct is None else correct + hits
            loss_sum = loss if loss_sum is None else loss_sum + loss
            total += int(y.numel())
        self.train(was_training)
        if correct is None or loss_sum is None:
            return torch.zeros((), dtype=torch.int64), 0, torch.zeros((), dtype=torch.float64)
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
