"""Constants and small classes that several test files share.

Test files import it as ``from helpers import ...``: tests/conftest.py puts
this folder on ``sys.path`` (pytest runs with ``--import-mode=importlib``, so
tests/ is no package). Shared fixtures live in tests/conftest.py. Nothing here
imports torch: the device tests run without it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_sdk.protocol import Message

__all__ = ["ARCH", "Collector", "ari_against", "count_publishes"]

#: The small CNN for scikit-learn's 8x8 digits that most federations train.
ARCH = "digits_cnn_1x8x8_10"


class Collector:
    """A transport handler that records what it gets and lets a test wait for it.

    ``items`` holds ``(topic, message)`` pairs in arrival order; ``wait(n)``
    waits for ``n`` of them, up to ``timeout`` seconds (the constructor's
    unless given).
    """

    def __init__(self, timeout: float = 10.0) -> None:
        self.items: list[tuple[str, Message]] = []
        self.timeout = timeout
        self._cv = threading.Condition()

    def __call__(self, topic: str, msg: Message) -> None:
        with self._cv:
            self.items.append((topic, msg))
            self._cv.notify_all()

    def wait(self, n: int = 1, timeout: float | None = None) -> bool:
        """Wait until ``n`` messages arrived; False if ``timeout`` ran out first."""
        with self._cv:
            return self._cv.wait_for(lambda: len(self.items) >= n, self.timeout if timeout is None else timeout)

    @property
    def messages(self) -> list[Message]:
        """The messages, without their topics."""
        with self._cv:
            return [m for _, m in self.items]

    def topics(self) -> list[str]:
        """The topics, in arrival order."""
        with self._cv:
            return [t for t, _ in self.items]


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
