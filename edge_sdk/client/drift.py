"""What a device keeps to tell the server that its local data changed: its sketch key, its last sketch sent.

The application says the data changed with :meth:`edge_sdk.client.EdgeClient.data_changed`
(any thread); the client's loop takes the new data between two commands
(:func:`edge_sdk.client.commands.apply_data_change`) and, when the new sketch
moved beyond flip noise (:class:`edge_sdk.drift.DriftWatch`), sends it unasked.
"""

from __future__ import annotations

import threading
from typing import Any

from ..bits import fresh_seed
from ..drift import DriftWatch
from ..sketch import Sketch, Sketcher

__all__ = ["DeviceDrift"]


class DeviceDrift:
    """What a device keeps to tell the server that its data changed.

    See :meth:`edge_sdk.client.EdgeClient.data_changed`.

    Parameters
    ----------
    seed : int, optional
        The device's sketch key: the seed of every :class:`~edge_sdk.sketch.Sketcher`
        it makes (None: one drawn from the operating system once, here). Kept for the
        device's life, so that sketching unchanged data again gives the same bits.

    Attributes
    ----------
    watch : DriftWatch or None
        The device's sketcher and the last sketch it sent, asked or unasked (None before the first).
    unasked : int
        Sketches sent unasked.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = fresh_seed() if seed is None else seed
        self.watch: DriftWatch | None = None
        self.unasked = 0
        self._lock = threading.Lock()
        self._new: tuple[Any, ...] | None = None

    def sketcher(self, encoder: Any, num_classes: int, flip_prob: float) -> Sketcher:
        """The device's sketcher for these settings (the same one while they stay; always its own key)."""
        w = self.watch
        if (w is None or w.sketcher.encoder is not encoder or w.sketcher.num_classes != num_classes
                or w.sketcher.flip_prob != flip_prob):
            self.watch = DriftWatch(Sketcher(encoder, num_classes, flip_prob, seed=self.seed))
        return self.watch.sketcher

    def sent(self, sketch: Sketch) -> None:
        """Remember the sketch just sent."""
        if self.watch is not None:
            self.watch.sent(sketch)

    def offer(self, data: tuple[Any, ...]) -> None:
        """New local data (any thread); the latest offered wins."""
        with self._lock:
            self._new = data

    def take(self) -> tuple[Any, ...] | None:
        """The new local data offered since the last call, or None (the client's loop)."""
        with self._lock:
            data, self._new = self._new, None
        return data
