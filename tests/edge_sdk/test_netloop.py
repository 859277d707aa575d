"""The shared network loop: many MQTT connections on one thread, handlers in order per transport."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from edge_sdk.protocol import Kind, Message
from edge_sdk.transport import BrokerConfig, MqttTransport
from edge_sdk.transport.netloop import NetworkLoop, OrderedPool, raise_nofile_limit
from server_kit.broker import MosquittoBroker, find_mosquitto

from helpers import PROBE, Collector, prove_subscribed

FED = "loop"
needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


class Inbox:
    """Numbers received per transport, in arrival order (probes of ``prove_subscribed`` left out)."""

    def __init__(self) -> None:
        self.got: dict[str, list[int]] = {}
        self.probed: set[str] = set()
        self._cv = threading.Condition()

    def handler(self, name: str, *, jitter_s: float = 0.0):
        def handle(topic: str, msg: Message) -> None:
            if PROBE in msg.meta:
                with self._cv:
                    self.probed.add(topic)
                    self._cv.notify_all()
                return
            if jitter_s:
                time.sleep(random.uniform(0, jitter_s))  # slow handlers must not reorder a transport's messages
            with self._cv:
                self.got.setdefault(name, []).append(msg.round)
                self._cv.notify_all()
        return handle

    def wait_probe(self, topic: str, timeout: float) -> bool:
        """A probe of :func:`prove_subscribed` arrived on ``topic``: the broker holds that subscription."""
        with self._cv:
            return self._cv.wait_for(lambda: topic in self.probed, timeout)

    def wait(self, total: int, timeout: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: sum(map(len, self.got.values())) >= total, timeout)


def cmd(rnd: int) -> Message:
    return Message(Kind.CMD, FED, "server", rnd, {"op": "hello"})


@pytest.fixture(scope="module")
def broker():
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    with MosquittoBroker(extra_conf="max_queued_messages 100000") as b:
        yield b


@pytest.fixture
def loop():
    lp = NetworkLoop(workers=3, misc_interval_s=60.0)  # no periodic pass during a test: nothing hides a stall
    yield lp
    lp.close()


def test_ordered_pool_keeps_each_lane_in_order_and_runs_lanes_side_by_side():
    pool = OrderedPool(3, name="test-pool").start()
    seen: dict[int, list[int]] = {}
    lanes = [pool.lane(str(k)) for k in range(5)]
    done = threading.Event()
    for j in range(100):
        for k, lane in enumerate(lanes):
            def job(k=k, j=j):
                time.sleep(random.uniform(0, 0.0005))
                seen.setdefault(k, []).append(j)
                if sum(map(len, seen.values())) == 500:
                    done.set()
            pool.submit(lane, job)
    assert done.wait(20)
    assert all(seen[k] == list(range(100)) for k in range(5))
    barrier = threading.Barrier(2, timeout=5)  # two lanes at once, or this waits forever
    both = [pool.lane("a"), pool.lane("b")]
    results = []
    for lane in both:
        pool.submit(lane, lambda: results.append(barrier.wait()))
    deadline = time.monotonic() + 5
    while len(results) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(results) == [0, 1] and pool.errors == 0
    pool.close()


def test_ordered_pool_refuses_a_bad_worker_count():
    with pytest.raises(ValueError, match=r"workers must be a positive integer, got 0"):
        OrderedPool(0)


def test_connect_without_waiting_needs_a_loop():
    t = MqttTransport(BrokerConfig("mqtt://127.0.0.1:1"), "c1", federation=FED)
    with pytest.raises(ValueError, match=r"connect\(wait=False\) needs a transport on a NetworkLoop"):
        t.connect(wait=False)


@needs_mosquitto
def test_each_transport_gets_its_messages_in_order_through_the_shared_pool(broker, loop):
    inbox = Inbox()
    n, k = 30, 40
    devices = []
    for i in range(n):
        t = MqttTransport(BrokerConfig.from_url(broker.url), f"o{i}", federation=FED, loop=loop)
        t.subscribe(t.topics.cmd(f"o{i}"), inbox.handler(f"o{i}", jitter_s=0.002))
        t.connect(wait=False)
        devices.append(t)
    assert all(t.wait_connected(10) for t in devices)
    server = MqttTransport(BrokerConfig.from_url(broker.url), "server", federation=FED)
    server.connect()
    try:
        for t in devices:  # connected is not subscribed: a message the broker gets first would be dropped
            prove_subscribed(server, server.topics.cmd(t.client_id), inbox)
        for r in range(k):  # interleaved: every device's message r before anyone's r + 1
            for i in range(n):
                server.publish(server.topics.cmd(f"o{i}"), cmd(r))
        assert inbox.wait(n * k, 30), sum(map(len, inbox.got.values()))
        assert all(inbox.got[f"o{i}"] == list(range(k)) for i in range(n))
        assert loop.sockets == n and loop.stats()["job_errors"] == 0
    finally:
        server.close()
        for t in devices:
            t.close()
    assert loop.sockets == 0


@needs_mosquitto
def test_a_publish_from_another_thread_goes_out_at_once(broker, loop):
    """No periodic pass runs (misc_interval_s=60): every message must be written when it is published.

    Eight threads publish through eight idle loop transports at once, many
    times: paho's write flag raced with its network thread and left about one
    device in a thousand waiting for the next flush; here all must arrive
    within seconds.
    """
    server = MqttTransport(BrokerConfig.from_url(broker.url), "server", federation=FED)
    inbox, probes = Inbox(), Collector()
    server.subscribe(server.topics.all_clients("hello"), inbox.handler("server"))
    server.subscribe(server.topics.all_clients("hello"), probes)
    server.connect()
    devices = [MqttTransport(BrokerConfig.from_url(broker.url), f"w{i}", federation=FED, loop=loop)
               for i in range(8)]
    for t in devices:
        t.connect()
    try:
        # the server's subscription is live (connect() returns on the CONNACK); the server probes it itself,
        # so the loop stays idle
        prove_subscribed(server, server.topics.hello("w0"), probes)
        t0 = time.monotonic()
        devices[0].publish(devices[0].topics.hello("w0"), Message(Kind.HELLO, FED, "w0", 0, {"n_samples": 1}))
        # no periodic pass runs for 60 s (misc_interval_s; paho's keep-alive pings go out only from those
        # passes): a message left for the next one would take a minute. Within 20 s means it went out at once
        assert inbox.wait(1, 20.0)
        print(f"first hello through an idle loop: {time.monotonic() - t0:.3f} s")  # reported, not asserted
        per_thread = 250

        def burst(i: int) -> None:
            t = devices[i]
            for r in range(per_thread):
                t.publish(t.topics.hello(f"w{i}"), Message(Kind.HELLO, FED, f"w{i}", r + 1, {"n_samples": 1}))
                if r % 25 == 0:
                    time.sleep(0.001)  # let the loop's write race the next publish
        threads = [threading.Thread(target=burst, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert inbox.wait(1 + 8 * per_thread, 10), len(inbox.got.get("server", []))
    finally:
        server.close()
        for t in devices:
            t.close()


class FakePaho:
    """What the loop calls on a paho client, over one end of a socket pair; ``pending``: bytes paho holds."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.pending = 0
        self.writes = threading.Event()
        self.on_socket_open = self.on_socket_close = None
        self.on_socket_register_write = self.on_socket_unregister_write = None

    def socket(self):
        return self.sock

    def want_write(self) -> bool:
        return self.pending > 0

    def loop_write(self) -> int:
        self.pending = 0
        self.writes.set()
        return 0

    def loop_read(self) -> int:
        self.sock.recv(4096)
        return 0

    def loop_misc(self) -> int:
        return 0


def test_a_publish_racing_the_write_flag_is_still_written(loop):
    """paho withdraws its write interest after its own check found nothing to send; a publish from another
    thread lands just then, sees paho's flag still set and asks nobody to write it. The loop looks again
    (``want_write()``) when paho withdraws, so the message goes out now, not at the next keep-alive."""
    import socket

    a, b = socket.socketpair()
    a.setblocking(False)
    fake = FakePaho(a)
    loop.attach(None, fake)
    ready = threading.Event()

    def open_then_race() -> None:  # in the loop's thread, as paho's callbacks are
        fake.on_socket_open(fake, None, a)
        fake.on_socket_register_write(fake, None, a)
        fake.pending = 1  # the other thread's publish, after paho's "nothing to write" ...
        fake.on_socket_unregister_write(fake, None, a)  # ... and before paho's unregister reaches the loop
        ready.set()
    loop.call_soon(open_then_race)
    assert ready.wait(2)
    assert fake.writes.wait(1.0)  # written at once (misc_interval_s is 60 s)
    loop.detach(fake)
    b.close()


def test_detach_closes_the_socket_it_still_watches(loop, caplog):
    """Detaching a client whose socket is open unwatches it and closes it, with no error logged."""
    import socket

    a, b = socket.socketpair()
    a.setblocking(False)
    fake = FakePaho(a)
    loop.attach(None, fake)
    opened = threading.Event()
    loop.call_soon(lambda: (fake.on_socket_open(fake, None, a), opened.set()))
    assert opened.wait(2)
    errors = loop.stats()["errors"]
    loop.detach(fake)
    deadline = time.monotonic() + 2
    while a.fileno() != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.fileno() == -1  # closed by the loop
    assert "operation failed" not in caplog.text
    assert loop.stats()["errors"] == errors
    b.close()


@needs_mosquitto
def test_sockets_past_descriptor_1024(broker, loop):
    """select() cannot watch a descriptor >= 1024 (paho's own loop); the shared loop's epoll can."""
    soft = raise_nofile_limit()
    if 0 < soft < 1200:
        pytest.skip(f"this process may open {soft} files (ulimit -Hn): 1,200 are needed to pass descriptor 1024")
    dummies = []
    try:
        while not dummies or dummies[-1] < 1100:
            dummies.append(os.open(os.devnull, os.O_RDONLY))
        inbox = Inbox()
        devices = []
        for i in range(3):
            t = MqttTransport(BrokerConfig.from_url(broker.url), f"h{i}", federation=FED, loop=loop)
            t.subscribe(t.topics.cmd(f"h{i}"), inbox.handler(f"h{i}"))
            t.connect(timeout=10)
            devices.append(t)
        server = MqttTransport(BrokerConfig.from_url(broker.url), "server", federation=FED, loop=loop)
        server.connect(timeout=10)
        for i in range(3):
            for r in range(5):
                server.publish(server.topics.cmd(f"h{i}"), cmd(r))
        assert inbox.wait(15, 10)
        assert all(inbox.got[f"h{i}"] == list(range(5)) for i in range(3))
        server.close()
        for t in devices:
            t.close()
    finally:
        for fd in dummies:
            os.close(fd)


@needs_mosquitto
def test_a_loop_transport_comes_back_after_a_broker_restart(tmp_path):
    with MosquittoBroker() as b, NetworkLoop(workers=1, misc_interval_s=0.2) as lp:
        cfg = BrokerConfig.from_url(b.url, reconnect_min_s=0.1, reconnect_max_s=0.5)
        inbox = Inbox()
        t = MqttTransport(cfg, "r1", federation=FED, loop=lp)
        t.subscribe(t.topics.cmd("r1"), inbox.handler("r1"))
        reconnects = []
        t.on_connected(lambda: reconnects.append(time.monotonic()))
        t.connect()
        b.restart()
        deadline = time.monotonic() + 10
        while len(reconnects) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(reconnects) == 2 and t.is_connected
        assert t.stats()["errors"].get("connection-lost") == 1
        server = MqttTransport(BrokerConfig.from_url(b.url), "server", federation=FED)
        server.connect()
        server.publish(server.topics.cmd("r1"), cmd(7))
        assert inbox.wait(1, 5) and inbox.got["r1"] == [7]  # subscriptions renewed
        server.close()
        t.close()


@needs_mosquitto
def test_a_refused_loop_transport_says_why_and_stops_retrying():
    with MosquittoBroker(passwords={"c1": "right"}) as b, NetworkLoop(workers=1) as lp:
        t = MqttTransport(BrokerConfig.from_url(b.url, username="c1", password="wrong", reconnect_min_s=0.05),
                          "c1", federation=FED, loop=lp)
        with pytest.raises(ConnectionError, match=r"refused c1: Not authorized"):
            t.connect(timeout=5)
        time.sleep(0.3)
        assert lp.sockets == 0 and not t.is_connected
