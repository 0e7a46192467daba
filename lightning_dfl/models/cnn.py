"""Small CNNs: PSFL's CIFAR and HAM10000 models and a tiny CNN for 8x8 digits.

* :func:`cnn_cifar`: PSFL Sec. VI-A1, "two 5x5 convolutional layers, each followed by ReLU
  and max pooling, and three fully connected layers"; the widths (64, 64, 384, 192) are those
  of the CNN in the code of Li & Lyu (PSFL's ref. [25], taken from FedDyn).
* :func:`cnn_ham`: PSFL's HAM10000 model, "three 3x3 convolutional layers (with ReLU and max
  pooling) and two fully connected layers with dropout"; the paper gives no widths, these
  (32, 64, 128 channels, 256 hidden units, dropout 0.5) are ours.
* :func:`cnn_digits`: conv3x3(32) -> conv3x3(64) -> 2x2 max-pool -> FC 128 -> FC classes, for
  the 8x8 one-channel digits the project embeds (fast on a CPU, four maskable layers).
"""

from __future__ import annotations

from torch import Tensor, nn


def _conv_out(size: int, kernel: int, padding: int = 0) -> int:
    return size + 2 * padding - kernel + 1


class CifarCNN(nn.Module):
    """conv5x5(64) -> pool -> conv5x5(64) -> pool -> FC 384 -> FC 192 -> FC classes."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        side = _conv_out(_conv_out(image_size, 5) // 2, 5) // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=5), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
            nn.Conv2d(64, 64, kernel_size=5), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, 384), nn.ReLU(inplace=True),
            nn.Linear(384, 192), nn.ReLU(inplace=True),
            nn.Linear(192, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


class HamCNN(nn.Module):
    """Three conv3x3 (32, 64, 128) + ReLU + 2x2 max-pool, then dropout -> FC 256 -> dropout -> FC."""

    def __init__(self, num_classes: int = 7, in_channels: int = 3, image_size: int = 64,
                 hidden: int = 256, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for width in (32, 64, 128):
            layers += [nn.Conv2d(channels, width, kernel_size=3, padding=1), nn.ReLU(inplace=True),
                       nn.MaxPool2d(2, 2)]
            channels = width
        self.features = nn.Sequential(*layers)
        side = image_size // 8
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(128 * side * side, hidden), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


class DigitsCNN(nn.Module):
    """conv3x3(32) -> conv3x3(64) -> 2x2 max-pool -> FC hidden -> FC classes.

    He-normal initialization (fan-out for convs, fan-in for linears, zero biases): with
    PyTorch's default init, plain SGD at lr 0.1 barely moves on a client's few hundred samples.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 8,
                 hidden: int = 128) -> None:
        super().__init__()
        side = image_size // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


def _check_size(model: str, image_size: int, minimum: int, why: str) -> None:
    if image_size < minimum:
        raise ValueError(f"{model} needs image_size >= {minimum} ({why}), got {image_size}")


def cnn_cifar(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> CifarCNN:
    """PSFL's CIFAR CNN (two 5x5 convs, three FC layers); 32x32 in the paper."""
    _check_size("cnn_cifar", image_size, 16, "two unpadded 5x5 convs and two 2x2 max-pools")
    return CifarCNN(num_classes=num_classes, in_channels=in_channels, image_size=image_size)


def cnn_ham(num_classes: int = 7, in_channels: int = 3, image_size: int = 64, *,
            hidden: int = 256, dropout: float = 0.5) -> HamCNN:
    """PSFL's HAM10000 CNN (three 3x3 convs, two FC layers with dropout)."""
    _check_size("cnn_ham", image_size, 8, "three 2x2 max-pools")
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    return HamCNN(num_classes=num_classes, in_channels=in_channels, image_size=image_size,
                  hidden=hidden, dropout=dropout)


def cnn_digits(num_classes: int = 10, in_channels: int = 1, image_size: int = 8, *,
               hidden: int = 128) -> DigitsCNN:
    """A small CNN for the embedded 8x8 digits (the project's default CPU job)."""
    _check_size("cnn_digits", image_size, 2, "one 2x2 max-pool")
    if image_size % 2:
        raise ValueError(f"cnn_digits needs an even image_size (its 2x2 max-pool would drop an odd size's last row "
                         f"and column), got {image_size}")
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    return DigitsCNN(num_classes=num_classes, in_channels=in_channels, image_size=image_size,
                     hidden=hidden)
