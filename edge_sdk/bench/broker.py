"""The MQTT round trip and upload rate to the real broker, as the device, on the device's own status topic.

The shipped ACL (``deploy/acl``) lets a device write five topics under its
own ``clients/<id>/`` and read only its commands, the cluster models and the
broadcast: no topic is both, so no message of its own ever comes back. The
round trip is therefore a QoS 1 publish until the broker's PUBACK (device ->
broker -> device). The messages go on ``clients/<id>/status`` and say
``offline``, true while the bench holds the device's connection (its
``fedsketch-client`` must be stopped: the broker keeps one connection per
client id), so a running server takes nothing from them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from typing import Callable

from ..protocol import Kind, Message
from ..transport import BrokerConfig, MqttTransport
from .errors import EXIT_BROKER, BenchError
from .results import BrokerTiming
from .timing import median, percentile

__all__ = ["METHOD_NOTE", "probe_broker"]

METHOD_NOTE = ("round trip = QoS 1 publish until the broker's PUBACK: the ACL lets a device read none of the "
               "topics it writes (deploy/acl), so nothing of its own comes back")


def _fail(cfg: BrokerConfig, reason: object) -> BenchError:
    text = " ".join(str(reason).split()).replace(f"from broker {cfg.url} ", "").replace(f"broker {cfg.url} ", "")
    return BenchError(f"broker {cfg.url}: {text}", EXIT_BROKER)


def _reach(cfg: BrokerConfig, timeout: float) -> None:
    """Fail at once, with the system's reason, where nothing listens (MQTT's own connect would retry until its timeout)."""
    try:
        with socket.create_connection((cfg.host, cfg.port), timeout=timeout):
            pass
    except socket.timeout:
        raise _fail(cfg, f"no answer from {cfg.host}:{cfg.port} within {timeout:g} s") from None
    except OSError as e:
        raise _fail(cfg, f"cannot reach {cfg.host}:{cfg.port} ({e.strerror or e})") from None


@contextlib.contextmanager
def _quiet(quiet: bool) -> Iterator[None]:
    """The transport's own log lines off (the bench says what failed, in one line)."""
    logger = logging.getLogger("edge_sdk.transport")
    before = logger.level
    if quiet:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(before)


def _measure(t: MqttTransport, topic: str, federation: str, client_id: str, *, messages: int, upload_bytes: int,
             upload_messages: int, timeout: float) -> tuple[list[float], int, float]:
    small = Message(Kind.STATUS, federation, client_id, 0, {"state": "offline"})
    rtts = []
    for _ in range(messages):
        t0 = time.perf_counter()
        t.publish(topic, small, qos=1, wait=True, timeout=timeout)
        rtts.append(time.perf_counter() - t0)
    big = Message(Kind.STATUS, federation, client_id, 0, {"state": "offline"}, bytes(upload_bytes))
    sent = 0
    t0 = time.perf_counter()
    for _ in range(upload_messages):
        sent += t.publish(topic, big, qos=1, wait=True, timeout=max(timeout, 120.0))
    return rtts, sent, time.perf_counter() - t0


def probe_broker(cfg: BrokerConfig, client_id: str, *, federation: str, root: str = "fedsketch",
                 messages: int = 20, upload_bytes: int = 1_000_000, upload_messages: int = 3,
                 connect_timeout: float = 10.0, quiet: bool = True,
                 progress: Callable[[str], None] = lambda line: None) -> BrokerTiming:
    """Connect as ``client_id`` and time ``messages`` small publishes and ``upload_messages`` large ones.

    Parameters
    ----------
    cfg : BrokerConfig
        The broker and the device's credentials (``--broker``, ``--username``, ``--password-file``...).
    client_id, federation, root : str
        The device's id (its broker user name) and its federation's topics.
    messages : int
        Small messages (a 20-odd-byte envelope each) for the round trip.
    upload_bytes, upload_messages : int
        Size and count of the large messages for the upload rate (chunked
        above ``cfg.max_payload``, as the transport sends updates).
    connect_timeout : float
        Seconds to wait for the broker's answer.

    Raises
    ------
    BenchError
        Exit 3, one line: the broker cannot be reached, refuses the
        credentials, or stops acknowledging.
    """
    _reach(cfg, connect_timeout)
    with _quiet(quiet):
        t = MqttTransport(cfg, client_id, federation=federation, root=root)
        topic = t.topics.status(client_id)
        try:
            progress(f"broker: connecting to {cfg.url} as {client_id}")
            t.connect(timeout=connect_timeout)
            progress(f"broker: {messages} small and {upload_messages} large messages on {topic}")
            rtts, sent, seconds = _measure(t, topic, federation, client_id, messages=messages,
                                           upload_bytes=upload_bytes, upload_messages=upload_messages,
                                           timeout=connect_timeout)
            refused = t.stats()["errors"].get("publish", 0)
        except (ConnectionError, TimeoutError, OSError) as e:
            raise _fail(cfg, e) from None
        finally:
            t.close(timeout=2.0)
    note = METHOD_NOTE
    if refused:
        note += f"; the broker refused {refused} publish(es) (not authorized: check the ACL and the user name)"
    return BrokerTiming(url=cfg.url, client_id=client_id, topic=topic, method="puback", messages=len(rtts),
                        rtt_median_s=median(rtts), rtt_p90_s=percentile(rtts, 90), upload_bytes=int(sent),
                        upload_seconds=seconds, upload_mb_s=sent / seconds / 1e6, note=note)
