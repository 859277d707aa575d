"""A device's own drift signal: its new sketch against the last one it sent.

A device keeps its flip key (the seed of its :class:`~edge_sdk.sketch.Sketcher`)
for its whole life, so sketching unchanged data again gives the same bits:
the Hamming distance between two of its sketches counts only bits whose
class means really moved. :class:`DriftWatch` re-sketches when the device's
data changes and says whether the change is worth telling the server
unasked: when the distance exceeds what flip noise alone makes between two
devices of one group (``z`` standard deviations of the Hamming distance of
two independent flips of the same bits, ``q = 2p(1 - p)`` per bit). Small
changes (a few new samples) stay below it; a moved camera or another
rotation changes far more bits.

What repeated sketches tell the server: with the key fixed, averaging two
sketches of the same data strips no flip noise (they are equal), and two
sketches of changed data show exactly which bits changed, no more than the
new sketch shows by itself.
"""

from __future__ import annotations

import math
from typing import Any

from .sketch import Sketch, Sketcher
from .validation import check_positive

__all__ = ["DriftWatch", "noise_margin_bits"]


def noise_margin_bits(n_bits: int, flip_prob: float, z: float = 4.0) -> float:
    """``z`` standard deviations of the Hamming distance between two independent P-flips of the same bits."""
    q = 2.0 * flip_prob * (1.0 - flip_prob)
    return float(check_positive(z, "z")) * math.sqrt(n_bits * q * (1.0 - q))


class DriftWatch:
    """Re-sketches a device's data and says when it changed enough to tell the server.

    Parameters
    ----------
    sketcher : Sketcher
        The device's sketcher (its flip key is the one its sent sketches used).
    z : float
        The threshold in standard deviations of flip noise (:func:`noise_margin_bits`).

    Attributes
    ----------
    last : Sketch or None
        The last sketch the device sent (:meth:`sent`).
    threshold_bits : float
        Hamming distance above which :meth:`check` reports a change.
    """

    def __init__(self, sketcher: Sketcher, *, z: float = 4.0) -> None:
        self.sketcher = sketcher
        self.threshold_bits = noise_margin_bits(sketcher.n_bits, sketcher.flip_prob, z)
        self.last: Sketch | None = None

    def sent(self, sketch: Sketch) -> None:
        """Remember the sketch the device just sent (asked or unasked)."""
        self.last = sketch

    def check(self, x: Any, y: Any) -> Sketch | None:
        """The new sketch of ``(x, y)`` if it differs from the last sent by more than the threshold, else None."""
        new = self.sketcher.sketch(x, y)
        if self.last is None or self.last.hamming(new) > self.threshold_bits:
            return new
        return None
