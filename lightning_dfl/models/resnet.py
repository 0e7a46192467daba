"""CIFAR-style residual networks built from torchvision's blocks.

* :func:`resnet18`: the ResNet18 that DisPFL and DA-DPFL train on CIFAR (torchvision's
  ``ResNet(BasicBlock, [2, 2, 2, 2])`` with a 3x3 stride-1 stem, no max-pool, and GroupNorm
  with 32 groups in place of BatchNorm). About 11.2M parameters and 0.556 GMAC per 32x32 image.
* :func:`resnet20`: He et al.'s CIFAR ResNet-20 (3 stages of 3 basic blocks, 16/32/64
  channels) with BatchNorm, as PRISAM prunes it by BN channel masks.

Parameter names follow torchvision: ``conv1``, ``bn1``, ``layerN.i.conv1``,
``layerN.0.downsample.0`` (the 1x1 shortcut conv) and ``fc`` (the classifier).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, ResNet, conv1x1

NORMS = ("group", "batch")


def make_norm(norm: str, num_groups: int = 32, channels: tuple[int, ...] = ()) -> Callable[[int], nn.Module]:
    """A picklable ``channels -> norm layer`` factory: GroupNorm(num_groups) or BatchNorm2d.

    ``channels`` lists the channel counts the factory will be called with; for GroupNorm
    ``num_groups`` must divide each of them.
    """
    if norm == "batch":
        return nn.BatchNorm2d
    if norm != "group":
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    bad = sorted({c for c in channels if c % num_groups})
    if bad:
        raise ValueError(f"num_groups={num_groups} must divide every normalized channel count "
                         f"{sorted(set(channels))}; it does not divide {bad}")
    return partial(nn.GroupNorm, num_groups)


def resnet18(num_classes: int = 10, in_channels: int = 3, image_size: int = 32, *,
             norm: str = "group", num_groups: int = 32) -> ResNet:
    """CIFAR ResNet18 of DisPFL / DA-DPFL: 3x3 stride-1 stem, no max-pool, GroupNorm(32) by default.

    ``norm="batch"`` gives the BatchNorm variant. Any ``image_size`` >= 1 works (global
    average pooling before the classifier); the published setting is 32.
    """
    if image_size < 1:
        raise ValueError(f"resnet18 needs image_size >= 1, got {image_size}")
    norm_layer = make_norm(norm, num_groups, (64, 128, 256, 512))
    model = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, norm_layer=norm_layer)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


class CifarResNet(nn.Module):
    """He et al.'s CIFAR ResNet (depth 6n+2): a 3x3 stem, three stages of ``n`` torchvision
    :class:`BasicBlock` s with 16, 32 and 64 channels, global average pooling and ``fc``.

    Downsampling shortcuts are 1x1 conv + norm (option B), so every conv is followed by a
    norm layer whose scaling factors PRISAM can mask.
    """

    def __init__(self, blocks_per_stage: int = 3, num_classes: int = 10, in_channels: int = 3,
                 norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = norm_layer(16)
        self.relu = nn.ReLU(inplace=True)
        inplanes = 16
        stages = []
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            blocks = []
            for i in range(blocks_per_stage):
                s = stride if i == 0 else 1
                downsample = None
                if s != 1 or inplanes != planes:
                    downsample = nn.Sequential(conv1x1(inplanes, planes, s), norm_layer(planes))
                blocks.append(BasicBlock(inplanes, planes, s, downsample, norm_layer=norm_layer))
                inplanes = planes
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.avgpool(x).flatten(1))


def resnet20(num_classes: int = 10, in_channels: int = 3, image_size: int = 32, *,
             norm: str = "batch", num_groups: int = 8) -> CifarResNet:
    """CIFAR ResNet-20 (3 x 3 basic blocks, BatchNorm by default), PRISAM's SVHN model."""
    if image_size < 1:
        raise ValueError(f"resnet20 needs image_size >= 1, got {image_size}")
    norm_layer = make_norm(norm, num_groups, (16, 32, 64))
    return CifarResNet(3, num_classes=num_classes, in_channels=in_channels, norm_layer=norm_layer)
