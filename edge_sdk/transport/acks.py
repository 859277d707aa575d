"""The publishes a :class:`~edge_sdk.transport.mqtt.MqttTransport` has in flight, not yet acknowledged.

paho gives each QoS 1 publish a message id when it queues it, and calls back
with that id when the broker acknowledges it, in its network thread, which
may come before ``publish`` has recorded the id: :class:`InFlight` keeps both
orders right, and lets a publisher (or ``close``) wait for the acknowledgements.
"""

from __future__ import annotations

import threading
import time

__all__ = ["InFlight"]


class InFlight:
    """Message ids sent and not acknowledged yet, and acknowledgements that came before their id was noted."""

    def __init__(self) -> None:
        self._acks = threading.Condition()
        self._unacked: set[int] = set()
        self._early_acks: set[int] = set()

    def __len__(self) -> int:
        return len(self._unacked)

    def sent(self, mid: int) -> None:
        """Note a message paho queued (publisher's thread)."""
        with self._acks:
            if mid in self._early_acks:
                self._early_acks.discard(mid)
            else:
                self._unacked.add(mid)

    def acked(self, mid: int) -> None:
        """Note the broker's acknowledgement of a message (network thread), and wake the waiters."""
        with self._acks:
            if mid in self._unacked:
                self._unacked.discard(mid)
            else:
                self._early_acks.add(mid)
            self._acks.notify_all()

    def forget(self) -> None:
        """Drop every id in flight: a new connection will not acknowledge the old one's (a SUBSCRIBE's)."""
        with self._acks:
            self._unacked.clear()
            self._early_acks.clear()

    def wait(self, mids: set[int] | None, timeout: float) -> bool:
        """Wait until ``mids`` (None: every message in flight) are acknowledged; returns whether they are.

        With ``mids`` given, raises ``TimeoutError`` after ``timeout`` seconds instead of returning False.
        """
        deadline = time.monotonic() + timeout
        with self._acks:
            while True:
                left = self._unacked if mids is None else (mids & self._unacked)
                if not left:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if mids is not None:
                        raise TimeoutError(f"{len(left)} message(s) not acknowledged within {timeout:g} s")
                    return False
                self._acks.wait(min(remaining, 0.5))
