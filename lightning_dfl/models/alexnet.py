"""AlexNet for small images (DA-DPFL's HAM10000 model, 64x64 inputs).

The layout of DA-DPFL's code: five 3x3 convs (64, 192, 384, 256, 256; the first with
stride 2) with three 2x2 max-pools, adaptive average pooling to 2x2, and a classifier
Dropout(0.5) -> Linear(1024, 4096) -> ReLU -> Dropout(0.5) -> Linear(4096, 4096) -> ReLU ->
Linear(4096, num_classes). No normalization layers.
"""

from __future__ import annotations

from torch import Tensor, nn

#: The smallest input side for which the stride-2 stem and three max-pools leave >= 1 pixel.
MIN_IMAGE_SIZE = 16


class SmallAlexNet(nn.Module):
    """AlexNet with 3x3 kernels for 16-64 pixel inputs."""

    def __init__(self, num_classes: int = 7, in_channels: int = 3, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(64, 192, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(256 * 2 * 2, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


def alexnet(num_classes: int = 7, in_channels: int = 3, image_size: int = 64, *,
            dropout: float = 0.5) -> SmallAlexNet:
    """DA-DPFL's AlexNet (HAM10000 at 64x64); any ``image_size`` >= 16 works."""
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"alexnet needs image_size >= {MIN_IMAGE_SIZE} (a stride-2 stem and three "
                         f"2x2 max-pools), got {image_size}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    return SmallAlexNet(num_classes=num_classes, in_channels=in_channels, dropout=dropout)
