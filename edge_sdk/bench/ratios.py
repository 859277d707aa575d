"""The paper's Figure 6: how many sketches one local training epoch costs (epoch seconds / sketch seconds).

Prigent et al. measured on a Raspberry Pi 4: the sketch costs 4x less than one
LeNet-5 epoch (MNIST) and 115x less than one ResNet-18 epoch (CIFAR-10). Each
architecture is compared with the encoder of its data: LeNet-5 with the 28x28
encoder, ResNet-18 with the 3x32x32 one, DigitsCNN with the digits one. The
epoch is scaled to the sketch's sample count (an epoch's time grows with its
samples), so both figures are for the same samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

from .results import Ratio, StageTiming, TrainTiming

__all__ = ["PAIRS", "figure6_ratios"]

#: Architecture -> (the encoder of its data, the paper's ratio on a Raspberry Pi 4 or None).
PAIRS: Mapping[str, tuple[str, Optional[float]]] = {
    "lenet5_1x28x28_10": ("fmnist_fc_encoder", 4.0),
    "resnet18_3x32x32_10": ("conv_ae_encoder", 115.0),
    "digits_cnn_1x8x8_10": ("digits_encoder", None),
}


def figure6_ratios(training: Sequence[TrainTiming], stages: Sequence[StageTiming]) -> list[Ratio]:
    """A :class:`Ratio` per measured epoch whose paired encoder was sketched."""
    sketches = {s.encoder: s for s in stages if s.stage == "sketch" and s.seconds}
    out = []
    for t in training:
        pair = PAIRS.get(t.architecture)
        if pair is None or t.measured_seconds is None or not t.measured_samples or pair[0] not in sketches:
            continue
        sk = sketches[pair[0]]
        epoch = t.measured_seconds / t.measured_samples * sk.samples
        out.append(Ratio(architecture=t.architecture, encoder=sk.encoder, epoch_seconds=epoch,
                         sketch_seconds=float(sk.seconds), ratio=epoch / float(sk.seconds), paper=pair[1],
                         samples=sk.samples))
    return out
