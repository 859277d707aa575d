"""A round's judgement and its outcome: the screening verdicts from every update's norm, and what aggregating did.

:func:`screen_round` is the round's judge step: the server's own updates
decompressed against the models they started from, their sample counts
capped, each update's verdict decided from the norms of every update of the
round (those ingest workers hold included, by their receipts). It does no
I/O and changes nothing: :class:`Screening` is what it decided, which
:meth:`server_kit.strategies.base.Strategy.aggregate` then combines.
:class:`Aggregation` is what that combination did, typed; its
:meth:`Aggregation.to_dict` is the round's ``summary`` in ``results.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edge_sdk.compress.update_codec import with_delta
from edge_sdk.tasks import Update

from ..robust import (
    RobustConfig,
    ScreenReport,
    Verdict,
    apply_verdicts,
    cap_samples,
    judge_norms,
    update_norms,
)

__all__ = ["Aggregation", "Judged", "Screening", "decompressed", "screen_round"]


class Judged(Protocol):
    """What the judge step reads of a strategy (every :class:`~server_kit.strategies.base.Strategy` is one)."""

    #: The registered devices (each with its ``n_samples``), by id.
    clients: Mapping[str, Any]
    #: The models of the round, before aggregation, by key.
    models: Mapping[str, Mapping[str, np.ndarray]]
    robust: RobustConfig


@dataclass(frozen=True)
class Screening:
    """A round's screening, decided from the norms of every update: those the server holds and those held elsewhere.

    The server's own updates decompressed, capped and clipped (the refused
    left out), each update's verdict (the ones ingest workers hold too: the
    round tells each worker what to sum by them), and the figures of the
    screening.
    """

    #: The server's own updates, ready to combine.
    updates: list[Update]
    #: Each update's verdict (clip scale, or refused), by device, the updates held elsewhere included.
    verdicts: Mapping[str, Verdict]
    report: ScreenReport
    #: How many of the server's own updates had their sample count capped.
    capped: int
    #: Each device's registered sample count (the cap of the updates held elsewhere too).
    registered: Mapping[str, int]
    #: Whether updates held elsewhere (ingest workers) took part (their partial sums join the combination).
    held_elsewhere: bool = False


def decompressed(models: Mapping[str, Mapping[str, np.ndarray]], updates: Sequence[Update]) -> list[Update]:
    """Compressed updates (a decoded ``delta``) as whole weights: the model they started from plus the delta.

    An update kept coded (``coded``) stays so, told the model it started from.
    """
    out = []
    for u in updates:
        if u.coded is not None:
            u = dataclasses.replace(u, coded=u.coded.on(models[u.model_key]))
        elif u.delta is not None:
            u = dataclasses.replace(u, delta=None, weights=with_delta(models[u.model_key], u.delta))
        out.append(u)
    return out


def screen_round(strategy: Judged, rnd: int, updates: Sequence[Update], *,
                 held_norms: Mapping[str, float | None] | None = None,
                 held_keys: Mapping[str, str] | None = None) -> Screening:
    """Decompress, cap and screen round ``rnd``'s updates (no I/O; ``Strategy.aggregate`` then combines them).

    Compressed updates are decompressed against the models they started
    from (the round checked that each names the version of the round).
    Screening, against the models the updates started from
    (``strategy.models[u.model_key]``, before aggregation): sample counts
    above the device's registered count are capped at it; with norm
    bounding on, updates whose delta norm is not finite or above
    ``refuse_above`` times the median of all the round's update norms are
    refused, and those above ``norm_bound`` times it are clipped onto that
    bound (:func:`server_kit.robust.screen_updates`).

    ``held_norms`` and ``held_keys``: the norms and model keys of the
    updates ingest workers hold (their receipts). They join the round's,
    so the median and every decision are those of a server that held them
    all; the round then asks each worker for the sum of its kept updates
    (clipped as decided) and passes the partial sums to ``Strategy.aggregate``.
    """
    registered = {cid: c.n_samples for cid, c in strategy.clients.items()}
    capped_updates, capped = cap_samples(decompressed(strategy.models, updates), registered)
    norms = update_norms(capped_updates, strategy.models)
    keys = {u.cid: u.model_key for u in capped_updates}
    norms.update(held_norms or {})
    keys.update(held_keys or {})
    robust = strategy.robust
    verdicts, report = judge_norms(norms, robust.norm_bound, refuse_above=robust.refuse_above, rnd=rnd, keys=keys)
    screened = apply_verdicts(capped_updates, strategy.models, verdicts, norms)
    return Screening(screened, verdicts, report, capped, registered, held_elsewhere=held_norms is not None)


@dataclass(frozen=True)
class Aggregation:
    """What aggregating one round did: the method's own figures, the screening's, the models' new versions."""

    #: The method's summary of its combination (its private ``_combine``: per-method figures for the logs).
    combined: Mapping[str, Any]
    #: What screening did (clipped, refused, the norms' median and bounds, who was refused and why).
    screen: ScreenReport
    #: Sample counts capped at the registered ones, partial sums' members included.
    capped_samples: int
    #: The rule that combined each model's updates ("fedavg", "trimmed-mean", "median").
    aggregator: str
    #: The models whose version moved, with their new version (compression on); empty otherwise.
    versions: Mapping[str, int] = field(default_factory=dict)
    #: With updates held elsewhere: the partial sums combined, and the updates they carried; None otherwise.
    partial_sums: int | None = None
    summed_remote: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The round's ``summary`` record, as ``results.json`` and the report page read it."""
        out = dict(self.combined)
        if self.partial_sums is not None:  # a partial sum counts once in the method's figures: the updates it carries
            out["partial_sums"] = self.partial_sums
            out["summed_remote"] = self.summed_remote
        out.update(self.screen.as_dict())
        out["capped_samples"] = self.capped_samples
        out["aggregator"] = self.aggregator
        if self.versions:
            out["versions"] = dict(self.versions)
        return out
