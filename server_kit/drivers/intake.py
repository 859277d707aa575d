"""What the current phase expects from the devices, and what they sent that it accepted.

Every message from a client is checked on arrival against the phase: its
round, whether the device was tasked and with which models, the tensors'
names, shapes and dtypes, NaN; a bad one is refused (counted, logged, never
fatal) and an accepted one is recorded for the phase to read.

Per message, the server's work does not grow with the fleet: every phase
waits on a set of the clients it still expects (:class:`~.round_wait.Awaited`;
a training round's :class:`~.round_wait.RoundWait`), updated in O(1) by the
message handlers and by status changes, instead of scanning the clients
before each message.

A tasked device's update that is refused, whatever refused it (the
transport's decoding, the schema, the tensors, the model key, the round), is
known to its round (:meth:`Intake.refuse_update`): the round records the
reason and counts it as the device's answer toward its report goal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from edge_sdk.compress.frames import coded_change
from edge_sdk.compress.update_codec import update_codec
from edge_sdk.protocol import (
    Kind,
    Message,
    ProtocolError,
    check_features,
    parse_sketch,
    parse_tensors,
)
from edge_sdk.secure import SecureError
from edge_sdk.sketch import Sketch
from edge_sdk.tasks import Task, Update

from ..pretrain.rounds import AEPretraining
from ..rounds.admission import admit_update
from ..rounds.arrivals import Receipt
from ..rounds.decoding import DecodeAt, Decoding
from ..rounds.pace import Pace
from ..rounds.reask import BUSY
from ..rounds.round_wait import Awaited, RoundWait
from ..strategies.base import Strategy
from .link import ServerLink
from .models import RunModels
from .phase import Phase, RunPhase

if TYPE_CHECKING:
    from ..privacy.secure_sum import SecureSums

__all__ = ["Awaited", "Intake"]

log = logging.getLogger(__name__)


class Intake:
    """The current phase (its name, its round, who it waits for) and what the devices sent it.

    Parameters
    ----------
    link : ServerLink
        Where refused messages are counted.
    strategy : Strategy
        The run's strategy (which summary the devices send).
    models : RunModels
        The run's models (the spec of an update, the latent size of a sketch).
    num_classes : int
        The classes of the federation.
    pace : Pace, optional
        The run's memory of its devices' training times (fed with each valid update).
    """

    def __init__(self, link: ServerLink, strategy: Strategy, models: RunModels, num_classes: int,
                 pace: Pace | None = None, decode_updates: DecodeAt | str = DecodeAt.AUTO) -> None:
        self.link = link
        self.strategy = strategy
        self.models = models
        self.num_classes = num_classes
        self.pace = pace or Pace()
        #: How the run's updates come up (chosen once: whole weights, or compressed deltas).
        self.codec = update_codec(strategy.compress_up)
        #: The run's phase and round (:meth:`RunPhase.enter` is the one way to change them).
        self.run = RunPhase()
        #: The clients the current phase waits for.
        self.awaited: Awaited = Awaited("none")
        #: The current training round's wait (its groups, goals, refusals), or None outside a round.
        self.wait: RoundWait | None = None
        self.tasked: set[str] = set()
        #: The model keys each tasked client was sent this round: its update must name one of them.
        self.allowed: dict[str, frozenset[str]] = {}
        #: The rounds each client was tasked in (a late update is told apart from a stray one).
        self.tasked_rounds: dict[str, set[int]] = {}
        self.updates: dict[str, Update] = {}
        #: Secure aggregation (``--secure``): the run's groups, and the round's masked updates as arrivals (their
        #: loss and metrics; no weights: the server never reads one alone).
        self.secure: SecureSums | None = None
        self.masked: dict[str, Update] = {}
        #: The round's updates aggregators hold (:mod:`server_kit.partials`): their receipts, weights left there.
        self.held_elsewhere: dict[str, Receipt] = {}
        #: The autoencoder pre-training of the run, while it goes on (:mod:`server_kit.pretrain.rounds`).
        self.ae: AEPretraining | None = None
        self.metrics: dict[str, dict[str, Any]] = {}
        #: During the final evaluation: the devices asked, and the model key each must evaluate.
        self.eval_keys: dict[str, str] = {}
        #: Each client's summary: a :class:`~edge_sdk.sketch.Sketch`, or a float array (e.g. LADD's spectra).
        self.sketches: dict[str, Sketch] = {}
        #: Sketches received per device (each spends the device's privacy budget again), and the devices that
        #: declined to send one (their owner's budget, ``fedsketch-client --max-sketch-epsilon``).
        self.sketch_counts: dict[str, int] = {}
        self.declined: set[str] = set()
        self.feature_shape: tuple[int, int] | None = None
        #: Where int8 and int4 updates are decoded (``ServerConfig.decode_updates``).
        self.decoding = Decoding(decode_updates)

    @property
    def phase(self) -> Phase:
        """The run's phase."""
        return self.run.phase

    @property
    def round(self) -> int:
        """The round the server is in (the final evaluation's is the last round plus one)."""
        return self.run.round

    # -- what the phase expects -----------------------------------------------
    def expect(self, kind: str, cids: Iterable[str], online: Iterable[str]) -> Awaited:
        """Wait for a ``kind`` message from each of ``cids`` (those online)."""
        self.awaited = Awaited(kind, cids, online)
        return self.awaited

    def open_round(self, rnd: int, tasks: list[Task], online: Iterable[str], *, report_goal: float = 1.0,
                   clock: Any = time.monotonic) -> RoundWait:
        """Round ``rnd`` begins now: expect an update from each task's client, for a model it was sent."""
        self.run.begin_round(rnd)
        self.updates = {}
        self.held_elsewhere = {}
        self.masked = {}
        self.tasked = {t.cid for t in tasks}
        self.allowed = {t.cid: frozenset(t.models) for t in tasks}
        for t in tasks:
            self.tasked_rounds.setdefault(t.cid, set()).add(rnd)
        self.wait = RoundWait(rnd, tasks, online, report_goal=report_goal, clock=clock)
        self.awaited = self.wait
        return self.wait

    def close_round(self) -> None:
        """The round closed: what arrives for it from now on is late."""
        self.wait = None
        self.awaited = Awaited("none")

    def arrivals(self) -> tuple[list[Update], list[Receipt]]:
        """The round's updates and receipts by device id (arrival order over a network is not reproducible)."""
        return ([self.updates[c] for c in sorted(self.updates)],
                [self.held_elsewhere[c] for c in sorted(self.held_elsewhere)])

    def refuse_update(self, cid: str, reason: str) -> None:
        """An update from ``cid`` was refused (by anything): its round, if it tasked ``cid``, counts it as an answer.

        A receiver that had no room for it (``busy``) refused nothing: the round, while it waits for ``cid``,
        asks for it again later (:mod:`~server_kit.rounds.reask`). In pre-training, the autoencoder round gives
        up on the device.
        """
        wait = self.wait
        if wait is not None and reason == BUSY and cid in wait.left:
            delay = wait.reasks.busy(cid)
            log.info("round %d: no room for %s's update now; asking for it again in %.1f s", wait.round, cid, delay)
            return
        if wait is not None:
            wait.refuse(cid, reason)
        elif self.phase is Phase.PRETRAIN:
            self.awaited.give_up("ae", cid)

    def set_online(self, cid: str, online: bool) -> None:
        """A client went online or offline: the phase waits for online clients only."""
        self.awaited.set_online(cid, online)

    # -- what the devices send ------------------------------------------------
    def on_summary(self, cid: str, msg: Message) -> Any:
        """A sketch (or a float summary), checked and recorded; returns it."""
        if self.strategy.capabilities.summary_kind == "sketch":
            if msg.kind != Kind.SKETCH:
                raise ProtocolError("kind", f"expected a SKETCH, got {msg.kind.name}")
            sk: Any = parse_sketch(msg.body, num_classes=self.num_classes, latent_dim=self.models.latent)
        else:
            if msg.kind != Kind.FEATURES:
                raise ProtocolError("kind", f"expected FEATURES, got {msg.kind.name}")
            sk = self._features(msg)
        self.sketches[cid] = sk
        if isinstance(sk, Sketch):
            self.sketch_counts[cid] = self.sketch_counts.get(cid, 0) + 1
        self.awaited.answer("sketch", cid)
        return sk

    def on_declined(self, cid: str) -> None:
        """A device said its sketch would pass its owner's budget: not waited for, left out of the clustering."""
        if cid not in self.declined:
            log.warning("%s declined to send its sketch (its owner's privacy budget): left out of the clustering",
                        cid)
        self.declined.add(cid)
        self.awaited.give_up("sketch", cid)

    def _features(self, msg: Message) -> Any:
        """A float summary (e.g. LADD's spectra): one finite float32 (num_classes, W) tensor."""
        if msg.meta.get("summary") != self.strategy.capabilities.summary_kind:
            raise ProtocolError("meta", f"summary {msg.meta.get('summary')!r} is not the "
                                        f"{self.strategy.capabilities.summary_kind!r} this server asked for")
        feats = check_features(parse_tensors(msg.body), self.feature_shape or (self.num_classes, None))
        self.feature_shape = feats.shape
        return feats

    def admit_update(self, cid: str, meta: Mapping[str, Any]) -> RoundWait | None:
        """The checks of a round's update (or of an aggregator's receipt of one), by its meta; the round's wait.

        None: a late update for a closed round the device was tasked in
        (refused, logged). Raises :class:`ProtocolError`: a stray update
        (``stale-update``), one for a model the client was not sent
        (``wrong-model``), from another version than the round's with
        compression on (``wrong-version``), or a second one this round
        (``duplicate-update``).
        """
        rnd = meta["round"]
        closed = rnd < self.round or (rnd == self.round and self.wait is None)
        if closed and rnd in self.tasked_rounds.get(cid, ()):
            # the documented rule: an update for a closed round is refused (its model has moved on), logged
            self.link.reject("late-update", f"update for round {rnd} arrived after the round closed (now round "
                                             f"{self.round}); refused, the device trains again from the new model",
                             cid)
            return None
        wait = self.wait
        # a tasked device that names another round than the open one is refused for this round too
        admit_update(cid, meta, open_round=None if wait is None else self.round, tasked=cid in self.tasked,
                     allowed=self.allowed.get(cid, frozenset()), version_of=self.strategy.versions.version.get,
                     codec=self.codec, held=cid in self.updates or cid in self.held_elsewhere or cid in self.masked)
        return wait

    def on_update(self, cid: str, msg: Message) -> Update | None:
        """A round's update: refused if late, stray or for a model the client was not sent; else recorded, returned.

        With compression on, the body is the compressed delta from the model
        version the device names (it must be the version of the round's model),
        checked whole before anything is decoded (:func:`edge_sdk.compress.decode_delta`).
        """
        m = msg.meta
        if bool(m.get("secure")) != (self.secure is not None):
            raise ProtocolError("secure", "this run sums updates securely: a plain update is refused" if self.secure
                                else "a masked update, and this run does not sum securely")
        wait = self.admit_update(cid, m)
        if wait is None:
            return None
        if self.secure is not None:
            self._on_masked(cid, msg, wait)
            return None
        key, n = m["model_key"], m["n_samples"]  # Strategy.aggregate weighs n by the count registered, never more
        # bad tensors raise: the link counts the refusal and tells the round (refuse_update)
        if self.decoding.at_sum(self.strategy, self.codec):  # checked whole, codes kept as they came for the sum (server_kit.rounds.decoding)
            coded = coded_change(msg.body, self.models.spec, self.codec.compression.method)
            upd = Update(cid, m["round"], key, {}, n, m.get("loss", float("nan")), m["metrics"],
                         version=m.get("version"), coded=coded)
        else:
            body = self.codec.decode(msg.body, self.models.spec, m.get("version"))
            upd = Update(cid, m["round"], key, body.weights, n, m.get("loss", float("nan")), m["metrics"],
                         delta=body.delta, version=body.version)
        self.updates[cid] = upd
        wait.answer("update", cid)
        self.pace.note_update(wait, cid)
        return upd

    def _on_masked(self, cid: str, msg: Message, wait: RoundWait) -> None:
        """A masked update, into its secure group (a body that does not fit is refused and counted)."""
        assert self.secure is not None
        m = msg.meta
        try:
            self.secure.add_masked(cid, m["model_key"], m["round"], msg.body, self.strategy.models)
        except SecureError as e:
            raise ProtocolError(f"secure-{e.reason}", str(e)) from None
        self.masked[cid] = Update(cid, m["round"], m["model_key"], {}, m["n_samples"], m.get("loss", float("nan")),
                                  m["metrics"])
        wait.answer("update", cid)
        self.pace.note_update(wait, cid)

    def on_reveal(self, cid: str, msg: Message) -> None:
        """A survivor's reveal of a secure round (refused and counted if no group waits for it or it is bad)."""
        if self.secure is None:
            raise ProtocolError("secure", "a reveal, and this run does not sum securely")
        try:
            self.secure.add_reveal(cid, msg.meta["model_key"], msg.meta["round"], msg.body)
        except SecureError as e:
            raise ProtocolError(f"secure-{e.reason}", str(e)) from None

    def masked_arrivals(self) -> list[Update]:
        """The round's masked updates as arrivals (loss and metrics only), by device id."""
        return [self.masked[c] for c in sorted(self.masked)]

    def on_receipt(self, cid: str, meta: Mapping[str, Any]) -> Receipt | None:
        """An aggregator holds ``cid``'s update: checked as the update would be, recorded (weights left there)."""
        wait = self.admit_update(cid, meta)
        if wait is None:
            return None
        if "n_samples" not in meta:
            raise ProtocolError("meta-field", "a receipt of an update must name its n_samples")
        upd = Receipt(cid, meta["round"], meta["model_key"], meta["n_samples"], meta.get("loss", float("nan")),
                      meta["metrics"], version=meta.get("version"))
        self.held_elsewhere[cid] = upd
        wait.answer("update", cid)
        self.pace.note_update(wait, cid)
        return upd

    def on_ae_update(self, cid: str, msg: Message, registered: int) -> None:
        """An autoencoder update (its sample count capped at the ``registered`` one), checked and recorded."""
        m = msg.meta
        rnd = m["round"]
        if self.ae is None or rnd != self.round or cid not in self.tasked or m["model_key"] != "ae":
            raise ProtocolError("stale-update", f"AE update for round {rnd}, model {m['model_key']!r} "
                                                f"(current {self.round}, tasked: {cid in self.tasked})")
        n = min(m["n_samples"], registered)
        self.ae.receive(cid, parse_tensors(msg.body, spec=self.ae.spec), n, m.get("loss", float("nan")))
        self.awaited.answer("ae", cid)

    def on_metrics(self, cid: str, m: Mapping[str, Any]) -> None:
        """A device's evaluation, for the round in hand: recorded if it was asked, for the model it was asked."""
        if m["round"] != self.round:
            return
        if not self.eval_keys:
            return  # no evaluation under way: nothing reads it
        key = self.eval_keys.get(cid)
        if key is None:
            self.link.reject("unasked-metrics",
                             f"metrics for round {m['round']} from a device not asked to evaluate", cid)
            return
        if m["model_key"] != key:
            self.link.reject("wrong-model", f"metrics for model {m['model_key']!r}; this device was asked to "
                                             f"evaluate {key!r}", cid)
            return
        self.metrics[cid] = dict(m)
        self.awaited.answer("metrics", cid)
