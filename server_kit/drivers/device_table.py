"""Each device of a run at a glance: online, cluster, rounds done, refusals, its last round, its health.

:class:`DeviceTallies` keeps, round by round (O(the round's devices), from
each round's record), what the rounds did with each device; :func:`device_rows`
puts it beside what the :class:`~.fleet.Fleet` knows (online, last seen, the
device's own benchmark and its health) as one :class:`DeviceRow` per device:
the devices table of ``results.json`` (``fleet``), of the report page and of
the live page, and the devices the metrics watch one by one.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .fleet import Fleet

__all__ = ["DeviceRow", "DeviceTallies", "DeviceTally", "device_rows", "model_keys", "most_watched"]


@dataclass
class DeviceTally:
    """What the rounds did with one device."""

    #: Rounds whose valid update of the device was kept.
    rounds: int = 0
    #: Rounds that refused its update (admission, transport, schema, screening).
    refusals: int = 0
    #: Seconds from its last kept round's start to its update.
    round_s: float | None = None
    #: Why its last refused update was refused.
    last_refusal: str | None = None


class DeviceTallies:
    """Every device's :class:`DeviceTally`, added to from each round's record."""

    def __init__(self) -> None:
        self.by_device: dict[str, DeviceTally] = {}

    @classmethod
    def from_history(cls, history: Iterable[Mapping[str, Any]]) -> DeviceTallies:
        """The tallies of a run's rounds so far (a resumed run's checkpoint)."""
        tallies = cls()
        for rec in history:
            tallies.add_round(rec)
        return tallies

    def add_round(self, rec: Mapping[str, Any]) -> None:
        """One closed round's record (:meth:`~server_kit.rounds.training.RoundReport.to_dict`)."""
        refused = rec.get("refused") or {}
        for cid, reason in refused.items():
            tally = self.by_device.setdefault(cid, DeviceTally())
            tally.refusals += 1
            tally.last_refusal = str(reason)
        for cid, seconds in (rec.get("reported_s") or {}).items():
            if cid not in refused:
                tally = self.by_device.setdefault(cid, DeviceTally())
                tally.rounds += 1
                tally.round_s = float(seconds)

    def get(self, cid: str) -> DeviceTally:
        """``cid``'s tally (the live one: :func:`device_rows` copies it)."""
        return self.by_device.get(cid) or DeviceTally()


@dataclass(frozen=True)
class DeviceRow:
    """One device's line of the devices table."""

    device: str
    online: bool
    #: The model it trains and is evaluated with (its cluster's), or None before it has one.
    cluster: str | None
    #: Seconds since its last message.
    last_seen_s: float
    tally: DeviceTally
    #: Why it is benched, or None.
    benched: str | None
    #: Its own benchmark's sketch time (``fedsketch bench``), or None.
    sketch_ms: float | None
    #: Its last health (:meth:`edge_sdk.health.DeviceHealth.to_meta`), {} when it sent none.
    health: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        t = self.tally
        return {"online": self.online, "cluster": self.cluster, "last_seen_s": round(self.last_seen_s, 1),
                "rounds": t.rounds, "refusals": t.refusals, "round_s": t.round_s, "last_refusal": t.last_refusal,
                "benched": self.benched, "sketch_ms": self.sketch_ms, "health": dict(self.health)}


def model_keys(strategy: Any, cids: Iterable[str]) -> dict[str, str]:
    """The model each of ``cids`` trains and is evaluated with (its cluster's), for those that have one (O(cids))."""
    keys = {}
    for cid in cids:
        if strategy.is_clustered(cid):
            try:
                keys[cid] = strategy.model_key_for(cid)
            except KeyError:  # admitted, not placed yet
                pass
    return keys


def device_rows(fleet: Fleet, clusters: Mapping[str, str], tallies: DeviceTallies,
                cids: Iterable[str] | None = None, *, now: float | None = None) -> list[DeviceRow]:
    """The rows of ``cids`` (every admitted device by default), in that order.

    ``clusters``: each device's model key. ``now``: the monotonic time the
    ages are measured from.
    """
    now = time.monotonic() if now is None else now
    rows = []
    for cid in (sorted(fleet.clients) if cids is None else cids):
        state = fleet.clients.get(cid)
        if state is None:
            continue
        speed = fleet.speeds.get(cid)
        health = getattr(state, "health", None)
        rows.append(DeviceRow(
            device=cid, online=state.online, cluster=clusters.get(cid), last_seen_s=max(0.0, now - state.last_seen),
            tally=replace(tallies.get(cid)), benched=fleet.benched.get(cid),
            sketch_ms=None if speed is None else speed.figures.get("sketch_ms"),
            health={} if health is None else health.to_meta()))
    return rows


def most_watched(tallies: DeviceTallies, known: Mapping[str, Any], limit: int) -> list[str]:
    """At most ``limit`` devices of ``known`` worth a look: the most refused, then the slowest (half each, the
    rest to whichever has more), in that order; O(devices) with a heap, never a sort of the fleet."""
    if limit <= 0:
        return []
    tally = tallies.by_device
    refused = heapq.nlargest(limit, (c for c, t in tally.items() if t.refusals and c in known),
                             key=lambda c: (tally[c].refusals, c))
    slow = heapq.nlargest(limit, (c for c, t in tally.items() if t.round_s is not None and c in known),
                          key=lambda c: (tally[c].round_s or 0.0, c))
    chosen: list[str] = []
    for c in refused[:max(limit // 2, limit - len(slow))]:
        chosen.append(c)
    for c in slow:
        if len(chosen) >= limit:
            break
        if c not in chosen:
            chosen.append(c)
    for c in refused:
        if len(chosen) >= limit:
            break
        if c not in chosen:
            chosen.append(c)
    if len(chosen) < limit:  # a young run: nobody slow nor refused yet; the first devices, for a stable set
        for c in heapq.nsmallest(limit, known):
            if len(chosen) >= limit:
                break
            if c not in chosen:
                chosen.append(c)
    return chosen
