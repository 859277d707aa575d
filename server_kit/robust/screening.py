"""Screening a round's updates: delta norms, clipping, refusing the absurd, capping sample counts.

:func:`screen_updates` measures each update's delta against the model it
started from (:func:`delta_norm`), refuses the non-finite and the absurd
ones, and clips the large ones onto the bound (:func:`clip_update`), both
against the median norm of the round; :func:`cap_samples` caps claimed
sample counts at the registered ones.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_sdk.tasks import Update

__all__ = ["ScreenReport", "Verdict", "apply_verdicts", "cap_samples", "sample_cap", "clip_update", "delta_norm", "judge_norms",
           "screen_updates", "update_norms"]

log = logging.getLogger(__name__)

Weights = Mapping[str, np.ndarray]


def _is_float(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.floating)


def delta_norm(weights: Weights, reference: Weights) -> float:
    """L2 norm of ``weights - reference`` over the floating tensors of ``reference``.

    Parameters
    ----------
    weights : mapping of str to numpy.ndarray
        An update's weights. Tensors ``reference`` lacks are ignored.
    reference : mapping of str to numpy.ndarray
        The model the update started from.

    Returns
    -------
    float
        The norm, computed in float64; ``inf`` if a difference is NaN or
        Inf (or overflows float64).

    Raises
    ------
    ValueError
        If ``weights`` lacks a floating tensor of ``reference`` or has
        another shape for it.
    """
    total = 0.0
    for name, ref in reference.items():
        r = np.asarray(ref)
        if not _is_float(r):
            continue
        if name not in weights:
            raise ValueError(f"tensor {name!r} is missing")
        w = np.asarray(weights[name])
        if w.shape != r.shape:
            raise ValueError(f"tensor {name!r} has shape {w.shape}, expected {r.shape}")
        with np.errstate(over="ignore", invalid="ignore"):
            d = w.astype(np.float64) - r.astype(np.float64)
            total += float(np.dot(d.ravel(), d.ravel()))
    return math.sqrt(total) if math.isfinite(total) else math.inf


def clip_update(weights: Weights, reference: Weights, bound: float, norm: float | None = None
                ) -> dict[str, np.ndarray]:
    """``reference + delta * min(1, bound / ||delta||)`` for the floating tensors.

    Parameters
    ----------
    weights, reference : mapping of str to numpy.ndarray
        The update and the model it started from.
    bound : float
        The largest delta norm kept (>= 0).
    norm : float, optional
        ``delta_norm(weights, reference)`` when already known.

    Returns
    -------
    dict of str to numpy.ndarray
        ``weights`` itself (as a new dict, arrays not copied) when its norm is
        within the bound; else new floating arrays in the update's dtypes.
        Integer tensors and tensors ``reference`` lacks are passed through.

    Raises
    ------
    ValueError
        On a negative or non-finite ``bound`` or a non-finite norm, or as
        :func:`delta_norm`.
    """
    if not (isinstance(bound, (int, float, np.integer, np.floating)) and math.isfinite(bound) and bound >= 0):
        raise ValueError(f"bound must be a finite number >= 0, got {bound!r}")
    n = delta_norm(weights, reference) if norm is None else float(norm)
    if not math.isfinite(n):
        raise ValueError("cannot clip an update whose delta norm is not finite")
    if n <= bound:
        return dict(weights)
    scale = bound / n
    out = {}
    for name, w in weights.items():
        w = np.asarray(w)
        ref = reference.get(name)
        if ref is None or not _is_float(w) or not _is_float(np.asarray(ref)):
            out[name] = w
            continue
        r = np.asarray(ref, dtype=np.float64)
        out[name] = (r + (w.astype(np.float64) - r) * scale).astype(w.dtype)
    return out



@dataclass
class ScreenReport:
    """What screening did to a round's updates (added to the round's summary)."""

    clipped: int = 0
    refused_norm: int = 0
    norm_median: float | None = None
    norm_max_ratio: float | None = None
    norm_bound: float | None = None
    refuse_bound: float | None = None
    #: The devices whose update was refused, with the reason.
    refused_by: dict[str, str] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Verdict:
    """What screening decided of one update: kept as it is (``scale`` 1), clipped (``scale`` < 1) or refused."""

    scale: float = 1.0
    refused: str | None = None


def judge_norms(norms: Mapping[str, float | None], norm_bound: float | None, *,
                refuse_above: float | None = None, rnd: int | None = None,
                keys: Mapping[str, str] | None = None) -> tuple[dict[str, Verdict], ScreenReport]:
    """Screening's decisions from the round's update norms alone, by client id.

    The one rule of screening (see :func:`screen_updates`), which a server
    applies to its own updates and sends to the aggregators that hold the
    others (:mod:`server_kit.partials`). ``None``: the norm could not be
    computed (the update passes; the aggregation refuses it with its own
    reason); ``inf``: not finite. ``keys`` names each client's model, for
    the log.
    """
    keys = keys or {}
    finite = [n for n in norms.values() if n is not None and math.isfinite(n)]
    report = ScreenReport()
    if finite:
        median = float(np.median(finite))
        report.norm_median = median
        report.norm_max_ratio = float(max(finite) / median) if median > 0 else None
    verdicts = {cid: Verdict() for cid in norms}
    if norm_bound is None:
        return verdicts, report
    bound = None if not report.norm_median else norm_bound * report.norm_median
    refuse = None if bound is None or refuse_above is None else max(refuse_above, norm_bound) * report.norm_median
    report.norm_bound, report.refuse_bound = bound, refuse
    for cid, n in norms.items():
        if n is None:
            continue
        key = keys.get(cid, "?")
        if not math.isfinite(n):
            report.refused_norm += 1
            verdicts[cid] = Verdict(refused="screening: its delta norm is not finite")
            log.warning("round %s: update of %s for %s refused: its delta norm is not finite", rnd, cid, key)
        elif refuse is not None and n > refuse:
            report.refused_norm += 1
            verdicts[cid] = Verdict(refused=f"screening: delta norm {n / report.norm_median:.3g} x the round's median")
            log.warning("round %s: update of %s for %s refused: delta norm %.4g is %.3g x the round's median "
                        "%.4g (refused above %g x)", rnd, cid, key, n, n / report.norm_median,
                        report.norm_median, refuse_above)
        elif bound is not None and n > bound:
            report.clipped += 1
            verdicts[cid] = Verdict(scale=bound / n)
            log.warning("round %s: update of %s for %s clipped: delta norm %.4g is %.1f x the round's median "
                        "%.4g (bound %.4g)", rnd, cid, key, n, n / report.norm_median, report.norm_median, bound)
    report.refused_by = {cid: v.refused for cid, v in verdicts.items() if v.refused is not None}
    return verdicts, report


def update_norms(updates: Sequence[Update], references: Mapping[str, Weights]) -> dict[str, float | None]:
    """Each update's delta norm against the model it started from (None: it cannot be computed), by client.

    An update kept coded (``u.coded``) has the norm of the change its codes stand for.
    """
    norms: dict[str, float | None] = {}
    for u in updates:
        ref = references.get(u.model_key)
        if u.coded is not None:  # a compressed update not decoded: the norm its codes stand for
            norms[u.cid] = None if ref is None else u.coded.norm
            continue
        try:
            norms[u.cid] = None if ref is None else delta_norm(u.weights, ref)
        except ValueError:
            norms[u.cid] = None
    return norms


def apply_verdicts(updates: Sequence[Update], references: Mapping[str, Weights],
                   verdicts: Mapping[str, Verdict], norms: Mapping[str, float | None]) -> list[Update]:
    """The updates kept, in their order, clipped ones replaced by clipped copies (:func:`clip_update`; one
    kept coded gets the clip as its factor, applied to its decoded change where it is summed)."""
    kept = []
    for u in updates:
        v = verdicts.get(u.cid, Verdict())
        if v.refused is not None:
            continue
        n = norms.get(u.cid)
        if v.scale < 1.0 and n is not None:
            u = (dataclasses.replace(u, coded=u.coded.scaled(v.scale)) if u.coded is not None  # scaled where summed
                 else dataclasses.replace(u, weights=clip_update(u.weights, references[u.model_key], v.scale * n, n)))
        kept.append(u)
    return kept


def screen_updates(updates: Sequence[Update], references: Mapping[str, Weights], norm_bound: float | None,
                   *, refuse_above: float | None = None, rnd: int | None = None
                   ) -> tuple[list[Update], ScreenReport]:
    """Refuse non-finite or absurd updates and clip large ones against the round's median update norm.

    Parameters
    ----------
    updates : sequence of Update
        The round's updates, every cluster together (one per client).
    references : mapping of str to weights
        The models the updates started from, by model key (the strategy's
        models before aggregation).
    norm_bound : float or None
        Multiple of the median of the round's finite update norms above which
        an update is clipped; None: no bounding (updates pass unchanged and
        nothing is refused; the norms are still reported).
    refuse_above : float, optional
        Multiple of that median above which an update is refused (with
        bounding on; never below ``norm_bound``); None: only non-finite
        updates are refused.
    rnd : int, optional
        The round, for the log.

    Returns
    -------
    list of Update
        The updates kept, in their order; clipped ones replaced by copies
        with clipped weights. An update whose norm cannot be computed (an
        unknown model key, a missing tensor or another shape) passes
        unchanged: the strategy's aggregation refuses it with its own reason.
    ScreenReport
        Counts, the median norm, the largest ratio of a finite norm to it,
        and the absolute clipping and refusal bounds used (None when off or
        the median is 0).
    """
    norms = update_norms(updates, references)
    verdicts, report = judge_norms(norms, norm_bound, refuse_above=refuse_above, rnd=rnd,
                                   keys={u.cid: u.model_key for u in updates})
    return apply_verdicts(updates, references, verdicts, norms), report


def sample_cap(cid: str, n_samples: int, registered: Mapping[str, int]) -> int:
    """The one sample cap: ``n_samples`` at most the count ``cid`` registered (absent or 0: not capped), logged."""
    limit = int(registered.get(cid, 0) or 0)
    if limit > 0 and n_samples > limit:
        log.warning("update of %s claims %d samples; capped at the %d it registered", cid, n_samples, limit)
        return limit
    return n_samples


def cap_samples(updates: Sequence[Update], registered: Mapping[str, int]) -> tuple[list[Update], int]:
    """Cap each update's ``n_samples`` at the count its client registered.

    Parameters
    ----------
    updates : sequence of Update
    registered : mapping of str to int
        Client id -> sample count announced at registration; clients absent
        or registered with 0 are not capped.

    Returns
    -------
    list of Update
        The updates, capped ones replaced by copies.
    int
        How many were capped.
    """
    out, capped = [], 0
    for u in updates:
        n = sample_cap(u.cid, u.n_samples, registered)
        if n != u.n_samples:
            out.append(dataclasses.replace(u, n_samples=n))
            capped += 1
        else:
            out.append(u)
    return out, capped
