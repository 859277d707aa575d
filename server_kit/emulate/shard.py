"""The devices of one process: their settings, their connections, and the threads that step them.

A :class:`Shard` creates every device of its process (a real
:class:`~edge_sdk.client.EdgeClient` on its own
:class:`~edge_sdk.transport.MqttTransport`), shares a few
:class:`~edge_sdk.transport.netloop.NetworkLoop` threads and one
:class:`~edge_sdk.transport.pool.OrderedPool` among them, and counts what
they did (:meth:`Shard.snapshot`).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..data.partition import ClientData

__all__ = ["FleetSettings", "Shard", "sum_into"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetSettings:
    """How the emulated devices reach the broker and behave (plain values: they cross to child processes).

    ``loops`` network threads and ``workers`` handler threads per loop,
    ``steppers`` threads calling :meth:`EdgeClient.step`, per process.
    ``connect_window``: connections opened and not yet acknowledged by the
    broker at once (Mosquitto accepts from a queue of 100: a larger burst
    only makes the kernel drop SYNs, and the devices wait 1 s to retry), and
    as many devices whose subscriptions are not acknowledged yet.
    """

    broker_url: str
    federation: str = "default"
    root: str = "fedsketch"
    loops: int = 2
    workers: int = 2
    steppers: int = 2
    hello_jitter_s: float = 0.0
    model_timeout_s: float = 120.0
    connect_window: int = 64
    connect_timeout_s: float = 120.0
    keepalive: int = 60
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 10.0
    #: The devices' subscriptions' QoS (BrokerConfig.subscribe_qos: 0 needs no JetStream consumer on NATS).
    subscribe_qos: int = 1
    seed: int = 0
    quiet: bool = True

    def __post_init__(self) -> None:
        for name in ("loops", "workers", "steppers", "connect_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not self.hello_jitter_s >= 0:
            raise ValueError(f"hello_jitter_s must be >= 0, got {self.hello_jitter_s!r}")


def sum_into(total: dict[str, Any], part: Mapping[str, Any]) -> None:
    """Add nested counters (dicts of ints) into ``total``."""
    for k, v in part.items():
        if isinstance(v, Mapping):
            sum_into(total.setdefault(k, {}), v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            total[k] = total.get(k, 0) + v


class _Timer:
    """One thread calling ``fn(item)`` at given times (for the devices' jittered hellos)."""

    def __init__(self, fn: Callable[[int], None]) -> None:
        self._fn = fn
        self._heap: list[tuple[float, int]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="fedsketch-emulate-timer", daemon=True)
        self._thread.start()

    def at(self, when: float, item: int) -> None:
        with self._cv:
            heapq.heappush(self._heap, (when, item))
            if self._heap[0][1] == item:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, item = heapq.heappop(self._heap)
            self._fn(item)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(5)


class Shard:
    """The devices of one process."""

    def __init__(self, settings: FleetSettings, clients: Sequence[ClientData],
                 passwords: Mapping[str, str] | None = None) -> None:
        self.s = settings
        self.clients = list(clients)
        self.passwords = dict(passwords or {})
        self.edges: list[Any] = []
        self.transports: list[Any] = []
        self.loops: list[Any] = []
        self.done: dict[str, int] = {}  # device -> exit code, once it stopped
        self._lanes: list[Any] = []
        self._steps: Any = None
        self._timer: _Timer | None = None
        self._closed = False
        self.started_s: float | None = None

    def start(self) -> None:
        """Create every device, connect them (``connect_window`` at a time), start each client."""
        from edge_sdk.client import EdgeClient
        from edge_sdk.protocol import Kind, Message, Topics, encode_message
        from edge_sdk.transport import BrokerConfig, MqttTransport
        from edge_sdk.transport.netloop import NetworkLoop, OrderedPool, raise_nofile_limit
        from edge_sdk.worker import LocalWorker

        s = self.s
        need = len(self.clients) + 256
        soft = raise_nofile_limit()
        if 0 < soft < need:
            raise OSError(f"{len(self.clients)} devices need about {need} open files; this process may open "
                          f"{soft} (ulimit -Hn): raise the hard limit or use more processes")
        t0 = time.monotonic()
        self.loops = [NetworkLoop(workers=s.workers, name=f"fedsketch-emu{i}") for i in range(s.loops)]
        self._steps = OrderedPool(s.steppers, name="fedsketch-emu-step").start()
        self._timer = _Timer(self._wake)
        topics = Topics(s.root, s.federation)
        encoders: dict[str, Any] = {}  # one ONNX session per encoder for the whole process (thread-safe)
        brokers = [u.strip() for u in s.broker_url.split(",")]
        for i, c in enumerate(self.clients):
            pw = self.passwords.get(c.cid)
            first = i % len(brokers)  # a broker list (a NATS cluster's nodes): devices spread over its brokers
            cfg = BrokerConfig.from_url(",".join(brokers[first:] + brokers[:first]), username=c.cid if pw is not None else None, password=pw,
                                        keepalive=s.keepalive, reconnect_min_s=s.reconnect_min_s,
                                        reconnect_max_s=s.reconnect_max_s, subscribe_qos=s.subscribe_qos)
            will = encode_message(Message(Kind.STATUS, s.federation, c.cid, 0, {"state": "offline"}))
            t = MqttTransport(cfg, c.cid, federation=s.federation, root=s.root,
                              will_topic=topics.status(c.cid), will_payload=will, loop=self.loops[i % s.loops])
            w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, seed=s.seed + i)
            ec = EdgeClient(t, w, federation=s.federation, root=s.root, seed=s.seed + i,
                            model_timeout_s=s.model_timeout_s, hello_jitter_s=s.hello_jitter_s,
                            encoders=encoders)  # one ONNX Runtime session per encoder in the process
            t.on_delivered(partial(self._wake, i))
            self.transports.append(t)
            self.edges.append(ec)
            self._lanes.append(self._steps.lane(c.cid))
        # Two stages of at most connect_window devices each: connecting, then subscribing (a NATS node creates a
        # JetStream consumer per subscription: thousands asked at once time out).
        connecting: deque[int] = deque()
        subscribing: deque[int] = deque()
        for i, t in enumerate(self.transports):
            t.connect(wait=False)
            connecting.append(i)
            if len(connecting) >= s.connect_window:
                self._start_client(connecting.popleft(), subscribing)
        while connecting:
            self._start_client(connecting.popleft(), subscribing)
        while subscribing:
            self._wait_subscribed(subscribing.popleft())
        self.started_s = time.monotonic() - t0

    def _start_client(self, i: int, subscribing: deque[int]) -> None:
        t, ec = self.transports[i], self.edges[i]
        if not t.wait_connected(self.s.connect_timeout_s):
            raise ConnectionError(f"device {ec.cid} not connected to {self.s.broker_url} within "
                                  f"{self.s.connect_timeout_s:g} s")
        ec.start()  # subscribes, then schedules its hello (jittered)
        t.on_connected(partial(self._after_connect, i))  # after the client's own listener: its hello is due
        self._schedule(i)
        subscribing.append(i)
        if len(subscribing) >= self.s.connect_window:
            self._wait_subscribed(subscribing.popleft())

    def _wait_subscribed(self, i: int) -> None:
        if not self.transports[i].wait_subscribed(self.s.connect_timeout_s):
            raise ConnectionError(f"device {self.edges[i].cid}: {self.s.broker_url} did not acknowledge its "
                                  f"subscriptions within {self.s.connect_timeout_s:g} s")

    def _after_connect(self, i: int) -> None:
        self._schedule(i)

    def _schedule(self, i: int) -> None:
        due = self.edges[i].hello_due
        if due is not None and self._timer is not None:
            self._timer.at(due, i)

    def _wake(self, i: int) -> None:
        if not self._closed:
            self._steps.submit(self._lanes[i], partial(self._step, i))

    def _step(self, i: int) -> None:
        ec = self.edges[i]
        if ec.cid in self.done:
            return
        if ec.step(0):
            self._schedule(i)
        else:
            self.done[ec.cid] = ec.exit_code

    def snapshot(self, totals: bool = False) -> dict[str, Any]:
        """Counts: devices, connected, done (and exit codes), commands handled per op; ``totals``: traffic too."""
        handled: dict[str, int] = {}
        for ec in self.edges:
            for op, n in list(ec.handled.items()):
                handled[op] = handled.get(op, 0) + n
        codes: dict[str, int] = {}
        for code in list(self.done.values()):
            codes[str(code)] = codes.get(str(code), 0) + 1
        out: dict[str, Any] = {
            "devices": len(self.clients), "connected": sum(t.is_connected for t in self.transports),
            "done": len(self.done), "exit_codes": codes, "handled": handled,
            "started_s": self.started_s,
        }
        if totals:
            traffic: dict[str, Any] = {}
            for t in self.transports:
                st = t.stats()
                sum_into(traffic, {"sent": st["sent"], "received": st["received"], "rejected": st["rejected"],
                                    "errors": st["errors"]})
            out["traffic"] = traffic
            loops: dict[str, Any] = {}
            for lp in self.loops:
                sum_into(loops, lp.stats())
            out["loops"] = loops
            out["rejected_by_clients"] = {}
            for ec in self.edges:
                sum_into(out["rejected_by_clients"], dict(ec.rejected))
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Disconnect every device cleanly (no last will), stop the threads."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.close()
        if self._steps is not None:
            self._steps.close(timeout)
        for t in self.transports:
            try:
                t.close(timeout=min(timeout, 1.0))
            except Exception as e:  # keep closing the others
                log.warning("closing %s: %s", t.client_id, e)
        for lp in self.loops:
            lp.close(timeout)
