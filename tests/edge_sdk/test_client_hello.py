"""A device's hello: one message (no STATUS beside it), jittered after a (re)connection, at once when asked."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.client.cli import build_parser, main
from edge_sdk.protocol import Kind, Message
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker

FED = "hello"


def device(broker: MemoryBroker, cid: str = "c1", **kw) -> EdgeClient:
    rng = np.random.default_rng(0)
    w = LocalWorker(cid, rng.random((12, 8, 8), dtype=np.float32), np.arange(12) % 10)
    return EdgeClient(MemoryTransport(broker, cid, federation=FED), w, federation=FED, **kw)


def sent(broker: MemoryBroker, leaf: str) -> list[str]:
    """Topics of the device messages with this leaf, in order."""
    return [t for t, _ in broker.log if t.endswith(f"/{leaf}") and "/clients/" in t]


def test_a_hello_is_one_message_without_a_status():
    broker = MemoryBroker()
    ec = device(broker)
    ec.start()
    assert ec.step() is True
    assert sent(broker, "hello") == ["fedsketch/hello/clients/c1/hello"]
    assert sent(broker, "status") == []  # the server takes the hello as "online"
    assert ec.hello_due is None


class FakeClock:
    """Stands in for the ``time`` module of the device (edge_sdk.client, edge_sdk.client.link): ``monotonic()``
    moves only when a test says; any ``sleep`` fails the test (nothing there may block)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        raise AssertionError(f"the edge client slept {seconds} s")


def test_the_hello_after_connecting_waits_a_random_jitter_without_blocking(monkeypatch):
    import edge_sdk.client.edge_client
    import edge_sdk.client.link

    clock = FakeClock()
    monkeypatch.setattr(edge_sdk.client.edge_client, "time", clock)
    monkeypatch.setattr(edge_sdk.client.link, "time", clock)
    broker = MemoryBroker()
    ec = device(broker, hello_jitter_s=0.4)
    ec.start()  # schedules the hello: no sleep (the fake clock refuses one), the clock stands still
    due = ec.hello_due
    assert due is not None and 1000.0 <= due <= 1000.4
    assert ec.step() is True  # not due yet (unless the draw was exactly 0): step() neither waits nor sends
    assert sent(broker, "hello") == ([] if due > 1000.0 else ["fedsketch/hello/clients/c1/hello"])
    clock.now = due
    ec.step()
    assert len(sent(broker, "hello")) == 1 and ec.hello_due is None


def test_devices_jitter_alike_only_by_chance():
    broker = MemoryBroker()
    dues = []
    for i in range(20):
        ec = device(broker, f"c{i}", hello_jitter_s=10.0, seed=0)  # same sketch seed: the jitter still differs
        ec.start()
        dues.append(ec.hello_due - time.monotonic())
    # 20 draws in [0, 10) s to the millisecond: two alike by chance happen in 2 % of runs (the birthday
    # bound), four alike in about 1e-8; devices sharing their jitter would give one value
    assert len({round(d, 3) for d in dues}) >= 17 and max(dues) - min(dues) > 1.0


def test_the_server_asking_again_gets_a_hello_at_once(server_transport):
    broker = MemoryBroker()
    ec = device(broker, hello_jitter_s=30.0)  # a pending boot hello far away
    ec.start()
    server = server_transport(broker, federation=FED)
    server.connect()
    server.publish(server.topics.broadcast(), Message(Kind.CMD, FED, "server", 0, {"op": "hello"}))
    assert ec.step() is True
    assert len(sent(broker, "hello")) == 1  # answered now, not in 30 s
    assert ec.hello_due is None  # and the pending one is dropped: it would say the same
    server.publish(server.topics.cmd("c1"), Message(Kind.CMD, FED, "server", 0, {"op": "hello"}))
    ec.step()
    assert len(sent(broker, "hello")) == 2 and ec.handled["hello"] == 2


def test_a_reconnection_schedules_a_hello_again():
    broker = MemoryBroker()
    ec = device(broker)
    ec.start()
    ec.step()
    ec.transport.kill()
    assert ec.hello_due is None
    ec.transport.connect()
    assert ec.hello_due is not None
    ec.step()
    assert len(sent(broker, "hello")) == 2


def test_step_says_false_once_the_server_said_stop(server_transport):
    broker = MemoryBroker()
    ec = device(broker)
    ec.start()
    server = server_transport(broker, federation=FED)
    server.connect()
    server.publish(server.topics.cmd("c1"), Message(Kind.CMD, FED, "server", 0, {"op": "stop", "reason": "done"}))
    ec.step()  # the hello
    assert ec.step() is False and ec.step() is False


def test_a_negative_jitter_is_refused():
    with pytest.raises(ValueError, match=r"hello_jitter_s must be a non-negative number of seconds, got -1"):
        device(MemoryBroker(), hello_jitter_s=-1)


def test_the_cli_jitters_a_few_seconds_by_default(capsys, tmp_path):
    assert build_parser().parse_args(["--client-id", "c1", "--data", "x.npz"]).hello_jitter == 3.0
    data = tmp_path / "d.npz"
    np.savez(data, x=np.zeros((2, 8, 8), np.float32), y=np.zeros(2, np.int64))
    paho = logging.getLogger("edge_sdk.transport.paho")
    level = paho.level
    try:  # main configures logging for its process: put it back for the other tests
        assert main(["--client-id", "c1", "--data", str(data), "--hello-jitter", "-2"]) == 2
    finally:
        paho.setLevel(level)
    assert "--hello-jitter must be >= 0 seconds, got -2" in capsys.readouterr().err
