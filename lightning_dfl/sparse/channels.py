"""PRISAM's BN channel masks: channel groups, BN-scaling pruning, expansion, physical export.

A *channel group* is a set of feature-map channels that must be kept or dropped together:
the channels normalized by one BatchNorm layer (VGG11-BN; ResNet-20's block-internal
``bn1``), or, in ResNet-20, the residual-added channels of one stage, which the stem's (or the
shortcut's) BN and every block's ``bn2`` write into the same tensor (prisam-notes 8). Each
group names

* ``norms``: its BN layers (all of width ``size``),
* ``producers``: the convs whose *output* channels are the group's channels,
* ``consumers``: the convs (input channels) and the Linear (input features) that read them.

The stem's input and the classifier's output (and its bias) are never masked.

:class:`ChannelMasks` holds one boolean vector per group: PRISAM's BN mask, one bit per group
channel (VGG11-BN: 2752 bits = 344 B; ResNet-20: 448 bits, 336 block-internal and 112 in the
three tied stage groups; prisam-notes 19). :func:`expand` turns it into per-tensor boolean
masks (by ``state_dict`` name) for every parameter and buffer that a channel touches:

* conv ``weight[o, i]`` = ``out[o] and in[i]``; conv ``bias[o]`` = ``out[o]``;
* BN ``weight``, ``bias``, ``running_mean``, ``running_var`` follow ``out``;
* Linear ``weight[:, j]`` = ``in[j // per_channel]`` (``per_channel`` input features per
  channel after the flatten; 1 behind the global average pool of both models).

Untouched tensors (the stem conv's input dim is part of its mask, but e.g. the classifier's
bias, BN's ``num_batches_tracked``) are *absent* from the expansion, which every consumer of
weight masks in this package reads as dense (``ModelMask`` masks only what it is given,
``FlopsProfile`` counts absent layers dense).

Masked model = compact model. With the expanded masks applied (:func:`apply_channel_masks_`)
a dropped channel's conv filter, conv bias, BN gamma and beta are 0, so its BN output is
exactly ``0 * x_hat + 0 = 0`` whatever the running statistics (in train and eval mode), its
ReLU output is 0, the residual sum of a tied group adds only zeros, and every consumer's input
slice for it is 0 as well. The running statistics of dropped channels are therefore
irrelevant to the output; :func:`apply_channel_masks_` sets them to BatchNorm's reset values
(mean 0, var 1) so that they stay finite and neutral, and :func:`inflate_state` does the same.
:func:`export` builds the physically smaller network (``index_select`` per group) whose
eval-mode logits equal the masked model's and whose parameter and MAC counts equal the masked
counts (:func:`masked_param_count`, :func:`masked_macs`).

Only the project's ``vgg11(norm="batch")`` (:class:`~lightning_dfl.models.vgg.CifarVGG`) and
``resnet20`` (:class:`~lightning_dfl.models.resnet.CifarResNet`, BatchNorm) are supported; the
groups are read from their known builder structure, which is validated, and anything else
raises ``ValueError``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock

from lightning_dfl.models.resnet import CifarResNet
from lightning_dfl.models.vgg import CifarVGG
from lightning_dfl.sparse.flops import FlopsProfile, profile_flops

__all__ = [
    "ChannelGroup", "ChannelMasks", "apply_channel_masks_", "channel_groups", "channel_scores", "expand",
    "export", "inflate_state", "kept_count", "mask_state_", "masked_macs", "masked_param_count",
    "state_channel_scores",
]

#: Tolerance of ``floor(rho * C)`` against binary floating point (0.29 * 100 = 28.999...).
_FLOOR_EPS = 1e-9
#: Names of the BN buffers that follow a channel.
_BN_BUFFERS = ("running_mean", "running_var")


@dataclass(frozen=True)
class ChannelGroup:
    """Channels kept or dropped together (see the module docstring).

    ``name`` is the group's key in :class:`ChannelMasks`: the BN layer's module name for a
    one-BN group (``"features.1"``, ``"layer2.0.bn1"``), ``"layerS.residual"`` for ResNet
    stage ``S``'s tied residual channels. Layers are module names as in ``named_modules``.
    """

    name: str
    size: int
    norms: tuple[str, ...]
    producers: tuple[str, ...]
    consumers: tuple[str, ...]

    @property
    def tied(self) -> bool:
        return len(self.norms) > 1


# -- groups -------------------------------------------------------------------------------
def _unsupported(model: nn.Module, why: str) -> ValueError:
    return ValueError(f"channel masks are defined for the project's vgg11(norm='batch') and resnet20 "
                      f"(BatchNorm) only; got {type(model).__name__}: {why}")


def _check_bn(model: nn.Module, name: str, module: nn.Module, channels: int) -> None:
    if type(module) is not nn.BatchNorm2d:
        raise _unsupported(model, f"{name} is {type(module).__name__}, expected BatchNorm2d "
                                  f"(build the model with norm='batch')")
    if not module.affine or not module.track_running_stats:
        raise _unsupported(model, f"{name} must be affine with running statistics")
    if module.num_features != channels:
        raise _unsupported(model, f"{name} normalizes {module.num_features} channels, its conv "
                                  f"produces {channels}")


def _check_conv(model: nn.Module, name: str, module: nn.Module) -> nn.Conv2d:
    if type(module) is not nn.Conv2d or module.groups != 1:
        raise _unsupported(model, f"{name} is not an ungrouped Conv2d")
    return module


def _vgg_groups(model: CifarVGG) -> list[ChannelGroup]:
    layers = list(model.features.named_children())
    convs: list[tuple[str, str, int]] = []  # (conv name, bn name, channels)
    for k, (name, module) in enumerate(layers):
        if isinstance(module, nn.Conv2d):
            conv = _check_conv(model, f"features.{name}", module)
            if k + 2 >= len(layers) or not isinstance(layers[k + 2][1], nn.ReLU):
                raise _unsupported(model, f"features.{name} is not followed by a norm layer and ReLU")
            bn_name = f"features.{layers[k + 1][0]}"
            _check_bn(model, bn_name, layers[k + 1][1], conv.out_channels)
            if convs and convs[-1][2] != conv.in_channels:
                raise _unsupported(model, f"features.{name} reads {conv.in_channels} channels, "
                                          f"the previous conv writes {convs[-1][2]}")
            convs.append((f"features.{name}", bn_name, conv.out_channels))
        elif not isinstance(module, (nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d)):
            raise _unsupported(model, f"unexpected layer features.{name} ({type(module).__name__})")
    if not convs:
        raise _unsupported(model, "no conv layers")
    classifier = list(model.classifier.named_children())
    if len(classifier) != 1 or type(classifier[0][1]) is not nn.Linear:
        raise _unsupported(model, "the classifier must be a single Linear")
    if not isinstance(model.avgpool, nn.AdaptiveAvgPool2d):
        raise _unsupported(model, "expected global average pooling before the classifier")
    linear_name = f"classifier.{classifier[0][0]}"
    groups = []
    for k, (conv, bn, channels) in enumerate(convs):
        consumer = convs[k + 1][0] if k + 1 < len(convs) else linear_name
        groups.append(ChannelGroup(bn, channels, (bn,), (conv,), (consumer,)))
    return groups


def _resnet_groups(model: CifarResNet) -> list[ChannelGroup]:
    _check_conv(model, "conv1", model.conv1)
    _check_bn(model, "bn1", model.bn1, model.conv1.out_channels)
    if type(model.fc) is not nn.Linear or not isinstance(model.avgpool, nn.AdaptiveAvgPool2d):
        raise _unsupported(model, "expected global average pooling and a Linear fc")
    groups: list[ChannelGroup] = []
    # The residual stream entering the next stage: (its BNs, producers, consumers so far).
    width = model.conv1.out_channels
    norms, producers, consumers = ["bn1"], ["conv1"], []
    stage_name = None
    for s, stage in enumerate((model.layer1, model.layer2, model.layer3), start=1):
        stage_prefix = f"layer{s}"
        for i, block in enumerate(stage):
            p = f"{stage_prefix}.{i}"
            if type(block) is not BasicBlock:
                raise _unsupported(model, f"{p} is {type(block).__name__}, expected torchvision BasicBlock")
            conv1 = _check_conv(model, f"{p}.conv1", block.conv1)
            conv2 = _check_conv(model, f"{p}.conv2", block.conv2)
            _check_bn(model, f"{p}.bn1", block.bn1, conv1.out_channels)
            _check_bn(model, f"{p}.bn2", block.bn2, conv2.out_channels)
            if conv1.in_channels != width or conv2.in_channels != conv1.out_channels:
                raise _unsupported(model, f"{p}'s channel counts do not chain")
            consumers.append(f"{p}.conv1")
            if block.downsample is not None:
                ds = list(block.downsample)
                if len(ds) != 2:
                    raise _unsupported(model, f"{p}.downsample must be conv1x1 + norm")
                ds_conv = _check_conv(model, f"{p}.downsample.0", ds[0])
                _check_bn(model, f"{p}.downsample.1", ds[1], ds_conv.out_channels)
                if ds_conv.in_channels != width or ds_conv.out_channels != conv2.out_channels:
                    raise _unsupported(model, f"{p}.downsample's channel counts do not match")
                consumers.append(f"{p}.downsample.0")
                # The incoming stream ends here; the block's output starts a new tied group.
                groups.append(ChannelGroup(stage_name or "stem", width, tuple(norms), tuple(producers),
                                           tuple(consumers)))
                width = conv2.out_channels
                norms, producers, consumers = [f"{p}.downsample.1"], [f"{p}.downsample.0"], []
            elif conv2.out_channels != width:
                raise _unsupported(model, f"{p} changes the width without a downsample")
            stage_name = f"{stage_prefix}.residual"
            groups.append(ChannelGroup(f"{p}.bn1", conv1.out_channels, (f"{p}.bn1",), (f"{p}.conv1",),
                                       (f"{p}.conv2",)))
            norms.append(f"{p}.bn2")
            producers.append(f"{p}.conv2")
    if model.fc.in_features != width:
        raise _unsupported(model, f"fc reads {model.fc.in_features} features, the last stage writes {width}")
    consumers.append("fc")
    groups.append(ChannelGroup(stage_name, width, tuple(norms), tuple(producers), tuple(consumers)))
    return groups


def channel_groups(model: nn.Module) -> tuple[ChannelGroup, ...]:
    """The channel groups of ``vgg11(norm="batch")`` or ``resnet20``, in bit order.

    VGG11-BN: one group per BN layer (8 groups, 2752 channels). ResNet-20: per block its
    ``bn1`` group (9, 336 channels), and per stage the tied residual group (3, 112 channels)
    ``"layerS.residual"``: stage 1's holds the stem's ``bn1`` and the blocks' ``bn2``, stages 2
    and 3's the shortcut's BN and the blocks' ``bn2``. The bit order (:meth:`ChannelMasks.
    to_vector`) is this tuple's order: VGG in layer order; ResNet block-internal groups in
    block order with each stage's tied group after its stage's last block.
    Raises ``ValueError`` for any other architecture (or a GroupNorm variant).
    """
    if isinstance(model, CifarVGG):
        groups = _vgg_groups(model)
    elif isinstance(model, CifarResNet):
        groups = _resnet_groups(model)
    else:
        raise _unsupported(model, "not a CifarVGG or CifarResNet")
    if len({g.name for g in groups}) != len(groups):  # pragma: no cover - guards the builders above
        raise RuntimeError(f"duplicate channel group names: {[g.name for g in groups]}")
    return tuple(groups)


def _roles(groups: tuple[ChannelGroup, ...]) -> dict[str, dict[str, ChannelGroup]]:
    """module name -> {"out": group, "in": group} (either may be missing)."""
    roles: dict[str, dict[str, ChannelGroup]] = {}
    for group in groups:
        for name in group.norms + group.producers:
            roles.setdefault(name, {})["out"] = group
        for name in group.consumers:
            roles.setdefault(name, {})["in"] = group
    return roles


# -- masks --------------------------------------------------------------------------------
def kept_count(channels: int, rho: float) -> int:
    """Channels kept of ``channels`` at pruning ratio ``rho``: ``C - floor(rho C)`` (>= 1)."""
    rho = _check_rho(rho)
    if channels < 1:
        raise ValueError(f"channels must be >= 1, got {channels!r}")
    return channels - math.floor(rho * channels + _FLOOR_EPS)


def _check_rho(rho: float) -> float:
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0.0 <= float(rho) < 1.0:
        raise ValueError(f"the pruning ratio rho must be a number in [0, 1), got {rho!r}")
    return float(rho)


def channel_scores(model: nn.Module, groups: tuple[ChannelGroup, ...] | None = None) -> dict[str, Tensor]:
    """Per group the channel importance PRISAM ranks by: ``|gamma|`` of the group's BN, and for
    a tied group the mean ``|gamma|`` over its BNs (prisam-notes 8; the sum ranks the same).

    Float64 on the CPU, detached. Raises ``ValueError`` if a gamma is not finite.
    """
    groups = channel_groups(model) if groups is None else groups
    modules = dict(model.named_modules())
    return state_channel_scores({f"{n}.weight": modules[n].weight for g in groups for n in g.norms}, groups)


def state_channel_scores(state: Mapping[str, Tensor], groups: tuple[ChannelGroup, ...]) -> dict[str, Tensor]:
    """:func:`channel_scores` read from a state dict (``"<bn>.weight"`` entries) instead of a model:
    e.g. an aggregated model before it is loaded (PRISAM re-prunes by the averaged ``|gamma|``)."""
    scores = {}
    for group in groups:
        gammas = torch.stack([state[f"{n}.weight"].detach().to("cpu", torch.float64).abs() for n in group.norms])
        if not torch.isfinite(gammas).all():
            raise ValueError(f"non-finite BN scaling factors in channel group {group.name!r}")
        scores[group.name] = gammas.mean(dim=0)
    return scores


class ChannelMasks(Mapping[str, Tensor]):
    """PRISAM's BN mask: channel group name -> boolean vector of the group's width (CPU).

    A read-only mapping in bit order (the order of :func:`channel_groups`). Build it with
    :meth:`from_bn_scaling`, :meth:`ones`, :meth:`from_vector`, or from a dict of vectors.
    """

    def __init__(self, masks: Mapping[str, Tensor]) -> None:
        self._masks: dict[str, Tensor] = {}
        for name, mask in masks.items():
            mask = torch.as_tensor(mask)
            if mask.dim() != 1:
                raise ValueError(f"channel mask {name!r} must be 1-D, got shape {tuple(mask.shape)}")
            if mask.dtype != torch.bool:
                if not bool(((mask == 0) | (mask == 1)).all()):
                    raise ValueError(f"channel mask {name!r} must be boolean or 0/1")
                mask = mask != 0
            self._masks[name] = mask.detach().to("cpu").clone()

    # -- construction -------------------------------------------------------------------
    @classmethod
    def ones(cls, model: nn.Module) -> "ChannelMasks":
        """Every channel kept (the dense model)."""
        return cls({g.name: torch.ones(g.size, dtype=torch.bool) for g in channel_groups(model)})

    @classmethod
    def from_bn_scaling(cls, model: nn.Module, rho: float) -> "ChannelMasks":
        """Per group keep the ``C - floor(rho C)`` channels of largest score (prisam-notes 6).

        The score is :func:`channel_scores` (``|gamma|``; the mean over a tied group's BNs);
        ties are broken by channel index (the lower index is kept). ``rho`` in [0, 1).
        """
        groups = channel_groups(model)
        return cls.from_scores(groups, channel_scores(model, groups), rho)

    @classmethod
    def from_scores(cls, groups: tuple[ChannelGroup, ...], scores: Mapping[str, Tensor], rho: float) -> "ChannelMasks":
        """Per group keep the ``C - floor(rho C)`` channels of largest ``scores[group]`` (ties by
        index); :meth:`from_bn_scaling` with scores from :func:`state_channel_scores`."""
        rho = _check_rho(rho)
        masks = {}
        for group in groups:
            order = torch.argsort(-scores[group.name], stable=True)  # descending, ties by index
            keep = torch.zeros(group.size, dtype=torch.bool)
            keep[order[:kept_count(group.size, rho)]] = True
            masks[group.name] = keep
        return cls(masks)

    @classmethod
    def from_vector(cls, model: nn.Module, vector: Tensor) -> "ChannelMasks":
        """Split a flat bit vector (as :meth:`to_vector` writes it) into the model's groups."""
        groups = channel_groups(model)
        vector = torch.as_tensor(vector).reshape(-1)
        total = sum(g.size for g in groups)
        if vector.numel() != total:
            raise ValueError(f"the model has {total} channel bits, the vector {vector.numel()}")
        return cls(dict(zip([g.name for g in groups], torch.split(vector, [g.size for g in groups]))))

    # -- views ----------------------------------------------------------------------------
    def to_vector(self) -> Tensor:
        """All bits concatenated in group order (the mask devices exchange)."""
        return torch.cat(list(self._masks.values())) if self._masks else torch.zeros(0, dtype=torch.bool)

    @property
    def channel_count(self) -> int:
        """Number of mask bits: the channels of all groups (VGG11-BN 2752, ResNet-20 448)."""
        return sum(m.numel() for m in self._masks.values())

    bits = channel_count

    @property
    def nbytes(self) -> int:
        """Bytes of the mask packed 8 bits a byte (VGG11-BN: 344)."""
        return math.ceil(self.channel_count / 8)

    def num_kept(self) -> int:
        return sum(int(m.sum()) for m in self._masks.values())

    def kept_indices(self, name: str) -> Tensor:
        """The kept channels of group ``name`` in increasing order (int64)."""
        return torch.nonzero(self._masks[name], as_tuple=False).flatten()

    def validate(self, model: nn.Module) -> tuple[ChannelGroup, ...]:
        """Check the masks name exactly the model's groups with their widths; return the groups."""
        groups = channel_groups(model)
        expected = {g.name: g.size for g in groups}
        if set(expected) != set(self._masks):
            raise ValueError(f"channel masks name groups {sorted(self._masks)}, the model has "
                             f"{sorted(expected)}")
        for name, size in expected.items():
            if self._masks[name].numel() != size:
                raise ValueError(f"channel mask {name!r} has {self._masks[name].numel()} bits, "
                                 f"the group has {size} channels")
        return groups

    def __getitem__(self, name: str) -> Tensor:
        return self._masks[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._masks)

    def __len__(self) -> int:
        return len(self._masks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return set(self) == set(other) and all(torch.equal(self[k], torch.as_tensor(other[k]).bool())
                                               for k in self)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChannelMasks(groups={len(self)}, kept={self.num_kept()}/{self.channel_count})"


# -- expansion ------------------------------------------------------------------------------
def _linear_per_channel(name: str, linear: nn.Linear, channels: int) -> int:
    if linear.in_features % channels:
        raise ValueError(f"{name} reads {linear.in_features} features, not a multiple of the "
                         f"{channels} channels before the flatten")
    return linear.in_features // channels


def expand(model: nn.Module, channel_masks: Mapping[str, Tensor], *,
           include_buffers: bool = True) -> dict[str, Tensor]:
    """Per-tensor boolean masks (by ``state_dict`` name) of every tensor a channel touches.

    See the module docstring for the rules. Masks lie on their tensor's device. Tensors no
    channel touches are absent (read as dense). ``include_buffers=False`` drops the BN
    running statistics, giving exactly the parameter masks that
    :class:`~lightning_dfl.sparse.masks.ModelMask` accepts; keep them for aggregation (their
    running statistics are averaged over their keepers, prisam-notes 7).
    """
    masks = channel_masks if isinstance(channel_masks, ChannelMasks) else ChannelMasks(channel_masks)
    groups = masks.validate(model)
    modules = dict(model.named_modules())
    out: dict[str, Tensor] = {}
    for name, role in _roles(groups).items():
        module = modules[name]
        device = module.weight.device
        o = masks[role["out"].name].to(device) if "out" in role else None
        i = masks[role["in"].name].to(device) if "in" in role else None
        if isinstance(module, nn.Conv2d):
            rows = o if o is not None else torch.ones(module.out_channels, dtype=torch.bool, device=device)
            cols = i if i is not None else torch.ones(module.in_channels, dtype=torch.bool, device=device)
            out[f"{name}.weight"] = (rows[:, None] & cols[None, :])[:, :, None, None].expand_as(module.weight).clone()
            if module.bias is not None and o is not None:
                out[f"{name}.bias"] = o.clone()
        elif isinstance(module, nn.BatchNorm2d):
            for tensor in ("weight", "bias") + (_BN_BUFFERS if include_buffers else ()):
                out[f"{name}.{tensor}"] = o.clone()
        elif isinstance(module, nn.Linear):
            per = _linear_per_channel(name, module, i.numel())
            cols = i.repeat_interleave(per)
            out[f"{name}.weight"] = cols[None, :].expand_as(module.weight).clone()
        else:  # pragma: no cover - channel_groups admits only these types
            raise TypeError(f"unexpected layer {name}: {type(module).__name__}")
    return out


@torch.no_grad()
def apply_channel_masks_(model: nn.Module, channel_masks: Mapping[str, Tensor]) -> nn.Module:
    """Zero every parameter entry of a dropped channel in place; reset its BN statistics.

    Dropped channels get running mean 0 and running variance 1 (BatchNorm's reset values;
    any finite values give the same output, see the module docstring). Returns ``model``.
    """
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    mask_state_(model, state, channel_masks)
    return model


@torch.no_grad()
def mask_state_(model: nn.Module, state: Mapping[str, Tensor], channel_masks: Mapping[str, Tensor]) -> None:
    """:func:`apply_channel_masks_` on ``state`` (tensors by ``model``'s ``state_dict`` names, on any
    device; e.g. an aggregated model before it is loaded): dropped entries 0, dropped BN variances 1."""
    for name, mask in expand(model, channel_masks, include_buffers=True).items():
        tensor = state[name]
        tensor.masked_fill_(~mask.to(tensor.device), 1.0 if name.endswith(".running_var") else 0.0)


# -- counts -------------------------------------------------------------------------------
def masked_param_count(model: nn.Module, channel_masks: Mapping[str, Tensor]) -> int:
    """Parameters of the masked model that are active (= the exported model's parameter count)."""
    expanded = expand(model, channel_masks, include_buffers=False)
    return sum(int(expanded[n].sum()) if n in expanded else p.numel() for n, p in model.named_parameters())


def masked_macs(model: nn.Module, channel_masks: Mapping[str, Tensor], input_shape: tuple[int, ...] | None = None,
                *, profile: FlopsProfile | None = None) -> int:
    """Per-sample forward multiply-adds over the active Conv/Linear weights.

    Give one sample's ``input_shape`` (e.g. ``(3, 32, 32)``) or a ready ``profile`` of the
    model (:func:`~lightning_dfl.sparse.flops.profile_flops`). Equals the exported model's
    dense MACs (VGG11-BN, CIFAR, rho = 0.5: 38.6 M).
    """
    if profile is None:
        if input_shape is None:
            raise ValueError("give input_shape or profile")
        profile = profile_flops(model, input_shape)
    expanded = expand(model, channel_masks, include_buffers=False)
    return profile.forward_macs({n: m for n, m in expanded.items() if n in profile.layers})


# -- export / inflate -----------------------------------------------------------------------
def _kept(masks: ChannelMasks, role: dict[str, ChannelGroup], key: str, size: int, device) -> Tensor:
    if key in role:
        return masks.kept_indices(role[key].name).to(device)
    return torch.arange(size, device=device)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


@torch.no_grad()
def export(model: nn.Module, channel_masks: Mapping[str, Tensor]) -> nn.Module:
    """A physically smaller copy of ``model`` holding only the kept channels.

    Every conv, BN and Linear a group touches is replaced by a smaller layer of the same
    type whose tensors are ``index_select`` s of the originals (kept channels in increasing
    order); module names and the forward are unchanged, so :func:`channel_groups` and
    ``profile_flops`` work on the result. In eval mode its logits equal those of the masked
    model (:func:`apply_channel_masks_`, or any model whose expanded entries are zero) up to
    float rounding; its parameter count and MACs equal :func:`masked_param_count` and
    :func:`masked_macs`. ``model`` is not modified; the copy keeps its device, dtype and
    training mode. Raises ``ValueError`` if a group keeps no channel.
    """
    masks = channel_masks if isinstance(channel_masks, ChannelMasks) else ChannelMasks(channel_masks)
    groups = masks.validate(model)
    empty = [g.name for g in groups if not bool(masks[g.name].any())]
    if empty:
        raise ValueError(f"cannot export: channel groups {empty} keep no channel")
    compact = copy.deepcopy(model)
    modules = dict(compact.named_modules())
    for name, role in _roles(groups).items():
        old = modules[name]
        device, dtype = old.weight.device, old.weight.dtype
        if isinstance(old, nn.Conv2d):
            o = _kept(masks, role, "out", old.out_channels, device)
            i = _kept(masks, role, "in", old.in_channels, device)
            new = nn.Conv2d(i.numel(), o.numel(), old.kernel_size, stride=old.stride, padding=old.padding,
                            dilation=old.dilation, bias=old.bias is not None, padding_mode=old.padding_mode,
                            device=device, dtype=dtype)
            new.weight.copy_(old.weight.index_select(0, o).index_select(1, i))
            if old.bias is not None:
                new.bias.copy_(old.bias.index_select(0, o))
        elif isinstance(old, nn.BatchNorm2d):
            o = _kept(masks, role, "out", old.num_features, device)
            new = nn.BatchNorm2d(o.numel(), eps=old.eps, momentum=old.momentum, affine=True,
                                 track_running_stats=True, device=device, dtype=dtype)
            for tensor in ("weight", "bias") + _BN_BUFFERS:
                getattr(new, tensor).copy_(getattr(old, tensor).index_select(0, o))
            new.num_batches_tracked.copy_(old.num_batches_tracked)
        else:  # nn.Linear, consumer only
            per = _linear_per_channel(name, old, masks[role["in"].name].numel())
            i = (_kept(masks, role, "in", 0, device)[:, None] * per
                 + torch.arange(per, device=device)[None, :]).flatten()
            new = nn.Linear(i.numel(), old.out_features, bias=old.bias is not None, device=device, dtype=dtype)
            new.weight.copy_(old.weight.index_select(1, i))
            if old.bias is not None:
                new.bias.copy_(old.bias)
        new.train(old.training)
        _set_submodule(compact, name, new)
    return compact


@torch.no_grad()
def inflate_state(compact_state: Mapping[str, Tensor], model: nn.Module,
                  channel_masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The full-shape ``state_dict`` of a compact model exported from ``model``'s architecture.

    Kept entries come from ``compact_state`` (e.g. a peer's published ``export(...).state_dict()``),
    dropped parameter entries are 0 and dropped BN statistics 0 (mean) / 1 (var); tensors no
    channel touches are copied as they are. ``model`` supplies only the architecture and the
    target shapes, devices and dtypes. Loading the result into ``model`` gives the masked model
    of the peer: ``export`` of it equals the compact model.
    """
    masks = channel_masks if isinstance(channel_masks, ChannelMasks) else ChannelMasks(channel_masks)
    groups = masks.validate(model)
    roles = _roles(groups)
    modules = dict(model.named_modules())
    target = model.state_dict()
    missing = sorted(set(target) - set(compact_state))
    if missing:
        raise ValueError(f"compact_state lacks {missing}")
    full: dict[str, Tensor] = {}
    for key, like in target.items():
        layer, _, tensor = key.rpartition(".")
        src = compact_state[key].to(device=like.device, dtype=like.dtype)
        role = roles.get(layer)
        if role is None or tensor == "num_batches_tracked":
            if src.shape != like.shape:
                raise ValueError(f"compact_state[{key!r}] has shape {tuple(src.shape)}, expected "
                                 f"{tuple(like.shape)}")
            full[key] = src.clone()
            continue
        module = modules[layer]
        fill = 1.0 if tensor == "running_var" else 0.0
        dst = torch.full_like(like, fill)
        if isinstance(module, nn.Linear):
            if tensor == "bias":
                dst.copy_(src)
            else:
                per = _linear_per_channel(layer, module, masks[role["in"].name].numel())
                i = (masks.kept_indices(role["in"].name).to(like.device)[:, None] * per
                     + torch.arange(per, device=like.device)[None, :]).flatten()
                dst[:, i] = src
        else:
            size_out = like.shape[0]
            o = _kept(masks, role, "out", size_out, like.device)
            if tensor == "weight" and isinstance(module, nn.Conv2d):
                i = _kept(masks, role, "in", like.shape[1], like.device)
                dst[o[:, None], i[None, :]] = src
            else:
                dst[o] = src
        full[key] = dst
    return full
