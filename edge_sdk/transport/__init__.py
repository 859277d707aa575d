"""MQTT transport: the one package that owns paho, its in-memory twin, and the network loop for many connections.

:class:`MqttTransport` wraps a paho-mqtt 2.x client (it never subclasses it
nor lets paho types escape): persistent sessions (clean_session false on
MQTT 3.1.1, clean_start false plus a session expiry on MQTT 5), QoS 1,
subscriptions remade on every connect so they survive reconnects, exponential
reconnect back-off, an optional last will, TLS for ``mqtts://``.

Incoming payloads go through one path, shared with :class:`MemoryTransport`:
:func:`~edge_sdk.protocol.decode_message` (on a ``clients/<id>/`` topic other
than ``cmd`` the sender must be ``<id>``; the federation must be ours), CHUNK
envelopes through a :class:`~edge_sdk.protocol.Reassembler`, then the
handlers. Rejections are logged and counted by reason, never raised into
the network thread. Outgoing messages above ``max_payload`` are chunked.
Bytes are counted per message kind in both directions (chunk traffic is
attributed to the kind it carries), which is how FedSketch measures
communication.

Handlers run on one dispatcher thread of the transport, not in paho's
network thread, so a slow handler does not stop keep-alives; still, hand
long work (training) to another thread and do not wait for a publish inside
a handler. :class:`MemoryTransport` calls handlers synchronously, in the
publisher's thread, which keeps unit tests deterministic.

A process that holds many connections (the fleet emulator) passes a shared
:class:`~edge_sdk.transport.netloop.NetworkLoop` (``loop=``): then one
thread runs the sockets of every transport and a small pool runs their
handlers, still in order per transport (see
:mod:`edge_sdk.transport.netloop`). Without it, each transport has its own
threads, which is right for a device.

The modules, one job each:

* :mod:`~edge_sdk.transport.config`: :class:`BrokerConfig`, where the broker is and how to talk to it;
* :mod:`~edge_sdk.transport.filters`: topic filters, :func:`topic_matches`;
* :mod:`~edge_sdk.transport.inbox`: the receive path (validate, reassemble, count, route);
* :mod:`~edge_sdk.transport.base`: the :class:`Transport` interface and the shared send side;
* :mod:`~edge_sdk.transport.mqtt`: :class:`MqttTransport`, the one class that owns paho (the session);
* :mod:`~edge_sdk.transport.paho_client`: the paho client built from a :class:`BrokerConfig`;
* :mod:`~edge_sdk.transport.failover`: ``BrokerList``, the broker in use and which refusals pass to the next;
* :mod:`~edge_sdk.transport.acks`: ``InFlight``, the publishes not yet acknowledged and the wait for them;
* :mod:`~edge_sdk.transport.dispatch`: ``Dispatcher``, paho's messages to the handlers;
* :mod:`~edge_sdk.transport.memory`: :class:`MemoryBroker` and :class:`MemoryTransport`;
* :mod:`~edge_sdk.transport.netloop`: :class:`NetworkLoop`, one epoll thread for many connections;
* :mod:`~edge_sdk.transport.pool`: :class:`OrderedPool`, the handlers' threads, in order per transport.
"""

from .base import Transport
from .config import BrokerConfig
from .filters import topic_matches
from .inbox import Handler
from .memory import MemoryBroker, MemoryTransport
from .mqtt import MqttTransport
from .netloop import NetworkLoop, raise_nofile_limit
from .pool import OrderedPool

__all__ = [
    "BrokerConfig",
    "Handler",
    "MemoryBroker",
    "MemoryTransport",
    "MqttTransport",
    "NetworkLoop",
    "OrderedPool",
    "Transport",
    "raise_nofile_limit",
    "topic_matches",
]
