"""How models reach the devices: the model topics each device follows, and each model sent once or per device.

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

With compression on (``--compress``), what a device is sent of a model
depends on the version it holds (:class:`server_kit.downstream.ModelVersions`:
the chain of compressed changes since then, or the whole model). The server
counts on the version it sent a device, and on the one each update names
(:meth:`Delivery.note_held`); a hello forgets them. A device that cannot
apply what it was sent (its copy is not the version the server counted on)
asks for the model whole with its status ``need`` (:meth:`Delivery.send_whole`). A model goes once on its cluster topic only when every device that gets it
there is sent the same bytes (they hold the same version); otherwise per
device. With ``"cluster"`` delivery, the topic carries the chain from the
oldest version its needers hold (a device applies the changes it lacks and
skips those it has), or the whole model when one of them holds none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from edge_sdk.protocol import Kind

from ..downstream import ModelVersions
from .link import ServerLink

__all__ = ["Delivery"]

log = logging.getLogger(__name__)


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
#: What a device is sent of a model: (client id, key) -> (meta, body).
Payloads = Callable[[str, str], tuple[dict[str, Any], bytes]]
#: What goes on a model's cluster topic for its needers (``"cluster"`` delivery): (key, needers) -> (meta, body).
TopicPayload = Callable[[str, list[str]], tuple[dict[str, Any], bytes]]


class Delivery:
    """Sends models to the devices that need them, once on a cluster topic or per device (see the module docstring).

    Parameters
    ----------
    link : ServerLink
        Where the models go out.
    mode : str
        ``ServerConfig.model_delivery``: "auto", "client" or "cluster".
    online : callable
        The online admitted devices (a scan: called once per delivery, never per message).
    """

    def __init__(self, link: ServerLink, mode: str, online: Callable[[], Iterable[str]]) -> None:
        self.link = link
        self.mode = mode
        self.online = online
        #: The model topics each device follows, as far as the server knows (absent: every model).
        self.follow: dict[str, _Follow] = {}
        #: Online devices told a new follow that have not confirmed it yet.
        self.pending: set[str] = set()
        #: Bytes of models (and encoders) the clients downloaded, per kind (see the module docstring).
        self.delivered: dict[str, int] = {}
        #: The model versions each device said it holds (its updates name the version they started from).
        self.held: dict[str, dict[str, int]] = {}
        #: The model keys each device was last sent (the ones it may ask for whole).
        self.needed: dict[str, frozenset[str]] = {}
        self._sent_whole: dict[tuple[str, str], int] = {}

    def note_held(self, cid: str, key: str, version: int) -> None:
        """Device ``cid`` holds version ``version`` of model ``key`` (it trained from it)."""
        self.held.setdefault(cid, {})[key] = version

    # -- the model topics each device follows ---------------------------------
    def narrow(self, cid: str, key: str, online: bool) -> list[str] | None:
        """``cid`` is to follow only ``key``'s topic: the follow to tell it, or None when it already does."""
        new = frozenset({key})
        st = self.follow.setdefault(cid, _Follow())
        if st.confirmed and st.maybe == new:
            return None
        # until it confirms, it may get its old topics and the new one
        st.maybe, st.confirmed, st.told = st.maybe | new, False, new
        if online:
            self.pending.add(cid)
        return sorted(new)

    def confirm(self, cid: str, keys: list[str]) -> None:
        """A device confirms the model topics it follows (its status, sent after its (un)subscriptions)."""
        got = frozenset(keys)
        st = self.follow.get(cid)
        if st is None or st.told is None or got == st.told:
            st = self.follow.setdefault(cid, _Follow())
            st.maybe, st.confirmed = got, True
            self.pending.discard(cid)
        # else: the answer to an earlier assign; the latest one's answer is on its way

    def forget(self, cid: str) -> None:
        """A device says hello again: reconnected, it follows what it was told; restarted, every model.

        Until it confirms a follow again, it may get any topic (no model goes
        on a cluster topic it may follow).
        """
        st = self.follow.get(cid)
        if st is not None and st.told is not None:
            st.maybe, st.confirmed = frozenset({"+"}), False
        self.held.pop(cid, None)  # a restarted device holds no model

    def set_online(self, cid: str, online: bool) -> None:
        """Only online devices are waited for to confirm a follow (O(1))."""
        if online:
            st = self.follow.get(cid)
            if st is not None and not st.confirmed:
                self.pending.add(cid)
        else:
            self.pending.discard(cid)

    def await_confirmations(self, round_timeout_s: float) -> None:
        """Give the devices told a new follow a moment to confirm it (bounded; the unconfirmed get copies)."""
        if not self.pending:
            return
        limit = min(10.0, round_timeout_s)
        if not self.link.pump(lambda: not self.pending, limit):
            log.warning("%d device(s) did not confirm their model topic within %g s: their models go per device",
                        len(self.pending), limit)

    # -- sending models -------------------------------------------------------
    def deliver(self, needs: Mapping[str, Any], messages: Mapping[str, tuple[dict[str, Any], bytes]] | Payloads,
                counter: str, topic_payload: TopicPayload | None = None) -> tuple[int, dict[str, int]]:
        """Get each client of ``needs`` (client id -> model keys) the message it needs of each key.

        ``messages``: key -> (meta, body), the same for every client, or a
        function (client id, key) -> (meta, body) (a compressed model: it
        depends on the version the client holds). On the cluster topics or per
        client, by ``mode`` (``ServerConfig.model_delivery``, see the module
        docstring); ``topic_payload`` (key, its needers) gives what goes on a
        topic in ``"cluster"`` mode. Adds the bytes the clients download to
        ``delivered[counter]``. Returns those bytes and the publications:
        ``{"cluster_topic": n, "per_device": m}``.
        """
        payload_of: Payloads = messages if callable(messages) else (lambda cid, key: messages[key])
        needs = {cid: sorted(set(keys)) for cid, keys in needs.items()}
        keys = sorted({k for ks in needs.values() for k in ks})
        total = 0
        on_topic: dict[str, tuple[set[str], tuple[dict[str, Any], bytes]]] = {}
        if self.mode == "cluster":
            receivers = set(self.online()) | set(needs)  # every online client subscribes to clusters/+/model
            for key in keys:
                needers = sorted(c for c, ks in needs.items() if key in ks)
                on_topic[key] = (receivers, topic_payload(key, needers) if topic_payload else
                                 payload_of(needers[0], key))
        elif self.mode == "auto":
            for key, got in self.topic_receivers(needs, keys).items():
                payloads = {id(p): p for p in (payload_of(c, key) for c in sorted(got))}
                if len(payloads) == 1:  # the same bytes for all of them (the same version held)
                    on_topic[key] = (got, next(iter(payloads.values())))
        for key, (receivers, (meta, body)) in sorted(on_topic.items()):
            total += self.link.send(self.link.topics.model(key), Kind.MODEL, meta=meta, body=body) * len(receivers)
        per_device = 0
        for cid, ks in needs.items():
            for key in ks:
                if cid not in on_topic.get(key, ((),))[0]:
                    meta, body = payload_of(cid, key)
                    total += self.link.send(self.link.topics.cmd(cid), Kind.MODEL, meta=meta, body=body)
                    per_device += 1
        self.delivered[counter] = self.delivered.get(counter, 0) + total
        return total, {"cluster_topic": len(on_topic), "per_device": per_device}

    def topic_receivers(self, needs: Mapping[str, list[str]], keys: list[str]) -> dict[str, set[str]]:
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
            st = self.follow.get(cid, _EVERY_MODEL)
            mine = needs.get(cid, ())
            for key in (wanted if "+" in st.maybe else st.maybe & wanted):
                if st.confirmed and key in mine:
                    receivers[key].add(cid)
                else:
                    blocked.add(key)
        return {k: r for k, r in receivers.items() if r and k not in blocked}

    def deliver_models(self, needs: Mapping[str, Any], models: Mapping[str, Mapping[str, np.ndarray]],
                       versions: ModelVersions) -> tuple[int, dict[str, int]]:
        """Deliver strategy models (key -> its current weights) to the clients that need them.

        Each device gets, of each model, what :meth:`ModelVersions.payload`
        gives for the version it holds (with compression off: the whole model).
        """
        versions.sync(models)  # a model changed outside aggregation goes whole

        def payload_of(cid: str, key: str) -> tuple[dict[str, Any], bytes]:
            return versions.payload(key, self.held.get(cid, {}).get(key), models[key])

        def topic_payload(key: str, needers: list[str]) -> tuple[dict[str, Any], bytes]:
            held = [self.held.get(c, {}).get(key) for c in needers]
            oldest = None if None in held else min(held)
            return versions.payload(key, oldest, models[key], merge=len(set(held)) == 1)

        sent = self.deliver(needs, payload_of, "MODEL", topic_payload)
        for cid, keys in needs.items():  # each holds the version sent now (a device that could not apply it says "need")
            held = versions.versions_sent(keys)
            if held is not None:
                self.held.setdefault(cid, {}).update(held)
                self.needed[cid] = frozenset(keys)
        return sent

    def send_whole(self, cid: str, keys: Iterable[str], models: Mapping[str, Mapping[str, np.ndarray]],
                   versions: ModelVersions) -> int:
        """A device could not apply what it was sent of these models (its status ``need``): each goes whole.

        Only a model it was last sent, once per version: a device cannot make
        the server send whole models it does not need, nor the same one twice.
        Returns the bytes sent.
        """
        total = 0
        for key in keys:
            self.held.get(cid, {}).pop(key, None)
            if key not in self.needed.get(cid, ()) or key not in models:  # needed: only with compressed models
                log.info("client %s asks for model %r whole, which it was not sent: ignored", cid, key)
                continue
            if self._sent_whole.get((cid, key)) == versions.version[key]:
                continue
            self._sent_whole[(cid, key)] = versions.version[key]
            meta, body = versions.payload(key, None, models[key], whole=True)
            total += self.link.send(self.link.topics.cmd(cid), Kind.MODEL, meta=meta, body=body)
            log.info("client %s could not apply model %r version %d: sent whole (%d bytes)", cid, key,
                     versions.version[key], len(body))
        self.delivered["MODEL"] = self.delivered.get("MODEL", 0) + total
        return total

    def send_encoder(self, cids: Iterable[str], message: tuple[dict[str, Any], bytes] | None) -> None:
        """Deliver the federated encoder to ``cids`` (all online ones at once: broadcast, a late one: to it)."""
        assert message is not None
        self.deliver({c: ["encoder"] for c in cids}, {"encoder": message}, "ENCODER")
