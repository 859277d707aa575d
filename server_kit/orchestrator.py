"""The MQTT driver: a real federation of client processes behind a broker.

The :class:`Orchestrator` runs a :class:`~server_kit.strategy.Strategy` over
clients it reaches through a transport (:class:`edge_sdk.transport.MqttTransport`,
or its in-memory twin in unit tests):

1. registration: clients say hello (the server broadcasts a request, so
   clients started before it re-register); closed by quorum or deadline;
2. if the strategy pre-trains the sketch autoencoder (``strategy.pretrain``,
   "fedsketch-fedae"): FedAvg rounds of the autoencoder over the clients'
   images (model key "ae"), then its encoder exported to ONNX and sent to
   every client (model key "encoder", raw .onnx bytes, sha256 in meta);
3. if the strategy clusters from sketches: ask every client for its sketch,
   collect until quorum or deadline, cluster once, tell each client its model;
4. rounds: deliver each client the models it needs (see below), command the
   round's clients to train, collect updates until quorum or deadline (a
   client that vanished, announced by its last will, is not waited for),
   aggregate, checkpoint;
5. a final evaluation: one broadcast ``evaluate`` command (each device
   evaluates the model it was assigned), of all the assigned online devices
   or of a seeded sample of them (``eval_fraction``, at least one per
   cluster; :func:`edge_sdk.sampling.in_sample` tells the server and each
   device alike who is in it).

Model delivery (``ServerConfig.model_delivery``): a device starts subscribed
to ``clusters/+/model``, so a model published there reaches it whatever its
cluster. ``"client"`` publishes each model a client needs on that client's
own command topic, just before the command that uses it: each device
downloads exactly its models (with K clusters, 1/K of the broadcast's bytes),
and the server sends one copy per client. ``"cluster"`` publishes each model
once on its cluster topic: one copy from the server, every online client
downloads all of them. ``"auto"`` (the default) keeps each device's downloads
exactly what it needs and sends as few copies as that allows: after the
assignment of a clustered strategy each device follows only its own cluster's
topic (the ``assign`` command's ``follow``; the device confirms with a status
saying what it follows, sent after its (un)subscriptions, and until then the
server counts it as following both its old and its new topics, and after a
hello (a reconnected device follows what it was told, a restarted one every
model) as following any); a model goes once on its cluster topic when every
online device that may follow that topic needs it (and has confirmed what it
follows), and per device on the command topics otherwise. So the final
evaluation of a whole cluster, or a round that trains every member, goes once
per cluster, and a round that samples 75 of 3,550 devices goes per device;
each round records which in ``deliveries`` (``cluster_topic``: publications on
cluster topics, ``per_device``: copies on command topics), as does the final
evaluation. ``delivered`` and each round's ``model_bytes_delivered`` count the
bytes the devices download, as the broker delivers them.

Nothing is retained on the broker (the shipped configuration has
``retain_available false``): a device that loses its connection keeps its
persistent session (:class:`edge_sdk.transport.MqttTransport` connects with
``clean_session`` false on MQTT 3.1.1, ``clean_start`` false with a session
expiry of ``BrokerConfig.session_expiry_s``, one hour by default, on MQTT 5),
so the QoS 1 models and commands published while it was away, on its command
topic and on the cluster topic it follows, are delivered when it comes back;
a device away longer than the session expiry says hello again and is sent
its assignment anew.

Per message, the server's work does not grow with the fleet: every phase
waits on a set of the clients it still expects (:class:`_Awaited`), updated
in O(1) by the message handlers and by status changes, instead of scanning
the clients before each message.

Every message from a client is validated on arrival (envelope, sender vs
topic, registration, round, tensor names/shapes/dtypes, NaN); a bad one is
logged and counted, never fatal. State after every round goes to a
checkpoint folder (JSON + safetensors), and :meth:`Orchestrator.run` with
``resume=True`` continues a killed server from its last finished round.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edge_sdk.protocol import (
    SERVER_ID,
    Kind,
    Message,
    ProtocolError,
    Topics,
    parse_sketch,
    parse_tensors,
    tensors_body,
)
from edge_sdk.rejections import RejectionLog
from edge_sdk.sampling import in_sample, sample_point
from edge_sdk.schema import check_meta
from edge_sdk.sketch import Sketch
from edge_sdk.worker import Update

from .strategy import ClientInfo, ClusteredFedAvg, Strategy

__all__ = ["Orchestrator", "ServerConfig"]

#: Admissions logged one by one at INFO while a fleet registers; the rest at DEBUG.
ADMISSIONS_LOGGED = 20

log = logging.getLogger(__name__)

#: How models reach the clients (see the module docstring).
MODEL_DELIVERY = ("auto", "client", "cluster")


@dataclass(frozen=True)
class ServerConfig:
    """Settings of a server run (validated on construction)."""

    federation: str = "default"
    root: str = "fedsketch"
    rounds: int = 10
    min_clients: int = 2
    register_timeout_s: float = 60.0
    #: At the registration deadline, the run starts if this share of ``min_clients`` was admitted.
    register_quorum: float = 0.5
    sketch_quorum: float = 1.0
    sketch_timeout_s: float = 60.0
    round_quorum: float = 1.0
    round_timeout_s: float = 120.0
    #: Deadline of the first round, which includes every device's start-up (default: 3 x round_timeout_s).
    first_round_timeout_s: float | None = None
    #: A round stays open this long past a device's last "still training" report (a device reports every 10 s).
    progress_grace_s: float = 30.0
    #: Longest any round may stay open, progress or not (default: 10 x round_timeout_s).
    max_round_s: float | None = None
    eval_timeout_s: float = 60.0
    #: Share of the assigned devices the final evaluation asks (a seeded sample, at least one per cluster).
    eval_fraction: float = 1.0
    num_classes: int = 10
    flip_prob: float = 0.1
    #: None: the shipped encoder that takes the fleet's samples.
    encoder: str | None = None
    latent_dim: int | None = None
    #: None: the shipped classifier that takes the fleet's samples.
    architecture: str | None = None
    seed: int = 0
    checkpoint_dir: str | None = None
    stop_clients: bool = True
    model_delivery: str = "auto"

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {self.rounds}")
        if self.min_clients < 1:
            raise ValueError(f"min_clients must be a positive integer, got {self.min_clients}")
        for name in ("sketch_quorum", "round_quorum", "register_quorum", "eval_fraction"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        for name in ("register_timeout_s", "sketch_timeout_s", "round_timeout_s", "eval_timeout_s",
                     "progress_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("first_round_timeout_s", "max_round_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive or None, got {getattr(self, name)}")
        if not 0.0 <= self.flip_prob <= 0.5:
            raise ValueError(f"flip_prob must be in [0, 0.5], got {self.flip_prob}")
        if self.model_delivery not in MODEL_DELIVERY:
            raise ValueError(f"model_delivery must be one of {list(MODEL_DELIVERY)}, got {self.model_delivery!r}")


@dataclass
class _ClientState:
    info: ClientInfo
    online: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    #: Whether it can train (torch): a device that cannot is never tasked to.
    trains: bool = True
    #: The round it last said it is training, and when.
    working: tuple[int, float] | None = None


def _some(cids: list[str], shown: int = 20) -> str:
    """The first ``shown`` ids for a log line (a fleet's worth would flood the log)."""
    return ", ".join(cids[:shown]) + (f" ... ({len(cids)} in all)" if len(cids) > shown else "")


@dataclass
class _Follow:
    """The model topics the server knows a device follows (model keys; "+": every model)."""

    #: The keys whose topics it may get: while a change is unconfirmed, its old ones and the new ones.
    maybe: frozenset[str] = frozenset({"+"})
    #: Whether it confirmed that it follows exactly ``maybe``.
    confirmed: bool = True
    #: The follow it was last told in an assign (None: never told, it follows every model).
    told: frozenset[str] | None = None


_EVERY_MODEL = _Follow()


class _Awaited:
    """The clients a phase waits for: expected, not answered, not given up on, online.

    Handlers and status changes update it in O(1), so that the pump's
    stopping rule never scans the clients. ``kind`` names the phase, so that
    a stray message of another phase answers nothing.
    """

    def __init__(self, kind: str, expected: Any = (), online: Any = ()) -> None:
        self.kind = kind
        self.expected = frozenset(expected)
        self.answered: set[str] = set()
        self.given_up: set[str] = set()
        #: Expected, online, neither answered nor given up on.
        self.left = {c for c in self.expected if c in online}

    def answer(self, kind: str, cid: str) -> None:
        if kind == self.kind and cid in self.expected:
            self.answered.add(cid)
            self.left.discard(cid)

    def give_up(self, kind: str, cid: str) -> None:
        if kind == self.kind and cid in self.expected:
            self.given_up.add(cid)
            self.left.discard(cid)

    def set_online(self, cid: str, online: bool) -> None:
        if cid not in self.expected:
            return
        if not online:
            self.left.discard(cid)
        elif cid not in self.answered and cid not in self.given_up:
            self.left.add(cid)


class Orchestrator:
    """Drives a strategy over MQTT clients. See the module docstring."""

    def __init__(
        self,
        strategy: Strategy,
        transport: Any,
        config: ServerConfig,
        *,
        template: Mapping[str, np.ndarray] | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.strategy = strategy
        self.transport = transport
        self.config = config
        self.topics = Topics(config.root, config.federation)
        self.on_round = on_round
        self._inbox: queue.Queue[tuple[str, Message]] = queue.Queue(maxsize=100_000)
        self.clients: dict[str, _ClientState] = {}
        self.sketches: dict[str, Sketch] = {}
        self._updates: dict[str, Update] = {}
        self._metrics: dict[str, dict[str, Any]] = {}
        self._round = 0
        self._tasked: set[str] = set()
        #: The model keys each tasked client was sent this round: its update must name one of them.
        self._allowed: dict[str, frozenset[str]] = {}
        #: Tasked clients that answered this round for a model they were not sent: not waited for any longer.
        self._refused: set[str] = set()
        self._phase = "register"
        self._rejections = RejectionLog(log)
        #: Refused messages per reason (logged once per sender and reason per interval).
        self.rejected: dict[str, int] = self._rejections.counts
        self.history: list[dict[str, Any]] = []
        self.timings: dict[str, float] = {}
        #: Bytes of models (and encoders) the clients downloaded, per kind (see the module docstring).
        self.delivered: dict[str, int] = {}
        self._lock = threading.Lock()
        self._feature_shape: tuple[int, int] | None = None
        #: The encoder the clients sketch with (the federated one after pre-training); None until chosen.
        self.encoder_name = config.encoder
        #: The classifier architecture of the run; None until chosen (or when a template was given).
        self.architecture = config.architecture
        self.template: dict[str, np.ndarray] | None = None
        self._spec: dict[str, tuple[tuple[int, ...], str]] = {}
        self._latent: int | None = None
        self._input_size: int | None = None
        #: Hellos of devices not yet admitted nor refused (while the models are not chosen).
        self._pending: dict[str, dict[str, Any]] = {}
        #: Devices refused at registration, with the reason they were told.
        self.refused: dict[str, str] = {}
        #: Admitted devices left out of training, with the reason.
        self.not_training: dict[str, str] = {}
        #: The rounds each client was tasked in (a late update is told apart from a stray one).
        self._tasked_rounds: dict[str, set[int]] = {}
        self._went_offline: dict[str, int] = {}
        self._slowest_update_s = 0.0
        self._round_started = time.monotonic()
        if template is not None:
            self.template = {k: np.asarray(v) for k, v in template.items()}
        if (self.template is not None or self.architecture) and (self.encoder_name or not self._needs_encoder()):
            self._use_models(self.encoder_name, self.architecture, "as given")
        self._encoder_msg: tuple[dict[str, Any], bytes] | None = None
        self._encoder_tmp: tempfile.TemporaryDirectory[str] | None = None
        self._ae_spec: dict[str, tuple[tuple[int, ...], str]] = {}
        self._ae_updates: dict[str, tuple[dict[str, np.ndarray], int, float]] = {}
        self.pretrain_history: list[dict[str, Any]] = []
        #: Online admitted clients (kept by :meth:`_set_online`; counted without a scan).
        self._online: set[str] = set()
        #: The clients the current phase waits for.
        self._awaited = _Awaited("none")
        #: ``set(strategy.clusters())``, rebuilt after each strategy hook that may change it (None: stale).
        self._clustered: set[str] | None = None
        #: The model topics each device follows, as far as the server knows (absent: every model).
        self._follow: dict[str, _Follow] = {}
        #: Online devices told a new follow that have not confirmed it yet.
        self._follow_pending: set[str] = set()
        #: The model key each device was last told in an assign (what a broadcast evaluate makes it evaluate).
        self._told_key: dict[str, str] = {}
        #: During the final evaluation: the devices asked, and the model key each must evaluate.
        self._eval_keys: dict[str, str] = {}

    # -- models and admission -------------------------------------------
    def _needs_encoder(self) -> bool:
        return (self.strategy.needs_sketches and self.strategy.summary_kind == "sketch"
                and getattr(self.strategy, "pretrain", None) is None)

    @property
    def models_chosen(self) -> bool:
        return self.template is not None

    def _use_models(self, encoder: str | None, architecture: str | None, how: str) -> None:
        """Fix the run's encoder and architecture: template, tensor spec, latent size, input size."""
        from edge_sdk.artifacts import input_size

        self.encoder_name, self.architecture = encoder, architecture
        if self.template is None:
            from edge_sdk.trainer import initial_weights

            self.template = {k: np.asarray(v) for k, v in initial_weights(architecture, self.config.seed).items()}
        self._spec = {k: (tuple(v.shape), str(v.dtype)) for k, v in self.template.items()}
        if self._needs_encoder():
            self._latent = self.config.latent_dim or self._encoder_latent(encoder)
        self._input_size = ((input_size(architecture) if architecture else None)
                            or (input_size(encoder) if encoder else None))
        if hasattr(self.strategy, "architecture") and self.strategy.architecture is None:
            self.strategy.architecture = architecture  # IFCA builds its K models from it
        if how != "as given":
            log.info("models: encoder %s, architecture %s (%s)", encoder, architecture, how)

    def _choose_models(self) -> None:
        """After registration: the models of the run, then each waiting device admitted or refused."""
        if not self.models_chosen:
            from .admission import choose_models

            enc, arch, how = choose_models(self._pending, self.encoder_name, self.architecture)
            self._use_models(enc, arch, how)
        for cid in sorted(self._pending):
            self._admit(cid, self._pending.pop(cid))

    def _admit(self, cid: str, hello: Mapping[str, Any]) -> bool:
        """Admit a device (welcome: what to use) or refuse it (with the reason, which makes it exit)."""
        from .admission import can_train, refusal

        reason = refusal(hello, input_size=self._input_size, num_classes=self.config.num_classes)
        if reason is not None:
            self.refused[cid] = reason
            self.clients.pop(cid, None)
            self._set_online(cid, False)
            log.warning("refused client %s: %s", cid, reason)
            self._cmd(cid, "refused", reason=reason)
            return False
        self.refused.pop(cid, None)
        known = self.clients.get(cid)
        n = hello["n_samples"]
        if known is not None and n != known.info.n_samples:
            # the sample count weighs this device's updates: it is fixed at registration
            log.warning("client %s says hello with %d samples, registered with %d: keeping %d",
                        cid, n, known.info.n_samples, known.info.n_samples)
            n = known.info.n_samples
        trains = can_train(hello)
        info = ClientInfo(cid, n, hello["classes_present"], tuple(hello["capabilities"]))
        self.clients[cid] = _ClientState(info, trains=trains)
        self._set_online(cid, True)
        why = None if trains else "no torch on the device (pip install 'fedsketch[train]')"
        if why:
            self.not_training[cid] = why
        else:
            self.not_training.pop(cid, None)
        welcome: dict[str, Any] = {"num_classes": self.config.num_classes, "train": trains}
        if self.architecture:
            welcome["architecture"] = self.architecture
        if self.encoder_name:
            welcome["encoder"] = self.encoder_name
        if why:
            welcome["reason"] = why
        self._cmd(cid, "welcome", **welcome)
        if known is None:
            # a fleet registering at once: the first few, then DEBUG (the count closes registration)
            loud = self._phase != "register" or len(self.clients) <= ADMISSIONS_LOGGED or not trains
            log.log(logging.INFO if loud else logging.DEBUG, "client %s admitted (%d samples, %d classes%s)", cid,
                    n, info.classes_present, "" if trains else f"; sketches and evaluates, never trains: {why}")
            if self._phase == "register" and len(self.clients) == ADMISSIONS_LOGGED + 1:
                log.info("more clients are registering: each one logged at DEBUG (-v), the count when "
                         "registration closes")
        elif not known.online:
            log.info("client %s is back", cid)
        return True

    def trainable(self) -> list[str]:
        """Online admitted clients that can train (a scan: once per phase, never per message)."""
        return sorted(c for c, s in self.clients.items() if s.online and s.trains)

    def _set_online(self, cid: str, online: bool) -> None:
        """Keep the online set, the phase's wait and the pending follow confirmations in step (O(1))."""
        if online:
            self._online.add(cid)
            st = self._follow.get(cid)
            if st is not None and not st.confirmed:
                self._follow_pending.add(cid)
        else:
            self._online.discard(cid)
            self._follow_pending.discard(cid)
        self._awaited.set_online(cid, online)

    # -- assignment and the model topics each device follows ----------------
    def _in_clusters(self, cid: str) -> bool:
        """``cid in strategy.clusters()``, from a set rebuilt only after the strategy's hooks."""
        if self._clustered is None:
            self._clustered = set(self.strategy.clusters())
        return cid in self._clustered

    def _narrows(self) -> bool:
        """Whether assigned devices follow only their own cluster's topic (auto delivery, a clustering)."""
        return (self.config.model_delivery == "auto" and isinstance(self.strategy, ClusteredFedAvg)
                and bool(self.strategy.assignment))

    def _assign(self, cid: str, key: str) -> None:
        """Tell a device its model; with :meth:`_narrows`, also that it follows only that model's topic."""
        if self._clustered is not None:
            self._clustered.add(cid)  # assign_late or the clustering made it a member
        meta: dict[str, Any] = {"model_key": key}
        if self._narrows():
            new = frozenset({key})
            st = self._follow.setdefault(cid, _Follow())
            if not (st.confirmed and st.maybe == new):
                # until it confirms, it may get its old topics and the new one
                st.maybe, st.confirmed, st.told = st.maybe | new, False, new
                if cid in self._online:
                    self._follow_pending.add(cid)
                meta["follow"] = sorted(new)
        self._told_key[cid] = key
        self._cmd(cid, "assign", **meta)

    def _on_follow(self, cid: str, keys: list[str]) -> None:
        """A device confirms the model topics it follows (its status, sent after its (un)subscriptions)."""
        got = frozenset(keys)
        st = self._follow.get(cid)
        if st is None or st.told is None or got == st.told:
            st = self._follow.setdefault(cid, _Follow())
            st.maybe, st.confirmed = got, True
            self._follow_pending.discard(cid)
        # else: the answer to an earlier assign; the latest one's answer is on its way

    def _forget_follow(self, cid: str) -> None:
        """A device says hello again: reconnected, it follows what it was told; restarted, every model.

        Until it confirms a follow again, it may get any topic (no model goes
        on a cluster topic it may follow); and it may have forgotten its model.
        """
        st = self._follow.get(cid)
        if st is not None and st.told is not None:
            st.maybe, st.confirmed = frozenset({"+"}), False
        self._told_key.pop(cid, None)

    def _await_follow(self) -> None:
        """Give the devices told a new follow a moment to confirm it (bounded; the unconfirmed get copies)."""
        if not self._follow_pending:
            return
        limit = min(10.0, self.config.round_timeout_s)
        if not self._pump(lambda: not self._follow_pending, limit):
            log.warning("%d device(s) did not confirm their model topic within %g s: their models go per device",
                        len(self._follow_pending), limit)

    # -- plumbing ---------------------------------------------------------
    @staticmethod
    def _encoder_latent(name: str) -> int:
        from edge_sdk.artifacts import load_manifest

        spec = load_manifest().get(name)
        if spec is None or spec.latent_dim is None:
            raise ValueError(f"encoder {name!r} is not in the model manifest or has no latent size")
        return spec.latent_dim

    def _reject(self, reason: str, detail: str, sender: str = "?") -> None:
        self._rejections(reason, sender, detail)

    def _enqueue(self, topic: str, msg: Message) -> None:
        try:
            self._inbox.put_nowait((topic, msg))
        except queue.Full:
            self._reject("inbox-full", f"dropping {msg.kind.name}", msg.sender)

    def _subscribe(self) -> None:
        for leaf in ("hello", "sketch", "update", "status", "metrics"):
            self.transport.subscribe(self.topics.all_clients(leaf), self._enqueue)

    def _send(self, topic: str, kind: Kind, *, meta: Mapping[str, Any] | None = None, body: bytes = b"",
              retain: bool = False) -> int:
        msg = Message(kind, self.config.federation, SERVER_ID, self._round, dict(meta or {}), body)
        return self.transport.publish(topic, msg, retain=retain)

    def _cmd(self, cid: str, op: str, **meta: Any) -> None:
        self._send(self.topics.cmd(cid), Kind.CMD, meta={"op": op, **meta})

    def _broadcast(self, op: str, **meta: Any) -> None:
        self._send(self.topics.broadcast(), Kind.CMD, meta={"op": op, **meta})

    def _pump(self, until: Callable[[], bool], timeout: float) -> bool:
        """Handle incoming messages until ``until()`` or the deadline; returns whether ``until`` held."""
        deadline = time.monotonic() + timeout
        while True:
            if until():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return until()
            try:
                topic, msg = self._inbox.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            self._handle_safely(topic, msg)

    def _handle_safely(self, topic: str, msg: Message) -> None:
        """Handle one message; whatever it raises is a counted rejection, never the end of the server."""
        try:
            self._handle(topic, msg)
        except ProtocolError as e:
            self._reject(e.reason, f"{msg.kind.name}: {e}", msg.sender)
        except (ValueError, KeyError, TypeError) as e:
            self._reject("invalid", f"{msg.kind.name}: {e}", msg.sender)
        except Exception as e:  # a handler bug a message could trigger: count it, keep serving
            log.debug("handler error on %s from %s", msg.kind.name, msg.sender, exc_info=True)
            self._reject("handler-error", f"{msg.kind.name}: {type(e).__name__}: {e}", msg.sender)

    # -- message handling -----------------------------------------------
    def _handle(self, topic: str, msg: Message) -> None:
        cid = msg.sender
        msg = dataclasses.replace(msg, meta=check_meta(msg))  # every field a handler reads, checked
        if msg.kind == Kind.HELLO:
            self._on_hello(cid, msg)
            return
        state = self.clients.get(cid)
        if state is None and cid in self._pending:
            return  # registered, admitted once the models are chosen: its status adds nothing yet
        if state is None:
            self._reject("unknown-client", f"{msg.kind.name} from an unregistered client", cid)
            return
        state.last_seen = time.monotonic()
        if msg.kind == Kind.STATUS:
            online = msg.meta["state"] != "offline"
            if state.online and not online:
                log.info("client %s is offline", cid)
                self._went_offline[cid] = self._round
            state.online = online
            self._set_online(cid, online)
            if "working" in msg.meta:
                state.working = (msg.meta["working"], time.monotonic())
            if "follow" in msg.meta:
                self._on_follow(cid, msg.meta["follow"])
        elif msg.kind in (Kind.SKETCH, Kind.FEATURES):
            self._on_sketch(cid, msg)
        elif msg.kind == Kind.UPDATE and self._phase == "pretrain":
            self._on_ae_update(cid, msg)
        elif msg.kind == Kind.UPDATE:
            self._on_update(cid, msg)
        elif msg.kind == Kind.METRICS:
            if msg.meta["round"] == self._round:
                self._on_metrics(cid, msg.meta)
        else:
            self._reject("kind", f"unexpected {msg.kind.name}", cid)

    def _on_hello(self, cid: str, msg: Message) -> None:
        """A device (re)announces itself: admit or refuse it now, or once the models are chosen."""
        m = msg.meta  # checked by the schema: n_samples in [1, 2**31), classes_present in [0, 65535]
        if not self.models_chosen:
            if cid not in self._pending:
                log.info("client %s registered (%d samples, %s)", cid, m["n_samples"],
                         "x".join(map(str, m.get("input_shape", []))) or "shape not said")
            self._pending[cid] = m
            return
        self._forget_follow(cid)
        if not self._admit(cid, m):
            return
        info = self.clients[cid].info
        if self._phase == "train" and not self._in_clusters(cid):
            self._admit_late(cid, info)
        elif self._phase == "train":
            self._assign(cid, self.strategy.model_key_for(cid))

    def _admit_late(self, cid: str, info: ClientInfo) -> None:
        if self.strategy.needs_sketches:
            if cid in self.sketches:
                key = self.strategy.assign_late(cid, self.sketches[cid], info)
                self._assign(cid, key)
            else:
                log.info("late client %s: asking for its sketch", cid)
                self._ask_sketch(cid)
        else:
            key = self.strategy.assign_late(cid, None, info)
            self._assign(cid, key)

    def _sketch_request(self) -> dict[str, Any]:
        encoder = {"encoder": self.encoder_name} if self.encoder_name else {}  # LADD's spectra need none
        return {**encoder, "num_classes": self.config.num_classes, "flip_prob": self.config.flip_prob,
                "summary": self.strategy.summary_kind, "params": dict(self.strategy.summary_params)}

    def _ask_sketch(self, cid: str) -> None:
        if self._encoder_msg is not None and self._phase == "train":
            self._send_encoder([cid])  # a late client has not got the federated encoder yet
        self._cmd(cid, "sketch", **self._sketch_request())

    def _on_features(self, cid: str, msg: Message) -> Any:
        """A float summary (e.g. LADD's spectra): one finite float32 (num_classes, W) tensor."""
        if msg.meta.get("summary") != self.strategy.summary_kind:
            raise ProtocolError("meta", f"summary {msg.meta.get('summary')!r} is not the "
                                        f"{self.strategy.summary_kind!r} this server asked for")
        arr = parse_tensors(msg.body)
        feats = arr.get("features")
        if set(arr) != {"features"} or feats is None or feats.dtype != np.float32 or feats.ndim != 2:
            raise ProtocolError("tensor-name", "a features message holds one float32 2-D tensor 'features'")
        shape = self._feature_shape or (self.config.num_classes, feats.shape[1])
        if feats.shape != shape:
            raise ProtocolError("tensor-shape", f"features of shape {feats.shape}, expected {shape}")
        self._feature_shape = shape
        return feats

    def _on_sketch(self, cid: str, msg: Message) -> None:
        if self.strategy.summary_kind == "sketch":
            if msg.kind != Kind.SKETCH:
                raise ProtocolError("kind", f"expected a SKETCH, got {msg.kind.name}")
            sk: Any = parse_sketch(msg.body, num_classes=self.config.num_classes, latent_dim=self._latent)
        else:
            if msg.kind != Kind.FEATURES:
                raise ProtocolError("kind", f"expected FEATURES, got {msg.kind.name}")
            sk = self._on_features(cid, msg)
        self.sketches[cid] = sk
        self._awaited.answer("sketch", cid)
        if self._phase == "train" and not self._in_clusters(cid):
            key = self.strategy.assign_late(cid, sk, self.clients[cid].info)
            self._assign(cid, key)

    def _on_update(self, cid: str, msg: Message) -> None:
        m = msg.meta
        rnd = m["round"]
        if rnd < self._round and rnd in self._tasked_rounds.get(cid, ()):
            # the documented rule: an update for a closed round is refused (its model has moved on), logged
            self._reject("late-update", f"update for round {rnd} arrived after the round closed (now round "
                                        f"{self._round}); refused, the device trains again from the new model",
                         cid)
            return
        if rnd != self._round or cid not in self._tasked:
            self._reject("stale-update", f"update for round {rnd} (current {self._round}, "
                                         f"tasked: {cid in self._tasked})", cid)
            return
        key = m["model_key"]
        if key not in self._allowed.get(cid, ()):
            self._refused.add(cid)
            self._awaited.give_up("update", cid)
            self._reject("wrong-model", f"update for model {key!r} in round {rnd}; this client was sent "
                                        f"{sorted(self._allowed.get(cid, ()))}", cid)
            return
        n = m["n_samples"]  # Strategy.aggregate weighs it by the count the device registered, never more
        # (bad tensors do not end the wait: they may be a forgery on a broker without the ACL, or damage)
        weights = parse_tensors(msg.body, spec=self._spec)
        self._updates[cid] = Update(cid, rnd, key, weights, n, m.get("loss", float("nan")), m["metrics"])
        self._awaited.answer("update", cid)
        self._slowest_update_s = max(self._slowest_update_s, time.monotonic() - self._round_started)

    def _on_ae_update(self, cid: str, msg: Message) -> None:
        m = msg.meta
        rnd = m["round"]
        if rnd != self._round or cid not in self._tasked or m["model_key"] != "ae":
            self._reject("stale-update", f"AE update for round {rnd}, model {m['model_key']!r} "
                                         f"(current {self._round}, tasked: {cid in self._tasked})", cid)
            return
        n = min(m["n_samples"], self.clients[cid].info.n_samples)
        weights = parse_tensors(msg.body, spec=self._ae_spec)
        self._ae_updates[cid] = (weights, n, m.get("loss", float("nan")))
        self._awaited.answer("ae", cid)

    def _on_metrics(self, cid: str, m: Mapping[str, Any]) -> None:
        if not self._eval_keys:
            return  # no evaluation under way: nothing reads it
        key = self._eval_keys.get(cid)
        if key is None:
            self._reject("unasked-metrics", f"metrics for round {m['round']} from a device not asked to evaluate",
                         cid)
            return
        if m["model_key"] != key:
            self._reject("wrong-model", f"metrics for model {m['model_key']!r}; this device was asked to "
                                        f"evaluate {key!r}", cid)
            return
        self._metrics[cid] = dict(m)
        self._awaited.answer("metrics", cid)

    # -- phases -------------------------------------------------------------
    def online(self) -> list[str]:
        """Online admitted clients."""
        return sorted(c for c, s in self.clients.items() if s.online)

    def _register(self) -> None:
        t0 = time.monotonic()
        self._broadcast("hello")
        need = self.config.min_clients
        quorum = max(1, int(np.ceil(self.config.register_quorum * need)))

        def count() -> int:
            return len(self.clients) + len(self._pending)

        ok = self._pump(lambda: count() >= need, self.config.register_timeout_s)
        # let stragglers of the same start register too (short grace)
        self._pump(lambda: False, 0.5)
        if not ok:
            if count() < quorum:
                raise TimeoutError(
                    f"only {count()} of the {need} clients needed registered within "
                    f"{self.config.register_timeout_s:g} s (at least {quorum} to start: --register-quorum)")
            log.warning("registration deadline: starting with %d of the %d clients asked for (quorum %d)",
                        count(), need, quorum)
        self._choose_models()
        self.timings["register_s"] = time.monotonic() - t0
        if len(self.clients) < quorum:
            raise RuntimeError(f"only {len(self.clients)} client(s) admitted, {quorum} needed; refused: "
                               + "; ".join(f"{c}: {r}" for c, r in sorted(self.refused.items())))
        if not self.trainable():
            raise RuntimeError(f"none of the {len(self.clients)} admitted clients can train "
                               f"({'; '.join(f'{c}: {r}' for c, r in sorted(self.not_training.items()))}): "
                               "install torch on the devices (pip install 'fedsketch[train]')")
        log.info("registration closed: %d clients admitted (%d train)%s", len(self.clients),
                 len(self.trainable()), f", {len(self.refused)} refused" if self.refused else "")

    def _pretrain_ae(self) -> None:
        """Federated pre-training of the sketch autoencoder, then its encoder sent to every client."""
        from edge_sdk.trainer import initial_weights, state_spec

        from .aggregate import StreamingFedAvg
        from .pretrain import export_encoder
        from .strategy import pretrain_config

        t0 = time.monotonic()
        cfg = pretrain_config(self.strategy.pretrain or {}, self.encoder_name)
        arch = cfg["architecture"]
        self._phase = "pretrain"
        weights = initial_weights(arch, self.config.seed)
        self._ae_spec = state_spec(weights)
        for rnd in range(1, cfg["rounds"] + 1):
            tr = time.monotonic()
            self._round = rnd
            self._ae_updates = {}
            pool = self.trainable()
            m = max(1, int(np.ceil(cfg["fraction"] * len(pool))))
            chosen = pool if m >= len(pool) else sorted(
                np.random.default_rng([self.config.seed, rnd, 7919]).choice(pool, size=m, replace=False).tolist())
            self._tasked = set(chosen)
            self._awaited = _Awaited("ae", chosen, self._online)
            size, _ = self._deliver({c: ["ae"] for c in chosen}, {"ae": ({"key": "ae"}, tensors_body(weights))},
                                    "AE_MODEL")
            for cid in chosen:
                self._cmd(cid, "train_ae", round=rnd, architecture=arch, epochs=cfg["epochs"], lr=cfg["lr"],
                          batch_size=cfg["batch_size"])
            need = max(1, int(np.ceil(self.config.round_quorum * len(chosen))))

            def done(need: int = need) -> bool:
                return len(self._ae_updates) >= need or not self._awaited.left

            self._pump(done, self.config.round_timeout_s)
            got = {c: self._ae_updates[c] for c in sorted(self._ae_updates)}
            missing = sorted(self._tasked - set(got))
            if missing:
                log.warning("AE round %d closed without %d client(s): %s", rnd, len(missing), _some(missing))
            if got:
                agg = StreamingFedAvg(weights)
                for w, n, _ in got.values():
                    agg.add(w, n)
                weights = agg.result()
            n_tot = sum(n for _, n, _ in got.values())
            loss = sum(loss * n for _, n, loss in got.values()) / n_tot if n_tot else None
            self.pretrain_history.append({"round": rnd, "tasked": len(chosen), "updates": len(got),
                                          "missing": missing, "loss": loss, "model_bytes_delivered": size,
                                          "seconds": time.monotonic() - tr})
            log.info("AE pre-training round %d: %d/%d updates, MSE %s", rnd, len(got), len(chosen), loss)
        self._tasked = set()
        self._round = 0
        if self.config.checkpoint_dir:
            out = Path(self.config.checkpoint_dir) / "encoder"
        else:
            self._encoder_tmp = tempfile.TemporaryDirectory(prefix="fedsketch-fedae-")
            out = Path(self._encoder_tmp.name)
        name = f"fedae_{self.config.federation}"
        exported = export_encoder(weights, arch, out, name=name,
                                  metadata={"pretrain": {k: v for k, v in cfg.items()}})
        self._encoder_msg = ({"key": "encoder", "name": exported.name, "sha256": exported.sha256,
                              "entry": dict(exported.entry)}, exported.path.read_bytes())
        self.encoder_name = exported.name
        self._latent = int(exported.entry["latent_dim"])
        self._send_encoder(self.online())
        self._phase = "register"
        self.timings["pretrain_s"] = time.monotonic() - t0
        log.info("federated encoder %s (%d bytes, latent %d) sent", exported.name, exported.nbytes, self._latent)

    def _send_encoder(self, cids) -> None:
        """Deliver the federated encoder to ``cids`` (all online ones at once: broadcast, a late one: to it)."""
        assert self._encoder_msg is not None
        self._deliver({c: ["encoder"] for c in cids}, {"encoder": self._encoder_msg}, "ENCODER")

    def _cluster(self) -> None:
        t0 = time.monotonic()
        cids = self.online()
        self._awaited = awaited = _Awaited("sketch", cids, self._online)
        for cid in cids:
            if cid in self.sketches:
                awaited.answer("sketch", cid)
        # the same request for every admitted device: one broadcast (a device not admitted ignores it)
        self._broadcast("sketch", **self._sketch_request())
        need = max(1, int(np.ceil(self.config.sketch_quorum * len(cids))))
        self._pump(lambda: len(awaited.answered) >= need, self.config.sketch_timeout_s)
        got = {c: self.sketches[c] for c in cids if c in self.sketches}
        if len(got) < need:
            log.warning("sketch deadline: %d of %d sketches (quorum %d); clustering those", len(got), len(cids), need)
        if not got:
            raise TimeoutError("no sketch arrived before the deadline")
        self.timings["sketch_collect_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        self.strategy.on_sketches(got)
        self._clustered = None
        self.timings["clustering_s"] = time.monotonic() - t1

    def _announce_assignment(self) -> None:
        assigned = self.strategy.clusters()
        self._clustered = set(assigned)
        for cid in self.online():
            if cid in assigned:
                self._assign(cid, self.strategy.model_key_for(cid))
            else:
                self._admit_late(cid, self.clients[cid].info)

    def _deliver(self, needs: Mapping[str, Any], messages: Mapping[str, tuple[dict[str, Any], bytes]],
                 counter: str) -> tuple[int, dict[str, int]]:
        """Get each client of ``needs`` (client id -> model keys) the ``messages`` (key -> meta, body) it needs.

        On the cluster topics or per client, by ``config.model_delivery`` (see
        the module docstring); adds the bytes the clients download to
        ``delivered[counter]``. Returns those bytes and the publications:
        ``{"cluster_topic": n, "per_device": m}``.
        """
        needs = {cid: sorted(set(keys)) for cid, keys in needs.items()}
        keys = sorted({k for ks in needs.values() for k in ks})
        mode = self.config.model_delivery
        total = 0
        on_topic: dict[str, set[str]] = {}
        if mode == "cluster":
            receivers = set(self.online()) | set(needs)  # every online client subscribes to clusters/+/model
            on_topic = {key: receivers for key in keys}
        elif mode == "auto":
            on_topic = self._topic_receivers(needs, keys)
        for key, receivers in sorted(on_topic.items()):
            meta, body = messages[key]
            total += self._send(self.topics.model(key), Kind.MODEL, meta=meta, body=body) * len(receivers)
        per_device = 0
        for cid, ks in needs.items():
            for key in ks:
                if cid not in on_topic.get(key, ()):
                    meta, body = messages[key]
                    total += self._send(self.topics.cmd(cid), Kind.MODEL, meta=meta, body=body)
                    per_device += 1
        self.delivered[counter] = self.delivered.get(counter, 0) + total
        return total, {"cluster_topic": len(on_topic), "per_device": per_device}

    def _topic_receivers(self, needs: Mapping[str, list[str]], keys: list[str]) -> dict[str, set[str]]:
        """The keys that may go once on their cluster topic, each with the devices that get it there.

        A key qualifies when every online device that may follow its topic
        needs it and has confirmed what it follows (so nobody downloads a
        model it does not need, nor one twice through an old and a new
        subscription, and nobody misses one); its other needers get copies
        on their command topics. One pass over the online devices, per step.
        """
        wanted = set(keys)
        receivers: dict[str, set[str]] = {k: set() for k in keys}
        blocked: set[str] = set()
        for cid in self.online():
            st = self._follow.get(cid, _EVERY_MODEL)
            mine = needs.get(cid, ())
            for key in (wanted if "+" in st.maybe else st.maybe & wanted):
                if st.confirmed and key in mine:
                    receivers[key].add(cid)
                else:
                    blocked.add(key)
        return {k: r for k, r in receivers.items() if r and k not in blocked}

    def _deliver_models(self, needs: Mapping[str, Any]) -> tuple[int, dict[str, int]]:
        """Deliver strategy models (key -> its current weights) to the clients that need them."""
        keys = {k for ks in needs.values() for k in ks}
        messages = {k: ({"key": k}, tensors_body(self.strategy.models[k])) for k in keys}
        return self._deliver(needs, messages, "MODEL")

    def _run_round(self, rnd: int) -> dict[str, Any]:
        t0 = time.monotonic()
        self._round = rnd
        self._updates = {}
        self._refused = set()
        self._round_started = t0
        tasks = self.strategy.configure_round(rnd, self.trainable())
        self._tasked = {t.cid for t in tasks}
        self._allowed = {t.cid: frozenset(t.models) for t in tasks}
        for t in tasks:
            self._tasked_rounds.setdefault(t.cid, set()).add(rnd)
        self._awaited = _Awaited("update", self._tasked, self._online)
        # what each client is offered (IFCA: all K), as the devices download it
        delivered, deliveries = self._deliver_models({t.cid: list(t.models) for t in tasks})
        log.info("round %d: models once on %d cluster topic(s), %d copies per device", rnd,
                 deliveries["cluster_topic"], deliveries["per_device"])
        arch = {"architecture": self.architecture} if self.architecture else {}
        for t in tasks:
            self._cmd(t.cid, "train", round=rnd, models=sorted(t.models), evaluate_first=t.evaluate_first,
                      **arch, **t.settings.to_dict())
        need = max(1, int(np.ceil(self.config.round_quorum * len(tasks))))

        awaited = self._awaited

        def waiting() -> list[str]:
            return sorted(awaited.left)

        def done() -> bool:
            # quorum reached, or nobody left worth waiting for (the rest went offline): O(1)
            return len(self._updates) >= need or not awaited.left

        self._wait_round(rnd, done, waiting)
        updates = [self._updates[c] for c in sorted(self._updates)]
        missing = sorted(self._tasked - set(self._updates))
        if missing:
            log.warning("round %d closed without %d client(s): %s", rnd, len(missing), _some(missing))
        summary = self.strategy.aggregate(rnd, updates) if updates else {"updates": 0}
        self._clustered = None  # the strategy may have clustered (update-based methods)
        before = [u.metrics["acc_before"] for u in updates if "acc_before" in u.metrics]
        before_per_model: dict[str, list[float]] = {}
        for u in updates:
            if "acc_before" in u.metrics:
                before_per_model.setdefault(u.model_key, []).append(float(u.metrics["acc_before"]))
        rec = {
            "round": rnd, "tasked": len(tasks), "updates": len(updates), "missing": missing,
            "acc_before": float(np.mean(before)) if before else None,
            # the same, per model the updates were for (what each cluster's model reached last round)
            "acc_before_per_model": {k: float(np.mean(v)) for k, v in sorted(before_per_model.items())},
            "loss": float(np.mean([u.loss for u in updates])) if updates else None,
            "model_bytes_delivered": delivered, "deliveries": deliveries,
            "clipped": int(summary.get("clipped", 0)), "refused_norm": int(summary.get("refused_norm", 0)),
            "summary": summary, "seconds": time.monotonic() - t0,
        }
        self.history.append(rec)
        self._checkpoint(rnd)
        if self.on_round:
            self.on_round(rec)
        log.info("round %d: %d/%d updates, loss %s", rnd, len(updates), len(tasks), rec["loss"])
        return rec

    def round_deadline(self, rnd: int) -> float:
        """Seconds round ``rnd`` waits before it looks at progress reports.

        The first round includes every device's start-up (loading data, the
        first torch import): ``first_round_timeout_s`` (default 3 x
        ``round_timeout_s``). Later rounds wait ``round_timeout_s`` or twice
        the slowest update seen so far, whichever is longer.
        """
        c = self.config
        if rnd == 1 or not self._slowest_update_s:
            return c.first_round_timeout_s or 3 * c.round_timeout_s
        return max(c.round_timeout_s, 2 * self._slowest_update_s)

    def _wait_round(self, rnd: int, done: Callable[[], bool], waiting: Callable[[], list[str]]) -> None:
        """Pump until ``done()`` or the deadline; past it, wait on while devices report they still train.

        A tasked device sends "training round r" every 10 s while it trains;
        the round stays open while one of those not yet answered reported
        within ``progress_grace_s``, up to ``max_round_s`` in all. So a round
        never closes empty while its devices are working.
        """
        c = self.config
        start = time.monotonic()
        cap = c.max_round_s or 10 * c.round_timeout_s
        if self._pump(done, self.round_deadline(rnd)):
            return
        while time.monotonic() - start < cap:
            now = time.monotonic()
            working = [cid for cid in waiting() if (w := self.clients[cid].working) is not None
                       and w[0] == rnd and now - w[1] <= c.progress_grace_s]
            if not working:
                return
            log.info("round %d: past its deadline, %d device(s) still training (%s): waiting on",
                     rnd, len(working), ", ".join(working[:5]) + (" ..." if len(working) > 5 else ""))
            if self._pump(done, min(c.progress_grace_s, cap - (now - start))):
                return

    def _eval_sample(self, keys: Mapping[str, str]) -> tuple[list[str], list[str]]:
        """The devices the final evaluation asks: those of :func:`in_sample`, and one per cluster it missed.

        Returns the sampled devices (the broadcast reaches them) and the
        extra ones (asked one by one: the device of the smallest sample point
        in each cluster that has a device and none sampled).
        """
        f, seed = self.config.eval_fraction, self.config.seed
        sampled = [c for c in keys if in_sample(c, f, seed)]
        covered = {keys[c] for c in sampled}
        extra: dict[str, str] = {}
        for c in keys:
            k = keys[c]
            if k not in covered and (k not in extra or sample_point(c, seed) < sample_point(extra[k], seed)):
                extra[k] = c
        return sampled, sorted(extra.values())

    def _final_eval(self) -> dict[str, Any]:
        self._round = self.config.rounds + 1
        self._metrics = {}
        keys = {c: self.strategy.model_key_for(c) for c in self.online() if self._in_clusters(c)}
        sampled, extra = self._eval_sample(keys)
        asked = sorted(sampled + extra)
        for cid in asked:  # a device evaluates the model it was told: tell it again where that changed
            if self._told_key.get(cid) != keys[cid]:
                self._assign(cid, keys[cid])
        self._await_follow()
        self._eval_keys = {c: keys[c] for c in asked}
        self._awaited = awaited = _Awaited("metrics", asked, self._online)
        delivered, deliveries = self._deliver_models({c: [keys[c]] for c in asked})
        arch = {"architecture": self.architecture} if self.architecture else {}
        if sampled:  # one command for the sample; each device knows its model and whether it is in it
            self._broadcast("evaluate", round=self._round, fraction=self.config.eval_fraction,
                            seed=self.config.seed, **arch)
        for cid in extra:
            self._cmd(cid, "evaluate", round=self._round, model_key=keys[cid], **arch)
        log.info("final evaluation: %d of %d assigned device(s) asked (fraction %g, %d added so that every "
                 "cluster is evaluated); models once on %d cluster topic(s), %d copies per device", len(asked),
                 len(keys), self.config.eval_fraction, len(extra), deliveries["cluster_topic"],
                 deliveries["per_device"])
        self._pump(lambda: not awaited.left, self.config.eval_timeout_s)
        self._eval_keys = {}
        per_client = {c: float(m["accuracy"]) for c, m in self._metrics.items() if "accuracy" in m}
        per_model: dict[str, list[float]] = {}
        for c, a in per_client.items():
            per_model.setdefault(keys[c], []).append(a)
        return {
            "accuracy": float(np.mean(list(per_client.values()))) if per_client else None,
            "per_client": per_client,
            "per_model": {k: float(np.mean(v)) for k, v in per_model.items()},
            # the model each client evaluated (clients per cluster in the reports)
            "model_per_client": {c: keys[c] for c in per_client},
            "eval_fraction": self.config.eval_fraction,
            "asked": len(asked), "evaluated": len(per_client),
            "model_bytes_delivered": delivered, "deliveries": deliveries,
            "commands": {"broadcast": int(bool(sampled)), "per_device": len(extra)},
        }

    # -- checkpoints ------------------------------------------------------
    def _checkpoint(self, rnd: int) -> None:
        d = self.config.checkpoint_dir
        if not d:
            return
        from safetensors.numpy import save_file

        path = Path(d)
        path.mkdir(parents=True, exist_ok=True)
        meta, tensors = self.strategy.state()
        tmp = path / "models.safetensors.tmp"
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path / "models.safetensors")
        state = {
            "round": rnd, "strategy": meta, "history": self.history, "timings": self.timings,
            "clients": {c: asdict(s.info) for c, s in self.clients.items()},
            "sketches": {c: [s.bits.hex(), s.num_classes, s.latent_dim] for c, s in self.sketches.items()
                         if isinstance(s, Sketch)},
            "config": asdict(self.config),
            "encoder": self.encoder_name, "architecture": self.architecture, "latent_dim": self._latent,
            "pretrain_history": self.pretrain_history,
        }
        tmp = path / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1, default=list))
        os.replace(tmp, path / "state.json")

    def _restore(self) -> int:
        from safetensors.numpy import load_file

        path = Path(self.config.checkpoint_dir or "")
        state_file = path / "state.json"
        if not state_file.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint in {path} (state.json missing)")
        state = json.loads(state_file.read_text())
        tensors = load_file(str(path / "models.safetensors"))
        infos = {c: ClientInfo(**{k: (tuple(v) if k == "capabilities" else v) for k, v in i.items()})
                 for c, i in state["clients"].items()}
        arch = state.get("architecture") or self.architecture
        if not self.models_chosen or arch != self.architecture:
            self._use_models(state.get("encoder") or self.encoder_name, arch, "from the checkpoint")
        self.strategy.setup(list(infos.values()), self.template)
        self.strategy.load_state(state["strategy"], tensors)
        self.clients = {c: _ClientState(info, online=False, trains="train-torch" in info.capabilities)
                        for c, info in infos.items()}
        self._online = set()
        self._clustered = None
        self.sketches = {c: Sketch(bytes.fromhex(hx), n, lat)
                         for c, (hx, n, lat) in state.get("sketches", {}).items()}
        self.history = list(state.get("history", []))
        self.timings = dict(state.get("timings", {}))
        self.pretrain_history = list(state.get("pretrain_history", []))
        self.encoder_name = state.get("encoder") or self.encoder_name
        if state.get("latent_dim") is not None:
            self._latent = int(state["latent_dim"])
        if (path / "encoder" / "manifest.json").is_file():  # the federated encoder, for late clients
            from edge_sdk.artifacts import load_manifest

            enc_dir = path / "encoder"
            spec = load_manifest(enc_dir)[self.encoder_name]
            raw = json.loads((enc_dir / "manifest.json").read_text())["artifacts"][self.encoder_name]
            self._encoder_msg = ({"key": "encoder", "name": self.encoder_name, "sha256": spec.sha256,
                                  "entry": raw}, (enc_dir / spec.file).read_bytes())
        log.info("resumed from %s after round %d (%d clients known)", path, state["round"], len(self.clients))
        return int(state["round"])

    # -- the run ------------------------------------------------------------
    def run(self, *, resume: bool = False) -> dict[str, Any]:
        """Run the federation; returns a summary (assignment, history, final evaluation, bytes)."""
        t0 = time.monotonic()
        self._subscribe()
        start = 1
        if resume:
            start = self._restore() + 1
            self._phase = "train"
            self._broadcast("hello")
            self._pump(lambda: len(self._online) >= min(self.config.min_clients, len(self.clients)),
                       self.config.register_timeout_s)
            self._pump(lambda: False, 0.5)
        else:
            try:
                self._register()
            except (RuntimeError, ValueError) as e:  # the devices are told, so they do not wait in vain
                if self.config.stop_clients:
                    self._broadcast("stop", reason=f"the server stopped: {e}"[:300])
                raise
            self.strategy.setup([s.info for s in self.clients.values()], self.template)
            self._clustered = None
            if getattr(self.strategy, "pretrain", None) is not None:
                self._pretrain_ae()
            if self.strategy.needs_sketches:
                self._cluster()
            self._phase = "train"
            self._announce_assignment()
        self._pump(lambda: False, 0.2)
        self._await_follow()
        t_train = time.monotonic()
        for rnd in range(start, self.config.rounds + 1):
            self._run_round(rnd)
        final = self._final_eval()
        self.timings["training_s"] = time.monotonic() - t_train
        if self.config.stop_clients:
            self._broadcast("stop", reason="finished")
        self.timings["total_s"] = time.monotonic() - t0
        return {
            "strategy": self.strategy.name,
            "assignment": self.strategy.clusters(),
            "history": self.history,
            "final": final,
            "timings": self.timings,
            "rejected": dict(self.rejected),
            "transport": self.transport.stats(),
            "delivered": dict(self.delivered),
            "pretrain": list(self.pretrain_history),
            "encoder": self.encoder_name,
            "architecture": self.architecture,
            "refused": dict(self.refused),
            "not_training": dict(self.not_training),
            "dropped": {c: f"offline since round {self._went_offline.get(c, 0)}"
                        for c, st in sorted(self.clients.items()) if not st.online},
        }
