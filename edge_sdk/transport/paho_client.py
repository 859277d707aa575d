"""The paho client a :class:`~edge_sdk.transport.mqtt.MqttTransport` wraps, made from a :class:`BrokerConfig`.

Everything set on paho before the first connect: the protocol and the
persistent session (clean_session false on MQTT 3.1.1; clean_start false
plus a session expiry in the CONNECT properties on MQTT 5), credentials, TLS
for ``mqtts://``, the reconnect back-off, the last will, and paho's logger
(``edge_sdk.transport.paho``) with its filter. No paho type leaves the transport.
"""

from __future__ import annotations

import logging
from typing import Any

from ..protocol import Message, encode_message
from .config import BrokerConfig
from .filters import check_topic

__all__ = ["connect_kwargs", "new_client", "refusal_hint"]

#: The logger paho writes to (``enable_logger``); the programs set its level by this name.
_PAHO_LOGGER = "edge_sdk.transport.paho"


class _WhileReconnecting(logging.Filter):
    """paho's "Client is not connected" (logged as an error on each pass of its loop while the connection
    is down) is kept only at DEBUG: the transport says itself that it lost the connection and reconnects."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and str(record.msg).startswith("Client is not connected"):
            return logging.getLogger(_PAHO_LOGGER).isEnabledFor(logging.DEBUG)
        return True


logging.getLogger(_PAHO_LOGGER).addFilter(_WhileReconnecting())


def new_client(config: BrokerConfig, client_id: str, *, will_topic: str | None = None,
               will_payload: Message | bytes | None = None, will_retain: bool = False) -> Any:
    """A paho-mqtt 2.x client for ``client_id``, set up from ``config``, with its last will if given.

    Raises ``ValueError`` when only one of ``will_topic`` and ``will_payload`` is given.
    """
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    v5 = config.protocol == "5"
    kwargs: dict[str, Any] = {"client_id": client_id, "protocol": mqtt.MQTTv5 if v5 else mqtt.MQTTv311}
    if not v5:
        kwargs["clean_session"] = False
    client = mqtt.Client(CallbackAPIVersion.VERSION2, **kwargs)
    client.enable_logger(logging.getLogger(_PAHO_LOGGER))
    if config.username is not None:
        client.username_pw_set(config.username, config.password)
    if config.tls:
        client.tls_set(ca_certs=config.ca_certs, certfile=config.certfile, keyfile=config.keyfile)
        if config.tls_insecure:
            client.tls_insecure_set(True)
    client.reconnect_delay_set(config.reconnect_min_s, config.reconnect_max_s)
    if (will_topic is None) != (will_payload is None):
        raise ValueError("will_topic and will_payload go together")
    if will_topic is not None:
        payload = encode_message(will_payload) if isinstance(will_payload, Message) else bytes(will_payload)
        client.will_set(check_topic(will_topic), payload, qos=1, retain=will_retain)
    return client


def connect_kwargs(config: BrokerConfig) -> dict[str, Any]:
    """The keyword arguments of paho's ``connect_async``: on MQTT 5, keep the session (clean_start false,
    ``session_expiry_s``); on MQTT 3.1.1 none (the client was made with clean_session false)."""
    if config.protocol != "5":
        return {}
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = int(config.session_expiry_s)
    return {"clean_start": False, "properties": props}


def refusal_hint(v5: bool, reason: str | None) -> str:
    """What to add to a refused CONNECT's reason: a broker that speaks no MQTT 5 says so in its own words."""
    return " (it does not speak MQTT 5: use protocol 3.1.1)" if v5 and reason == "Unsupported protocol version" else ""
