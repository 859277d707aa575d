"""Ed25519 signatures on what the server sends: format, checks, freshness, replay, through a transport."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.cli import main as fedsketch
from edge_sdk.protocol import (
    FLAG_SIGNED,
    SIGNATURE_TRAILER,
    Kind,
    Message,
    ProtocolError,
    Topics,
    decode_message,
    encode_message,
    tensors_body,
)
from edge_sdk.signing import (
    Signer,
    Verifier,
    generate_key,
    load_signer,
    load_verifier,
    sign_payload,
    signature_id,
    verify_payload,
)
from edge_sdk.transport import MemoryBroker, MemoryTransport

FED = "sig"
STOP = Message(Kind.CMD, FED, "server", 3, {"op": "stop"})


@pytest.fixture(scope="module")
def key():
    return generate_key()


def test_signed_envelope_layout_and_decode(key):
    plain = encode_message(STOP)
    signed = sign_payload(plain, key, now_ms=1_700_000_000_123)
    assert len(signed) == len(plain) + SIGNATURE_TRAILER == len(plain) + 72
    assert signed[4] == FLAG_SIGNED and signed[:4] == plain[:4] and signed[5:len(plain)] == plain[5:]
    assert signed[len(plain):len(plain) + 8] == (1_700_000_000_123).to_bytes(8, "big")
    assert decode_message(signed) == STOP  # the decoder skips the trailer
    assert verify_payload(signed, key.public_key()) == 1_700_000_000_123


@pytest.mark.parametrize("where", ["flags", "round", "meta", "timestamp", "signature"])
def test_any_changed_byte_breaks_the_signature(key, where):
    signed = bytearray(sign_payload(encode_message(STOP), key))
    pos = {"flags": None, "round": 8, "meta": len(signed) - 80, "timestamp": len(signed) - 70,
           "signature": len(signed) - 1}[where]
    if pos is None:
        signed[4] = 0  # strip the flag: now it is "unsigned" (and its size no longer adds up)
        with pytest.raises(ProtocolError, match="message is not signed by the server") as info:
            verify_payload(bytes(signed), key.public_key())
        assert info.value.reason == "unsigned"
        return
    signed[pos] ^= 0x01
    with pytest.raises(ProtocolError, match="signature does not verify with the server's key") as info:
        verify_payload(bytes(signed), key.public_key())
    assert info.value.reason == "signature"


def test_another_key_does_not_verify(key):
    signed = sign_payload(encode_message(STOP), generate_key())
    with pytest.raises(ProtocolError, match="does not verify"):
        verify_payload(signed, key.public_key())


def test_verifier_refuses_stale_and_replayed_messages(key):
    now = [1_000_000.0]
    v = Verifier(key.public_key(), max_age_s=3600, window_s=300, clock=lambda: now[0])

    def at(t: float) -> bytes:
        return sign_payload(encode_message(STOP), key, now_ms=int(t * 1000))

    fresh = at(now[0])
    v.check(fresh)
    with pytest.raises(ProtocolError, match="seen before") as info:
        v.check(fresh)
    assert info.value.reason == "replay"
    with pytest.raises(ProtocolError, match=r"is 3601 s old by this device's clock \(at most 3600\); are both "
                                            r"clocks on NTP\?") as info:
        v.check(at(now[0] - 3601))
    assert info.value.reason == "stale"
    v.check(at(now[0] + 1000))  # the newest seen moves on
    with pytest.raises(ProtocolError, match="is 400 s older than the newest from the server"):
        v.check(at(now[0] + 600))
    v.check(at(now[0] + 800))  # within the window: fine


def test_keygen_writes_an_openssl_compatible_pair(tmp_path, capsys):
    assert fedsketch(["keygen", str(tmp_path / "k")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "k" / "server.key").stat().st_mode & 0o777 == 0o600
    signer, verifier = load_signer(tmp_path / "k" / "server.key"), load_verifier(tmp_path / "k" / "server.pub")
    verifier.check(signer.sign(encode_message(STOP)))
    assert fedsketch(["keygen", str(tmp_path / "k")]) == 2
    assert "exists already" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a PEM public key"):
        load_verifier(tmp_path / "k" / "server.key")


def test_signed_chunks_through_a_transport(key, server_transport):
    """A 200 KB model cut into 4 KB chunks: each chunk and the whole are signed; forged ones are dropped."""
    broker = MemoryBroker()
    t = Topics("fedsketch", FED)
    server = server_transport(broker, federation=FED, max_payload=4096)
    server.sign_with(Signer(key))
    device = MemoryTransport(broker, "c1", federation=FED)
    device.verify_with(Verifier(key.public_key()))
    got = []
    device.subscribe(t.cmd("c1"), lambda topic, m: got.append(m))
    device.connect()
    server.connect()
    w = np.arange(50_000, dtype=np.float32)
    server.publish(t.cmd("c1"), Message(Kind.MODEL, FED, "server", 1, {"key": "c0"}, tensors_body({"w": w})))
    assert len(got) == 1 and got[0].meta == {"key": "c0"}
    assert max(len(p) for topic, p in broker.log) <= 4096 - len(t.cmd("c1")) - 16  # the trailer fits the budget
    chunks = [p for topic, p in broker.log if p[3] == Kind.CHUNK]
    assert len(chunks) > 40 and all(p[4] == FLAG_SIGNED for p in chunks)
    # an intruder (no ACL on the memory broker) replays one chunk and forges a stop
    broker.publish(t.cmd("c1"), chunks[0])
    broker.publish(t.cmd("c1"), encode_message(STOP))
    assert len(got) == 1
    assert device.rejected == {"replay": 1, "unsigned": 1}


def test_an_admitted_signature_is_accepted_at_any_age_once_and_only_that_one(key):
    now = [1_000_000.0]
    v = Verifier(key.public_key(), max_age_s=3600, window_s=300, clock=lambda: now[0])
    offline = encode_message(Message(Kind.STATUS, FED, "server", 0, {"state": "offline"}))
    will = sign_payload(offline, key, now_ms=int(now[0] * 1000))
    other = sign_payload(encode_message(STOP), key, now_ms=int(now[0] * 1000))
    assert signature_id(will) == will[-64:-48].hex() and signature_id(offline) is None
    now[0] += 7200  # the server's connection lived two hours
    with pytest.raises(ProtocolError, match="is 7200 s old") as info:
        v.check(will)
    assert info.value.reason == "stale"
    v.admit(signature_id(will))
    with pytest.raises(ProtocolError, match="is 7200 s old"):  # another old message is not admitted with it
        v.check(other)
    v.check(will)  # named by a fresh announcement: accepted whatever its age
    with pytest.raises(ProtocolError) as info:
        v.check(will)  # once: a second copy is as old as it is
    assert info.value.reason == "stale"
    forged = will[:-64] + bytes(64)
    v.admit(signature_id(forged))
    with pytest.raises(ProtocolError) as info:  # the name admits nothing whose signature does not verify
        v.check(forged)
    assert info.value.reason == "signature"


def test_a_device_learns_that_its_server_died_hours_after_it_connected(key):
    """The server's will, signed when it connected, names itself in the run's announcement: accepted late."""
    from edge_sdk.client import EdgeClient
    from edge_sdk.worker import LocalWorker

    now = [1_000_000.0]
    broker = MemoryBroker()
    t = Topics("fedsketch", FED)
    will = Signer(key, clock=lambda: now[0]).sign(encode_message(Message(Kind.STATUS, FED, "server", 0,
                                                                         {"state": "offline"})))
    server = MemoryTransport(broker, "server", federation=FED, will_topic=t.server_status(), will_payload=will)
    server.sign_with(Signer(key, clock=lambda: now[0]))
    server.connect()
    rng = np.random.default_rng(0)
    transport = MemoryTransport(broker, "c1", federation=FED)
    transport.verify_with(Verifier(key.public_key(), clock=lambda: now[0]))
    ec = EdgeClient(transport, LocalWorker("c1", rng.random((12, 8, 8), dtype=np.float32), np.arange(12) % 10),
                    federation=FED)
    ec.start()
    assert server.will_name == signature_id(will)
    server.publish(t.server_status(), Message(Kind.STATUS, FED, "server", 0,
                                              {"state": "online", "run": "r1", "will": server.will_name}))
    for _ in range(20):  # the announcement, and the hello it schedules
        ec.step()
    assert ec.server_online is True and ec.run_id == "r1"
    now[0] += 3 * 3600  # hours of training: the newest signed message moves on with the clock
    server.publish(t.cmd("c1"), Message(Kind.CMD, FED, "server", 0, {"op": "hello"}))
    ec.step()
    server.kill()  # the broker publishes the will, signed three hours ago
    ec.step()
    assert ec.server_online is False
    assert transport.rejected == {}
