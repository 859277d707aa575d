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
5. a final evaluation round.

Model delivery (``ServerConfig.model_delivery``): every client subscribes to
``clusters/+/model``, so a model published there reaches every online client,
whatever its cluster. ``"client"`` publishes each model a client needs on
that client's own command topic, just before the command that uses it: each
device downloads exactly its models (with K clusters, 1/K of the broadcast's
bytes), and the server sends one copy per client. ``"cluster"`` publishes
each model once on its cluster topic: one copy from the server, every online
client downloads all of them. ``"auto"`` (the default) broadcasts when every
online client needs every model of the step (IFCA or FedAvg with all clients
every round, the encoder for everyone) and otherwise delivers per client.
``delivered`` and each round's ``model_bytes_delivered`` count the bytes the
devices download, as the broker delivers them.

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
    Kind,
    Message,
    ProtocolError,
    Topics,
    parse_sketch,
    parse_tensors,
    tensors_body,
)
from edge_sdk.rejections import RejectionLog
from edge_sdk.schema import check_meta
from edge_sdk.sketch import Sketch
from edge_sdk.worker import Update

from .strategy import ClientInfo, Strategy

__all__ = ["Orchestrator", "ServerConfig"]

log = logging.getLogger(__name__)

SERVER_ID = "server"
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
    sketch_quorum: float = 1.0
    sketch_timeout_s: float = 60.0
    round_quorum: float = 1.0
    round_timeout_s: float = 120.0
    eval_timeout_s: float = 60.0
    num_classes: int = 10
    flip_prob: float = 0.1
    encoder: str = "digits_encoder"
    latent_dim: int | None = None
    architecture: str = "digits_cnn_1x8x8_10"
    seed: int = 0
    checkpoint_dir: str | None = None
    stop_clients: bool = True
    model_delivery: str = "auto"

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {self.rounds}")
        if self.min_clients < 1:
            raise ValueError(f"min_clients must be a positive integer, got {self.min_clients}")
        for name in ("sketch_quorum", "round_quorum"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        for name in ("register_timeout_s", "sketch_timeout_s", "round_timeout_s", "eval_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.flip_prob <= 0.5:
            raise ValueError(f"flip_prob must be in [0, 0.5], got {self.flip_prob}")
        if self.model_delivery not in MODEL_DELIVERY:
            raise ValueError(f"model_delivery must be one of {list(MODEL_DELIVERY)}, got {self.model_delivery!r}")


@dataclass
class _ClientState:
    info: ClientInfo
    online: bool = True
    last_seen: float = field(default_factory=time.monotonic)


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
        #: Tasked clients whose update this round was refused: they answered, the round does not wait for them.
        self._refused: set[str] = set()
        self._phase = "register"
        self._rejections = RejectionLog(log)
        #: Refused messages per reason (logged once per sender and reason per interval).
        self.rejected: dict[str, int] = self._rejections.counts
        self.history: list[dict[str, Any]] = []
        self.timings: dict[str, float] = {}
        #: Bytes of models (and encoders) the clients downloaded, per kind (see the module docstring).
        self.delivered: dict[str, int] = {}
        if template is None:
            from edge_sdk.trainer import initial_weights

            template = initial_weights(config.architecture, config.seed)
        self.template = {k: np.asarray(v) for k, v in template.items()}
        self._spec = {k: (tuple(v.shape), str(v.dtype)) for k, v in self.template.items()}
        self._latent = (config.latent_dim or self._encoder_latent(config.encoder)
                        if strategy.summary_kind == "sketch" else None)
        self._lock = threading.Lock()
        self._feature_shape: tuple[int, int] | None = None
        #: The encoder the clients sketch with (the federated one after pre-training).
        self.encoder_name = config.encoder
        self._encoder_msg: tuple[dict[str, Any], bytes] | None = None
        self._encoder_tmp: tempfile.TemporaryDirectory[str] | None = None
        self._ae_spec: dict[str, tuple[tuple[int, ...], str]] = {}
        self._ae_updates: dict[str, tuple[dict[str, np.ndarray], int, float]] = {}
        self.pretrain_history: list[dict[str, Any]] = []

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
        if state is None:
            self._reject("unknown-client", f"{msg.kind.name} from an unregistered client", cid)
            return
        state.last_seen = time.monotonic()
        if msg.kind == Kind.STATUS:
            online = msg.meta.get("state") != "offline"
            if state.online and not online:
                log.info("client %s is offline", cid)
            state.online = online
        elif msg.kind in (Kind.SKETCH, Kind.FEATURES):
            self._on_sketch(cid, msg)
        elif msg.kind == Kind.UPDATE and self._phase == "pretrain":
            self._on_ae_update(cid, msg)
        elif msg.kind == Kind.UPDATE:
            self._on_update(cid, msg)
        elif msg.kind == Kind.METRICS:
            if msg.meta["round"] == self._round:
                self._metrics[cid] = dict(msg.meta)
        else:
            self._reject("kind", f"unexpected {msg.kind.name}", cid)

    def _on_hello(self, cid: str, msg: Message) -> None:
        m = msg.meta  # checked by the schema: n_samples in [1, 2**31), classes_present in [0, 65535]
        n = m["n_samples"]
        known = cid in self.clients
        if known and n != self.clients[cid].info.n_samples:
            # the sample count weighs this device's updates: it is fixed at registration
            log.warning("client %s says hello with %d samples, registered with %d: keeping %d",
                        cid, n, self.clients[cid].info.n_samples, self.clients[cid].info.n_samples)
            n = self.clients[cid].info.n_samples
        info = ClientInfo(cid, n, m["classes_present"], tuple(m["capabilities"]))
        self.clients[cid] = _ClientState(info)
        if not known:
            log.info("client %s registered (%d samples, %d classes)", cid, n, info.classes_present)
        if self._phase == "train" and cid not in self.strategy.clusters():
            self._admit_late(cid, info)
        elif self._phase == "train":
            self._cmd(cid, "assign", model_key=self.strategy.model_key_for(cid))

    def _admit_late(self, cid: str, info: ClientInfo) -> None:
        if self.strategy.needs_sketches:
            if cid in self.sketches:
                key = self.strategy.assign_late(cid, self.sketches[cid], info)
                self._cmd(cid, "assign", model_key=key)
            else:
                log.info("late client %s: asking for its sketch", cid)
                self._ask_sketch(cid)
        else:
            key = self.strategy.assign_late(cid, None, info)
            self._cmd(cid, "assign", model_key=key)

    def _ask_sketch(self, cid: str) -> None:
        if self._encoder_msg is not None and self._phase == "train":
            self._send_encoder([cid])  # a late client has not got the federated encoder yet
        self._cmd(cid, "sketch", encoder=self.encoder_name, num_classes=self.config.num_classes,
                  flip_prob=self.config.flip_prob, summary=self.strategy.summary_kind,
                  params=dict(self.strategy.summary_params))

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
        if self._phase == "train" and cid not in self.strategy.clusters():
            key = self.strategy.assign_late(cid, sk, self.clients[cid].info)
            self._cmd(cid, "assign", model_key=key)

    def _on_update(self, cid: str, msg: Message) -> None:
        m = msg.meta
        rnd = m["round"]
        if rnd != self._round or cid not in self._tasked:
            self._reject("stale-update", f"update for round {rnd} (current {self._round}, "
                                         f"tasked: {cid in self._tasked})", cid)
            return
        key = m["model_key"]
        if key not in self._allowed.get(cid, ()):
            self._refused.add(cid)
            self._reject("wrong-model", f"update for model {key!r} in round {rnd}; this client was sent "
                                        f"{sorted(self._allowed.get(cid, ()))}", cid)
            return
        # weighed by the count the device registered, never by a new claim
        n = min(m["n_samples"], self.clients[cid].info.n_samples)
        try:
            weights = parse_tensors(msg.body, spec=self._spec)
        except ProtocolError:
            self._refused.add(cid)  # it answered, badly: the round does not wait for it
            raise
        self._updates[cid] = Update(cid, rnd, key, weights, n, m.get("loss", float("nan")), m["metrics"])

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

    # -- phases -------------------------------------------------------------
    def online(self) -> list[str]:
        return sorted(c for c, s in self.clients.items() if s.online)

    def _register(self) -> None:
        t0 = time.monotonic()
        self._broadcast("hello")
        need = self.config.min_clients
        ok = self._pump(lambda: len(self.clients) >= need, self.config.register_timeout_s)
        if not ok:
            raise TimeoutError(
                f"only {len(self.clients)} of the {need} clients needed registered within "
                f"{self.config.register_timeout_s:g} s"
            )
        # let stragglers of the same start register too (short grace)
        self._pump(lambda: False, 0.5)
        self.timings["register_s"] = time.monotonic() - t0
        log.info("registration closed: %d clients", len(self.clients))

    def _pretrain_ae(self) -> None:
        """Federated pre-training of the sketch autoencoder, then its encoder sent to every client."""
        from edge_sdk.trainer import initial_weights, state_spec

        from .aggregate import StreamingFedAvg
        from .pretrain import export_encoder
        from .strategy import pretrain_config

        t0 = time.monotonic()
        cfg = pretrain_config(self.strategy.pretrain or {}, self.config.encoder)
        arch = cfg["architecture"]
        self._phase = "pretrain"
        weights = initial_weights(arch, self.config.seed)
        self._ae_spec = state_spec(weights)
        for rnd in range(1, cfg["rounds"] + 1):
            tr = time.monotonic()
            self._round = rnd
            self._ae_updates = {}
            pool = self.online()
            m = max(1, int(np.ceil(cfg["fraction"] * len(pool))))
            chosen = pool if m >= len(pool) else sorted(
                np.random.default_rng([self.config.seed, rnd, 7919]).choice(pool, size=m, replace=False).tolist())
            self._tasked = set(chosen)
            size = self._deliver({c: ["ae"] for c in chosen}, {"ae": ({"key": "ae"}, tensors_body(weights))},
                                 "AE_MODEL")
            for cid in chosen:
                self._cmd(cid, "train_ae", round=rnd, architecture=arch, epochs=cfg["epochs"], lr=cfg["lr"],
                          batch_size=cfg["batch_size"])
            need = max(1, int(np.ceil(self.config.round_quorum * len(chosen))))

            def done(need: int = need) -> bool:
                waiting = [c for c in self._tasked if c not in self._ae_updates and self.clients[c].online]
                return len(self._ae_updates) >= need or not waiting

            self._pump(done, self.config.round_timeout_s)
            got = {c: self._ae_updates[c] for c in sorted(self._ae_updates)}
            missing = sorted(self._tasked - set(got))
            if missing:
                log.warning("AE round %d closed without %d client(s): %s", rnd, len(missing), ", ".join(missing))
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
        for cid in cids:
            self._ask_sketch(cid)
        need = max(1, int(np.ceil(self.config.sketch_quorum * len(cids))))
        self._pump(lambda: len([c for c in cids if c in self.sketches]) >= need, self.config.sketch_timeout_s)
        got = {c: self.sketches[c] for c in cids if c in self.sketches}
        if len(got) < need:
            log.warning("sketch deadline: %d of %d sketches (quorum %d); clustering those", len(got), len(cids), need)
        if not got:
            raise TimeoutError("no sketch arrived before the deadline")
        self.timings["sketch_collect_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        self.strategy.on_sketches(got)
        self.timings["clustering_s"] = time.monotonic() - t1

    def _announce_assignment(self) -> None:
        assigned = self.strategy.clusters()
        for cid in self.online():
            if cid in assigned:
                self._cmd(cid, "assign", model_key=self.strategy.model_key_for(cid))
            else:
                self._admit_late(cid, self.clients[cid].info)

    def _deliver(self, needs: Mapping[str, Any], messages: Mapping[str, tuple[dict[str, Any], bytes]],
                 counter: str) -> int:
        """Get each client of ``needs`` (client id -> model keys) the ``messages`` (key -> meta, body) it needs.

        Broadcast on the cluster topics or per client, by ``config.model_delivery``;
        adds the bytes the clients download to ``delivered[counter]`` and returns them.
        """
        needs = {cid: sorted(set(keys)) for cid, keys in needs.items()}
        keys = sorted({k for ks in needs.values() for k in ks})
        mode = self.config.model_delivery
        if mode == "auto":
            online = set(self.online())
            mode = "cluster" if set(needs) >= online and all(ks == keys for ks in needs.values()) else "client"
        total = 0
        if mode == "cluster":
            receivers = len(set(self.online()) | set(needs))  # every online client subscribes to clusters/+/model
            for key in keys:
                meta, body = messages[key]
                total += self._send(self.topics.model(key), Kind.MODEL, meta=meta, body=body) * receivers
        else:
            for cid, ks in needs.items():
                for key in ks:
                    meta, body = messages[key]
                    total += self._send(self.topics.cmd(cid), Kind.MODEL, meta=meta, body=body)
        self.delivered[counter] = self.delivered.get(counter, 0) + total
        return total

    def _deliver_models(self, needs: Mapping[str, Any]) -> int:
        """Deliver strategy models (key -> its current weights) to the clients that need them."""
        keys = {k for ks in needs.values() for k in ks}
        messages = {k: ({"key": k}, tensors_body(self.strategy.models[k])) for k in keys}
        return self._deliver(needs, messages, "MODEL")

    def _run_round(self, rnd: int) -> dict[str, Any]:
        t0 = time.monotonic()
        self._round = rnd
        self._updates = {}
        self._refused = set()
        tasks = self.strategy.configure_round(rnd, self.online())
        self._tasked = {t.cid for t in tasks}
        self._allowed = {t.cid: frozenset(t.models) for t in tasks}
        # what each client is offered (IFCA: all K), as the devices download it
        delivered = self._deliver_models({t.cid: list(t.models) for t in tasks})
        for t in tasks:
            self._cmd(t.cid, "train", round=rnd, models=sorted(t.models), evaluate_first=t.evaluate_first,
                      **t.settings.to_dict())
        need = max(1, int(np.ceil(self.config.round_quorum * len(tasks))))

        def done() -> bool:
            # quorum reached, or nobody left worth waiting for (the rest went offline)
            waiting = [c for c in self._tasked if c not in self._updates and c not in self._refused
                       and self.clients[c].online]
            return len(self._updates) >= need or not waiting

        self._pump(done, self.config.round_timeout_s)
        updates = [self._updates[c] for c in sorted(self._updates)]
        missing = sorted(self._tasked - set(self._updates))
        if missing:
            log.warning("round %d closed without %d client(s): %s", rnd, len(missing), ", ".join(missing))
        summary = self.strategy.aggregate(rnd, updates) if updates else {"updates": 0}
        before = [u.metrics["acc_before"] for u in updates if "acc_before" in u.metrics]
        rec = {
            "round": rnd, "tasked": len(tasks), "updates": len(updates), "missing": missing,
            "acc_before": float(np.mean(before)) if before else None,
            "loss": float(np.mean([u.loss for u in updates])) if updates else None,
            "model_bytes_delivered": delivered,
            "clipped": int(summary.get("clipped", 0)), "refused_norm": int(summary.get("refused_norm", 0)),
            "summary": summary, "seconds": time.monotonic() - t0,
        }
        self.history.append(rec)
        self._checkpoint(rnd)
        if self.on_round:
            self.on_round(rec)
        log.info("round %d: %d/%d updates, loss %s", rnd, len(updates), len(tasks), rec["loss"])
        return rec

    def _final_eval(self) -> dict[str, Any]:
        self._round = self.config.rounds + 1
        self._metrics = {}
        cids = self.online()
        self._deliver_models({c: [self.strategy.model_key_for(c)] for c in cids})
        for cid in cids:
            self._cmd(cid, "evaluate", round=self._round, model_key=self.strategy.model_key_for(cid))
        self._pump(lambda: all(c in self._metrics or not self.clients[c].online for c in cids),
                   self.config.eval_timeout_s)
        per_client = {c: float(m["accuracy"]) for c, m in self._metrics.items() if "accuracy" in m}
        per_model: dict[str, list[float]] = {}
        for c, a in per_client.items():
            per_model.setdefault(self.strategy.model_key_for(c), []).append(a)
        return {
            "accuracy": float(np.mean(list(per_client.values()))) if per_client else None,
            "per_client": per_client,
            "per_model": {k: float(np.mean(v)) for k, v in per_model.items()},
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
            "encoder": self.encoder_name, "latent_dim": self._latent,
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
        self.strategy.setup(list(infos.values()), self.template)
        self.strategy.load_state(state["strategy"], tensors)
        self.clients = {c: _ClientState(info, online=False) for c, info in infos.items()}
        self.sketches = {c: Sketch(bytes.fromhex(hx), n, lat)
                         for c, (hx, n, lat) in state.get("sketches", {}).items()}
        self.history = list(state.get("history", []))
        self.timings = dict(state.get("timings", {}))
        self.pretrain_history = list(state.get("pretrain_history", []))
        self.encoder_name = str(state.get("encoder", self.config.encoder))
        if state.get("latent_dim") is not None:
            self._latent = int(state["latent_dim"])
        if self.encoder_name != self.config.encoder:  # the federated encoder, for late clients
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
            self._pump(lambda: len(self.online()) >= min(self.config.min_clients, len(self.clients)),
                       self.config.register_timeout_s)
            self._pump(lambda: False, 0.5)
        else:
            self._register()
            self.strategy.setup([s.info for s in self.clients.values()], self.template)
            if getattr(self.strategy, "pretrain", None) is not None:
                self._pretrain_ae()
            if self.strategy.needs_sketches:
                self._cluster()
            self._phase = "train"
            self._announce_assignment()
        self._pump(lambda: False, 0.2)
        t_train = time.monotonic()
        for rnd in range(start, self.config.rounds + 1):
            self._run_round(rnd)
        final = self._final_eval()
        self.timings["training_s"] = time.monotonic() - t_train
        if self.config.stop_clients:
            self._broadcast("stop")
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
        }
