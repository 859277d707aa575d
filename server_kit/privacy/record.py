"""A run's ``privacy`` record (``results.json``, the report): the sketches, the DP accountants, the secure sums."""

from __future__ import annotations

from typing import Any

from .sketch_report import sketch_privacy

__all__ = ["privacy_record"]


def privacy_record(strategy: Any, intake: Any, flip_prob: float, num_classes: int, latent: int | None
                   ) -> dict[str, Any]:
    """What the run gave away so far: ``sketch`` (a strategy that sketches), ``dp`` (``--dp-epsilon``),
    ``secure`` (``--secure``)."""
    out: dict[str, Any] = {}
    if strategy.capabilities.summary_kind == "sketch" and latent and (intake.sketch_counts or intake.declined):
        out["sketch"] = sketch_privacy(flip_prob, num_classes, latent, intake.sketch_counts, intake.declined)
    if strategy.dp is not None:
        out["dp"] = strategy.dp.to_dict()
    if intake.secure is not None:
        out["secure"] = intake.secure.totals.to_dict(intake.secure.settings)
    return out
