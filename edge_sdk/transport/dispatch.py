"""The receive side of a :class:`~edge_sdk.transport.mqtt.MqttTransport`: from paho's callback to the handlers.

Each message paho hands over is validated by the transport's inbox (never
raising into paho's network thread) and its deliveries go to the handlers in
order: on the transport's own dispatcher thread, through a bounded queue
(when it is full, paho's network thread waits: back-pressure to the broker),
or, with a shared :class:`~edge_sdk.transport.netloop.NetworkLoop`, on the
loop's pool, in the transport's lane. The same thread, or the loop's tick,
expires stalled chunked transfers about once a second.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from typing import Any, Callable

from .inbox import Delivery, Inbox, Meter

__all__ = ["Dispatcher"]

# the transport's log keeps its one name: these lines were MqttTransport's and still are
log = logging.getLogger("edge_sdk.transport.mqtt")

#: Seconds between two expiry passes over partial chunked transfers, while idle.
_EXPIRY_PERIOD_S = 1.0


class Dispatcher:
    """Validate each incoming message and run its handlers, off paho's network thread.

    Parameters
    ----------
    client_id : str
        The transport's id: its dispatcher thread's name, its lane's.
    inbox, meter :
        The transport's receive path and counters.
    deliver : callable
        ``deliver(deliveries)``: runs the handlers (and the delivery listeners).
    closing : callable
        ``closing()``: whether the transport is closing (then nothing more is delivered).
    dispatch_queue : int
        Validated messages waiting for the dispatcher thread. Not used with ``loop``.
    loop : NetworkLoop, optional
        The shared loop whose pool runs the handlers instead of a thread of this transport.
    """

    def __init__(self, client_id: str, inbox: Inbox, meter: Meter, deliver: Callable[[list[Delivery]], None],
                 closing: Callable[[], bool], *, dispatch_queue: int, loop: Any = None) -> None:
        self._name = f"fedsketch-{client_id}"
        self._inbox = inbox
        self._meter = meter
        self._deliver = deliver
        self._closing = closing
        self._queue: queue.Queue[list[Delivery] | None] = queue.Queue(maxsize=dispatch_queue)
        self._worker: threading.Thread | None = None
        self._loop = loop
        self._lane = loop.pool.lane(client_id) if loop is not None else None
        self._next_expiry = 0.0

    # -- paho's callback (network thread) --
    def on_message(self, client: Any, userdata: Any, message: Any) -> None:
        if self._lane is not None:  # validated and handled on the loop's pool, in order
            self._loop.submit(self._lane, functools.partial(
                self._receive, message.topic, message.payload, bool(getattr(message, "retain", False))))
            return
        try:
            deliveries = self._inbox.process(message.topic, message.payload, bool(getattr(message, "retain", False)))
        except Exception:  # never raise into paho's thread
            self._meter.bump(self._meter.errors, "receive")
            log.exception("failed to process a message on %s", getattr(message, "topic", "?"))
            return
        while deliveries and not self._closing():
            try:
                self._queue.put(deliveries, timeout=0.5)
                break
            except queue.Full:
                log.warning("handlers are behind: %d messages waiting", self._queue.qsize())

    # -- with a loop: on its pool, and its timer --
    def _receive(self, topic: str, payload: bytes, retained: bool) -> None:
        """With a loop: validate and deliver one message (on the loop's pool)."""
        if self._closing():
            return
        try:
            deliveries = self._inbox.process(topic, payload, retained)
        except Exception:
            self._meter.bump(self._meter.errors, "receive")
            log.exception("failed to process a message on %s", topic)
            return
        if deliveries:
            self._deliver(deliveries)

    def tick(self) -> None:
        """Called by the loop about once a second: expiry of stalled chunked transfers."""
        if self._inbox.partials() and time.monotonic() >= self._next_expiry:
            self._next_expiry = time.monotonic() + _EXPIRY_PERIOD_S
            self._loop.submit(self._lane, self._expire)

    def _expire(self) -> None:
        try:
            self._inbox.expire()
        except Exception:
            self._meter.bump(self._meter.errors, "expire")
            log.exception("expiring partial transfers failed")

    # -- without a loop: the dispatcher thread --
    def start(self) -> None:
        """Start the dispatcher thread (without a loop, once)."""
        if self._worker is None and self._loop is None:
            self._worker = threading.Thread(target=self._dispatch, name=self._name, daemon=True)
            self._worker.start()

    def stop(self, timeout: float) -> None:
        """Stop the dispatcher thread once the messages queued before are handled (up to ``timeout`` s)."""
        if self._worker is not None:
            self._queue.put(None)
            if self._worker is not threading.current_thread():
                self._worker.join(timeout)
            self._worker = None

    def _dispatch(self) -> None:
        # Also the timer that frees stalled partial transfers when no chunk comes.
        next_expiry = time.monotonic() + _EXPIRY_PERIOD_S
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_expiry - time.monotonic()))
            except queue.Empty:
                item = []
            if item is None:
                return
            if time.monotonic() >= next_expiry:
                try:
                    self._inbox.expire()
                except Exception:  # keep the dispatcher alive
                    self._meter.bump(self._meter.errors, "expire")
                    log.exception("expiring partial transfers failed")
                next_expiry = time.monotonic() + _EXPIRY_PERIOD_S
            if item:
                self._deliver(item)
