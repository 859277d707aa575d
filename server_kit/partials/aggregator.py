"""One aggregator: it takes devices' updates, checks and holds them, and sends receipts and partial sums.

A :class:`PartialAggregator` serves the coordinator (``fedsketch-server``)
in two settings with one protocol: as an ingest worker beside it (on its
partition of the core broker's update topics, :mod:`.ingest`) and as a site aggregator
beside a site broker bridged to the core (``fedsketch-aggregator``, :mod:`.cli`).

Per round:

1. The server says which model each of the round's updates starts from: one
   signed ``COLLECT`` per model on ``aggregation/cmd`` (the model whole, its
   version, the run's compression).
2. Each update that arrives is checked as the server checks it (schema,
   round, model, version, tensors: names, shapes, dtypes, finite), made whole
   (a compressed one decompressed against the model by the one decompression,
   :func:`edge_sdk.compress.update_codec.with_delta`, as the server's round does) and held;
   a ``RECEIPT`` tells the server its model, its sample count and its delta
   norm. A refused one gets a receipt with the reason.
3. When the round closes, the server decides screening from every norm of the
   round and sends each aggregator a ``FLUSH``: which members to sum, with
   what sample count (capped at the registered one) and clipping scale.
4. The aggregator sends one signed ``PARTIAL`` per model: the weighted mean
   of its members' updates (FedAvg's numpy reference, :func:`server_kit.aggregate.fedavg`),
   its total sample count and the members' ids; then forgets the round.

An aggregator holds its share of a round's updates, decoded, until the round
closes: screening needs the round's median norm, which only the server knows
then. Past ``hold_memory_bytes`` of them in memory, the round's further updates
wait in files of a private folder, read back one at a time at the close:
memory stays bounded however many updates a round brings. Everything it sends is signed with its own key; the server accepts
aggregators by their public keys.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.compress import Compression
from edge_sdk.compress.update_codec import UpdateCodec, update_codec
from edge_sdk.protocol import BUSY, Kind, Message, ProtocolError, parse_tensors, tensors_body
from edge_sdk.schema import check_meta

from ..aggregate import RunningMean
from ..robust import clip_update, delta_norm
from ..rounds.admission import admit_update

__all__ = ["DEFAULT_HOLD_MEMORY_BYTES", "PartialAggregator", "RoundBase"]

log = logging.getLogger(__name__)


@dataclass
class RoundBase:
    """What one round's updates start from: each model, its version, the run's update codec."""

    round: int
    models: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    versions: dict[str, int | None] = field(default_factory=dict)
    codec: UpdateCodec = field(default_factory=lambda: update_codec(None))


#: Bytes of decoded updates an aggregator holds in memory; past them, the round's further updates wait on disk.
DEFAULT_HOLD_MEMORY_BYTES = 256_000_000


@dataclass
class _Held:
    """One update held until its round closes: in memory, or (past the memory bound) in a file of its own."""

    key: str
    weights: dict[str, np.ndarray] | None
    norm: float
    path: Path | None = None
    nbytes: int = 0
    #: The receipt sent for it (sent again for a second copy: the first may have been lost on its way).
    receipt: dict[str, Any] | None = None

    def load(self) -> dict[str, np.ndarray]:
        if self.weights is not None:
            return self.weights
        assert self.path is not None
        with np.load(self.path, allow_pickle=False) as z:  # written by _Spill.write: plain arrays, never pickle
            return {name: z[name] for name in z.files}


class _Spill:
    """The folder where held updates past the memory bound wait for their round's close (created when needed)."""

    def __init__(self, aid: str) -> None:
        self.aid = aid
        self.dir: Path | None = None
        self.written = 0

    def write(self, weights: Mapping[str, np.ndarray]) -> Path:
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix=f"fedsketch-{self.aid}-held-"))
        self.written += 1
        path = self.dir / f"{self.written:08d}.npz"  # not the device id: it need not be a safe file name
        with open(path, "wb") as f:
            np.savez(f, **weights)
        return path

    def remove(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class PartialAggregator:
    """Takes updates on ``updates_filter``, answers the server's ``COLLECT`` and ``FLUSH``.

    Parameters
    ----------
    transport : MqttTransport
        Connected to the broker the devices publish on (the core broker for
        an ingest worker, the site broker for a site aggregator); it signs
        with the aggregator's key (``sign_with``) and, given the server's
        public key, verifies the server's messages (``verify_with``).
    aid : str
        The aggregator's id (its topics ``aggregators/<aid>/``).
    updates_filter : str, optional
        The subscription its updates come on (default: every device's
        ``update`` topic; one partition of them for an ingest worker).
    hold_memory_bytes : int
        Most bytes of decoded updates held in memory; a round's updates past
        them are held in files of a private temporary folder (numpy ``.npz``,
        read back one at a time when the round closes) and deleted with it.
    """

    def __init__(self, transport: Any, aid: str, *, updates_filter: str | None = None,
                 hold_memory_bytes: int = DEFAULT_HOLD_MEMORY_BYTES) -> None:
        if isinstance(hold_memory_bytes, bool) or not isinstance(hold_memory_bytes, int) or hold_memory_bytes < 0:
            raise ValueError(f"hold_memory_bytes must be an integer >= 0, got {hold_memory_bytes!r}")
        self.transport = transport
        self.aid = aid
        self.topics = transport.topics
        self.updates_filter = updates_filter or self.topics.all_clients("update")
        self.hold_memory_bytes = hold_memory_bytes
        self._lock = threading.Lock()
        self.base: RoundBase | None = None
        self.held: dict[str, _Held] = {}
        self._held_bytes = 0  # of the updates held in memory
        self._spill = _Spill(aid)
        #: Updates held on disk rather than in memory, since the start.
        self.spilled = 0
        #: Updates refused here, per reason (each also told to the server by a receipt).
        self.refused: dict[str, int] = {}
        #: Receipts of updates taken (not of refused ones), since the start.
        self.receipts = 0
        #: Partial sums sent, and the updates they carried.
        self.sent_partials = 0
        self.summed = 0
        self._connections = 0

    def start(self) -> None:
        """Subscribe (the transport connects, or is connected, separately); say so at every reconnection."""
        self.transport.subscribe(self.topics.aggregation(), self._on_server)
        self.transport.subscribe(self.updates_filter, self._on_update)
        self.transport.on_rejected(self._on_transport_refused)
        self.transport.on_connected(self._on_connected)

    def _on_connected(self) -> None:
        """After a reconnection (not the first connection): the status ``online`` that tells the server to ask
        again for the updates said sent to this aggregator and not receipted (they may have been in flight)."""
        self._connections += 1
        if self._connections > 1:
            log.warning("aggregator %s: reconnected to the broker; telling the server", self.aid)
            self._publish("status", Kind.STATUS, 0, {"state": "online"})

    # -- the server's messages ----------------------------------------------
    def _on_server(self, topic: str, msg: Message) -> None:
        try:
            meta = check_meta(msg)
            if msg.kind == Kind.COLLECT:
                self._collect(meta, msg.body)
            elif msg.kind == Kind.FLUSH:
                if meta["aggregator"] == self.aid:
                    self._flush(meta)
            else:
                raise ProtocolError("kind", f"unexpected {msg.kind.name} on the aggregation topic")
        except (ProtocolError, ValueError) as e:
            reason = e.reason if isinstance(e, ProtocolError) else "server-message"
            self._count(reason)
            log.warning("aggregator %s: refused a %s from the server: %s", self.aid, msg.kind.name, e)

    def _collect(self, meta: Mapping[str, Any], body: bytes) -> None:
        rnd, key = meta["round"], meta["model_key"]
        codec = update_codec(Compression.from_meta(meta["compress"]) if "compress" in meta else None)
        weights = parse_tensors(body)
        with self._lock:
            if self.base is None or self.base.round != rnd:
                if self.base is not None and rnd < self.base.round:
                    raise ProtocolError("stale-round", f"COLLECT for round {rnd}, after round {self.base.round}")
                self.base = RoundBase(rnd, codec=codec)
                self._forget_held()
            self.base.models[key] = weights
            self.base.versions[key] = meta.get("version")
        log.debug("aggregator %s: round %d collects model %s", self.aid, rnd, key)

    # -- the devices' updates -----------------------------------------------
    def _on_update(self, topic: str, msg: Message) -> None:
        cid = msg.sender
        if msg.kind == Kind.STATUS:  # the server's probe: this aggregator reads these topics; say so
            self._answer_probe(msg)
            return
        try:
            meta = check_meta(msg)
            if self._receipt_again(cid, meta):
                return
            held = self._take(cid, meta, msg.body)
        except (ProtocolError, ValueError) as e:
            reason = e.reason if isinstance(e, ProtocolError) else "tensors"
            self._refuse(cid, msg.meta.get("round"), reason, str(e))
            return
        held.receipt = self._send_receipt(cid, meta, held.norm)

    def _receipt_again(self, cid: str, meta: Mapping[str, Any]) -> bool:
        """A second copy of an update held for this round (the device was asked again: the server never saw the
        receipt, lost when a connection dropped): its receipt again, not a refusal; whether it was one."""
        with self._lock:
            held, base = self.held.get(cid), self.base
        if (held is None or held.receipt is None or base is None or meta.get("round") != base.round
                or meta.get("model_key") != held.key):
            return False
        log.info("aggregator %s: a second copy of %s's round %d update; its receipt again", self.aid, cid, base.round)
        self._publish("receipt", Kind.RECEIPT, base.round, dict(held.receipt))
        return True

    def _answer_probe(self, msg: Message) -> None:
        """Echo the probe of ``msg`` on this aggregator's status topic (what the server waits for at its start)."""
        try:
            probe = check_meta(msg).get("probe")
        except ProtocolError as e:
            self._count(e.reason)
            return
        if probe is None:
            self._count("kind")
            return
        log.info("aggregator %s: probe %s seen on %s's update topic; answering", self.aid, probe, msg.sender)
        self._publish("status", Kind.STATUS, 0, {"state": "online", "probe": probe})

    def _take(self, cid: str, meta: Mapping[str, Any], body: bytes) -> _Held:
        rnd, key = meta["round"], meta["model_key"]
        with self._lock:
            base = self.base
            if base is None or (isinstance(rnd, int) and rnd > base.round):
                # a worker just started again, its round's models still on their way: not the device's fault
                raise ProtocolError(BUSY, f"update for round {rnd} came before that round's models; the server "
                                          "asks for it again")
            admit_update(cid, meta, open_round=base.round, tasked=True, allowed=base.models.keys(),
                         version_of=base.versions.get, codec=base.codec, held=cid in self.held)
            model = base.models[key]
        spec = {n: (tuple(v.shape), str(v.dtype)) for n, v in model.items()}
        weights = base.codec.weights(base.codec.decode(body, spec, meta.get("version")), model)
        held = _Held(key, weights, delta_norm(weights, model), nbytes=sum(a.nbytes for a in weights.values()))
        with self._lock:
            if self.base is not base:
                raise ProtocolError("stale-update", f"round {rnd} closed while its update was decoded")
            spill = self._held_bytes + held.nbytes > self.hold_memory_bytes
            if not spill:
                self._held_bytes += held.nbytes
        if spill:  # written outside the lock: the other updates' checks go on meanwhile
            try:
                held.path, held.weights = self._spill.write(weights), None
            except OSError as e:
                raise ProtocolError(BUSY, f"no room to hold the update: {e}") from None
        with self._lock:
            if self.base is not base:
                if held.path is not None:
                    held.path.unlink(missing_ok=True)
                raise ProtocolError("stale-update", f"round {rnd} closed while its update was written")
            self.spilled += spill
            self.held[cid] = held
        return held

    def holding(self) -> tuple[int, int, int]:
        """(updates held for the open round, their bytes in memory, their bytes on disk)."""
        with self._lock:
            held = list(self.held.values())
        return (len(held), sum(h.nbytes for h in held if h.weights is not None),
                sum(h.nbytes for h in held if h.weights is None))

    def _forget_held(self) -> None:
        """Drop the held updates (the lock is held): their memory, their files."""
        for h in self.held.values():
            if h.path is not None:
                h.path.unlink(missing_ok=True)
        self.held, self._held_bytes = {}, 0

    def close(self) -> None:
        """Forget the round's held updates and remove the folder of those held on disk."""
        with self._lock:
            self._forget_held()
            self._spill.remove()

    def _on_transport_refused(self, topic: str, reason: str, detail: str) -> None:
        parsed = self.topics.parse(topic)
        if parsed is None or parsed[0] != "clients" or parsed[2] != "update" or reason == "sender":
            return
        base = self.base
        self._refuse(parsed[1], None if base is None else base.round, reason, detail)

    def _refuse(self, cid: str, rnd: Any, reason: str, detail: str) -> None:
        self._count(reason)
        log.info("aggregator %s: update of %s refused (%s): %s", self.aid, cid, reason, detail)
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            base = self.base
            if base is None:
                return  # no round to tell the server of
            rnd = base.round
        meta = {"round": rnd, "client": cid, "refused": reason[:64], "detail": detail[:300]}
        self._publish("receipt", Kind.RECEIPT, rnd, meta)

    def _send_receipt(self, cid: str, meta: Mapping[str, Any], norm: float) -> dict[str, Any]:
        out: dict[str, Any] = {"round": meta["round"], "client": cid, "model_key": meta["model_key"],
                               "n_samples": meta["n_samples"], "metrics": meta.get("metrics", {})}
        if "version" in meta:
            out["version"] = meta["version"]
        if math.isfinite(norm):
            out["norm"] = norm
        loss = meta.get("loss")
        if isinstance(loss, float) and math.isfinite(loss):
            out["loss"] = loss
        self._publish("receipt", Kind.RECEIPT, meta["round"], out)
        self.receipts += 1
        return out

    # -- the close ------------------------------------------------------------
    def _flush(self, meta: Mapping[str, Any]) -> None:
        rnd = meta["round"]
        members = {cid: _member(cid, spec) for cid, spec in sorted(meta["members"].items())}
        with self._lock:
            base = self.base
            if base is None or base.round != rnd:
                raise ProtocolError("stale-round", f"FLUSH for round {rnd}; this aggregator holds round "
                                                   f"{None if base is None else base.round}")
            held = self.held
            self.held, self._held_bytes = {}, 0
            self.base = RoundBase(rnd + 1, codec=base.codec)
        by_key: dict[str, list[tuple[str, _Held, int, float]]] = {}
        for cid, (n, scale) in members.items():
            h = held.pop(cid, None)
            if h is None:
                log.warning("aggregator %s: round %d: the server asks for %s's update, which it does not hold",
                            self.aid, rnd, cid)
                continue
            by_key.setdefault(h.key, []).append((cid, h, n, scale))
        try:
            for key, items in sorted(by_key.items()):
                # FedAvg's arithmetic one update at a time: those held on disk are read back one by one
                mean = RunningMean(base.models[key], f"model {key}")
                for cid, h, n, scale in items:
                    w = h.load()
                    if scale < 1.0:
                        w = clip_update(w, base.models[h.key], scale * h.norm, h.norm)
                    mean.add(w, n, f"update of {cid}")
                    h.weights = None
                    if h.path is not None:
                        h.path.unlink(missing_ok=True)
                self._publish("partial", Kind.PARTIAL, rnd,
                              {"round": rnd, "model_key": key, "n_samples": mean.total_samples,
                               "members": [c for c, _, _, _ in items]},
                              tensors_body(mean.result()))
                self.sent_partials += 1
                self.summed += len(items)
        finally:
            for h in [h for items in by_key.values() for _, h, _, _ in items] + list(held.values()):
                if h.path is not None:
                    h.path.unlink(missing_ok=True)
        log.info("aggregator %s: round %d: %d partial sum(s) of %d update(s) sent", self.aid, rnd, len(by_key),
                 sum(len(v) for v in by_key.values()))

    def _publish(self, leaf: str, kind: Kind, rnd: int, meta: dict[str, Any], body: bytes = b"") -> None:
        msg = Message(kind, self.transport.federation, self.aid, rnd, meta, body)
        try:
            self.transport.publish(self.topics.aggregator(self.aid, leaf), msg)
        except (ConnectionError, ValueError) as e:
            self._count("publish")
            log.error("aggregator %s: could not send its %s: %s", self.aid, kind.name, e)

    def _count(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1


def _member(cid: str, spec: Any) -> tuple[int, float]:
    """A FLUSH member's ``[n_samples, scale]``, checked."""
    ok = (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], int) and not isinstance(spec[0], bool)
          and spec[0] >= 1 and isinstance(spec[1], (int, float)) and not isinstance(spec[1], bool)
          and math.isfinite(spec[1]) and 0.0 <= spec[1] <= 1.0)
    if not ok:
        raise ProtocolError("meta-field", f"FLUSH member {cid!r} must be [n_samples >= 1, scale in [0, 1]], "
                                          f"got {spec!r}")
    return int(spec[0]), float(spec[1])
