"""Constants and small classes that several test files share.

Test files import it as ``from helpers import ...``: tests/conftest.py puts
this folder on ``sys.path`` (pytest runs with ``--import-mode=importlib``, so
tests/ is no package). Shared fixtures live in tests/conftest.py. Nothing here
imports torch: the device tests run without it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_sdk.protocol import Message

__all__ = ["ARCH", "PROBE", "Collector", "ari_against", "assert_same_models", "count_publishes", "leb",
           "model_digest", "prove_subscribed"]

#: The small CNN for scikit-learn's 8x8 digits that most federations train.
ARCH = "digits_cnn_1x8x8_10"

#: The meta key that marks a :func:`prove_subscribed` probe (its value: the probe's number).
PROBE = "probe"


class Collector:
    """A transport handler that records what it gets and lets a test wait for it.

    ``items`` holds ``(topic, message)`` pairs in arrival order; ``wait(n)``
    waits for ``n`` of them, up to ``timeout`` seconds (the constructor's
    unless given). Probes of :func:`prove_subscribed` (meta key ``"probe"``)
    are kept apart, in ``probes``: they never show in ``items``.
    """

    def __init__(self, timeout: float = 10.0) -> None:
        self.items: list[tuple[str, Message]] = []
        self.probes: list[tuple[str, Message]] = []
        self.timeout = timeout
        self._cv = threading.Condition()

    def __call__(self, topic: str, msg: Message) -> None:
        with self._cv:
            (self.probes if PROBE in msg.meta else self.items).append((topic, msg))
            self._cv.notify_all()

    def wait(self, n: int = 1, timeout: float | None = None) -> bool:
        """Wait until ``n`` messages arrived; False if ``timeout`` ran out first."""
        with self._cv:
            return self._cv.wait_for(lambda: len(self.items) >= n, self.timeout if timeout is None else timeout)

    def wait_probe(self, topic: str, timeout: float) -> bool:
        """Wait until a probe on ``topic`` arrived; False if ``timeout`` ran out first."""
        with self._cv:
            return self._cv.wait_for(lambda: any(t == topic for t, _ in self.probes), timeout)

    @property
    def messages(self) -> list[Message]:
        """The messages, without their topics."""
        with self._cv:
            return [m for _, m in self.items]

    def topics(self) -> list[str]:
        """The topics, in arrival order."""
        with self._cv:
            return [t for t, _ in self.items]


def prove_subscribed(publisher: Any, topic: str, collector: Collector, *, timeout: float = 10.0,
                     every: float = 0.2) -> int:
    """Positive control for a fresh subscription: probe ``topic`` until ``collector`` (its handler) gets a probe.

    ``MqttTransport.connect()`` returns on the CONNACK and ``subscribe()``
    does not wait for the SUBACK (the transport exposes none), so a message
    published at once may reach the broker before the subscription and be
    dropped. A probe that arrives proves the broker applied the subscription
    whose filter matches ``topic``: what is published on ``topic`` from now
    on reaches the handler. ``publisher`` (a connected transport that may
    write ``topic``) sends a STATUS probe (meta ``{"probe": n}``, the sender
    the topic requires, else the publisher's id) every ``every`` seconds
    until one arrives; the collector keeps probes out of its ``items``, so a
    late probe changes nothing the test looks at (but the transports count
    the probes in their STATUS statistics). Returns the number of probes
    sent; raises AssertionError after ``timeout`` seconds without one.
    """
    from edge_sdk.protocol import Kind, Message

    sender = publisher.topics.required_sender(topic) or publisher.client_id
    deadline = time.monotonic() + timeout
    n = 0
    while True:
        n += 1
        publisher.publish(topic, Message(Kind.STATUS, publisher.federation, sender, 0, {PROBE: n}), wait=True)
        if collector.wait_probe(topic, every):
            return n
        if time.monotonic() > deadline:
            raise AssertionError(f"no probe came back on {topic} within {timeout:g} s ({n} sent): "
                                 "the subscription never took effect")


def ari_against(truth: dict[str, int], assignment: dict[str, int]) -> float:
    """ARI of ``assignment`` against ``truth`` over the devices of ``truth`` (sorted ids)."""
    from sklearn.metrics import adjusted_rand_score

    cids = sorted(truth)
    return float(adjusted_rand_score([truth[c] for c in cids], [assignment[c] for c in cids]))


def count_publishes(transport: Any) -> list[tuple[str, str]]:
    """Record what ``transport`` publishes from now on: ``(topic, a command's op or the message kind)``."""
    published: list[tuple[str, str]] = []
    publish = transport.publish

    def counted(topic: str, msg: Message, **kw: Any) -> Any:
        published.append((topic, msg.meta.get("op", msg.kind.name)))
        return publish(topic, msg, **kw)

    transport.publish = counted
    return published


def leb(value: int) -> bytes:
    """One LEB128 varint (the index coding of compressed bodies), written the slow and obvious way."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def model_digest(weights: Any) -> str:
    """sha256 of a model's float32 tensors in name order: two copies of a model hash alike only bit for bit."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for n in sorted(weights):
        h.update(n.encode() + np.ascontiguousarray(weights[n], dtype=np.float32).tobytes())
    return h.hexdigest()


def assert_same_models(a: Any, b: Any, atol: float = 1e-5) -> None:
    """Strategies ``a`` and ``b`` hold the same models (every cluster, every tensor) up to ``atol``.

    Sums taken in another order (partial sums, workers) differ by ~1e-7 per average, and the rounds of
    training after it carry that on: 1e-5 after two rounds, far below what a different update would move.
    """
    import numpy as np

    assert sorted(a.models) == sorted(b.models)
    for key in a.models:
        for name in a.models[key]:
            np.testing.assert_allclose(a.models[key][name], b.models[key][name], rtol=0, atol=atol,
                                       err_msg=f"{key}/{name}")
