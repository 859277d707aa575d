"""The coordinator's side of partial aggregation: the updates aggregators hold, and their partial sums.

Aggregators (ingest workers beside the server, site aggregators beside site
brokers: :mod:`server_kit.partials`) take devices' updates and send a
receipt for each; the server records a receipt as the update's arrival (its
round counts it toward its goal, :meth:`~.intake.Intake.on_receipt`). When
the round closes, :meth:`RemoteRound.collect` (called by
:meth:`Strategy.aggregate <server_kit.strategies.base.Strategy.aggregate>`
once screening is decided from every norm of the round) tells each
aggregator what to sum and waits for one partial sum per model.

What the server refuses, with a reason it counts: a message on an
aggregator's topics not signed by a key it holds (``unknown-aggregator``,
``unsigned``, ``signature``, ``replay``: the transport); a partial for
another round (``partial-round``), a model or an aggregator it did not ask
(``partial-unasked``), a second one (``partial-duplicate``), a member it did
not ask that aggregator for (``partial-members``), a sample count other
than the sum of its members' counts (``partial-samples``, so never above what
those devices registered), bad tensors (``tensors``). The members of a
refused partial, and of one that never comes (an aggregator that died:
``aggregator-lost``), are refused in the round's record; the round goes on
with the rest.

What an aggregator is trusted with: it sees its devices' updates, and it may
drop one (the server sees a missing device, or a refused receipt) or sum a
wrong one; the server checks what it can (counts, members, rounds, models,
tensors) but cannot see inside a weighted mean. Run one only where you would
run the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edge_sdk.protocol import (
    Kind,
    Message,
    ProtocolError,
    parse_tensors,
    partition_of,
    tensors_body,
)
from edge_sdk.schema import check_meta

from ..robust.screening import Verdict, sample_cap
from ..rounds.arrivals import PartialSum
from ..rounds.round_wait import RoundWait
from ..strategies.base import Strategy
from .intake import Intake
from .link import ServerLink
from .models import RunModels

__all__ = ["Ingest", "RemoteRound"]


@dataclass(frozen=True)
class Ingest:
    """Ingest workers beside the server, as the run sees them (:class:`server_kit.partials.IngestWorkers`).

    The update topics are cut into ``len(workers)`` partitions: a device's ``train`` command names its own
    (:func:`edge_sdk.protocol.partition_of`), and ``workers[p]`` takes partition ``p``. The server does not
    subscribe to the updates.
    """

    #: The workers' aggregator ids, in the order of their partitions.
    workers: Sequence[str]
    #: ``alive(aid)``: whether aggregator ``aid`` runs (a dead one's updates are not waited for).
    alive: Callable[[str], bool]
    #: Starts the dead workers again; returns their new keys (:class:`edge_sdk.signing.Verifier`), by id.
    revive: Callable[[], Mapping[str, Any]]

    @property
    def partitions(self) -> int:
        return len(self.workers)

log = logging.getLogger(__name__)


class RemoteRound:
    """The round's updates held by aggregators: their receipts, the flushes, the partial sums.

    Parameters
    ----------
    link : ServerLink
        Publishes ``COLLECT`` and ``FLUSH`` on ``aggregation/cmd``, counts refusals, pumps while waiting.
    intake : Intake
        Checks each receipt as it would the update (:meth:`Intake.on_receipt`).
    strategy : Strategy
        The models a round's updates start from, and their versions.
    models : RunModels
        The tensor spec of a partial sum.
    aggregators : mapping
        Each aggregator's public key by id (``TransportBase.accept_aggregators``).
    timeout_s : float
        How long the close waits for partial sums.
    ingest : Ingest, optional
        The ingest workers among the aggregators: a dead one is given up on
        at once, started again while a round waits (:meth:`revive`), and the
        updates it held are asked for again.
    """

    def __init__(self, link: ServerLink, intake: Intake, strategy: Strategy, models: RunModels,
                 aggregators: Mapping[str, Any], *, timeout_s: float = 60.0, ingest: Ingest | None = None) -> None:
        self.link = link
        self.intake = intake
        self.strategy = strategy
        self.models = models
        self.aggregators = frozenset(aggregators)
        #: Each aggregator's public key (a worker started again brings a new one).
        self.verifiers = dict(aggregators)
        self.timeout_s = float(timeout_s)
        self.ingest = ingest
        self.alive = ingest.alive if ingest is not None else (lambda aid: True)
        self.round = -1
        self._keys: list[str] = []
        #: Each held update's delta norm (None when the receipt gave none: not finite), by client.
        self.norms: dict[str, float | None] = {}
        #: Each held update's model, and the aggregator holding it, by client.
        self.keys: dict[str, str] = {}
        self.held_by: dict[str, str] = {}
        self._asked: dict[str, dict[str, dict[str, int]]] = {}
        self._partials: dict[tuple[str, str], PartialSum] = {}
        self.refused_by: dict[str, str] = {}
        #: Partial sums combined, and members refused for want of one (per reason), over the run.
        self.combined = 0
        self.lost: dict[str, int] = {}
        self._connected: set[str] = set()

    def reconnected(self, wait: RoundWait) -> dict[str, list[str]]:
        """The aggregators that said they (re)connected since the last call, each with the devices of ``wait``'s
        round whose update it may have lost in flight: awaited, not receipted, and, for an ingest worker, on its
        partition (a site aggregator's devices are not known before their receipts: every awaited one)."""
        aids, self._connected = self._connected, set()
        out: dict[str, list[str]] = {}
        for aid in sorted(aids):
            part = None
            if self.ingest is not None and aid in self.ingest.workers:
                part = list(self.ingest.workers).index(aid)
            out[aid] = [cid for cid in sorted(wait.left) if cid not in self.held_by
                        and (part is None or partition_of(cid, self.ingest.partitions) == part)]
        return out

    # -- a dead ingest worker -------------------------------------------------------
    def revive(self, wait: RoundWait, sent: Mapping[str, tuple[int, float]]) -> list[str]:
        """Start the dead ingest workers again; returns the devices of ``wait``'s round to ask again.

        Those are the updates a revived worker held (its receipts are forgotten: the round waits for them
        again) and the updates said ``sent`` (``{cid: (round, when)}``) to its partition and not receipted.
        """
        if self.ingest is None:
            return []
        revived = self.ingest.revive()
        if not revived:
            return []
        self.verifiers.update(revived)
        self.link.transport.accept_aggregators(self.verifiers)
        self._collect()  # the new process resumes the worker's session: the round's models reach it
        partitions = {aid: p for p, aid in enumerate(self.ingest.workers)}
        lost = []
        for aid in sorted(revived):
            held = sorted(cid for cid, a in self.held_by.items() if a == aid)
            for cid in held:
                del self.held_by[cid]
                self.norms.pop(cid, None)
                self.keys.pop(cid, None)
                self.intake.held_elsewhere.pop(cid, None)
                wait.reopen(cid)
            p = partitions[aid]
            in_flight = sorted(cid for cid in wait.left if cid not in held and sent.get(cid, (-1,))[0] == wait.round
                               and partition_of(cid, self.ingest.partitions) == p)
            log.warning("round %d: ingest worker %s started again; asking again for the %d update(s) it held and "
                        "the %d sent to it meanwhile", wait.round, aid, len(held), len(in_flight))
            lost += held + in_flight
        return lost

    # -- the round opens --------------------------------------------------------
    def open(self, rnd: int, keys: Any) -> None:
        """Round ``rnd`` opens: send every aggregator the models its updates start from (``COLLECT``)."""
        self.round = rnd
        self.norms, self.keys, self.held_by = {}, {}, {}
        self._asked, self._partials = {}, {}
        #: This round's held updates no partial sum carried, with the reason (for the round's record).
        self.refused_by: dict[str, str] = {}
        self._keys = sorted(set(keys))
        self.strategy.versions.sync(self.strategy.models)  # a model new or changed outside aggregation: its version
        self._collect()

    def _collect(self) -> None:
        """Send the round's ``COLLECT`` of each of its models (once more for a worker started again)."""
        versions, codec = self.strategy.versions, self.intake.codec
        for key in self._keys:
            meta: dict[str, Any] = {"round": self.round, "model_key": key,
                                    **codec.base_meta(versions.version.get(key))}
            self.link.send(self.link.topics.aggregation(), Kind.COLLECT, meta=meta,
                           body=tensors_body(self.strategy.models[key]))

    # -- what aggregators send ----------------------------------------------------
    def on_message(self, aid: str, msg: Message) -> None:
        """A receipt or a partial sum from aggregator ``aid`` (its signature checked by the transport)."""
        meta = check_meta(msg)
        if msg.kind == Kind.RECEIPT:
            self._on_receipt(aid, meta)
        elif msg.kind == Kind.PARTIAL:
            self._on_partial(aid, meta, msg.body)
        elif msg.kind == Kind.STATUS:
            if meta.get("state") == "online" and "probe" not in meta:  # it (re)connected: see :meth:`reconnected`
                self._connected.add(aid)
        else:
            raise ProtocolError("kind", f"unexpected {msg.kind.name} from aggregator {aid}")

    def _on_receipt(self, aid: str, meta: Mapping[str, Any]) -> None:
        cid = meta["client"]
        if self.held_by.get(cid) == aid and meta["round"] == self.intake.round and "refused" not in meta:
            log.debug("round %d: %s's receipt again from %s (its update was asked for again)", self.round, cid, aid)
            return
        if "refused" in meta:
            reason = meta["refused"]
            self.link.reject(reason, f"(aggregator {aid}) {meta.get('detail', '')}", cid)
            if meta["round"] == self.intake.round:
                self.intake.refuse_update(cid, reason)
            return
        try:
            upd = self.intake.on_receipt(cid, meta)
        except ProtocolError as e:
            self.link.reject(e.reason, f"(aggregator {aid}) {e}", cid)
            self.intake.refuse_update(cid, e.reason)
            return
        if upd is None:
            return
        self.norms[cid] = meta.get("norm", float("inf"))
        self.keys[cid] = upd.model_key
        self.held_by[cid] = aid

    def _on_partial(self, aid: str, meta: Mapping[str, Any], body: bytes) -> None:
        rnd, key = meta["round"], meta["model_key"]
        if rnd != self.round:
            raise ProtocolError("partial-round", f"partial sum for round {rnd}; the server is in round {self.round}")
        asked = self._asked.get(aid, {}).get(key)
        if asked is None:
            raise ProtocolError("partial-unasked", f"partial sum of model {key!r} in round {rnd}: not asked of "
                                                   f"aggregator {aid}")
        if (aid, key) in self._partials:
            raise ProtocolError("partial-duplicate", f"a second partial sum of model {key!r} in round {rnd}")
        members = list(meta["members"])
        stray = sorted(set(members) - set(asked))
        if stray or len(set(members)) != len(members):
            raise ProtocolError("partial-members", f"partial sum of model {key!r} names devices not asked of it "
                                                   f"or twice: {stray[:5] or 'a repeated id'}")
        total = sum(asked[c] for c in members)
        if meta["n_samples"] != total:
            raise ProtocolError("partial-samples", f"partial sum of model {key!r} claims {meta['n_samples']} "
                                                   f"samples; its members' counts add up to {total}")
        weights = parse_tensors(body, spec=self.models.spec)
        self._partials[(aid, key)] = PartialSum(aid, rnd, key, weights, total, tuple(members))

    # -- the round closes -----------------------------------------------------------
    def collect(self, verdicts: Mapping[str, Verdict], registered: Mapping[str, int]) -> tuple[list[PartialSum], int]:
        """Tell each aggregator what to sum (``FLUSH``), wait for its partial sums; return them and the caps.

        A member's sample count is capped at the one it registered, and its
        clipping scale is screening's verdict; refused members are left out.
        """
        capped = 0
        self._asked = {}
        scales: dict[str, float] = {}
        for cid, aid in sorted(self.held_by.items()):
            v = verdicts.get(cid, Verdict())
            if v.refused is not None:
                continue
            claimed = self.intake.held_elsewhere[cid].n_samples
            n = sample_cap(cid, claimed, registered)
            capped += n != claimed
            self._asked.setdefault(aid, {}).setdefault(self.keys[cid], {})[cid] = n
            scales[cid] = v.scale
        for aid, by_key in sorted(self._asked.items()):
            members = {cid: [n, scales[cid]] for key in sorted(by_key) for cid, n in sorted(by_key[key].items())}
            self.link.send(self.link.topics.aggregation(), Kind.FLUSH,
                           meta={"round": self.round, "aggregator": aid, "members": members})
        expected = {(aid, key) for aid, by_key in self._asked.items() for key in by_key}

        def done() -> bool:
            return all(k in self._partials or not self.alive(k[0]) for k in expected)

        t0 = time.monotonic()
        self.link.pump(done, self.timeout_s)
        out = []
        for aid, key in sorted(expected):
            asked = self._asked[aid][key]
            got = self._partials.get((aid, key))
            members = set(got.members) if got is not None else set()
            for cid in sorted(set(asked) - members):
                why = "alive, no partial sum" if self.alive(aid) else "gone"
                self.link.reject("aggregator-lost", f"aggregator {aid} ({why}) did not sum its update of round "
                                                    f"{self.round}", cid)
                self.lost["aggregator-lost"] = self.lost.get("aggregator-lost", 0) + 1
                self.refused_by[cid] = f"aggregator-lost: {aid} did not sum it"
            if got is not None:
                out.append(got)
        self.combined += len(out)
        log.info("round %d: %d partial sum(s) from %d aggregator(s) in %.2f s", self.round, len(out),
                 len(self._asked), time.monotonic() - t0)
        return out, capped
