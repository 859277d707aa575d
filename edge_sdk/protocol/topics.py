"""Topics: every MQTT topic of one federation, built and parsed in one place."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from .envelope import ProtocolError, check_id

__all__ = ["MAX_PARTITIONS", "Topics", "partition_of"]

#: Most partitions the update topics may be cut into (one per ingest worker).
MAX_PARTITIONS = 256


def partition_of(cid: str, count: int) -> int:
    """The partition (of ``count``) of device ``cid``'s update topic: a hash of its id, the same everywhere."""
    return zlib.crc32(cid.encode("utf-8")) % count


def _check_root(root: str) -> str:
    if not isinstance(root, str) or not root:
        raise ValueError(f"topic root must be a non-empty string, got {root!r}")
    for level in root.split("/"):
        try:
            check_id(level, "topic root level")
        except ProtocolError as e:
            raise ValueError(f"invalid topic root {root!r}: {e}") from None
    return root


class Topics:
    """Every topic of one federation, under ``<root>/<federation>/``.

    ========================================  ===========================
    ``clients/<id>/hello|sketch|update|``     client -> server
    ``status|metrics``
    ``clients/<id>/update/<p>``               client -> ingest worker ``p``
    ``clients/<id>/cmd``                      server -> one client
    ``clusters/<k>/model``                    server -> a cluster
    ``broadcast/cmd``                         server -> all clients
    ``server/status``                         server's own status
    ``aggregators/<id>/receipt|partial``      aggregator -> server
    ``aggregation/cmd``                       server -> every aggregator
    ========================================  ===========================

    Id arguments are validated with :func:`check_id`; ``"+"`` is accepted in
    their place to build a subscription filter (for example ``model("+")``).

    Parameters
    ----------
    root : str
        First topic level(s), default ``"fedsketch"``.
    federation : str
        The federation's id.
    """

    def __init__(self, root: str = "fedsketch", federation: str = "default") -> None:
        self.root = _check_root(root)
        try:
            self.federation = check_id(federation, "federation")
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        self.base = f"{self.root}/{self.federation}"

    def __repr__(self) -> str:
        return f"Topics(root={self.root!r}, federation={self.federation!r})"

    @staticmethod
    def _id(value: Any, what: str) -> str:
        value = str(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
        if value == "+":
            return value
        try:
            return check_id(value, what)
        except ProtocolError as e:
            raise ValueError(str(e)) from None

    def _client(self, cid: str, leaf: str) -> str:
        return f"{self.base}/clients/{self._id(cid, 'client id')}/{leaf}"

    def hello(self, cid: str) -> str:
        """Client -> server: registration facts."""
        return self._client(cid, "hello")

    def sketch(self, cid: str) -> str:
        """Client -> server: the sketch."""
        return self._client(cid, "sketch")

    def update(self, cid: str, partition: int | None = None) -> str:
        """Client -> server: trained weights; with ``partition``, to the ingest worker that takes that partition."""
        topic = self._client(cid, "update")
        if partition is None:
            return topic
        if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition < MAX_PARTITIONS:
            raise ValueError(f"partition must be an integer in [0, {MAX_PARTITIONS}), got {partition!r}")
        return f"{topic}/{partition}"

    def partition_updates(self, partition: int) -> str:
        """Filter over every client's updates on ``partition`` (what ingest worker ``partition`` takes)."""
        return self.update("+", partition)

    def status(self, cid: str) -> str:
        """Client -> server: online/offline (the last will goes here)."""
        return self._client(cid, "status")

    def metrics(self, cid: str) -> str:
        """Client -> server: evaluation results."""
        return self._client(cid, "metrics")

    def cmd(self, cid: str) -> str:
        """Server -> one client: commands."""
        return self._client(cid, "cmd")

    def broadcast(self) -> str:
        """Server -> every client: commands for all (for example "send your sketch")."""
        return f"{self.base}/broadcast/cmd"

    def model(self, cluster: str | int) -> str:
        """Server -> the clients of one cluster: its model."""
        return f"{self.base}/clusters/{self._id(cluster, 'cluster id')}/model"

    def server_status(self) -> str:
        """The server's own status (retained)."""
        return f"{self.base}/server/status"

    def aggregator(self, aid: str, leaf: str) -> str:
        """Aggregator -> server: its receipts (``receipt``) and partial sums (``partial``)."""
        return f"{self.base}/aggregators/{self._id(aid, 'aggregator id')}/{self._id(leaf, 'leaf')}"

    def aggregation(self) -> str:
        """Server -> every aggregator: the round's models and its close (each addressed in its meta)."""
        return f"{self.base}/aggregation/cmd"

    def all_clients(self, leaf: str) -> str:
        """Filter over every client's ``leaf`` (``"#"`` for all of them)."""
        if leaf != "#":
            leaf = self._id(leaf, "leaf")
        return f"{self.base}/clients/+/{leaf}"

    def required_sender(self, topic: str) -> str | None:
        """The id a message on ``topic`` must come from, or None when the topic does not say.

        Under ``clients/<id>/`` every leaf is written by client ``<id>``,
        except ``cmd``, which the server writes; under ``aggregators/<id>/``,
        by aggregator ``<id>``.
        """
        parsed = self.parse(topic)
        if parsed is None or parsed[0] not in ("clients", "aggregators") or parsed[2] == "cmd":
            return None
        return parsed[1]

    def parse(self, topic: str) -> tuple[str, str, str] | None:
        """Split a topic of this federation into (scope, id, leaf) (an update's partition is not returned).

        Scope is ``"clients"``, ``"clusters"``, ``"aggregators"``,
        ``"server"``, ``"broadcast"`` or ``"aggregation"``; the id is empty
        for the last three. Returns ``None`` for
        a topic outside this federation or of another shape.
        """
        prefix = self.base + "/"
        if not topic.startswith(prefix):
            return None
        parts = topic[len(prefix) :].split("/")
        if len(parts) == 4 and parts[0] == "clients" and parts[2] == "update" and parts[3].isdigit() \
                and parts[3].isascii() and int(parts[3]) < MAX_PARTITIONS:
            parts = parts[:3]  # an update on a partition: the same device, the same leaf
        if len(parts) == 3 and parts[0] in ("clients", "clusters", "aggregators"):
            scope, ident, leaf = parts
        elif len(parts) == 2 and parts[0] in ("server", "broadcast", "aggregation"):
            scope, ident, leaf = parts[0], "", parts[1]
        else:
            return None
        for value in ([ident] if len(parts) == 3 else []) + [leaf]:
            try:
                check_id(value)
            except ProtocolError:
                return None
        return scope, ident, leaf
