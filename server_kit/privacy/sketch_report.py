"""What the run's sketches gave away, per device: the ``privacy.sketch`` record of ``results.json``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from edge_sdk.privacy import sketch_epsilon

__all__ = ["sketch_privacy"]


def sketch_privacy(flip_prob: float, num_classes: int, latent_dim: int, counts: Mapping[str, int],
                   declined: Iterable[str] = ()) -> dict[str, Any]:
    """One sketch's epsilons (:class:`edge_sdk.privacy.SketchEpsilon`), then each device's total over the
    sketches it sent (user level), and the devices that declined to send one."""
    eps = sketch_epsilon(flip_prob, num_classes, latent_dim)
    per = eps.per_device

    def total(k: int) -> float | None:
        v = k * per
        return None if math.isinf(v) else round(v, 6)

    return {**eps.to_dict(),
            "devices": {c: {"sketches": int(k), "epsilon": total(int(k))} for c, k in sorted(counts.items())},
            "declined": sorted(declined)}
