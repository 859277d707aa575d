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
