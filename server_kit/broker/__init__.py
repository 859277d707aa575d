"""MQTT brokers for demos and tests: Mosquitto in a subprocess, amqtt in-process, a NATS cluster in subprocesses.

:class:`MosquittoBroker` writes a configuration (listener, persistence,
message limits, password file, ACL) into a temporary folder and runs
``mosquitto -c`` on it; it is the broker of the integration tests and the one
the ``deploy/`` configuration targets. :class:`EmbeddedBroker` runs amqtt on
its own asyncio loop in a background thread, for machines without Mosquitto;
amqtt speaks MQTT 3.1.1 only and keeps no session of an anonymous client.
:class:`NatsCluster` runs several ``nats-server`` nodes, clustered, with
JetStream and an MQTT 3.1.1 listener each: the broker list a device fails
over along (``BrokerConfig(cluster.url)``).

>>> with start_broker() as broker:          # doctest: +SKIP
...     transport = MqttTransport(BrokerConfig(broker.url), "c1", federation="demo")

One module per job: :mod:`~server_kit.broker.mosquitto` (the Mosquitto
process), :mod:`~server_kit.broker.deploy_conf` (the shipped configuration,
adapted), :mod:`~server_kit.broker.embedded` (amqtt), :mod:`~server_kit.broker.nats` (NATS),
:mod:`~server_kit.broker.nats_deploy` (the shipped NATS cluster on one machine) and
:mod:`~server_kit.broker.ports`; :func:`start_broker` picks one here.
"""

from __future__ import annotations

from typing import Any, Union

from .deploy_conf import DEPLOY_CONF, adapt_deploy_conf
from .embedded import EmbeddedBroker
from .mosquitto import MosquittoBroker, find_mosquitto
from .nats import NatsCluster, find_nats_server, nats_server_version
from .nats_deploy import DEPLOY_NATS, ShippedNatsCluster
from .ports import free_port, free_ports

__all__ = ["DEPLOY_CONF", "DEPLOY_NATS", "EmbeddedBroker", "MosquittoBroker", "NatsCluster", "ShippedNatsCluster",
           "adapt_deploy_conf", "find_mosquitto", "find_nats_server", "free_port", "free_ports", "nats_server_version",
           "start_broker"]

#: Either kind of broker (what :func:`start_broker` returns).
AnyBroker = Union[MosquittoBroker, EmbeddedBroker]


def start_broker(prefer: str = "auto", **kw: Any) -> AnyBroker:
    """Start a broker and return it (use it as a context manager to stop it).

    Parameters
    ----------
    prefer : {"auto", "mosquitto", "amqtt"}
        ``auto`` takes Mosquitto when it is installed, else amqtt.
    **kw
        Passed to :class:`MosquittoBroker` (``port``, ``acl``...); for amqtt
        only ``host`` and ``port`` are used.
    """
    if prefer not in ("auto", "mosquitto", "amqtt"):
        raise ValueError(f"prefer must be 'auto', 'mosquitto' or 'amqtt', got {prefer!r}")
    if prefer == "mosquitto" or (prefer == "auto" and find_mosquitto() is not None):
        broker: AnyBroker = MosquittoBroker(**kw)
        broker.start()
        return broker
    embedded = EmbeddedBroker()
    embedded.start(host=kw.get("host", "127.0.0.1"), port=kw.get("port"))
    return embedded
