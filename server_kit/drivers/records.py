"""The final evaluation's record, built from what it collected, and the rule that picks the devices it asks.

Pure functions of their arguments (no transport, no clock). A round's record
is :class:`server_kit.rounds.training.RoundReport`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_sdk.training.sampling import in_sample, sample_point

__all__ = ["FinalEvaluation", "eval_result", "eval_sample"]


def eval_sample(keys: Mapping[str, str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """The devices the final evaluation asks: those of :func:`in_sample`, and one per cluster it missed.

    ``keys`` maps each assigned online device to its model key. Returns the
    sampled devices (the broadcast reaches them) and the extra ones (asked
    one by one: the device of the smallest sample point in each cluster that
    has a device and none sampled).
    """
    sampled = [c for c in keys if in_sample(c, fraction, seed)]
    covered = {keys[c] for c in sampled}
    extra: dict[str, str] = {}
    for c in keys:
        k = keys[c]
        if k not in covered and (k not in extra or sample_point(c, seed) < sample_point(extra[k], seed)):
            extra[k] = c
    return sampled, sorted(extra.values())


@dataclass(frozen=True)
class FinalEvaluation:
    """What the final evaluation found: each device's accuracy on its own test split with the model it was told.

    :meth:`to_dict` is the ``final`` record of ``results.json``.
    """

    #: Each answering device's accuracy, by device.
    per_client: dict[str, float]
    #: The model each answering device evaluated (clients per cluster in the reports).
    model_per_client: dict[str, str]
    eval_fraction: float
    #: The devices asked.
    asked: int
    #: The devices asked that sent no accuracy before the deadline (offline, or their model or command lost).
    unanswered: tuple[str, ...]
    model_bytes_delivered: int
    deliveries: dict[str, int]
    #: Whether one broadcast asked them, and how many were asked one by one.
    broadcast: bool
    per_device: int

    @property
    def accuracy(self) -> float | None:
        """The mean accuracy over the devices that answered (None: none did)."""
        return float(np.mean(list(self.per_client.values()))) if self.per_client else None

    def accuracy_per_model(self) -> dict[str, tuple[float, int]]:
        """Each model's mean accuracy over its devices, and how many devices evaluated it."""
        out: dict[str, list[float]] = {}
        for c, a in self.per_client.items():
            out.setdefault(self.model_per_client[c], []).append(a)
        return {k: (float(np.mean(v)), len(v)) for k, v in out.items()}

    def to_dict(self) -> dict[str, Any]:
        """The final evaluation's record, as ``results.json`` and the report page read it."""
        return {
            "accuracy": self.accuracy, "per_client": dict(self.per_client),
            "per_model": {k: acc for k, (acc, _) in self.accuracy_per_model().items()},
            "model_per_client": dict(self.model_per_client), "eval_fraction": self.eval_fraction,
            "asked": self.asked, "evaluated": len(self.per_client), "unanswered": list(self.unanswered),
            "model_bytes_delivered": self.model_bytes_delivered, "deliveries": dict(self.deliveries),
            "commands": {"broadcast": int(self.broadcast), "per_device": self.per_device},
        }


def eval_result(metrics: Mapping[str, Mapping[str, Any]], keys: Mapping[str, str], *, eval_fraction: float,
                asked: int, delivered: int, deliveries: Mapping[str, int], broadcast: bool,
                per_device: int, unanswered: Sequence[str] = ()) -> FinalEvaluation:
    """The final evaluation's result from the ``metrics`` the devices sent (``keys``: each device's model).

    ``unanswered``: the devices asked that sent no accuracy before the deadline (offline, or their model
    or command lost on the way), by name.
    """
    per_client = {c: float(m["accuracy"]) for c, m in metrics.items() if "accuracy" in m}
    return FinalEvaluation(per_client=per_client, model_per_client={c: keys[c] for c in per_client},
                           eval_fraction=eval_fraction, asked=asked,
                           unanswered=tuple(sorted(set(unanswered) - set(per_client))),
                           model_bytes_delivered=delivered, deliveries=dict(deliveries), broadcast=broadcast,
                           per_device=per_device)
