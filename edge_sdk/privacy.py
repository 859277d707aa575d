"""What a sketch gives away: its local differential privacy, stated, and a budget its owner sets.

A sketch is randomised response over bits. Each class vector (``latent_dim``
floats, the class's mean encoding, or uniform noise for an absent class) is
min-max normalised on its own and rounded to bits; every bit is then flipped
with probability P (``edge_sdk.bits.quantize_pack``). Whatever the data, a
bit comes out 1 with a probability between P and 1 - P, so one bit is
``ln((1 - P) / P)``-differentially private, and bits flipped independently
compose by adding their epsilons (basic composition; exact for the worst
case of randomised response on k bits: the likelihood ratio of two k-bit
strings is at most ``((1 - P) / P) ** k``).

The threat model: an observer (the server, the broker, anyone who records
the sketch) who knows the encoder, P and everything but the device's data.
What the sketch reveals depends on what changes between two neighbouring
datasets:

* **per image** (add, remove or replace one image): the image changes only
  its own class's mean, hence at most that class vector's ``latent_dim``
  bits (the normalisation is per class vector; an absent class's noise does
  not depend on the data): ``epsilon_image = latent_dim * epsilon_bit``.
* **per device** (user level: any change to the whole local dataset, the
  guarantee federated learning's user-level differential privacy speaks
  of): every bit may change: ``epsilon_device = classes * latent_dim *
  epsilon_bit``.

Each further sketch (a device whose data drifts sends new ones, with new
flips) adds its epsilon again. With P = 0.1 and 10 x 20 bits, one sketch is
2.20 per bit, 43.9 per image and 439 per device: the flips hide which
image a bit came from far better than they hide the device's whole class
structure, which clustering needs to see. P = 0.5 gives 0 (every bit a coin)
and P = 0 gives infinity (the bits are the data's own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["SketchEpsilon", "SketchBudget", "SketchOverBudget", "sketch_epsilon", "THREAT_MODEL"]

#: The one wording of what the figures guard against (logs, results.json, the report).
THREAT_MODEL = ("local DP of randomised response over the sketch's bits against anyone who reads the sketch; "
                "per image: one image changes one class vector; per device (user level): every bit may change; "
                "each further sketch of a device adds its epsilon")


@dataclass(frozen=True)
class SketchEpsilon:
    """The epsilons of one sketch of ``num_classes`` x ``latent_dim`` bits flipped with ``flip_prob``."""

    flip_prob: float
    num_classes: int
    latent_dim: int

    def __post_init__(self) -> None:
        if not 0.0 <= self.flip_prob <= 0.5:
            raise ValueError(f"flip_prob must be in [0, 0.5], got {self.flip_prob!r}")
        if self.num_classes < 1 or self.latent_dim < 1:
            raise ValueError(f"a sketch needs at least one class and one bit per class, got "
                             f"{self.num_classes} x {self.latent_dim}")

    @property
    def n_bits(self) -> int:
        return self.num_classes * self.latent_dim

    @property
    def per_bit(self) -> float:
        """``ln((1 - P) / P)``: infinite at P = 0, 0 at P = 0.5."""
        p = self.flip_prob
        return math.inf if p == 0.0 else math.log((1.0 - p) / p)

    @property
    def per_image(self) -> float:
        """One image added, removed or replaced: one class vector's bits."""
        return self.latent_dim * self.per_bit if self.per_bit else 0.0

    @property
    def per_device(self) -> float:
        """The whole local dataset (user level): every bit of the sketch."""
        return self.n_bits * self.per_bit if self.per_bit else 0.0

    def to_dict(self) -> dict[str, object]:
        """For ``results.json`` (an infinite epsilon as None: JSON has no infinity)."""
        def num(v: float) -> float | None:
            return None if math.isinf(v) else round(v, 6)
        return {"flip_prob": self.flip_prob, "bits": self.n_bits, "epsilon_per_bit": num(self.per_bit),
                "epsilon_per_image": num(self.per_image), "epsilon_per_device": num(self.per_device),
                "threat_model": THREAT_MODEL}

    def describe(self) -> str:
        """One log line's worth."""
        return (f"sketch epsilon {self.per_device:.1f} per device (user level), {self.per_image:.1f} per image, "
                f"{self.per_bit:.2f} per bit (P = {self.flip_prob:g}, {self.num_classes} x {self.latent_dim} bits)")


def sketch_epsilon(flip_prob: float, num_classes: int, latent_dim: int) -> SketchEpsilon:
    """The epsilons of one sketch (see the module docstring)."""
    return SketchEpsilon(float(flip_prob), int(num_classes), int(latent_dim))


class SketchOverBudget(ValueError):
    """A sketch the device's owner did not allow: its epsilon would pass the budget."""


@dataclass
class SketchBudget:
    """A device's budget for its sketches, user level (``fedsketch-client --max-sketch-epsilon``).

    Every sketch sent spends its per-device epsilon; :meth:`spend` refuses
    one that would take the total past ``max_epsilon``.
    """

    max_epsilon: float
    spent: float = 0.0
    sketches: int = field(default=0)

    def __post_init__(self) -> None:
        if not (self.max_epsilon >= 0.0) or math.isnan(self.max_epsilon):
            raise ValueError(f"--max-sketch-epsilon must be >= 0, got {self.max_epsilon!r}")

    def spend(self, eps: SketchEpsilon) -> None:
        """Count one sketch, or raise :class:`SketchOverBudget` (nothing spent) when it does not fit."""
        total = self.spent + eps.per_device
        if total > self.max_epsilon:
            raise SketchOverBudget(
                f"sketch refused: its epsilon {eps.per_device:.1f} per device (P = {eps.flip_prob:g}, "
                f"{eps.n_bits} bits) would bring this device's total to {total:.1f}, above its budget "
                f"--max-sketch-epsilon {self.max_epsilon:g} (spent so far {self.spent:.1f})")
        self.spent = total
        self.sketches += 1
