"""Every meta field checked in one place; decoders and the device's handlers fuzzed with hostile values."""

from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edge_sdk.client import EdgeClient
from edge_sdk.protocol import (
    MAGIC,
    PROTOCOL_VERSION,
    Kind,
    Message,
    ProtocolError,
    Reassembler,
    decode_message,
    encode_message,
    parse_sketch,
    parse_tensors,
)
from edge_sdk.rejections import RejectionLog
from edge_sdk.schema import COMMANDS, check_meta
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker

FED = "fz"


def raw_envelope(kind: int, meta: bytes, body: bytes = b"", sender: str = "server", rnd: int = 0) -> bytes:
    """An envelope with a meta of raw bytes (the encoder would refuse what an attacker writes)."""
    head = struct.pack(">2sBBBIHI", MAGIC, PROTOCOL_VERSION, kind, 0, rnd, len(meta), len(body))
    fed, snd = FED.encode(), sender.encode()
    return head + bytes((len(fed),)) + fed + bytes((len(snd),)) + snd + meta + body


# -- the six crash values of the issue, and friends ----------------------------------------

HOSTILE_NUMBERS = ["1e400", "-1e400", "1" + "0" * 400, "-" + "9" * 30, "NaN", "Infinity", "-Infinity",
                   "9223372036854775808", "-0.0", "1e308", "-1", "0", "4294967296", "1.5"]


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1" + "0" * 400, "NaN", "Infinity", "9" * 30])
def test_decoder_refuses_numbers_no_peer_sends(number):
    payload = raw_envelope(Kind.HELLO, f'{{"n_samples":100,"classes_present":{number}}}'.encode(), sender="c1")
    with pytest.raises(ProtocolError, match="not valid JSON") as info:
        decode_message(payload)
    assert info.value.reason == "meta"


def test_decoder_refuses_deep_nesting_without_recursion():
    deep = b'{"a":' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # json.loads alone: RecursionError
    with pytest.raises(ProtocolError, match="meta nests 30001 levels deep, at most 8") as info:
        decode_message(raw_envelope(Kind.HELLO, deep, sender="c1"))
    assert info.value.reason == "meta-depth"


def test_decoder_counts_depth_outside_strings_only():
    meta = json.dumps({"s": "[[[[[[[[[[[[{{{{{{{{{{\\\"", "n": [[1]]}).encode()
    assert decode_message(raw_envelope(Kind.HELLO, meta, sender="c1")).meta["n"] == [[1]]


@pytest.mark.parametrize(
    ("kind", "meta", "match"),
    [
        (Kind.HELLO, {"n_samples": 0}, r"meta field 'n_samples' must be an integer in \[1, 2.14748e\+09\], got 0"),
        (Kind.HELLO, {"n_samples": 10**12}, r"'n_samples' must be an integer in \[1, 2.14748e\+09\], got 1000000000000"),
        (Kind.HELLO, {"n_samples": 5, "classes_present": -1}, r"'classes_present' must be an integer in \[0, 65535\]"),
        (Kind.HELLO, {"n_samples": 5, "capabilities": "x"}, r"'capabilities' must be a list of at most 32 items"),
        (Kind.HELLO, {"n_samples": True}, r"'n_samples' must be an integer"),
        (Kind.HELLO, {}, r"meta field 'n_samples' is missing"),
        (Kind.UPDATE, {"round": 1, "model_key": "c0", "n_samples": 5, "loss": "x"}, r"'loss' must be a finite number"),
        (Kind.UPDATE, {"round": -1, "model_key": "c0", "n_samples": 5}, r"'round' must be an integer in \[0, 4.29497e\+09\]"),
        (Kind.UPDATE, {"round": 1, "model_key": "c/0", "n_samples": 5}, r"'model_key' must be a topic-safe id"),
        (Kind.UPDATE, {"round": 1, "model_key": "c0", "n_samples": 5, "metrics": {"a": "b"}},
         r"meta field 'metrics.a' must be a finite number"),
        (Kind.METRICS, {"round": 1, "model_key": "c0", "accuracy": 2.0}, r"'accuracy' must be a finite number in \[0, 1\]"),
        (Kind.STATUS, {"state": "gone"}, r"'state' must be one of \['online', 'offline'\]"),
        (Kind.CMD, {"op": "format-disk"}, r"meta field 'op' must be one of \["),
        (Kind.CMD, {"op": "train", "round": 1, "models": ["c0"], "epochs": 10**9}, r"'epochs' must be an integer in \[1, 10000\]"),
        (Kind.CMD, {"op": "train", "round": 1, "models": ["c0"], "optimizer": "lbfgs"}, r"'optimizer' must be one of"),
        (Kind.CMD, {"op": "sketch", "num_classes": 0}, r"'num_classes' must be an integer in \[1, 65535\]"),
        (Kind.CMD, {"op": "sketch", "num_classes": 10, "flip_prob": 0.7}, r"'flip_prob' must be a finite number in \[0, 0.5\]"),
        (Kind.CMD, {"op": "evaluate", "model_key": "c0"}, r"meta field 'round' is missing"),
        (Kind.CMD, {"op": "evaluate", "round": 1, "fraction": 1.5}, r"'fraction' must be a finite number in \[0, 1\]"),
        (Kind.CMD, {"op": "assign", "model_key": "c0", "follow": ["c/1"]}, r"'follow' must be a topic-safe id"),
        (Kind.CMD, {"op": "assign", "model_key": "c0", "follow": ["c1"] * 65},
         r"'follow' must be a list of at most 64 model keys"),
        (Kind.STATUS, {"follow": "+"}, r"'follow' must be a list of at most 64 model keys"),
        (Kind.MODEL, {"key": "x" * 65}, r"'key' must be a topic-safe id"),
    ],
)
def test_schema_rejects_with_the_field_named(kind, meta, match):
    with pytest.raises(ProtocolError, match=match) as info:
        check_meta(Message(kind, FED, "c1", 0, meta))
    assert info.value.reason == "meta-field"


def test_schema_fills_defaults_and_drops_unknown_fields():
    clean = check_meta(Message(Kind.CMD, FED, "server", 0, {"op": "train", "round": 3, "models": ["c1"],
                                                             "surprise": [1, 2]}))
    assert clean == {"op": "train", "round": 3, "models": ["c1"], "evaluate_first": True, "epochs": 1,
                     "lr": 1e-3, "batch_size": 32, "optimizer": "adam"}
    hello = check_meta(Message(Kind.HELLO, FED, "c1", 0, {"n_samples": 7, "input_shape": [8, 8]}))
    assert hello == {"n_samples": 7, "n_test": 0, "classes_present": 0, "capabilities": [], "input_shape": [8, 8]}


def test_every_command_the_server_sends_passes_the_schema():
    """The orchestrator's own commands, as it writes them (a drift here would refuse honest traffic)."""
    samples = {
        "hello": {}, "stop": {"reason": "finished", "failed": False},
        "leave": {"reason": "the fleet's owner retired this device"}, "assign": {"model_key": "c0", "follow": ["c0"]},
        "welcome": {"architecture": "lenet5_1x28x28_10", "encoder": "fmnist_fc_encoder", "num_classes": 10,
                    "train": True},
        "refused": {"reason": "its samples hold 64 values; this federation's models take 784 (28x28)"},
        "sketch": {"encoder": "digits_encoder", "num_classes": 10, "flip_prob": 0.1, "summary": "sketch",
                   "params": {}},
        "train": {"round": 1, "architecture": "digits_cnn_1x8x8_10", "models": ["c0", "c1"],
                  "evaluate_first": True, "epochs": 3, "lr": 0.01, "batch_size": 16, "optimizer": "adam"},
        "train_ae": {"round": 2, "architecture": "digits_ae", "epochs": 2, "lr": 1e-3, "batch_size": 32},
        "evaluate": {"round": 11, "model_key": "c1", "architecture": "digits_cnn_1x8x8_10"},
        "keep": {"round": 11, "strategy": "fedsketch", "models": {"c1": {"sha256": "0f" * 32, "round": 10,
                                                                       "accuracy": 0.93, "evaluated": 4}},
                 "run": "20261125T021800-3fa9c1", "architecture": "digits_cnn_1x8x8_10", "model_key": "c1",
                 "choose": False},
        "resend": {"round": 4},
        "unmask": {"round": 4, "model_key": "c1"},
    }
    broadcasts = {"evaluate": {"round": 11, "architecture": "digits_cnn_1x8x8_10", "fraction": 0.5, "seed": 3}}
    for op, fields in broadcasts.items():
        assert check_meta(Message(Kind.CMD, FED, "server", 0, {"op": op, **fields})) == {"op": op, **fields}
    assert check_meta(Message(Kind.STATUS, FED, "c1", 0, {"follow": ["+"]})) == {"state": "online", "follow": ["+"]}
    sent = {"state": "online", "sent": 4}  # a device's word that its update of round 4 went out
    assert check_meta(Message(Kind.STATUS, FED, "c1", 4, sent)) == sent
    announce = {"state": "online", "run": "20261125T021800-3fa9c1"}  # the server's run announcement
    assert check_meta(Message(Kind.STATUS, FED, "server", 0, announce)) == announce
    serving = {**announce, "serving": True}  # after the run: the server serves its models (cold start)
    assert check_meta(Message(Kind.STATUS, FED, "server", 0, serving)) == serving
    assert set(samples) == set(COMMANDS)
    secure = {"peers": {"c0": "ab" * 32, "c1": "cd" * 32}, "threshold": 2, "bits": 6, "clip": 5.0,
              "run": "20261125T021800-3fa9c1"}  # a secure round's train command carries its group
    train = {"op": "train", **samples["train"], "secure": secure}
    assert check_meta(Message(Kind.CMD, FED, "server", 0, train)) == train
    declined = {"state": "online", "declined": "sketch"}  # a device whose sketch would pass its owner's budget
    assert check_meta(Message(Kind.STATUS, FED, "c1", 0, declined)) == declined
    for op, fields in samples.items():
        assert check_meta(Message(Kind.CMD, FED, "server", 0, {"op": op, **fields})) == {"op": op, **fields}


# -- fuzzing ---------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0.0, -0.0, 2**63, -(2**63), 2**53 + 1, -5]) | st.text(max_size=200),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
FIELDS = sorted({f for schema in COMMANDS.values() for f in schema}
                | {"op", "n_samples", "classes_present", "capabilities", "loss", "metrics", "state", "key",
                   "accuracy", "summary", "name", "sha256", "entry"})


@st.composite
def hostile_meta(draw) -> bytes:
    fields = draw(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8))
    if draw(st.booleans()):
        fields["op"] = draw(st.sampled_from(sorted(COMMANDS)))
    text = json.dumps(fields, allow_nan=True)
    # numbers JSON can spell but Python's json.dumps never writes
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(FIELDS))
        num = draw(st.sampled_from(HOSTILE_NUMBERS))
        text = text[:-1] + ("," if len(text) > 2 else "") + f'"{key}":{num}}}'
    return text.encode()[:0xFFFF]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.binary(max_size=300))
def test_decoder_on_random_bytes_raises_only_protocol_errors(payload):
    try:
        decode_message(payload)
    except ProtocolError as e:
        assert e.reason and str(e)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from([int(k) for k in Kind]), meta=hostile_meta(), body=st.binary(max_size=64),
       flip=st.integers(0, 400), value=st.integers(0, 255))
def test_decoders_and_schema_on_hostile_envelopes(kind, meta, body, flip, value):
    payload = bytearray(raw_envelope(kind, meta, body))
    if flip < len(payload) and flip % 3 == 0:
        payload[flip] = value
    try:
        msg = decode_message(bytes(payload))
        check_meta(msg)
        if msg.kind == Kind.CHUNK:
            Reassembler(max_size=10_000).feed(msg)
        parse_sketch(msg.body, num_classes=10, latent_dim=20)
    except ProtocolError as e:
        assert e.reason
    try:
        parse_tensors(body)
    except ProtocolError as e:
        assert e.reason in ("tensors", "non-finite")


@pytest.fixture(scope="module")
def device():
    """A real edge client with a little digits data, its commands fuzzed through its own handler."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images[:40] / 16.0).astype(np.float32)
    y = d.target[:40]
    broker = MemoryBroker()
    t = MemoryTransport(broker, "c1", federation=FED)
    t.connect()
    worker = LocalWorker("c1", x, y, x[:10], y[:10], architecture="digits_cnn_1x8x8_10", seed=0)
    return EdgeClient(t, worker, federation=FED, seed=0, model_timeout_s=0.01)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(meta=hostile_meta(), rnd=st.integers(0, 2**32 - 1))
@example(meta=b'{"accuracy": null, "run": "0", "op": "stop"}', rnd=0)  # another run's stop: the device goes on
def test_device_survives_any_command(device, meta, rnd, caplog):
    try:
        msg = decode_message(raw_envelope(Kind.CMD, meta, rnd=rnd))
    except ProtocolError:
        return  # refused by the decoder: counted by the transport
    state = device.state
    # a stop naming a run this device is not in is not its stop (edge_sdk.client.commands.stop): it keeps serving
    others = (state.run_id is not None or not state.welcomed) and msg.meta.get("run") not in (None, state.run_id)
    with caplog.at_level(logging.ERROR, logger="edge_sdk"):
        keep_going = device.handle(msg)  # must not raise, whatever the meta holds
    op = check_meta_ok(msg)
    not_its_stop = op == "stop" and others and not check_meta(msg)["failed"]
    assert keep_going is (op not in ("stop", "refused", "leave") or not_its_stop)
    assert "Traceback" not in caplog.text


def check_meta_ok(msg: Message) -> str | None:
    try:
        return check_meta(msg)["op"]
    except ProtocolError:
        return None


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        ({"op": "train", "round": 1e300, "models": ["c0"]}, "meta-field"),
        ({"op": "sketch", "num_classes": 1e300}, "meta-field"),
        ({"op": "train", "round": 1, "models": ["c0"], "epochs": 1e300}, "meta-field"),
        ({"op": "evaluate", "round": 1.5, "model_key": "c0"}, "meta-field"),
    ],
)
def test_device_counts_the_crash_commands_of_the_issue(device, meta, reason):
    before = device.rejected.get(reason, 0)
    assert device.handle(Message(Kind.CMD, FED, "server", 1, meta)) is True
    assert device.rejected[reason] == before + 1


def test_device_keeps_a_bounded_model_cache(device):
    from edge_sdk.protocol import tensors_body

    body = tensors_body({"w": np.zeros(1000, np.float32)})
    for i in range(40):
        device.link.on_model("t", Message(Kind.MODEL, FED, "server", i, {"key": f"k{i}"}, body))
    assert sorted(device.store.keys(), key=lambda k: int(k[1:])) == [f"k{i}" for i in range(32, 40)]


def test_rejection_log_says_once_per_sender_and_reason(caplog):
    now = [0.0]
    rl = RejectionLog(logging.getLogger("fz"), interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="fz"):
        for _ in range(1000):
            rl("meta", "c9", "bad")
        rl("meta", "c8", "bad")
        now[0] = 11.0
        rl("meta", "c9", "bad")
    assert rl.counts == {"meta": 1002}
    assert [r.getMessage() for r in caplog.records] == [
        "rejected (meta) from c9: bad", "rejected (meta) from c8: bad",
        "rejected (meta) from c9: bad (999 more from c9 not logged)"]


def test_encoder_refuses_what_decoder_would():
    with pytest.raises(ProtocolError, match="meta is not JSON-serialisable"):
        encode_message(Message(Kind.HELLO, FED, "c1", 0, {"n": float("inf")}))
