"""The broker list a :class:`~edge_sdk.transport.mqtt.MqttTransport` goes round: failover across a cluster's nodes.

Given a list of brokers (the nodes of a cluster:
``BrokerConfig("mqtt://a:1883,mqtt://b:1883")``), the first connection goes to
the first one; each lost connection, failed attempt or refused CONNECT moves
the next attempt to the next broker of the list, round robin.
:class:`BrokerList` keeps which broker is in use or tried next, and says which
refusals let another broker of the list be tried; the transport dials it.
"""

from __future__ import annotations

from .config import BrokerConfig

__all__ = ["BUSY_REFUSALS", "BrokerList"]

#: CONNACK refusals that say this broker cannot take the client now, not that the client may not connect:
#: with a list of brokers, the first connect tries the next one instead of giving up.
BUSY_REFUSALS = frozenset({"Server unavailable", "Server busy", "Use another server", "Server moved"})


class BrokerList:
    """The brokers of ``config.url``, in order, and the one in use or tried next."""

    def __init__(self, config: BrokerConfig) -> None:
        self._urls = config.urls
        self._endpoints = config.endpoints
        #: Index in the broker list of the broker in use, or tried next.
        self._at = 0

    def __len__(self) -> int:
        return len(self._endpoints)

    @property
    def url(self) -> str:
        """The broker in use, or tried next (one of ``config.urls``)."""
        return self._urls[self._at]

    @property
    def endpoint(self) -> tuple[str, int]:
        """Its host and port."""
        return self._endpoints[self._at]

    @property
    def position(self) -> int:
        """Its place in the list, from 1."""
        return self._at + 1

    def advance(self) -> tuple[str, int]:
        """Move to the next broker of the list (round robin); returns its host and port."""
        self._at = (self._at + 1) % len(self._endpoints)
        return self.endpoint

    def passes_over(self, reason: str) -> bool:
        """Whether a CONNECT refused for ``reason`` lets another broker of the list be tried."""
        return reason in BUSY_REFUSALS and len(self._endpoints) > 1
