"""Chunked transfers one sender cannot starve: per-sender budgets, deadlines, expiry on a timer."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import numpy as np
import pytest

from edge_sdk.protocol import (
    Kind,
    Message,
    ProtocolError,
    Reassembler,
    Topics,
    decode_message,
    encode_message,
    split_payload,
    tensors_body,
)
from edge_sdk.transport import BrokerConfig, MemoryBroker, MemoryTransport, MqttTransport
from server_kit.broker import MosquittoBroker, find_mosquitto

from helpers import Collector, prove_subscribed

FED = "demo"
T = Topics("fedsketch", FED)
ids = itertools.count()


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def payload(sender: str = "c07", n: int = 50_000, seed: int = 0) -> bytes:
    body = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    return encode_message(Message(Kind.UPDATE, FED, sender, 3, {"n_samples": 10}, body))


def chunks(sender: str = "c07", n: int = 50_000, seed: int = 0) -> list[Message]:
    frames = split_payload(payload(sender, n, seed), max_payload=4096, federation=FED, sender=sender, round=3)
    return [decode_message(f) for f in frames]


def drip(sender: str, tid: str, i: int, *, n: int = 1000, size: int = 1000) -> Message:
    """Chunk ``i`` of a 1-byte-chunk transfer that will never complete (its sha256 is made up)."""
    meta = {"id": tid, "i": i, "n": n, "size": size, "sha256": "0" * 64, "k": int(Kind.UPDATE)}
    return Message(Kind.CHUNK, FED, sender, 0, meta, b"x")


# -- the reassembler, with an injected clock ------------------------------------


def test_sender_over_its_pending_cap_leaves_the_others_their_slots():
    r = Reassembler(max_pending=3, clock=Clock())
    assert r.feed(drip("evil", "a", 0)) is None
    assert r.feed(drip("evil", "b", 0)) is None
    with pytest.raises(ProtocolError, match=r"sender 'evil' already has 2 transfers in progress "
                                            r"\(limit 2 per sender\); refusing transfer c") as info:
        r.feed(drip("evil", "c", 0))
    assert info.value.reason == "pending"
    # the refused transfer took no slot: the third (and last) global slot is the honest sender's
    msgs = chunks("c07")
    out = [r.feed(m) for m in msgs]
    assert out[-1] == payload("c07") and out[:-1] == [None] * (len(msgs) - 1)
    assert r.pending() == 2 and r.pending_bytes() == 2000 and r.held_bytes() == 2
    assert r.refused == {"pending": 1}
    # the attacker's own transfers still progress
    assert r.feed(drip("evil", "a", 1)) is None and r.held_bytes() == 3


def test_pending_cap_is_per_federation_and_sender():
    r = Reassembler(clock=Clock(), max_pending_per_sender=1)
    r.feed(drip("evil", "a", 0))
    other_fed = Message(Kind.CHUNK, "other", "evil", 0, drip("evil", "b", 0).meta, b"x")
    assert r.feed(other_fed) is None
    assert r.feed(drip("c08", "b", 0)) is None
    with pytest.raises(ProtocolError, match=r"sender 'evil' already has 1 transfers in progress \(limit 1 per"):
        r.feed(drip("evil", "b", 0))
    assert r.pending() == 3


def test_sender_byte_cap():
    r = Reassembler(clock=Clock(), max_sender_bytes=100_000)
    r.feed(drip("evil", "a", 0, n=1000, size=60_000))
    with pytest.raises(ProtocolError, match=r"transfer b of 50000 bytes from sender 'evil' would exceed the "
                                            r"100000 bytes allowed per sender \(60000 pending\)") as info:
        r.feed(drip("evil", "b", 0, n=1000, size=50_000))
    assert info.value.reason == "oversized"
    r.feed(drip("c08", "b", 0, n=1000, size=60_000))  # another sender's budget is untouched
    assert r.pending() == 2 and r.pending_bytes() == 120_000 and r.refused == {"oversized": 1}


def test_sender_byte_cap_defaults_to_the_transfer_limit():
    assert Reassembler(max_size=1000).max_sender_bytes == 1000
    assert Reassembler(max_total_bytes=5000).max_sender_bytes == 5000
    assert Reassembler(max_total_bytes=5000, max_size=1000, max_sender_bytes=3000).max_sender_bytes == 3000


def test_global_memory_cap_counts_declared_bytes_and_makes_a_transfer_wait_its_turn():
    r = Reassembler(max_total_bytes=100_000, clock=Clock())
    r.feed(drip("c01", "a", 0, size=60_000))
    with pytest.raises(ProtocolError, match="^transfer b of 50000 bytes must wait its turn: 60000 of the 100000 "
                                            "bytes allowed for pending transfers are taken$") as info:
        r.feed(drip("c02", "b", 0, size=50_000))
    assert info.value.reason == "busy"
    # its later chunks are dropped without a word (the sender is asked again), and take no memory
    assert r.feed(drip("c02", "b", 1, size=50_000)) is None
    assert r.pending_bytes() == 60_000 and r.held_bytes() == 1
    assert r.refused == {"busy": 1} and r.stats()["deferred_chunks"] == 1
    # alone, a transfer larger than the whole bound is the sender's fault: oversized
    with pytest.raises(ProtocolError, match="^transfer c of 100001 bytes exceeds the 100000 bytes allowed for "
                                            "pending transfers$") as info:
        r.feed(drip("c03", "c", 0, size=100_001))
    assert info.value.reason == "oversized"


def test_a_full_reassembler_gives_the_room_of_transfers_idle_longest_to_a_new_one():
    clock = Clock()
    r = Reassembler(max_pending=2, clock=clock, evict_idle_s=2.0)
    r.feed(drip("h01", "a", 0))  # never finished: many hostile senders' worth
    clock.now += 1.0
    r.feed(drip("h02", "b", 0))
    clock.now += 0.5  # a idle 1.5 s, b 0.5 s: neither gives its room yet
    with pytest.raises(ProtocolError, match="^transfer c of 1000 bytes must wait its turn: 2 transfers in "
                                            "progress, the most at once$"):
        r.feed(drip("c01", "c", 0))
    clock.now += 1.0  # a idle 2.5 s: it goes, b (1.5 s) stays
    r.feed(drip("c02", "d", 0))
    assert r.pending() == 2 and r.evicted == 1 and r.lost == [(FED, "h01", int(Kind.UPDATE))]
    assert r.feed(drip("h01", "a", 1)) is None and r.pending() == 2  # what comes of it later is dropped
    # an honest transfer sends its chunks back to back: it is never the one that gives way
    honest = chunks("c03", n=20_000)
    clock.now += 3.0
    assert r.feed(honest[0]) is None  # b (idle 4.5 s) goes; d (3 s) would be next
    assert r.evicted == 2
    for m in honest[1:-1]:
        assert r.feed(m) is None
    clock.now += 3.0
    r.feed(drip("h03", "e", 0))  # d goes (idle longest), not the honest transfer (its last chunk came since)
    assert r.evicted == 3 and [s for _, s, _ in r.lost] == ["h01", "h02", "c02"]
    assert r.feed(honest[-1]) == payload("c03", n=20_000)


def test_deadline_from_the_first_chunk_drops_a_drip_fed_transfer(caplog):
    clock = Clock(100.0)
    r = Reassembler(timeout_s=5, deadline_s=20, clock=clock)
    msgs = chunks("c07")
    for j in range(6):  # a chunk every 4 s: never idle for 5 s
        clock.now = 100.0 + 4 * j
        assert r.feed(msgs[j]) is None
    assert clock.now == 120.0 and r.pending() == 1  # exactly at the deadline: kept
    held = sum(len(m.body) for m in msgs[:6])
    assert r.held_bytes() == held
    clock.now = 121.0
    with caplog.at_level(logging.WARNING, logger="edge_sdk.protocol"):
        assert r.expire() == 1
        assert r.expire() == 0
    assert r.pending() == 0 and r.held_bytes() == 0 and r.pending_bytes() == 0
    assert (r.expired, r.expired_deadline) == (0, 1)
    (rec,) = [x for x in caplog.records if "dropped incomplete transfer" in x.getMessage()]
    tid = msgs[0].meta["id"]
    assert rec.getMessage() == (
        f"dropped incomplete transfer {tid} from demo/c07: 6 of {len(msgs)} chunks ({held} of "
        f"{msgs[0].meta['size']} bytes), age 21.0 s, not complete 20 s after its first chunk"
    )
    assert rec.exc_info is None


def test_idle_transfer_expires_and_frees_its_bytes():
    clock = Clock(100.0)
    r = Reassembler(timeout_s=5, clock=clock)
    msgs = chunks("c07")
    r.feed(msgs[0])
    r.feed(msgs[1])
    assert r.held_bytes() == len(msgs[0].body) + len(msgs[1].body)
    assert r.pending_bytes() == msgs[0].meta["size"]
    clock.now = 105.0
    assert r.expire() == 0
    clock.now = 105.5
    assert r.expire() == 1
    assert (r.pending(), r.pending_bytes(), r.held_bytes()) == (0, 0, 0)
    assert r.stats() == {"pending": 0, "pending_bytes": 0, "held_bytes": 0, "expired": 1,
                         "expired_deadline": 0, "refused": {}, "deferred_chunks": 0, "gaps": 0, "evicted": 0}


def test_completed_transfer_holds_nothing():
    r = Reassembler(clock=Clock())
    msgs = chunks("c07")
    for m in msgs[:-1]:
        r.feed(m)
    assert r.held_bytes() == sum(len(m.body) for m in msgs[:-1])
    assert r.feed(msgs[-1]) == payload("c07")
    assert (r.pending(), r.pending_bytes(), r.held_bytes()) == (0, 0, 0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"deadline_s": 0}, "deadline_s must be > 0, got 0"),
        ({"max_pending_per_sender": 0}, "max_pending_per_sender must be positive, got 0"),
        ({"max_sender_bytes": 0}, "max_sender_bytes must be positive, got 0"),
    ],
)
def test_reassembler_limits_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        Reassembler(**kw)


# -- configuration and the transports -------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"chunk_timeout_s": 0}, "chunk_timeout_s must be a positive number of seconds, got 0"),
        ({"chunk_deadline_s": -1.0}, r"chunk_deadline_s must be a positive number of seconds, got -1\.0"),
        ({"chunk_deadline_s": "10"}, "chunk_deadline_s must be a positive number of seconds, got '10'"),
        ({"chunk_pending_per_sender": 0}, "chunk_pending_per_sender must be a positive integer, got 0"),
        ({"chunk_memory_bytes": 1.5}, r"chunk_memory_bytes must be a positive integer, got 1\.5"),
        ({"chunk_sender_bytes": 0}, "chunk_sender_bytes must be a positive integer, got 0"),
    ],
)
def test_broker_config_chunk_fields_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        BrokerConfig(**kw)


def test_broker_config_chunk_defaults_reach_the_reassembler():
    cfg = BrokerConfig()
    assert (cfg.chunk_timeout_s, cfg.chunk_deadline_s, cfg.chunk_pending_per_sender, cfg.chunk_memory_bytes,
            cfg.chunk_sender_bytes) == (60.0, 600.0, 2, 512 * 1024 * 1024, None)
    t = MqttTransport(BrokerConfig(chunk_timeout_s=3, chunk_deadline_s=9, chunk_pending_per_sender=4,
                                   chunk_memory_bytes=10**7, chunk_sender_bytes=10**6), "c1", federation=FED)
    r = t._inbox._reassembler
    assert (r.timeout_s, r.deadline_s, r.max_pending_per_sender, r.max_total_bytes, r.max_sender_bytes) == (
        3.0, 9.0, 4, 10**7, 10**6)
    assert MqttTransport(BrokerConfig(max_message=10**6), "c2", federation=FED)._inbox._reassembler.max_sender_bytes \
        == 10**6
    assert t.stats()["chunks"] == {"pending": 0, "pending_bytes": 0, "held_bytes": 0, "expired": 0,
                                   "expired_deadline": 0, "refused": {}, "deferred_chunks": 0, "gaps": 0, "evicted": 0}


def test_memory_transport_expires_on_request_and_counts_refusals(server_transport):
    clock = Clock(100.0)
    broker = MemoryBroker()
    server = server_transport(broker, federation=FED, chunk_limits={"chunk_timeout_s": 5, "clock": clock})
    got: list[Message] = []
    server.subscribe(T.all_clients("update"), lambda topic, m: got.append(m))
    server.connect()
    evil = MemoryTransport(broker, "evil", federation=FED)
    evil.connect()
    for tid in "abc":
        evil.publish(T.update("evil"), drip("evil", tid, 0))
    assert server.rejected == {"pending": 1}
    honest = MemoryTransport(broker, "c1", federation=FED, max_payload=4096)
    honest.connect()
    body = bytes(20_000)
    honest.publish(T.update("c1"), Message(Kind.UPDATE, FED, "c1", 0, {}, body))
    assert [m.body for m in got] == [body]
    chunks_state = server.stats()["chunks"]
    assert chunks_state == {"pending": 2, "pending_bytes": 2000, "held_bytes": 2, "expired": 0,
                            "expired_deadline": 0, "refused": {"pending": 1}, "deferred_chunks": 0, "gaps": 0, "evicted": 0}
    clock.now = 106.0
    assert server.expire_chunks() == 2
    assert server.stats()["chunks"]["pending"] == 0 and server.stats()["chunks"]["expired"] == 2


# -- a real Mosquitto ---------------------------------------------------------------


@pytest.fixture(scope="module")
def mosquitto():
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    with MosquittoBroker() as broker:
        yield broker


@pytest.fixture
def connect(mosquitto):
    made: list[MqttTransport] = []

    def make(cid: str, *, subscribe=(), **kw) -> MqttTransport:
        cfg = BrokerConfig.from_url(mosquitto.url, reconnect_min_s=0.1, reconnect_max_s=1.0, **kw)
        t = MqttTransport(cfg, f"{cid}x{next(ids)}", federation=FED)
        for topic_filter, handler in subscribe:
            t.subscribe(topic_filter, handler)
        t.connect(timeout=10)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(timeout=1)


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.broker
def test_one_flooding_sender_does_not_starve_honest_updates(connect):
    got = Collector()
    server = connect("server", subscribe=[(T.all_clients("update"), got)])
    evil = connect("evil")
    honest = [connect(f"c{j}", max_payload=4096) for j in range(4)]
    prove_subscribed(evil, T.update(evil.client_id), got)  # the server's one subscription is live
    n_transfers, rounds = 70, 5  # more transfers than the 64 pending slots of the whole receiver

    def flood(i: int) -> None:
        for j in range(n_transfers):
            evil.publish(T.update(evil.client_id), drip(evil.client_id, f"t{j}", i))

    flood(0)
    evil._wait_acks(None, 5)
    flooder = threading.Thread(target=lambda: [flood(i) for i in range(1, rounds)], daemon=True)
    flooder.start()
    bodies = {}
    for j, t in enumerate(honest):
        w = {"w": np.random.default_rng(j).normal(size=(100, 125)).astype(np.float32)}
        bodies[t.client_id] = tensors_body(w)
        assert len(bodies[t.client_id]) > 50_000
        t.publish(T.update(t.client_id), Message(Kind.UPDATE, FED, t.client_id, 1, {"n_samples": 5},
                                                 bodies[t.client_id]))
    assert got.wait(4, timeout=8)
    assert {m.sender: m.body for m in got.messages} == bodies
    flooder.join(5)
    evil._wait_acks(None, 5)
    refused = (n_transfers - 2) * rounds
    assert wait_for(lambda: server.rejected.get("pending", 0) == refused, timeout=5)
    time.sleep(0.2)
    assert server.rejected == {"pending": refused}
    state = server.stats()["chunks"]
    assert state == {"pending": 2, "pending_bytes": 2000, "held_bytes": 2 * rounds, "expired": 0,
                     "expired_deadline": 0, "refused": {"pending": refused}, "deferred_chunks": 0, "gaps": 0, "evicted": 0}
    assert all(t.stats()["sent"]["UPDATE"]["chunks"] > 12 for t in honest)


@pytest.mark.broker
def test_partial_transfer_is_freed_without_further_traffic(connect):
    got = Collector()
    server = connect("server", subscribe=[(T.all_clients("update"), got)], chunk_timeout_s=1)
    client = connect("c")
    cid = client.client_id
    prove_subscribed(client, T.update(cid), got)
    msgs = chunks(cid)
    half = msgs[: len(msgs) // 2]
    for m in half:
        client.publish(T.update(cid), m)
    held = sum(len(m.body) for m in half)
    assert wait_for(lambda: server.stats()["chunks"]["held_bytes"] == held, timeout=3)
    assert server.stats()["chunks"]["pending"] == 1
    t0 = time.monotonic()
    # nothing else is sent: the transport's own timer drops the transfer 1-2 s after its last chunk
    assert wait_for(lambda: server.stats()["chunks"]["pending"] == 0, timeout=4)
    assert time.monotonic() - t0 >= 0.5
    assert server.stats()["chunks"] == {"pending": 0, "pending_bytes": 0, "held_bytes": 0, "expired": 1,
                                        "expired_deadline": 0, "refused": {}, "deferred_chunks": 0, "gaps": 0, "evicted": 0}
    # an update dropped so is told busy, for the server to ask its device for it again
    assert got.messages == [] and server.rejected == {"busy": 1}


def test_a_transfer_whose_chunks_were_dropped_on_the_way_is_given_up_as_busy():
    clock = Clock()
    r = Reassembler(clock=clock, gap_s=5.0)
    msgs = chunks("c07")  # 13 chunks
    for j in (0, 1, 3):  # chunk 2 dropped by a full queue
        assert r.feed(msgs[j]) is None
    clock.now += 4.0
    assert r.feed(msgs[4]) is None  # a gap younger than 5 s: a redelivery may still fill it
    clock.now += 1.5
    with pytest.raises(ProtocolError, match=r"has missed chunks below chunk 4 for 5\.5 s") as info:
        r.feed(msgs[5])
    assert info.value.reason == "busy" and r.pending() == 0 and r.gaps == 1
    assert r.feed(msgs[6]) is None and r.pending() == 0  # the rest of it is dropped quietly
    # chunks out of order that fill their gap are reassembled as before
    other = chunks("c08", seed=1)
    order = [0, 2, 1, *range(3, len(other))]
    clock.now += 10
    assert [r.feed(other[j]) for j in order][-1] == payload("c08", seed=1)
    # a cut transfer whose last chunks never come is dropped by expire() and listed for its sender to be asked
    third = chunks("c09", seed=2)
    r.feed(third[0])
    r.feed(third[2])
    clock.now += 5.5
    assert r.expire() == 1 and r.lost == [(FED, "c09", int(Kind.UPDATE))] and r.gaps == 2
