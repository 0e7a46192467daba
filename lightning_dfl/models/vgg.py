"""CIFAR VGG11 as DisPFL and DA-DPFL train it on CIFAR-100.

torchvision's configuration "A" (8 3x3 convs with bias, 5 max-pools), each conv followed by a
norm layer (GroupNorm with 32 groups by default, as the authors' code; ``norm="batch"`` for
PRISAM's BN-masked VGG11) and ReLU, then a single ``Linear(512, num_classes)`` classifier,
as the authors' code. Weights are initialised as in the authors' code (Kaiming fan-out for
convs, N(0, 0.01) for the classifier).
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models.vgg import cfgs

from lightning_dfl.models.resnet import make_norm

#: The smallest input side that survives VGG's five 2x2 max-pools.
MIN_IMAGE_SIZE = 32


class CifarVGG(nn.Module):
    """VGG features for small images, global average pooling and one linear classifier."""

    def __init__(self, cfg: list[int | str], num_classes: int = 10, in_channels: int = 3,
                 norm: str = "group", num_groups: int = 32) -> None:
        super().__init__()
        norm_layer = make_norm(norm, num_groups, tuple(v for v in cfg if isinstance(v, int)))
        layers: list[nn.Module] = []
        channels = in_channels
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(channels, int(v), kernel_size=3, padding=1), norm_layer(int(v)),
                           nn.ReLU(inplace=True)]
                channels = int(v)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))  # a no-op at 32x32, where the map is 1x1
        self.classifier = nn.Sequential(nn.Linear(channels, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.GroupNorm, nn.BatchNorm2d)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


def vgg11(num_classes: int = 100, in_channels: int = 3, image_size: int = 32, *,
          norm: str = "group", num_groups: int = 32) -> CifarVGG:
    """CIFAR VGG11 (configuration "A"), GroupNorm(32) by default, ``norm="batch"`` for PRISAM."""
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"vgg11 needs image_size >= {MIN_IMAGE_SIZE} (five 2x2 max-pools), "
                         f"got {image_size}")
    return CifarVGG(cfgs["A"], num_classes=num_classes, in_channels=in_channels, norm=norm,
                    num_groups=num_groups)
