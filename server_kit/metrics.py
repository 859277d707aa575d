"""What every run records: accuracy landmarks, clustering scores, bytes on the wire.

Bytes are counted from the real wire encoding (:func:`edge_sdk.protocol.encode_message`
of the message each party would send, chunk envelopes included), per message
kind and direction, per client delivery: a model sent to 50 clients counts 50
times, as the paper counts all bytes in and out of the server.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_sdk.protocol import Kind, Message, tensors_body

__all__ = ["CommLedger", "SeedSpread", "clustering_scores", "final_accuracy", "mean_ci", "message_bytes",
           "rounds_to_target", "weighted_purity", "weights_message_bytes"]


def rounds_to_target(accuracies: Sequence[float | None], target: float) -> int | None:
    """First round (1-based) whose accuracy reaches ``target``; None if none does."""
    for i, a in enumerate(accuracies, start=1):
        if a is not None and a >= target:
            return i
    return None


def final_accuracy(accuracies: Sequence[float | None], last: int = 5) -> float | None:
    """Mean accuracy of the last ``last`` rounds that have one (the paper's final accuracy)."""
    vals = [a for a in accuracies if a is not None][-last:]
    return float(np.mean(vals)) if vals else None


def mean_ci(values: Sequence[float | None]) -> tuple[float, float]:
    """Mean and half-width of the 95 % Student-t confidence interval over runs (seeds).

    None and NaN values are left out; one value gives a half-width of 0, none gives NaN for both.
    """
    v = np.asarray([x for x in values if x is not None and not np.isnan(x)], dtype=np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    if v.size == 1:
        return float(v[0]), 0.0
    from scipy.stats import t

    return float(v.mean()), float(t.ppf(0.975, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size))


@dataclass(frozen=True)
class SeedSpread:
    """A figure measured over seeds, as a distribution: its mean, 5th percentile, worst and share under a floor.

    ``p5`` is numpy's linear-interpolation percentile; ``below`` the share of
    seeds whose value is under ``floor`` (0.95 for ARI).
    """

    n: int
    mean: float
    p5: float
    worst: float
    below: float
    floor: float

    @classmethod
    def of(cls, values: Sequence[float], floor: float = 0.95) -> SeedSpread:
        v = np.asarray(list(values), dtype=np.float64)
        if v.size == 0 or not np.all(np.isfinite(v)):
            raise ValueError(f"a spread needs finite values, got {v.tolist()}")
        return cls(int(v.size), round(float(v.mean()), 4), round(float(np.percentile(v, 5)), 4),
                   round(float(v.min()), 4), round(float(np.mean(v < floor)), 4), float(floor))

    def as_dict(self) -> dict[str, float]:
        """The JSON form: ``{"seeds", "mean", "p5", "min", "below_<floor>"}``."""
        return {"seeds": self.n, "mean": self.mean, "p5": self.p5, "min": self.worst,
                f"below_{self.floor:g}": self.below}


def clustering_scores(truth: Sequence[int], labels: Sequence[int]) -> dict[str, float]:
    """ARI, AMI, completeness and weighted purity (:func:`weighted_purity`) of a clustering against true groups."""
    from sklearn.metrics import adjusted_mutual_info_score, adjusted_rand_score, completeness_score

    if len(truth) != len(labels):
        raise ValueError(f"truth and labels differ in length: {len(truth)} vs {len(labels)}")
    return {
        "ari": float(adjusted_rand_score(truth, labels)),
        "ami": float(adjusted_mutual_info_score(truth, labels)),
        "completeness": float(completeness_score(truth, labels)),
        "weighted_purity": weighted_purity(truth, labels),
    }


def message_bytes(kind: Kind, body: bytes = b"", meta: Mapping[str, Any] | None = None, *,
                  sender: str = "c000", federation: str = "sim", max_payload: int = 1_000_000) -> int:
    """Bytes a message takes on the wire, chunk envelopes included."""
    return Message(kind, federation, sender, 1, dict(meta or {}), body).wire_size(max_payload)


def weights_message_bytes(kind: Kind, weights: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None,
                          **kw: Any) -> int:
    """Bytes of a message carrying ``weights`` as safetensors."""
    return message_bytes(kind, tensors_body(weights), meta, **kw)


class CommLedger:
    """Bytes and messages per (kind, direction); direction is "up" (to the server) or "down"."""

    def __init__(self) -> None:
        self._t: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(self, kind: str, direction: str, nbytes: int, messages: int = 1) -> None:
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        row = self._t[(kind, direction)]
        row[0] += int(nbytes) * int(messages)
        row[1] += int(messages)

    def total(self, direction: str | None = None, kinds: Sequence[str] | None = None) -> int:
        return sum(v[0] for (k, d), v in self._t.items()
                   if (direction is None or d == direction) and (kinds is None or k in kinds))

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        out: dict[str, dict[str, dict[str, int]]] = {"up": {}, "down": {}}
        for (k, d), (b, m) in sorted(self._t.items()):
            out[d][k] = {"bytes": b, "messages": m}
        return out

    def merge(self, other: CommLedger) -> None:
        for (k, d), (b, m) in other._t.items():
            row = self._t[(k, d)]
            row[0] += b
            row[1] += m


def weighted_purity(truth: Sequence[int], labels: Sequence[int]) -> float:
    """Bhattacharya and Aridi's weighted purity: the mean in-cluster purity of the predicted clusters.

    The in-cluster purity of a predicted cluster ``C`` (their Eq. 10) is the
    fraction of its pairs of clients that share a true group,
    ``|{{i, j} in C : truth(i) = truth(j)}| / (|C| choose 2)``; a cluster of one
    client is pure (1.0, the paper leaves 0/0 undefined). Eq. 11 prints the sum
    of ``IC(C_i) / |C_i|``, which gives 0.4 for a perfect clustering of 10
    clients into 2 clusters of 5 where their Table 1 reports 1.0; we read its
    denominator as the number of clusters ``|C|``, the mean of ``IC`` over the
    predicted clusters, which gives 1.0 for every perfect clustering, as Table 1
    reports. It rewards over-splitting (all singletons score 1.0): report it
    with ARI.
    """
    from math import comb

    t = np.asarray(truth)
    p = np.asarray(labels)
    if t.shape != p.shape or t.ndim != 1:
        raise ValueError(f"truth and labels must be 1-D and of equal length, got {t.shape} and {p.shape}")
    if len(t) == 0:
        raise ValueError("weighted purity of an empty clustering is undefined")
    purities = []
    for k in np.unique(p):
        members = t[p == k]
        pairs = comb(len(members), 2)
        same = sum(comb(int(c), 2) for c in np.unique(members, return_counts=True)[1])
        purities.append(same / pairs if pairs else 1.0)
    return float(np.mean(purities))
