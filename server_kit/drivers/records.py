"""What a server run reports, built from what it collected: each round's record, the final evaluation's result.

Pure functions of their arguments (no transport, no clock but the one a
round's duration is read from), and the rule that picks the devices the
final evaluation asks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edge_sdk.sampling import in_sample, sample_point
from edge_sdk.tasks import Update

__all__ = ["eval_result", "eval_sample", "round_record"]


def round_record(rnd: int, tasked: int, updates: Sequence[Update], missing: list[str], summary: Mapping[str, Any],
                 delivered: int, deliveries: Mapping[str, int], started: float) -> dict[str, Any]:
    """The record of round ``rnd`` (begun at ``started``, ``time.monotonic()``) for the history."""
    before = [u.metrics["acc_before"] for u in updates if "acc_before" in u.metrics]
    before_per_model: dict[str, list[float]] = {}
    for u in updates:
        if "acc_before" in u.metrics:
            before_per_model.setdefault(u.model_key, []).append(float(u.metrics["acc_before"]))
    return {
        "round": rnd, "tasked": tasked, "updates": len(updates), "missing": missing,
        "acc_before": float(np.mean(before)) if before else None,
        # the same, per model the updates were for (what each cluster's model reached last round)
        "acc_before_per_model": {k: float(np.mean(v)) for k, v in sorted(before_per_model.items())},
        "loss": float(np.mean([u.loss for u in updates])) if updates else None,
        "model_bytes_delivered": delivered, "deliveries": deliveries,
        "clipped": int(summary.get("clipped", 0)), "refused_norm": int(summary.get("refused_norm", 0)),
        "summary": summary, "seconds": time.monotonic() - started,
    }


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
