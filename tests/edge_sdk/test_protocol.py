"""The wire format: envelopes, sketch and tensor bodies, chunks, topics."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import zlib

import numpy as np
import pytest

from edge_sdk.protocol import (
    HEADER_SIZE,
    MAX_META_BYTES,
    PROTOCOL_VERSION,
    Kind,
    Message,
    ProtocolError,
    Reassembler,
    Topics,
    decode_message,
    encode_message,
    parse_sketch,
    parse_tensors,
    partition_of,
    sketch_body,
    split_payload,
    tensors_body,
)
from edge_sdk.sketch import Sketch


def demo_sketch(seed: int = 0) -> Sketch:
    bits = np.random.default_rng(seed).integers(0, 2, 200, dtype=np.uint8)
    return Sketch(np.packbits(bits).tobytes(), 10, 20)


def raw(kind=2, fed=b"demo", sender=b"c07", meta=b"", body=b"", *, magic=b"FS", version=PROTOCOL_VERSION,
        flags=0, rnd=0, meta_len=None, body_len=None) -> bytes:
    """An envelope built by hand, so that every field can be wrong."""
    head = struct.pack(">2sBBBIHI", magic, version, kind, flags, rnd,
                       len(meta) if meta_len is None else meta_len, len(body) if body_len is None else body_len)
    return head + bytes([len(fed)]) + fed + bytes([len(sender)]) + sender + meta + body


# -- envelope ---------------------------------------------------------------


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_round_trips(kind):
    msg = Message(kind, "demo", "c07", 42, {"op": "train", "lr": 0.001, "models": ["k0"], "note": "é"}, b"\x00\xff" * 10)
    assert decode_message(encode_message(msg)) == msg


def test_empty_meta_and_body_cost_nothing_and_round_is_u32():
    msg = Message(Kind.STATUS, "f", "s", 2**32 - 1)
    data = encode_message(msg)
    assert len(data) == HEADER_SIZE + 2 + 2
    assert decode_message(data) == msg
    with pytest.raises(ProtocolError, match=r"round must be an integer in \[0, 2\*\*32\)"):
        encode_message(Message(Kind.STATUS, "f", "s", 2**32))
    with pytest.raises(ProtocolError, match="round must be an integer"):
        encode_message(Message(Kind.STATUS, "f", "s", -1))


def test_demo_sketch_message_is_53_bytes():
    sk = demo_sketch()
    data = encode_message(Message(Kind.SKETCH, "demo", "c07", 0, {}, sketch_body(sk)))
    # 15 header + (1 + 4) federation + (1 + 3) sender + 4 shape + 25 bits
    assert len(data) == 53
    assert len(data) <= 64
    got = decode_message(data, expected_sender="c07", expected_federation="demo")
    assert got.kind == Kind.SKETCH
    assert parse_sketch(got.body, num_classes=10, latent_dim=20) == sk


def test_meta_is_compact_json():
    data = encode_message(Message(Kind.CMD, "demo", "server", 0, {"op": "sketch", "n": 1}))
    assert b'{"op":"sketch","n":1}' in data


def test_message_kind_is_coerced_and_validated():
    assert Message(3, "f", "s").kind is Kind.UPDATE
    with pytest.raises(ProtocolError, match="unknown message kind 99"):
        Message(99, "f", "s")


@pytest.mark.parametrize(
    ("payload", "reason", "match"),
    [
        (b"FS\x01", "truncated", "shorter than the 15-byte header"),
        (raw(magic=b"XX"), "magic", "not a FedSketch envelope"),
        (raw(version=2), "version", "unsupported protocol version 2"),
        (raw(version=0), "version", "unsupported protocol version 0"),
        (raw(kind=0), "kind", "unknown message kind 0"),
        (raw(kind=200), "kind", "unknown message kind 200"),
        (raw(flags=2), "flags", "unknown flags 0x02"),
        (raw(flags=1), "truncated", "shorter than its declared sizes"),  # signed, without its trailer
        (raw(body=b"abc", body_len=10), "truncated", "shorter than its declared sizes"),
        (raw(meta=b"{}", meta_len=9), "truncated", "shorter than its declared sizes"),
        (raw(body=b"abc", body_len=2), "trailing", "longer than its declared sizes"),
        (raw(fed=b"demo")[: HEADER_SIZE + 3], "truncated", "ends inside the federation id"),
        (raw(sender=b"c07")[: HEADER_SIZE + 5], "truncated", "ends before the sender id"),
        (raw(sender=b""), "sender", "sender is empty"),
        (raw(fed=b""), "federation", "federation is empty"),
        (raw(sender=b"x" * 65), "sender", "too long"),
        (raw(sender=b"c/07"), "sender", "forbidden characters"),
        (raw(sender=b"c+"), "sender", "forbidden characters"),
        (raw(fed=b"de#mo"), "federation", "forbidden characters"),
        (raw(sender=b"c\x0007"), "sender", "forbidden characters"),
        (raw(sender=b"c 07"), "sender", "forbidden characters"),
        (raw(sender=b"\xff\xfe"), "sender", "not valid utf-8"),
        (raw(meta=b"[1,2]"), "meta", "must be a JSON object, got list"),
        (raw(meta=b"{bad"), "meta", "not valid JSON"),
        (raw(meta=b'{"x":NaN}'), "meta", "NaN is not allowed"),
        (raw(meta=b"\xff"), "meta", "not valid JSON"),
    ],
)
def test_decoder_rejects(payload, reason, match):
    with pytest.raises(ProtocolError, match=match) as info:
        decode_message(payload)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError)


def test_decoder_rejects_oversized_before_parsing():
    data = encode_message(Message(Kind.UPDATE, "demo", "c07", body=bytes(1000)))
    assert decode_message(data, max_size=len(data)).body == bytes(1000)
    with pytest.raises(ProtocolError, match=f"payload of {len(data)} bytes exceeds the limit of 100") as info:
        decode_message(data, max_size=100)
    assert info.value.reason == "oversized"


def test_decoder_checks_expected_sender_and_federation():
    data = encode_message(Message(Kind.SKETCH, "demo", "c07"))
    with pytest.raises(ProtocolError, match="sender 'c07' does not match the topic's client id 'c08'") as info:
        decode_message(data, expected_sender="c08")
    assert info.value.reason == "sender"
    with pytest.raises(ProtocolError, match="federation 'demo' does not match the expected 'prod'") as info:
        decode_message(data, expected_federation="prod")
    assert info.value.reason == "federation"


def test_encoder_refuses_bad_messages():
    with pytest.raises(ProtocolError, match="sender 'a/b' contains forbidden characters") as info:
        encode_message(Message(Kind.HELLO, "demo", "a/b"))
    assert info.value.reason == "sender"
    with pytest.raises(ProtocolError, match="federation is too long"):
        encode_message(Message(Kind.HELLO, "f" * 65, "c1"))
    with pytest.raises(ProtocolError, match="meta is not JSON-serialisable"):
        encode_message(Message(Kind.HELLO, "demo", "c1", meta={"x": object()}))
    with pytest.raises(ProtocolError, match="meta is not JSON-serialisable"):
        encode_message(Message(Kind.HELLO, "demo", "c1", meta={"x": float("nan")}))
    with pytest.raises(ProtocolError, match=f"at most {MAX_META_BYTES}") as info:
        encode_message(Message(Kind.HELLO, "demo", "c1", meta={"x": "a" * 70_000}))
    assert info.value.reason == "meta"


def test_64_byte_ids_are_the_limit():
    fed, snd = "f" * 64, "é" * 32  # 64 utf-8 bytes each
    msg = Message(Kind.HELLO, fed, snd)
    assert decode_message(encode_message(msg)) == msg


# -- sketch bodies ----------------------------------------------------------


def test_sketch_body_round_trip_and_shape_checks():
    sk = demo_sketch(3)
    body = sketch_body(sk)
    assert body[:4] == b"\x00\x0a\x00\x14" and len(body) == 29
    assert parse_sketch(body) == sk
    with pytest.raises(ProtocolError, match=r"sketch shape \(10 classes, 20 bits\) differs from the expected \(62 classes"):
        parse_sketch(body, num_classes=62, latent_dim=20)
    with pytest.raises(ProtocolError, match="needs 25 bytes, got 24") as info:
        parse_sketch(body[:-1])
    assert info.value.reason == "sketch-length"
    with pytest.raises(ProtocolError, match="needs 25 bytes, got 26"):
        parse_sketch(body + b"\x00")
    with pytest.raises(ProtocolError, match="lacks its 4-byte shape"):
        parse_sketch(b"\x00\x0a")
    with pytest.raises(ProtocolError, match="must be positive"):
        parse_sketch(b"\x00\x00\x00\x14")


def test_sketch_padding_bits_must_be_zero():
    sk = Sketch(bytes(2), 1, 12)  # 12 bits in 2 bytes: 4 padding bits
    body = bytearray(sketch_body(sk))
    body[-1] |= 0x01
    with pytest.raises(ProtocolError, match="padding bits past n_bits must be zero") as info:
        parse_sketch(bytes(body))
    assert info.value.reason == "sketch-length"


# -- tensor bodies ----------------------------------------------------------


SPEC = {"w": ((3, 2), "float32"), "b": ((2,), "float32"), "steps": ((), "int64")}


def weights():
    return {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.ones(2, np.float32), "steps": np.array(7)}


def test_tensors_round_trip_with_spec():
    out = parse_tensors(tensors_body(weights()), spec=SPEC)
    assert set(out) == set(SPEC)
    for k, v in weights().items():
        np.testing.assert_array_equal(out[k], v)
        assert out[k].dtype == v.dtype
    out["w"] += 1  # writable copies
    assert out["steps"].dtype == np.int64


def test_tensors_body_handles_non_contiguous_arrays():
    w = np.arange(12, dtype=np.float64).reshape(3, 4).T
    out = parse_tensors(tensors_body({"w": w}))
    np.testing.assert_array_equal(out["w"], w)


@pytest.mark.parametrize(
    ("tensors", "reason", "match"),
    [
        ({**weights(), "extra": np.zeros(1, np.float32)}, "tensor-name", r"unexpected \['extra'\]"),
        ({k: v for k, v in weights().items() if k != "b"}, "tensor-name", r"missing \['b'\]"),
        ({**weights(), "w": np.zeros((2, 3), np.float32)}, "tensor-shape", r"tensor 'w' has shape \(2, 3\), expected \(3, 2\)"),
        ({**weights(), "b": np.ones(2, np.float64)}, "tensor-dtype", "tensor 'b' has dtype float64, expected float32"),
        ({**weights(), "b": np.array([1.0, np.nan], np.float32)}, "non-finite", "tensor 'b' contains NaN or Inf"),
        ({**weights(), "w": np.full((3, 2), np.inf, np.float32)}, "non-finite", "tensor 'w' contains NaN or Inf"),
    ],
)
def test_tensors_rejections(tensors, reason, match):
    with pytest.raises(ProtocolError, match=match) as info:
        parse_tensors(tensors_body(tensors), spec=SPEC)
    assert info.value.reason == reason


def test_non_finite_is_rejected_without_spec_too():
    with pytest.raises(ProtocolError, match="contains NaN or Inf"):
        parse_tensors(tensors_body({"x": np.array([np.nan], np.float16)}))


@pytest.mark.parametrize(
    "body",
    [b"", b"garbage", struct.pack("<Q", 10**9) + b"{}", struct.pack("<Q", 2) + b"[]",
     struct.pack("<Q", 60) + json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()[:60]],
)
def test_bad_safetensors_bytes_are_rejected(body):
    with pytest.raises(ProtocolError, match="not valid safetensors data") as info:
        parse_tensors(body)
    assert info.value.reason == "tensors"


def test_truncated_tensor_data_is_rejected():
    body = tensors_body(weights())
    with pytest.raises(ProtocolError, match="not valid safetensors data"):
        parse_tensors(body[:-4])


def test_bad_spec_is_a_caller_error():
    with pytest.raises(ValueError, match="spec entry 'w' must be"):
        parse_tensors(tensors_body(weights()), spec={"w": ((3, 2), "floaty")})


# -- chunks -------------------------------------------------------------------


def big_message(n: int = 50_000, seed: int = 0) -> bytes:
    body = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    return encode_message(Message(Kind.UPDATE, "demo", "c07", 3, {"n_samples": 10}, body))


def chunks_of(payload: bytes, max_payload: int = 4096) -> list[Message]:
    return [decode_message(c) for c in split_payload(payload, max_payload=max_payload, federation="demo",
                                                     sender="c07", round=3)]


def test_small_payload_is_not_split():
    payload = encode_message(Message(Kind.SKETCH, "demo", "c07", body=b"x"))
    assert split_payload(payload, max_payload=len(payload), federation="demo", sender="c07") == [payload]


def test_split_respects_max_payload_and_reassembles_in_order():
    payload = big_message()
    frames = split_payload(payload, max_payload=4096, federation="demo", sender="c07", round=3)
    assert len(frames) > 10
    assert all(len(f) <= 4096 for f in frames)
    assert len(frames[0]) >= 4000  # chunks are nearly full
    msgs = [decode_message(f) for f in frames]
    first = msgs[0]
    assert first.kind == Kind.CHUNK and first.round == 3 and first.sender == "c07"
    assert first.meta["n"] == len(frames) and first.meta["size"] == len(payload)
    assert first.meta["sha256"] == hashlib.sha256(payload).hexdigest()
    assert first.meta["k"] == Kind.UPDATE
    r = Reassembler()
    results = [r.feed(m) for m in msgs]
    assert results[:-1] == [None] * (len(msgs) - 1)
    assert results[-1] == payload
    assert r.pending() == 0
    assert decode_message(results[-1]).meta == {"n_samples": 10}


def test_reassembly_out_of_order_with_duplicates():
    payload = big_message(seed=1)
    msgs = chunks_of(payload)
    shuffled = msgs + msgs[:5]
    random.Random(0).shuffle(shuffled)
    r = Reassembler()
    done = [out for m in shuffled if (out := r.feed(m)) is not None]
    assert done == [payload]
    assert r.pending() == 0  # late duplicates of a completed transfer are ignored
    assert all(r.feed(m) is None for m in msgs[:3]) and r.pending() == 0


def test_chunk_with_corrupt_data_fails_the_checksum():
    payload = big_message(seed=2)
    msgs = chunks_of(payload)
    bad = bytearray(msgs[4].body)
    bad[10] ^= 0xFF
    msgs[4] = Message(Kind.CHUNK, "demo", "c07", 3, msgs[4].meta, bytes(bad))
    r = Reassembler()
    for m in msgs[:-1]:
        assert r.feed(m) is None
    with pytest.raises(ProtocolError, match=r"transfer [0-9a-f]+ of \d+ bytes fails its sha256 check") as info:
        r.feed(msgs[-1])
    assert info.value.reason == "checksum"
    assert r.pending() == 0


def test_inconsistent_chunks_drop_the_transfer():
    msgs = chunks_of(big_message(seed=3))
    r = Reassembler()
    r.feed(msgs[0])
    wrong = Message(Kind.CHUNK, "demo", "c07", 3, {**msgs[1].meta, "n": msgs[1].meta["n"] + 1}, msgs[1].body)
    with pytest.raises(ProtocolError, match="disagrees with the earlier chunks") as info:
        r.feed(wrong)
    assert info.value.reason == "chunk"
    assert r.pending() == 0
    r.feed(msgs[0])
    with pytest.raises(ProtocolError, match="arrived twice with different bytes"):
        r.feed(Message(Kind.CHUNK, "demo", "c07", 3, msgs[0].meta, msgs[0].body[:-1] + b"!"))


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"i": 0, "n": 2, "size": 10, "sha256": "0" * 64}, "transfer id must be"),
        ({"id": "x/y", "i": 0, "n": 2, "size": 10, "sha256": "0" * 64}, "transfer id must be"),
        ({"id": "ab", "i": 2, "n": 2, "size": 10, "sha256": "0" * 64}, "chunk index 2 of 2 is out of range"),
        ({"id": "ab", "i": "0", "n": 2, "size": 10, "sha256": "0" * 64}, "'i' must be an integer"),
        ({"id": "ab", "i": 0, "n": 20, "size": 10, "sha256": "0" * 64}, "chunk count 20 is impossible"),
        ({"id": "ab", "i": 0, "n": 2, "size": 10, "sha256": "XYZ"}, "sha256 must be 64 lowercase hex"),
        ({"id": "ab", "i": 0, "n": 2, "size": 10, "sha256": "0" * 64, "k": 8}, "inner kind 8"),
        ({"id": "ab", "i": 0, "n": 2, "size": 10, "sha256": "0" * 64, "zip": 1}, r"unknown fields \['zip'\]"),
    ],
)
def test_malformed_chunk_meta(meta, match):
    with pytest.raises(ProtocolError, match=match) as info:
        Reassembler().feed(Message(Kind.CHUNK, "demo", "c07", 0, meta, b"12345"))
    assert info.value.reason == "chunk"


def test_chunk_body_longer_than_declared_is_refused():
    r = Reassembler()
    meta = {"id": "ab", "i": 0, "n": 2, "size": 4, "sha256": "0" * 64}
    with pytest.raises(ProtocolError, match="received more than its declared 4 bytes"):
        r.feed(Message(Kind.CHUNK, "demo", "c07", 0, meta, b"12345"))


def test_reassembler_only_takes_chunks():
    with pytest.raises(ProtocolError, match="expected a CHUNK message, got SKETCH") as info:
        Reassembler().feed(Message(Kind.SKETCH, "demo", "c07"))
    assert info.value.reason == "kind"


def test_stalled_transfers_expire():
    now = [100.0]
    r = Reassembler(timeout_s=5, clock=lambda: now[0])
    msgs = chunks_of(big_message(seed=4))
    r.feed(msgs[0])
    now[0] += 4.0
    r.feed(msgs[1])  # progress resets the timer
    now[0] += 4.0
    assert r.expire() == 0 and r.pending() == 1
    now[0] += 2.0
    assert r.expire() == 1
    assert r.pending() == 0 and r.expired == 1
    # the late rest of the transfer is dropped quietly (its sender is asked again: r.lost names it)
    assert all(r.feed(m) is None for m in msgs[2:])
    assert r.pending() == 0 and len(r.lost) == 1


def test_limits_on_pending_transfers():
    a, b = chunks_of(big_message(seed=5)), chunks_of(big_message(seed=6))
    r = Reassembler(max_pending=1)
    r.feed(a[0])
    with pytest.raises(ProtocolError, match=r"must wait its turn: 1 transfers in progress, the most at once$") as info:
        r.feed(b[0])
    assert info.value.reason == "busy"
    r = Reassembler(max_total_bytes=len(big_message()) + 10)
    r.feed(a[0])
    with pytest.raises(ProtocolError, match="must wait its turn: .* bytes allowed for pending transfers are taken"
                       ) as info:
        r.feed(b[0])
    assert info.value.reason == "busy"
    with pytest.raises(ProtocolError, match="exceeds the limit of 1000") as info:
        Reassembler(max_size=1000).feed(a[0])
    assert info.value.reason == "oversized"


def test_transfers_are_kept_apart_by_sender():
    msgs = chunks_of(big_message(seed=7))
    r = Reassembler()
    for m in msgs[:-1]:
        r.feed(m)
    last = msgs[-1]
    other = Message(Kind.CHUNK, last.federation, "c08", last.round, last.meta, last.body)
    assert r.feed(other) is None  # c08 cannot complete c07's transfer
    assert r.pending() == 2


def test_split_needs_room_for_data():
    with pytest.raises(ValueError, match="leaves no room for data"):
        split_payload(bytes(500), max_payload=100, federation="demo", sender="c07")


WIRE_MESSAGES = [
    Message(Kind.STATUS, "f", "s"),
    Message(Kind.SKETCH, "demo", "c07", 0, {}, sketch_body(demo_sketch())),
    Message(Kind.CMD, "demo", "server", 7, {"op": "train", "lr": 0.001, "models": ["k0"], "note": "é"}),
    Message(Kind.UPDATE, "demo", "c07", 2**32 - 1, {"n_samples": 10}, bytes(range(256)) * 300),
]


@pytest.mark.parametrize("msg", WIRE_MESSAGES, ids=lambda m: m.kind.name)
def test_wire_size_is_the_encoded_length(msg):
    assert msg.wire_size() == len(encode_message(msg))


@pytest.mark.parametrize("max_payload", [200, 999, 4096, 10**6])
@pytest.mark.parametrize("msg", WIRE_MESSAGES, ids=lambda m: m.kind.name)
def test_wire_size_with_max_payload_counts_the_chunk_envelopes(msg, max_payload):
    frames = split_payload(encode_message(msg), max_payload=max_payload, federation=msg.federation,
                           sender=msg.sender, round=msg.round)
    assert msg.wire_size(max_payload) == sum(map(len, frames))


def test_wire_size_refuses_what_encode_refuses():
    with pytest.raises(ProtocolError, match="round must be an integer"):
        Message(Kind.STATUS, "f", "s", -1).wire_size()
    with pytest.raises(ValueError, match="leaves no room for data"):
        Message(Kind.UPDATE, "demo", "c07", 0, {}, bytes(500)).wire_size(max_payload=100)


# -- topics -------------------------------------------------------------------


def test_topics_layout():
    t = Topics("fedsketch", "demo")
    assert t.hello("c07") == "fedsketch/demo/clients/c07/hello"
    assert t.sketch("c07") == "fedsketch/demo/clients/c07/sketch"
    assert t.update("c07") == "fedsketch/demo/clients/c07/update"
    assert t.status("c07") == "fedsketch/demo/clients/c07/status"
    assert t.metrics("c07") == "fedsketch/demo/clients/c07/metrics"
    assert t.cmd("c07") == "fedsketch/demo/clients/c07/cmd"
    assert t.broadcast() == "fedsketch/demo/broadcast/cmd"
    assert t.model(3) == "fedsketch/demo/clusters/3/model"
    assert t.model("+") == "fedsketch/demo/clusters/+/model"
    assert t.server_status() == "fedsketch/demo/server/status"
    assert t.all_clients("sketch") == "fedsketch/demo/clients/+/sketch"
    assert t.all_clients("#") == "fedsketch/demo/clients/+/#"
    assert Topics().base == "fedsketch/default"
    assert Topics("org/fl", "x").cmd("c1") == "org/fl/x/clients/c1/cmd"


def test_topics_parse():
    t = Topics("fedsketch", "demo")
    assert t.parse(t.sketch("c07")) == ("clients", "c07", "sketch")
    assert t.parse(t.model("k2")) == ("clusters", "k2", "model")
    assert t.parse(t.broadcast()) == ("broadcast", "", "cmd")
    assert t.parse(t.server_status()) == ("server", "", "status")
    assert t.parse("fedsketch/other/clients/c07/sketch") is None
    assert t.parse("fedsketch/demo/clients/c07") is None
    assert t.parse("fedsketch/demo/clients/c07/sketch/extra") is None
    assert t.parse("fedsketch/demo/nodes/c07/sketch") is None
    assert t.parse("fedsketch/demo/clients//sketch") is None


def test_an_update_on_a_partition_is_the_same_device_and_leaf():
    t = Topics("fedsketch", "demo")
    assert t.update("c07", 3) == "fedsketch/demo/clients/c07/update/3"
    assert t.partition_updates(3) == "fedsketch/demo/clients/+/update/3"
    assert t.parse(t.update("c07", 3)) == ("clients", "c07", "update")
    assert t.required_sender(t.update("c07", 3)) == "c07"
    for other in ("fedsketch/demo/clients/c07/sketch/3", "fedsketch/demo/clients/c07/update/x",
                  "fedsketch/demo/clients/c07/update/256", "fedsketch/demo/clients/c07/update/٣"):
        assert t.parse(other) is None, other
    with pytest.raises(ValueError, match=r"^partition must be an integer in \[0, 256\), got 256$"):
        t.update("c07", 256)
    # the partition is a hash of the id, the same in every process (crc32, not Python's salted hash)
    assert [partition_of(c, 4) for c in ("c00", "c01", "c02", "c03")] == [
        zlib.crc32(c.encode()) % 4 for c in ("c00", "c01", "c02", "c03")]
    assert {partition_of(f"c{i:02d}", 2) for i in range(20)} == {0, 1}


def test_topics_required_sender():
    t = Topics("fedsketch", "demo")
    assert t.required_sender(t.update("c07")) == "c07"
    assert t.required_sender(t.status("c07")) == "c07"
    assert t.required_sender(t.cmd("c07")) is None  # the server writes there
    assert t.required_sender(t.model("k0")) is None
    assert t.required_sender("elsewhere/c07/update") is None


@pytest.mark.parametrize("bad", ["", "a/b", "a+", "#", "x" * 65, "tab\there"])
def test_topics_refuse_bad_ids(bad):
    with pytest.raises(ValueError, match="client id"):
        Topics("fedsketch", "demo").cmd(bad)


def test_topics_refuse_bad_root_and_federation():
    with pytest.raises(ValueError, match="invalid topic root 'a//b'"):
        Topics("a//b", "demo")
    with pytest.raises(ValueError, match="federation 'de/mo' contains forbidden characters"):
        Topics("fedsketch", "de/mo")
