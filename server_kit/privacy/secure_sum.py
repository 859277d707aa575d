"""Secure aggregation on the server: each cluster's round summed without reading one device's update.

The round's tasks of one model form its secure group: their devices' public
keys (from their hellos) go to each of them in the train command
(:meth:`SecureSums.command_fields`). Their masked updates are held as they
arrive (:meth:`SecureSums.add_masked`). At the close, each model's group is
closed (:class:`edge_sdk.secure.ServerSecureRound`: the devices whose masked
update arrived survive), each survivor is asked to reveal
(:meth:`SecureSums.close`), the reveals come back (:meth:`add_reveal`), and
each group's sum is unmasked, decoded to the mean change of its survivors and
handed to the strategy as one partial sum per model (:meth:`SecureSums.sums`).

A group short of its threshold, or whose reveals do not all come when a
device dropped before sending, is not summed: its model stays as it was this
round (counted in ``failed``). Every device of a group weighs the same (a
sample count would widen every summed integer). The server never screens a
single update (it cannot see one): the quantiser's clip bounds what each
device adds.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_sdk.secure import SecureError, SecureQuantizer, ServerSecureRound, default_threshold
from edge_sdk.secure.params import params_from_command
from edge_sdk.tasks import Task

from ..rounds.arrivals import PartialSum

__all__ = ["SecureSettings", "SecureSums", "SecureTotals"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SecureSettings:
    """``--secure``'s settings: the quantiser's ``bits`` and ``clip``, the reveals' wait."""

    bits: int = 6
    clip: float = 5.0
    reveal_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 16:
            raise ValueError(f"--secure-bits must be in [2, 16], got {self.bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"--secure-clip must be a finite number > 0, got {self.clip!r}")


@dataclass
class SecureTotals:
    """What the run's secure rounds did, for ``results.json``'s ``privacy.secure``."""

    rounds: int = 0
    failed: int = 0
    survivors: int = 0
    dropped: int = 0
    bytes_masked: int = 0
    bytes_unmask: int = 0
    bytes_reveal: int = 0
    unmask_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    def to_dict(self, settings: SecureSettings) -> dict[str, Any]:
        return {"bits": settings.bits, "clip": settings.clip, "rounds": self.rounds, "failed": self.failed,
                "survivors": self.survivors, "dropped": self.dropped, "bytes_masked_updates": self.bytes_masked,
                "bytes_unmask_requests": self.bytes_unmask, "bytes_reveals": self.bytes_reveal,
                "unmask_s": round(self.unmask_s, 6), "failures": self.failures[-20:]}


class SecureSums:
    """The run's secure groups, round after round (see the module docstring)."""

    def __init__(self, settings: SecureSettings, run_id: Callable[[], str], keys: Mapping[str, str]) -> None:
        self.settings = settings
        self.run_id = run_id
        #: Each device's public key (hex), as its hello said.
        self.keys = keys
        self.totals = SecureTotals()
        self._fields: dict[str, dict[str, Any]] = {}
        self._groups: dict[str, ServerSecureRound] = {}
        self._round = -1
        self._failed_now: set[str] = set()

    def groups_of(self, tasks: Iterable[Task]) -> dict[str, list[str]]:
        """The devices of each model's group (tasks of one model, devices with a key)."""
        groups: dict[str, list[str]] = {}
        for t in tasks:
            if len(t.models) == 1 and t.cid in self.keys:
                groups.setdefault(next(iter(t.models)), []).append(t.cid)
        return groups

    def command_fields(self, rnd: int, tasks: Iterable[Task]) -> dict[str, dict[str, Any]]:
        """Each tasked device's ``secure`` record for its train command; a group under two devices is left out
        (its devices get no record, and the round does not ask them)."""
        self._round, self._fields, self._groups, self._failed_now = rnd, {}, {}, set()
        out: dict[str, dict[str, Any]] = {}
        for key, cids in sorted(self.groups_of(tasks).items()):
            if len(cids) < 2:
                log.warning("round %d: model %s has %d device for a secure sum (at least 2): not trained this round",
                            rnd, key, len(cids))
                continue
            fields = {"peers": {c: self.keys[c] for c in sorted(cids)}, "threshold": default_threshold(len(cids)),
                      "bits": self.settings.bits, "clip": self.settings.clip, "run": self.run_id()}
            self._fields[key] = fields
            out.update({c: fields for c in cids})
        return out

    def add_masked(self, cid: str, key: str, rnd: int, body: bytes, models: Mapping[str, Mapping[str, np.ndarray]]
                   ) -> None:
        """A masked update: its group made at the first one; ``SecureError`` for a body that does not fit it."""
        if rnd != self._round or key not in self._fields:
            raise SecureError("closed", f"a masked update for round {rnd}, model {key!r}: no secure group open")
        group = self._groups.get(key)
        if group is None:
            n = sum(int(np.asarray(v).size) for v in models[key].values())
            group = self._groups[key] = ServerSecureRound(params_from_command(self._fields[key], rnd, key, n))
        group.add_masked(body)
        self.totals.bytes_masked += len(body)

    def close(self) -> dict[str, tuple[str, bytes]]:
        """Close every group: ``{survivor: (model, request body)}``; a group short of its threshold fails."""
        asks: dict[str, tuple[str, bytes]] = {}
        for key, group in sorted(self._groups.items()):
            try:
                requests = group.close()
            except SecureError as e:
                self._fail(key, str(e))
                continue
            for cid, req in requests.items():
                body = req.to_bytes()
                asks[cid] = (key, body)
                self.totals.bytes_unmask += len(body)
        self._groups = {k: g for k, g in self._groups.items() if g.closed and k not in self._failed_now}
        return asks

    def add_reveal(self, cid: str, key: str, rnd: int, body: bytes) -> None:
        """A survivor's reveal; ``SecureError`` for one that does not fit."""
        group = self._groups.get(key)
        if rnd != self._round or group is None:
            raise SecureError("closed", f"a reveal for round {rnd}, model {key!r}: no secure group waits for it")
        group.add_reveal(body)
        self.totals.bytes_reveal += len(body)

    def complete(self) -> bool:
        """Every survivor of every group has revealed."""
        return all(set(g.revealed) >= set(g.survivors) for g in self._groups.values())

    def sums(self, models: Mapping[str, Mapping[str, np.ndarray]]) -> list[PartialSum]:
        """Each ready group's mean change, as one partial sum of its survivors (equal weights)."""
        out = []
        for key, group in sorted(self._groups.items()):
            if not group.ready:
                self._fail(key, f"{len(group.revealed)} of {len(group.survivors)} survivors revealed, "
                                f"{len(group.dropped)} dropped before sending")
                continue
            t0 = time.perf_counter()
            try:
                ints = group.unmask()
            except SecureError as e:
                self._fail(key, str(e))
                continue
            base = models[key]
            n = sum(int(np.asarray(v).size) for v in base.values())
            quant = SecureQuantizer(self._fields[key]["clip"], self._fields[key]["bits"], group.params.ctx)
            mean = quant.decode(ints, len(group.survivors), n)
            weights, at = {}, 0
            for name in sorted(base):
                b = np.asarray(base[name])
                weights[name] = (b + mean[at:at + b.size].reshape(b.shape)).astype(b.dtype)
                at += b.size
            self.totals.unmask_s += time.perf_counter() - t0
            self.totals.rounds += 1
            self.totals.survivors += len(group.survivors)
            self.totals.dropped += len(group.dropped)
            log.info("round %d: model %s summed securely: %d devices, %d dropped before sending", self._round, key,
                     len(group.survivors), len(group.dropped))
            out.append(PartialSum("secure", self._round, key, weights, len(group.survivors), group.survivors))
        self._groups = {}
        return out

    def _fail(self, key: str, why: str) -> None:
        self.totals.failed += 1
        self._failed_now.add(key)
        self.totals.failures.append(f"{key}: round {self._round}: {why}")
        log.warning("round %d: model %s not summed securely (its model stays as it was): %s", self._round, key, why)
