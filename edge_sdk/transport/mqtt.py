"""MqttTransport: the one class that owns paho.

It wraps a paho-mqtt 2.x client (it never subclasses it nor lets paho types
escape): persistent sessions, QoS 1, subscriptions remade on every connect,
reconnects with back-off, an optional last will, TLS for ``mqtts://``. Given a
list of brokers (the nodes of a cluster: ``BrokerConfig("mqtt://a:1883,mqtt://b:1883")``),
each lost connection and each failed attempt moves the next attempt to the next
broker of the list, round robin. It runs its own network and dispatcher
threads, or, given ``loop=``, a shared
:class:`~edge_sdk.transport.netloop.NetworkLoop`. The package docstring
(:mod:`edge_sdk.transport`) tells the whole story.

Its other jobs have their modules: the paho client's setup from the
configuration (:mod:`~edge_sdk.transport.paho_client`), the broker list it
goes round (:mod:`~edge_sdk.transport.failover`), the publishes in flight
(:mod:`~edge_sdk.transport.acks`) and the receive side, from paho's callback
to the handlers (:mod:`~edge_sdk.transport.dispatch`). This module is the
session: connect, reconnect, subscribe, publish, close.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any

from ..protocol import Message
from .acks import InFlight
from .base import TransportBase
from .config import BrokerConfig
from .dispatch import Dispatcher
from .failover import BrokerList
from .filters import check_filter
from .inbox import Handler
from .paho_client import connect_kwargs, new_client, refusal_hint

__all__ = ["MqttTransport"]

log = logging.getLogger(__name__)


class MqttTransport(TransportBase):
    """A paho-mqtt 2.x client speaking the FedSketch protocol.

    Parameters
    ----------
    config : BrokerConfig
        Broker address (or a list of them: see :attr:`broker_url`), credentials, TLS, limits.
    client_id : str
        MQTT client id; also the id this side speaks as (use the broker user
        name, which the ACL ties to ``clients/<id>/``).
    federation : str
        Federation whose topics are used and whose messages are accepted.
    root : str
        Topic root.
    will_topic : str, optional
        Last-will topic, published by the broker if the connection is lost
        without a clean disconnect (usually ``topics.status(client_id)``).
    will_payload : Message or bytes, optional
        The last will: a :class:`Message` (encoded here) or an encoded one.
    will_retain : bool
        Retain the will on the broker.
    dispatch_queue : int
        Validated messages waiting for the handler thread; when full, paho's
        network thread waits (back-pressure to the broker). Not used with
        ``loop``.
    loop : NetworkLoop, optional
        Run this connection on a shared :class:`~edge_sdk.transport.netloop.NetworkLoop`
        (many connections per process) instead of its own network and
        dispatcher threads. Reconnections then wait a randomised back-off
        (half to all of the exponential delay), so that a fleet that lost
        its broker does not come back in one instant. Messages wait for the
        loop's pool without bound (no back-pressure to the broker).

    With several brokers in ``config.url``, the first connection goes to the
    first one; after a lost connection, a failed attempt or a refused
    CONNECT, the next attempt goes to the next broker of the list (round
    robin, with the same back-off), logged once at INFO and counted in
    ``stats()["errors"]["failover"]``. The session is persistent and the
    subscriptions are remade on every connect, so a cluster that shares
    sessions (NATS keeps them in JetStream) goes on delivering the session's
    QoS 1 messages on the new node.
    """

    def __init__(
        self,
        config: BrokerConfig,
        client_id: str,
        *,
        federation: str,
        root: str = "fedsketch",
        will_topic: str | None = None,
        will_payload: Message | bytes | None = None,
        will_retain: bool = False,
        dispatch_queue: int = 1000,
        loop: Any = None,
    ) -> None:
        super().__init__(client_id, federation, root, config.max_payload, config.max_message,
                         chunk_timeout_s=config.chunk_timeout_s, chunk_deadline_s=config.chunk_deadline_s,
                         chunk_pending_per_sender=config.chunk_pending_per_sender,
                         chunk_memory_bytes=config.chunk_memory_bytes,
                         chunk_sender_bytes=config.chunk_sender_bytes)
        self.config = config
        self._brokers = BrokerList(config)
        self._connect_kwargs: dict[str, Any] = {}
        client = new_client(config, self.client_id, will_topic=will_topic,
                            will_payload=self._name_will(will_payload), will_retain=will_retain)
        self._in_flight = InFlight()
        self._subscribing = InFlight()  # SUBSCRIBEs of this connection not acknowledged yet
        self._dispatcher = Dispatcher(self.client_id, self._inbox, self._meter, self._deliver,
                                      lambda: self._closing, dispatch_queue=dispatch_queue, loop=loop)
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = self._dispatcher.on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        self._client = client
        self._v5 = config.protocol == "5"
        self._connected = threading.Event()
        self._connack = threading.Event()
        self._refused: str | None = None
        #: connect() waits for the first answer: a refusal of the credentials then ends it (no failover).
        self._first_wait = False
        self._closing = False
        self._stopping = False
        self._started = False
        self._loop = loop
        #: With a loop: whether the connection is wanted (reconnect after a loss), and failed attempts in a row.
        self._want = False
        self._attempts = 0
        self._gone = threading.Event()

    def __repr__(self) -> str:
        return (f"MqttTransport(url={self.config.url!r}, client_id={self.client_id!r}, "
                f"federation={self.federation!r}, connected={self.is_connected})")

    @property
    def broker_url(self) -> str:
        """The broker of the list this transport is connected to, or tries next (one of ``config.urls``)."""
        return self._brokers.url

    def _fail_over(self, why: str) -> None:
        """Aim the next connection attempt at the next broker of the list (network thread; one broker: no-op).

        paho refuses a new host while its connection is not closed for good; ``connect_async`` (public)
        marks it closed and sets host and port, and paho's reconnect then dials them.
        """
        n = len(self._brokers)
        if n < 2 or self._closing or self._stopping:
            return
        was = self.broker_url
        host, port = self._brokers.advance()
        self._client.connect_async(host, port, int(self.config.keepalive), **self._connect_kwargs)
        self._meter.bump(self._meter.errors, "failover")
        log.info("%s: %s %s; failing over to broker %s (%d of %d)", self.client_id, why, was, self.broker_url,
                 self._brokers.position, n)

    def _final_refusal(self, reason: str) -> bool:
        """Whether a refusal ends connect(): while it waits, unless another broker of the list may take us."""
        return self._first_wait and not self._brokers.passes_over(reason)

    # -- paho callbacks (network thread) --
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            self._refused = str(reason_code)
            hint = refusal_hint(self._v5, self._refused)
            log.error("broker %s refused %s: %s%s", self.broker_url, self.client_id, reason_code, hint)
            if self._final_refusal(self._refused):
                self._connack.set()
            return
        self._refused = None
        self._attempts = 0
        self._connected.set()
        self._connack.set()
        filters = self._inbox.filters()
        self._subscribing.forget()
        if filters:
            self._note_subscribe(client.subscribe(filters))
        log.info("connected to %s as %s (session present: %s, %d subscriptions)", self.broker_url,
                 self.client_id, bool(getattr(flags, "session_present", False)), len(filters))
        self._notify_connected()

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        log.debug("connection attempt to %s failed; retrying with back-off", self.broker_url)
        self._fail_over("could not connect to")

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self._connected.clear()
        self._gone.set()
        if self._closing or self._stopping:
            if self._refused is None:  # after a refusal, the error said it all
                log.info("disconnected from %s", self.broker_url)
            return
        if self._refused is not None:  # the CONNECT was refused (said at ERROR): no connection was lost
            if self._final_refusal(self._refused):
                return  # connect() raises
            self._fail_over("refused by")
        else:
            self._meter.bump(self._meter.errors, "connection-lost")
            log.warning("lost connection to %s (%s); reconnecting with back-off", self.broker_url, reason_code)
            self._fail_over("lost")
        if self._loop is not None and self._want:
            self._retry_later()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        if getattr(reason_code, "is_failure", False):
            self._meter.bump(self._meter.errors, "publish")
            log.warning("broker did not accept message %d: %s", mid, reason_code)
        self._in_flight.acked(mid)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        self._subscribing.acked(mid)
        for rc in reason_codes:
            if rc.is_failure:
                self._meter.bump(self._meter.errors, "subscribe")
                log.warning("broker refused a subscription of %s: %s", self.client_id, rc)

    # -- with a loop: connecting, reconnecting, timers (network thread) --
    def _try_connect(self) -> None:
        if not self._want or self._closing or self._client.socket() is not None:
            return
        try:
            self._client.reconnect()
        except (OSError, ValueError) as e:
            self._attempts += 1
            log.debug("connection attempt %d of %s to %s failed (%s); retrying with back-off", self._attempts,
                      self.client_id, self.broker_url, e)
            self._fail_over("could not connect to")
            self._retry_later()

    def _retry_later(self) -> None:
        lo, hi = float(self.config.reconnect_min_s), float(self.config.reconnect_max_s)
        delay = min(hi, lo * 2 ** min(self._attempts, 30)) * random.uniform(0.5, 1.0)
        self._loop.call_later(delay, self._try_connect)

    def _tick(self) -> None:
        """Called by the loop about once a second: expiry of stalled chunked transfers."""
        self._dispatcher.tick()

    # -- public API --
    @property
    def is_connected(self) -> bool:
        """Whether the broker has accepted the connection and it is up."""
        return self._connected.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until connected (again); returns whether it is."""
        return self._connected.wait(timeout)

    def connect(self, timeout: float = 10.0, *, wait: bool = True) -> None:
        """Connect and start the network thread; block until the broker answers.

        After this returns, lost connections are retried in the background
        with exponential back-off, and subscriptions are renewed.

        Parameters
        ----------
        timeout : float
            Seconds to wait for the broker's answer.
        wait : bool
            With ``False`` (a transport on a :class:`~edge_sdk.transport.netloop.NetworkLoop`
            only), return at once: the connection is made, and retried with
            back-off, in the background; :meth:`wait_connected` waits for it.

        Raises
        ------
        ConnectionError
            When the broker refuses (bad credentials: "Not authorized"; one
            that speaks no MQTT 5: "Unsupported protocol version") or no
            broker of the list answers within ``timeout`` seconds. With a
            list, a broker that cannot be reached, or says it is unavailable,
            is passed over for the next one meanwhile.
        """
        if not wait and self._loop is None:
            raise ValueError("connect(wait=False) needs a transport on a NetworkLoop (loop=...)")
        if self._closing:
            raise ConnectionError("transport is closed")
        if self._started:
            if not self._connected.wait(timeout):
                raise ConnectionError(f"not reconnected to {self.config.url} within {timeout:g} s")
            return
        kwargs = connect_kwargs(self.config)
        self._connect_kwargs = kwargs
        self._connack.clear()
        self._first_wait = wait
        host, port = self._brokers.endpoint
        self._client.connect_async(host, port, int(self.config.keepalive), **kwargs)
        if self._loop is not None:
            self._loop.attach(self, self._client)
            self._want = True
            self._started = True
            self._loop.call_soon(self._try_connect)
            if not wait:
                return
        else:
            self._client.loop_start()
            self._started = True
        self._dispatcher.start()
        answered = self._connack.wait(timeout)
        self._first_wait = False
        if not answered:
            reason, url = self._refused, self.broker_url
            self._stop_network()
            if reason is not None:  # every broker tried said it was unavailable
                raise ConnectionError(f"broker {url} refused {self.client_id}: {reason} (and no broker of "
                                      f"{self.config.url} took it within {timeout:g} s)")
            raise ConnectionError(
                f"no answer from broker {self.config.url} within {timeout:g} s "
                "(is it running, and is the address reachable?)"
            )
        if self._refused is not None:
            reason, url = self._refused, self.broker_url
            self._stop_network(refused=True)
            raise ConnectionError(f"broker {url} refused {self.client_id}: {reason}{refusal_hint(self._v5, reason)}")

    def _stop_network(self, *, refused: bool = False, timeout: float = 5.0) -> None:
        self._stopping = True
        if self._loop is not None:
            self._want = False
            try:
                self._gone.clear()
                connected = self._client.socket() is not None
                self._client.disconnect()  # the loop writes it, then paho closes the socket there
                if connected and self._loop.running and not self._loop.in_loop():
                    self._gone.wait(timeout)
                self._loop.detach(self._client)  # after the close, in the loop's thread
            finally:
                self._stopping = False
                self._started = False
                self._connected.clear()
            return
        try:
            if refused:  # stop the retries first: the broker said no
                self._client.loop_stop()
                self._client.disconnect()
            else:
                self._client.disconnect()
                self._client.loop_stop()
        finally:
            self._stopping = False
            self._started = False
            self._connected.clear()

    def subscribe(self, topic_filter: str, handler: Handler, *, qos: int | None = None) -> None:
        """Route messages on ``topic_filter`` to ``handler(topic, message)`` (``qos``: the config's
        ``subscribe_qos`` unless given).

        May be called before :meth:`connect`; the subscription is (re)made on
        every connect. Avoid overlapping filters: a broker may deliver a
        message once per matching subscription.
        """
        check_filter(topic_filter)
        qos = self.config.subscribe_qos if qos is None else qos
        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
        self._inbox.add(topic_filter, handler, qos)
        if self._connected.is_set():
            self._note_subscribe(self._client.subscribe(topic_filter, qos))

    def _note_subscribe(self, result: tuple[int, int | None]) -> None:
        import paho.mqtt.client as mqtt

        rc, mid = result
        if rc == mqtt.MQTT_ERR_SUCCESS and mid is not None:
            self._subscribing.sent(mid)

    def wait_subscribed(self, timeout: float) -> bool:
        """Whether the broker acknowledged every subscription of this connection within ``timeout`` seconds
        (refused ones included: they are logged and counted as errors)."""
        return self._subscribing.wait(None, timeout)

    def unsubscribe(self, topic_filter: str) -> None:
        """Forget a filter and its handlers."""
        if self._inbox.remove(topic_filter) and self._connected.is_set():
            self._client.unsubscribe(topic_filter)

    def publish(self, topic: str, msg: Message, *, qos: int = 1, retain: bool = False, wait: bool = False,
                timeout: float = 60.0) -> int:
        """Send a message (chunked above ``max_payload``); returns the bytes sent.

        While disconnected, QoS 1 messages are queued by paho and sent after
        reconnecting. With ``wait`` this blocks until the broker acknowledged
        every chunk (or raises ``TimeoutError`` after ``timeout`` seconds).
        """
        import paho.mqtt.client as mqtt

        if self._closing:
            raise ConnectionError("transport is closed")
        frames = self._frames(topic, msg, retain)
        mids = []
        for frame in frames:
            info = self._client.publish(topic, frame, qos=qos, retain=retain)
            if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                raise ConnectionError(f"paho could not queue a message on {topic}: {mqtt.error_string(info.rc)}")
            self._in_flight.sent(info.mid)
            mids.append(info.mid)
        if wait:
            self._wait_acks(set(mids), timeout)
        return sum(map(len, frames))

    def _wait_acks(self, mids: set[int] | None, timeout: float) -> bool:
        """Wait for the broker's acknowledgements of ``mids`` (None: all in flight): :meth:`InFlight.wait`."""
        return self._in_flight.wait(mids, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Flush unacknowledged messages (up to ``timeout`` s), disconnect cleanly, stop threads.

        A clean disconnect does not trigger the last will.
        """
        if self._closing:
            return
        if self._started and self._connected.is_set() and not self._wait_acks(None, timeout):
            log.warning("closing with %d unacknowledged message(s)", len(self._in_flight))
        self._closing = True
        if self._started:
            self._stop_network(timeout=timeout)
        self._dispatcher.stop(timeout)

    def __enter__(self) -> MqttTransport:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
