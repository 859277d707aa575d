"""Updates asked for again instead of lost: a receiver with no room (back-pressure), an update lost in flight.

The rule on a scripted clock; then 6 devices over the embedded broker sending chunked updates to a server whose
reassembler holds two of them at once, and a device whose first update never reaches the broker.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from edge_sdk.protocol import Kind, tensors_body
from edge_sdk.tasks import TrainSettings
from edge_sdk.training.torch_support import initial_weights
from edge_sdk.transport import BrokerConfig, MqttTransport
from server_kit.broker import EmbeddedBroker
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.rounds.reask import Reasks, ReaskWhy
from server_kit.stallers import run_and_release, start_devices
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_busy_device_is_asked_again_after_a_delay_that_doubles_up_to_its_cap():
    clock = Clock()
    r = Reasks(3, first_delay_s=1.0, max_delay_s=4.0, clock=clock)
    delays = [r.busy("a") for _ in range(5)]
    for d, base in zip(delays, [1, 2, 4, 4, 4]):
        assert 0.75 * base <= d <= 1.25 * base
    assert r.due({"a"}, {}) == []
    clock.now += delays[-1]
    assert r.due({"a"}, {}) == [("a", ReaskWhy.BUSY)]
    assert r.due({"a"}, {}) == []  # asked once per refusal
    r.busy("b")
    clock.now += 10
    assert r.due({"a"}, {}) == []  # b answered meanwhile (no longer awaited): not asked
    assert r.to_dict() == {"busy": 1}


def test_an_update_said_sent_and_never_arrived_is_asked_for_once():
    clock = Clock()
    r = Reasks(3, lost_after_s=10.0, clock=clock)
    sent = {"a": (3, 100.0), "b": (2, 100.0), "c": (3, 105.0)}  # b: another round's claim
    clock.now = 109.9
    assert r.due({"a", "b", "c"}, sent) == []
    clock.now = 110.0
    assert r.due({"a", "b", "c"}, sent) == [("a", ReaskWhy.LOST)]
    clock.now = 200.0
    assert r.due({"a", "b", "c"}, sent) == [("c", ReaskWhy.LOST)]  # a: once only
    assert r.lost("a") is False and r.to_dict() == {"lost": 2}


def test_a_device_asked_again_for_room_is_not_taken_for_lost_while_it_sends():
    clock = Clock()
    r = Reasks(3, first_delay_s=1.0, lost_after_s=10.0, clock=clock)
    sent = {"a": (3, 100.0)}
    r.busy("a")
    clock.now = 105.0
    assert r.due({"a"}, sent) == [("a", ReaskWhy.BUSY)]
    clock.now = 114.0  # 14 s after its claim, 9 s after the request: still sending
    assert r.due({"a"}, sent) == []
    clock.now = 115.0
    assert r.due({"a"}, sent) == [("a", ReaskWhy.LOST)]


def test_announced_updates_are_asked_for_while_their_receiver_has_room():
    clock = Clock()
    r = Reasks(3, budget_bytes=250, receiver_of=lambda cid: 0 if cid < "m" else 1, clock=clock)
    ready = {"a": (3, 100), "b": (3, 100), "c": (3, 100), "x": (3, 300), "y": (3, 100), "old": (2, 100)}
    awaited = {"a", "b", "c", "x", "y", "old"}
    # receiver 0 takes a and b (200 of 250); receiver 1 takes x alone (larger than the budget, nothing in flight)
    assert r.due(awaited, {}, ready) == [("a", ReaskWhy.GO), ("b", ReaskWhy.GO), ("x", ReaskWhy.GO)]
    assert r.due(awaited, {}, ready) == []
    awaited -= {"a", "x"}  # a's and x's updates arrived: room for c and y
    assert r.due(awaited, {}, ready) == [("c", ReaskWhy.GO), ("y", ReaskWhy.GO)]
    r.busy("b")  # b's receiver had no room after all: b waits for room again, after its delay
    clock.now += 2
    assert r.due(awaited, {}, ready) == [("b", ReaskWhy.BUSY)] and r.to_dict() == {"busy": 1, "go": 5}


# -- over a broker --------------------------------------------------------------------------------------------

PAYLOAD = 8192


class FirstChunksTogether:
    """Holds each device's first update after its first chunk until the server has refused one transfer as busy.

    Devices finish training at different moments; left alone, their updates may reach the server one after the
    other, each complete before the next begins, and a tight server memory is never tested. Held so, every first
    chunk is on its way before any second one, and the server sees the transfers side by side (at most
    ``patience_s`` of waiting: past it the chunks go on and the test's assertion on ``busy`` says what happened).
    """

    def __init__(self, patience_s: float = 10.0) -> None:
        self.server: MqttTransport | None = None
        self.patience_s = patience_s

    def refused_busy(self) -> int:
        return 0 if self.server is None else self.server.stats()["rejected"].get("busy", 0)

    def gate(self, t: MqttTransport) -> None:
        frames_of, held = t._frames, []

        def frames(topic, msg, retain):
            out = frames_of(topic, msg, retain)
            if msg.kind != Kind.UPDATE or held or len(out) < 2:
                return out
            held.append(msg.round)
            return _HeldAfterFirst(out, self)

        t._frames = frames


class _HeldAfterFirst(list):
    """The frames of one update: iterating them the first time waits after the first (see FirstChunksTogether)."""

    def __init__(self, frames: list[bytes], together: FirstChunksTogether) -> None:
        super().__init__(frames)
        self.together, self.waited = together, False

    def __iter__(self):
        for i, frame in enumerate(list.__iter__(self)):
            if i == 1 and not self.waited:
                self.waited = True
                deadline = time.monotonic() + self.together.patience_s
                while self.together.refused_busy() == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
            yield frame


def run(clients, *, server_memory: int | None = None, drop_first_update_of: str | None = None,
        together: FirstChunksTogether | None = None, **settings):
    """``clients`` over the embedded broker, two rounds of FedSketch; every update is chunked (8 KiB packets)."""
    fed = "reask"
    release = threading.Event()
    release.set()
    with EmbeddedBroker() as broker:
        def make(cid):
            extra = {} if server_memory is None or cid != "server" else {"chunk_memory_bytes": server_memory}
            cfg = BrokerConfig.from_url(broker.url, reconnect_min_s=0.1, max_payload=PAYLOAD, **extra)
            t = MqttTransport(cfg, cid, federation=fed)
            if together is not None and cid != "server":
                together.gate(t)
            if cid == drop_first_update_of:
                publish, dropped = t.publish, []

                def lossy(topic, msg, **kw):  # the first update is lost on its way to the broker
                    if msg.kind == Kind.UPDATE and not dropped:
                        dropped.append(msg.round)
                        return None
                    return publish(topic, msg, **kw)

                t.publish = lossy
            return t

        threads = start_devices(clients, make, architecture=ARCH, release=release, stallers=False, max_idle_s=60)
        server = make("server")
        if together is not None:
            together.server = server
        server.connect(timeout=10)
        strategy = SketchClustered(settings=TrainSettings(epochs=1, lr=1e-2, batch_size=16), fraction=1.0,
                                   min_cluster_size=2, seed=0)
        config = ServerConfig(federation=fed, rounds=2, min_clients=len(clients), register_timeout_s=30,
                              sketch_timeout_s=30, round_timeout_s=60, eval_timeout_s=30, encoder="digits_encoder",
                              architecture=ARCH, seed=0, reask_lost_s=2.0, **settings)
        result = run_and_release(Orchestrator(strategy, server, config), release, threads)
        return result, server.stats()


@pytest.fixture(scope="module")
def six(digits12):
    return digits12[:6]


def test_updates_that_find_no_room_wait_their_turn_and_all_arrive(six):
    size = len(tensors_body(initial_weights(ARCH, 0)))  # one update's tensors (its transfer is a little more)
    result, meter = run(six, server_memory=int(1.5 * size), together=FirstChunksTogether())
    busy = meter["rejected"].get("busy", 0)
    print(f"update {size} bytes, server memory {int(1.5 * size)}: {busy} transfers waited their turn; "
          f"rounds {[(h['close'], h['close_s'], h['reasked']) for h in result.history]}")
    for rec in result.history:
        assert rec["reported"] == rec["selected"] == 6 and rec["refused"] == {} and rec["close"] == "all-answered"
        assert rec["close_s"] < 30
    assert busy >= 1 and sum(h["reasked"].get("busy", 0) for h in result.history) >= busy
    assert "oversized" not in meter["rejected"]


def test_large_updates_are_announced_and_sent_two_at_a_time(six):
    result, meter = run(six, announce_above_bytes=30_000, transfer_budget_bytes=120_000)  # updates of 55 kB
    for rec in result.history:
        assert rec["reported"] == rec["selected"] == 6 and rec["refused"] == {} and rec["close"] == "all-answered"
        assert rec["reasked"] == {"go": 6}, rec["reasked"]
    assert meter["rejected"] == {}


def test_an_update_lost_on_its_way_is_asked_for_again_and_the_round_closes_without_its_deadline(six, caplog):
    with caplog.at_level(logging.WARNING, logger="server_kit.drivers.round_port"):
        result, _ = run(six, drop_first_update_of="c03")
    r1, r2 = result.history
    assert r1["reasked"] == {"lost": 1} and r1["reported"] == 6 and r1["close"] == "all-answered"
    assert r1["unreceipted"] == {"server": 1} and r2["unreceipted"] == {}
    assert 2.0 <= r1["reported_s"]["c03"] < 10 and r1["close_s"] < 10
    assert r2["reasked"] == {} and r2["reported"] == 6
    said = [r.getMessage() for r in caplog.records if "never took" in r.getMessage()]
    assert len(said) == 1 and re.fullmatch(r"round 1: server never took c03's update \(said sent \d+\.\d s ago\): "
                                           r"asking c03 again", said[0]), said
