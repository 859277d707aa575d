"""The torch architectures themselves, imported by :mod:`edge_sdk.training.nets` on first use.

This module imports torch at its top: nothing may import it eagerly (a
device without torch imports :mod:`edge_sdk.training.nets` and never this). Import
the names from :mod:`edge_sdk.training.nets`, their public home. The classes carry
``__module__ = "edge_sdk.training.nets"`` (set at the bottom): the ONNX exporter
writes ``edge_sdk.training.nets.<class>`` into each node's metadata, and
``models/manifest.json`` pins the shipped files' bytes by sha256.
"""

from __future__ import annotations

from typing import Callable

from ..install import install_hint

try:
    import torch
    from torch import nn
except ImportError as e:  # a device without torch: sketching and ONNX evaluation never come here
    raise ImportError(f"the torch architectures need torch ({install_hint('train')}); sketching and "
                      "evaluate() with ONNX Runtime work without it") from e

__all__ = [
    "ARCHITECTURES",
    "BasicBlock",
    "ConvAutoencoder",
    "DigitsCNN",
    "EncoderOnly",
    "FCAutoencoder",
    "LeNet5",
    "ResNet18",
    "count_params",
]


def count_params(module: nn.Module) -> int:
    """Number of trainable and frozen parameters of ``module``.

    Parameters
    ----------
    module : torch.nn.Module
        Any module.

    Returns
    -------
    int
        Sum of the element counts of ``module.parameters()`` (buffers such as
        BatchNorm running statistics are not counted).
    """
    return int(sum(p.numel() for p in module.parameters()))


class FCAutoencoder(nn.Module):
    """Fully connected autoencoder on flattened images.

    Parameters
    ----------
    in_features : int
        Flattened input size (784 for 28x28, 64 for 8x8).
    hidden : int
        Width of the single hidden layer of encoder and decoder.
    latent : int
        Latent size; the encoder output has no activation.

    Notes
    -----
    Inputs are expected in [0, 1]; the decoder ends with a sigmoid so the
    reconstruction lies in the same range.
    """

    def __init__(self, in_features: int = 784, hidden: int = 50, latent: int = 20) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.hidden = int(hidden)
        self.latent = int(latent)
        self.encoder = nn.Sequential(
            nn.Linear(self.in_features, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, self.latent),
        )
        self.decoder = nn.Sequential(
            nn.Linear(self.latent, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, self.in_features),
            nn.Sigmoid(),
        )

    @property
    def latent_dim(self) -> int:
        """Size of the latent vector."""
        return self.latent

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Latent codes of ``x``.

        Parameters
        ----------
        x : torch.Tensor
            ``(batch, in_features)``, or ``(batch, ...)`` which is flattened.

        Returns
        -------
        torch.Tensor
            ``(batch, latent)``.
        """
        return self.encoder(x.reshape(x.shape[0], -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruction ``(batch, in_features)`` of ``x``."""
        return self.decoder(self.encode(x))


def _down_block(c_in: int, c_out: int) -> list[nn.Module]:
    """Conv2d(k4, s2, p1) -> BatchNorm2d -> ReLU, halving height and width."""
    return [nn.Conv2d(c_in, c_out, 4, stride=2, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]


def _up_block(c_in: int, c_out: int, last: bool = False) -> list[nn.Module]:
    """ConvTranspose2d(k4, s2, p1) -> BatchNorm2d -> ReLU (Sigmoid when ``last``)."""
    act: nn.Module = nn.Sigmoid() if last else nn.ReLU()
    return [nn.ConvTranspose2d(c_in, c_out, 4, stride=2, padding=1), nn.BatchNorm2d(c_out), act]


class ConvAutoencoder(nn.Module):
    """Convolutional autoencoder for 32x32 RGB images.

    Three down blocks 3 -> 12 -> 24 -> 48 channels (32 -> 16 -> 8 -> 4
    pixels), mirrored by three transposed-convolution blocks; the last
    block ends BatchNorm(3) -> Sigmoid. The latent map is 48x4x4 = 768.

    Parameters
    ----------
    channels : tuple of int
        Channel counts from the input to the latent map.
    """

    def __init__(self, channels: tuple[int, ...] = (3, 12, 24, 48)) -> None:
        super().__init__()
        if len(channels) < 2:
            raise ValueError(f"channels needs at least two entries, got {channels!r}")
        self.channels = tuple(int(c) for c in channels)
        down: list[nn.Module] = []
        for c_in, c_out in zip(self.channels[:-1], self.channels[1:]):
            down += _down_block(c_in, c_out)
        up: list[nn.Module] = []
        rev = self.channels[::-1]
        for i, (c_in, c_out) in enumerate(zip(rev[:-1], rev[1:])):
            up += _up_block(c_in, c_out, last=i == len(rev) - 2)
        self.encoder = nn.Sequential(*down)
        self.decoder = nn.Sequential(*up)
        n_down = len(self.channels) - 1
        self.latent_shape = (self.channels[-1], 32 >> n_down, 32 >> n_down)

    @property
    def latent_dim(self) -> int:
        """Size of the flattened latent map (768 for the default channels)."""
        c, h, w = self.latent_shape
        return c * h * w

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Flattened latent codes ``(batch, 768)`` of images ``(batch, 3, 32, 32)``."""
        return torch.flatten(self.encoder(x), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruction ``(batch, 3, 32, 32)`` of ``x``."""
        return self.decoder(self.encoder(x))


class LeNet5(nn.Module):
    """LeNet-5 for 1x28x28 images, returning logits.

    Conv(1->16, k5) tanh maxpool2, Conv(16->32, k5) tanh maxpool2, flatten
    (32x4x4 = 512) -> 120 tanh -> 84 tanh -> ``num_classes``. No softmax is
    applied: pair it with :class:`torch.nn.CrossEntropyLoss`.

    Parameters
    ----------
    in_channels : int
        Image channels.
    num_classes : int
        Number of output logits.

    Notes
    -----
    The parameter names (``features.0.*``, ``features.3.*`` for the two
    convolutions, ``classifier.{0,2,4}.*`` for the dense layers) are those of
    the shipped ``lenet5`` artifact and of the wire format; do not rename the
    submodules. With the trailing dot, ``"features.0."`` and
    ``"features.3."`` each select exactly one layer (see :data:`BASE_LAYERS`).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.in_channels = int(in_channels)
        self.num_classes = int(num_classes)
        self.input_shape = (self.in_channels, 28, 28)
        self.features = nn.Sequential(
            nn.Conv2d(self.in_channels, 16, 5),
            nn.Tanh(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5),
            nn.Tanh(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(512, 120),
            nn.Tanh(),
            nn.Linear(120, 84),
            nn.Tanh(),
            nn.Linear(84, self.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, num_classes)`` of images ``(batch, C, 28, 28)``."""
        return self.classifier(torch.flatten(self.features(x), 1))


class DigitsCNN(nn.Module):
    """A small CNN for scikit-learn's 8x8 digits, returning logits.

    Conv(1->16, k3, p1) ReLU maxpool2 (8 -> 4 pixels), Conv(16->32, k3, p1)
    ReLU maxpool2 (4 -> 2), flatten (32x2x2 = 128) -> Linear(128, 64) ReLU ->
    Linear(64, ``num_classes``). No softmax is applied.

    The layers are direct attributes (``conv1``, ``conv2``, ``fc1``,
    ``fc2``) so that their parameter names (``conv1.weight``, ...) make
    unambiguous prefixes for partial aggregation (see :data:`BASE_LAYERS`).

    Parameters
    ----------
    num_classes : int
        Number of output logits.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.num_classes = int(num_classes)
        self.input_shape = (1, 8, 8)
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, self.num_classes)
        self.pool = nn.MaxPool2d(2)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, num_classes)`` of images ``(batch, 1, 8, 8)``."""
        x = self.pool(self.act(self.conv1(x)))
        x = self.pool(self.act(self.conv2(x)))
        x = self.act(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class EncoderOnly(nn.Module):
    """Expose ``ae.encode`` as ``forward`` (for exporting the encoder alone).

    Parameters
    ----------
    ae : torch.nn.Module
        A module with an ``encode(x)`` method; its parameters are shared,
        not copied.
    """

    def __init__(self, ae: nn.Module) -> None:
        super().__init__()
        if not callable(getattr(ae, "encode", None)):
            raise TypeError(f"{type(ae).__name__} has no encode() method")
        self.ae = ae

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Latent codes of ``x``."""
        return self.ae.encode(x)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and an identity (or 1x1) shortcut.

    Parameters
    ----------
    c_in, c_out : int
        Input and output channels.
    stride : int
        Stride of the first convolution (2 halves height and width); the
        shortcut becomes a strided 1x1 convolution with BatchNorm whenever
        the shape changes.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for small images, returning logits.

    Stem Conv(3x3, stride 1) -> BatchNorm -> ReLU with 64 channels, four
    stages of two :class:`BasicBlock` each (64, 128, 256, 512 channels; the
    last three start with stride 2), global average pooling and one linear
    layer. For 32x32 inputs the last feature map is 4x4.

    Parameters
    ----------
    num_classes : int
        Number of output logits.
    in_channels : int
        Image channels.
    """

    stage_channels = (64, 128, 256, 512)
    blocks_per_stage = (2, 2, 2, 2)

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.num_classes = int(num_classes)
        self.in_channels = int(in_channels)
        self.input_shape = (self.in_channels, 32, 32)
        c0 = self.stage_channels[0]
        self.conv1 = nn.Conv2d(self.in_channels, c0, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c0)
        self.relu = nn.ReLU(inplace=True)
        stages: list[nn.Module] = []
        c_in = c0
        for i, (c_out, n_blocks) in enumerate(zip(self.stage_channels, self.blocks_per_stage)):
            blocks = [BasicBlock(c_in, c_out, stride=1 if i == 0 else 2)]
            blocks += [BasicBlock(c_out, c_out) for _ in range(n_blocks - 1)]
            stages.append(nn.Sequential(*blocks))
            c_in = c_out
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, self.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, num_classes)`` of images ``(batch, C, H, W)``."""
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


#: Architecture name (as written in the manifest) -> constructor.
ARCHITECTURES: dict[str, Callable[[], nn.Module]] = {
    "fc_ae_784_50_20": lambda: FCAutoencoder(784, 50, 20),
    "fc_ae_64_32_16": lambda: FCAutoencoder(64, 32, 16),
    "fc_ae_64_48_20": lambda: FCAutoencoder(64, 48, 20),
    "conv_ae_3_12_24_48": lambda: ConvAutoencoder((3, 12, 24, 48)),
    "lenet5_1x28x28_10": lambda: LeNet5(1, 10),
    "digits_cnn_1x8x8_10": lambda: DigitsCNN(10),
    "resnet18_3x32x32_10": lambda: ResNet18(10, 3),
}


# The public home of these names is edge_sdk.training.nets (see the module docstring).
for _obj in (BasicBlock, ConvAutoencoder, DigitsCNN, EncoderOnly, FCAutoencoder, LeNet5, ResNet18, count_params):
    _obj.__module__ = "edge_sdk.training.nets"
del _obj
