"""``rsign``, ``rtern`` and ``rint2``: 2, 3 or 4 levels per entry after a randomised Hadamard rotation, an unbiased scale per block."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from scipy.linalg import hadamard

from edge_sdk.compress import Compression, Method, decode_delta, encode_delta
from edge_sdk.compress.rotated import _flip_source, _seed_of, blocks_of, padded
from edge_sdk.protocol import ProtocolError

F32 = np.float32
RSIGN, RTERN, RINT2 = Compression.parse("rsign"), Compression.parse("rtern"), Compression.parse("rint2")
CODES = {Method.RSIGN: 6, Method.RINT2: 7, Method.RTERN: 8}


def head(count: int = 1, code: int = 6) -> bytes:
    return b"FZ" + bytes([1, code]) + struct.pack("<I", count)


@pytest.mark.parametrize(("n", "runs"), [
    (0, []), (1, [(0, 16, 1)]), (17, [(0, 16, 2)]), (84, [(0, 64, 1), (64, 16, 2)]),
    (48_000, [(0, 4096, 11), (45_056, 1024, 2), (47_104, 256, 3), (47_872, 64, 2)]),
    (70_000, [(0, 4096, 16), (65_536, 4096, 1), (69_632, 256, 1), (69_888, 64, 1), (69_952, 16, 3)])])
def test_blocks_are_powers_of_4_and_no_run_crosses_a_window(n, runs):
    assert blocks_of(n) == runs
    assert padded(n) == sum(b * c for _, b, c in runs) == -(-n // 16) * 16


def test_a_small_tensor_is_the_signs_of_its_rotation_with_drives_scale():
    x = np.array([0.5, -1.5, 0.0, -0.25, 1.0], F32)
    body, sent = encode_delta({"w": x}, RSIGN)
    seed = _seed_of(x)
    d = np.where(_flip_source(seed, 16)(0, 0, 16), -1.0, 1.0)
    h = hadamard(16)
    y = h @ (d * np.pad(x.astype(np.float64), (0, 11))) / 4  # the rotated block (orthonormal)
    scale = (y ** 2).sum() / np.abs(y).sum()
    assert body[:8] == head() and int.from_bytes(body[8:16], "little") == seed
    assert struct.unpack("<f", body[16:20])[0] == pytest.approx(scale, rel=1e-6)
    assert body[20:] == np.packbits(y < 0, bitorder="little").tobytes()
    assert len(body) == 8 + 8 + 4 + 2
    np.testing.assert_allclose(sent["w"], (d * (h @ np.where(y < 0, -scale, scale)) / 4)[:5], rtol=1e-5)


@pytest.mark.parametrize(("comp", "pin"), [(RSIGN, "2ab076d7a2b2377b"), (RTERN, "f190b2eaa02dccb9"), (RINT2, "61b6573598066499")],
                         ids=["rsign", "rtern", "rint2"])
def test_the_same_bits_on_every_machine(comp, pin):
    """Two chunks of blocks and a padded tail: the body and what comes back, pinned (x86 and the emulated Pi)."""
    x = (np.sin(np.arange(70_000, dtype=np.float64) * 0.37) * np.linspace(1e-4, 3e-3, 70_000)).astype(F32)
    body, sent = encode_delta({"w": x, "b": x[:84].copy()}, comp)
    assert hashlib.sha256(body + sent["b"].tobytes() + sent["w"].tobytes()).hexdigest()[:16] == pin


@pytest.mark.parametrize("comp", [RSIGN, RTERN, RINT2], ids=["rsign", "rtern", "rint2"])
@pytest.mark.parametrize("n", [0, 1, 15, 84, 1000, 1025, 40_000, 70_000])
def test_decode_gives_back_exactly_what_was_sent_and_in_place_leaves_the_rest(comp, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_t(3, size=n) * 1e-3).astype(F32)
    body, sent = encode_delta({"w": x}, comp)
    m = padded(n)
    codes = {RSIGN: m // 8, RTERN: -(-m // 5), RINT2: m // 4}[comp]
    assert len(body) == 8 + 8 + 4 * sum(c for _, _, c in blocks_of(n)) + codes
    back = decode_delta(body, {"w": ((n,), "float32")}, comp.method)
    assert back["w"].tobytes() == sent["w"].tobytes()
    rest = x.copy()
    lean, none = encode_delta({"w": rest}, comp, keep_sent=False)
    assert lean == body and none is None
    assert rest.tobytes() == (x - sent["w"]).tobytes()


def test_rint2s_small_tensor_is_its_rotation_in_four_levels():
    x = np.arange(-8, 8, dtype=F32) / F32(4)
    body, sent = encode_delta({"w": x}, RINT2)
    seed = int.from_bytes(body[8:16], "little")
    y = hadamard(16) @ (np.where(_flip_source(seed, 16)(0, 0, 16), -1.0, 1.0) * x) / 4
    q = np.where(y < 0, -1, 1) * np.where(np.abs(y) > 0.9957 * np.sqrt((y ** 2).mean()), 3, 1)
    assert body[:8] == head(code=7) and len(body) == 8 + 8 + 4 + 4
    assert struct.unpack("<f", body[16:20])[0] == pytest.approx((y ** 2).sum() / (y * q).sum(), rel=1e-6)
    codes = (q + 3) // 2
    assert list(body[20:]) == [int(sum(codes[i + j] << (2 * j) for j in range(4))) for i in range(0, 16, 4)]
    assert sorted(set(np.abs(q))) == [1, 3]


def test_rterns_small_tensor_is_its_rotation_in_three_levels_five_to_a_byte():
    x = np.arange(-8, 8, dtype=F32) / F32(4)
    body, sent = encode_delta({"w": x}, RTERN)
    seed = int.from_bytes(body[8:16], "little")
    y = hadamard(16) @ (np.where(_flip_source(seed, 16)(0, 0, 16), -1.0, 1.0) * x) / 4
    q = np.where(np.abs(y) > 0.6120 * np.sqrt((y ** 2).mean()), np.sign(y), 0).astype(int)
    assert body[:8] == head(code=8) and len(body) == 8 + 8 + 4 + 4  # 16 codes in 4 bytes
    assert struct.unpack("<f", body[16:20])[0] == pytest.approx((y ** 2).sum() / np.abs(y[q != 0]).sum(), rel=1e-6)
    codes = np.append(q + 1, [0] * 4)
    assert list(body[20:]) == [int(sum(codes[i + j] * 3 ** j for j in range(5))) for i in range(0, 20, 5)]
    assert 0 in q and set(np.abs(q)) == {0, 1}


def test_independent_devices_errors_average_away_where_sign_keeps_them():
    """Twelve devices with the same change and a little noise of their own: the mean of what they sent."""
    rng = np.random.default_rng(0)
    common = (rng.standard_t(3, size=20_000) * 1e-3).astype(F32)
    err = {}
    for comp in (Compression.parse("sign"), RSIGN, RTERN, RINT2):
        mean = np.zeros(common.size)
        for _ in range(12):
            _, sent = encode_delta({"w": common + (rng.normal(size=common.size) * 2e-4).astype(F32)}, comp)
            mean += sent["w"] / 12
        err[comp.method] = np.linalg.norm(mean - common) / np.linalg.norm(common)
    print({k.value: round(float(v), 3) for k, v in err.items()})
    # observed: sign 0.72 (every device makes the same error), rsign 0.22 (0.75 / sqrt(12) and the noise), rint2 0.11
    assert err[Method.RINT2] < err[Method.RTERN] < err[Method.RSIGN] < 0.35 < 0.5 < err[Method.SIGN]


@pytest.mark.parametrize("comp", [RSIGN, RTERN, RINT2], ids=["rsign", "rtern", "rint2"])
def test_the_scale_makes_it_unbiased_over_rotations(comp):
    rng = np.random.default_rng(3)
    x = (rng.standard_t(3, size=1024) * 1e-3).astype(F32)
    mean = np.zeros(x.size)
    one = []
    for i in range(400):
        _, sent = encode_delta({"w": x + F32(1e-9) * i}, comp)  # another seed each time
        mean += sent["w"] / 400
        one.append(np.linalg.norm(sent["w"] - x) / np.linalg.norm(x))
    # one rotation's error (rsign about 0.75 |x|, rint2 0.36) averages to 1 / 20 of it over 400
    assert np.linalg.norm(mean - x) / np.linalg.norm(x) < 1.5 * np.mean(one) / 20


BAD = {
    "negative scale": (3, struct.pack("<Qf", 1, -1.0) + bytes(2), "a scale is NaN, Inf, negative or too large"),
    "-0.0 scale": (3, struct.pack("<Qf", 1, -0.0) + bytes(2), "a scale is NaN, Inf, negative or too large"),
    "NaN scale": (3, struct.pack("<Qf", 1, float("nan")) + bytes(2), "a scale is NaN"),
    "huge scale": (3, struct.pack("<Qf", 1, 2.0 ** 126) + bytes(2), "too large"),
    "truncated": (3, struct.pack("<Qf", 1, 1.0) + bytes(1), "needs 14 bytes, 13 left"),
    "rint2 truncated": (17, struct.pack("<Qff", 1, 1.0, 1.0) + bytes(7), "needs 24 bytes, 23 left"),
    "rtern byte above 242": (3, struct.pack("<Qf", 1, 1.0) + bytes([243, 0, 0, 0]), "a byte above 242"),
    "rtern padding code": (3, struct.pack("<Qf", 1, 1.0) + bytes([0, 0, 0, 3 ** 1]), "the padding codes are not 0"),
    "trailing": (3, struct.pack("<Qf", 1, 1.0) + bytes(3), "1 trailing bytes"),
}


@pytest.mark.parametrize("case", BAD)
def test_hostile_rsign_bodies_are_refused_with_their_reason(case):
    n, tensor, match = BAD[case]
    method = Method(case.split()[0]) if case.startswith("r") else Method.RSIGN
    with pytest.raises(ProtocolError, match=match) as e:
        decode_delta(head(code=CODES[method]) + tensor, {"w": ((n,), "float32")}, method)
    assert e.value.reason in ("compressed-value", "compressed-length")


def test_a_delta_too_large_to_rotate_is_refused_by_the_encoder():
    with pytest.raises(ValueError, match="too large to rotate"):
        encode_delta({"w": np.full(64, 3e38, F32)}, RSIGN)
    with pytest.raises(ValueError, match="too large to rotate"):
        encode_delta({"w": np.full(64, 3e37, F32)}, RINT2)
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_delta({"w": np.array([1.0, np.nan], F32)}, RSIGN)
