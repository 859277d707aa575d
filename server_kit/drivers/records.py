"""The final evaluation's record, built from what it collected, and the rule that picks the devices it asks.

Pure functions of their arguments (no transport, no clock). A round's record
is :class:`server_kit.rounds.training.RoundReport`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edge_sdk.sampling import in_sample, sample_point

__all__ = ["eval_result", "eval_sample"]


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


def eval_result(metrics: Mapping[str, Mapping[str, Any]], keys: Mapping[str, str], *, eval_fraction: float,
                asked: int, delivered: int, deliveries: Mapping[str, int], broadcast: bool,
                per_device: int, unanswered: Sequence[str] = ()) -> dict[str, Any]:
    """The final evaluation's result from the ``metrics`` the devices sent (``keys``: each device's model).

    ``unanswered``: the devices asked that sent no accuracy before the deadline (offline, or their model
    or command lost on the way), by name.
    """
    per_client = {c: float(m["accuracy"]) for c, m in metrics.items() if "accuracy" in m}
    per_model: dict[str, list[float]] = {}
    for c, a in per_client.items():
        per_model.setdefault(keys[c], []).append(a)
    return {
        "accuracy": float(np.mean(list(per_client.values()))) if per_client else None,
        "per_client": per_client,
        "per_model": {k: float(np.mean(v)) for k, v in per_model.items()},
        # the model each client evaluated (clients per cluster in the reports)
        "model_per_client": {c: keys[c] for c in per_client},
        "eval_fraction": eval_fraction,
        "asked": asked, "evaluated": len(per_client),
        "unanswered": sorted(set(unanswered) - set(per_client)),
        "model_bytes_delivered": delivered, "deliveries": deliveries,
        "commands": {"broadcast": int(broadcast), "per_device": per_device},
    }
