"""Compressed deltas (int8, int4, sign, top-k, STC), error feedback, and chains of compressed model changes."""

from __future__ import annotations

import logging
import math
import struct
import tracemalloc

import numpy as np
import pytest

import edge_sdk.compress as compress
from edge_sdk.compress import (
    Compression,
    ErrorFeedback,
    Method,
    Step,
    apply_steps,
    chain_body,
    decode_delta,
    encode_delta,
    keep_count,
    parse_chain,
)
from edge_sdk.protocol import ProtocolError

from helpers import leb

F32 = np.float32
METHODS = ["int8", "int4", "sign", "topk:0.01", "topk:0.3", "topk:1.0", "stc:0.01", "stc:0.3", "stc:1.0"]


def spec_of(delta):
    return {name: (np.shape(a), "float32") for name, a in delta.items()}


def head(code: int, count: int = 1, magic: bytes = b"FZ", version: int = 1) -> bytes:
    return struct.pack("<2sBBI", magic, version, code, count)


def sparse(k: int, index_block: bytes, m: int | None = None) -> bytes:
    return struct.pack("<II", k, len(index_block) if m is None else m) + index_block


def sparse2(k: int, index_block: bytes, rice_b: int | None = None) -> bytes:
    """A version 2 index block: LEB128 (coding 0), or Rice with parameter ``rice_b`` (coding 1)."""
    coding = b"\x00" if rice_b is None else bytes([1, rice_b])
    return struct.pack("<I", k) + coding + struct.pack("<I", len(index_block)) + index_block


def f32s(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def refused(body, spec, method, reason, match):
    with pytest.raises(ProtocolError, match=match) as err:
        decode_delta(body, spec, method)
    assert err.value.reason == reason


def deltas():
    rng = np.random.default_rng(7)
    return {
        "zero-d": {"s": np.array(-0.75, dtype=F32)},
        "empty": {"e": np.zeros((0, 3), F32), "w": rng.standard_normal(5).astype(F32)},
        "one entry": {"w": np.array([2.5e-3], dtype=F32)},
        "zeros": {"a": np.zeros((4, 4), F32), "b": np.zeros(3, F32)},
        "all equal": {"a": np.full((3, 5), -0.125, F32)},
        "mixed shapes": {"conv.weight": rng.standard_normal((6, 1, 5, 5)).astype(F32),
                         "conv.bias": rng.standard_normal(6).astype(F32),
                         "fc.weight": rng.standard_normal((10, 300)).astype(F32) * F32(1e-3),
                         "fc.bias": np.array(0.5, dtype=F32)},
        "huge and tiny": {"a": np.array([3.4e38, -3.4e38, 1.0, 0.0], F32),
                          "b": np.array([1e-45, -1e-45, 0.0], F32),
                          "c": np.array([1e-38, -3e-39, 7e-40], F32)},
    }


# -- round trips ----------------------------------------------------------------


@pytest.mark.parametrize("text", METHODS)
@pytest.mark.parametrize("case", list(deltas()))
def test_decode_gives_back_exactly_what_encode_says_was_sent(text, case):
    delta = deltas()[case]
    comp = Compression.parse(text)
    body, sent = encode_delta(delta, comp)
    got = decode_delta(body, spec_of(delta), comp.method)
    assert list(sent) == sorted(delta) and list(got) == sorted(delta)
    for name in delta:
        assert sent[name].dtype == got[name].dtype == F32
        assert sent[name].shape == got[name].shape == np.shape(delta[name])
        assert got[name].tobytes() == sent[name].tobytes()  # bit for bit, signed zeros included
        assert got[name].flags.writeable
        assert np.isfinite(sent[name]).all()


def test_exact_bytes_of_a_small_delta_per_method():
    delta = {"b": np.array([0.5, -2.0, 0.0, 1.5], F32), "a": np.array(3.0, F32)}
    int8, sent = encode_delta(delta, Compression.parse("int8"))
    scale_a, scale_b = F32(3) / F32(127), F32(2) / F32(127)
    # b / scale_b = [31.75, -127, 0, 95.25]
    assert int8 == (head(1, 2) + struct.pack("<f", scale_a) + bytes([127])
                    + struct.pack("<f", scale_b) + np.array([32, -127, 0, 95], np.int8).tobytes())
    assert len(int8) == 8 + (4 + 1) + (4 + 4) == 21
    assert sent["b"].tolist() == [F32(32) * scale_b, F32(-127) * scale_b, 0.0, F32(95) * scale_b]
    assert sent["a"].tolist() == F32(127) * scale_a
    topk, sent = encode_delta(delta, Compression.parse("topk:0.5"))
    # gaps [1, 2] in Rice with b = 0: 1 0, 1 1 0 (least significant bit first) = 0x0D, one byte against LEB128's two
    assert topk == (head(2, 2, version=2) + sparse2(1, b"\x00") + f32s(3.0)
                    + sparse2(2, b"\x0d", rice_b=0) + f32s(-2.0, 1.5))
    assert len(topk) == 8 + (9 + 1 + 4) + (10 + 1 + 8) == 41
    assert sent["b"].tolist() == [0.0, -2.0, 0.0, 1.5] and sent["a"].tolist() == 3.0
    stc, sent = encode_delta(delta, Compression.parse("stc:0.5"))
    assert stc == (head(3, 2, version=2) + sparse2(1, b"\x00") + f32s(3.0) + b"\x00"
                   + sparse2(2, b"\x0d", rice_b=0) + f32s(1.75) + b"\x01")
    assert len(stc) == 8 + (9 + 1 + 4 + 1) + (10 + 1 + 4 + 1) == 39
    assert sent["b"].tolist() == [0.0, -1.75, 0.0, 1.75]


def test_indices_past_127_take_two_varint_bytes_and_empty_tensors_take_only_their_counts():
    x = np.zeros(300, F32)
    x[[5, 200]] = [1.0, -3.0]
    body, _ = encode_delta({"w": x, "z": np.zeros(0, F32)}, Compression.parse("topk:0.005"))  # k = 2
    # Rice needs 3 bytes too (17 bits with b = 6 or 7): LEB128 is kept on a tie
    assert body == head(2, 2, version=2) + sparse2(2, b"\x05" + leb(195)) + f32s(1.0, -3.0) + sparse2(0, b"")
    assert leb(195) == b"\xc3\x01" and len(body) == 8 + 9 + 3 + 8 + 9 == 37
    body, _ = encode_delta({"z": np.zeros(0, F32)}, Compression.parse("stc:0.5"))
    assert body == head(3, version=2) + sparse2(0, b"") + f32s(0.0)
    body, _ = encode_delta({"z": np.zeros(0, F32)}, Compression.parse("int8"))
    assert body == head(1) + f32s(0.0)


def test_varints_of_every_length_match_a_plain_leb128_coder():
    from edge_sdk.compress.varints import read_varints as _read_varints
    from edge_sdk.compress.varints import varints as _varints

    edges = [0, 1, 127, 128, 2**14 - 1, 2**14, 2**21 - 1, 2**21, 2**28 - 1, 2**28, 2**32 - 1]
    values = np.array(edges + np.random.default_rng(2).integers(0, 2**32, 500).tolist(), np.uint64)
    block = _varints(values)
    assert block.tobytes() == b"".join(leb(int(v)) for v in values)
    assert [len(leb(v)) for v in edges] == [1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert _read_varints(block, len(values), "t").tolist() == values.tolist()
    assert _varints(np.zeros(0, np.int64)).tobytes() == b""


def test_indices_of_every_varint_length_decode_in_place():
    idx = [0, 1, 129, 129 + 2**14, 129 + 2**14 + 2**21]
    block = b"".join(leb(g) for g in np.diff(idx, prepend=0).tolist())
    assert len(block) == 1 + 1 + 2 + 3 + 4
    got = decode_delta(head(2) + sparse(5, block) + f32s(1, 2, 3, 4, 5), {"w": ((2**22,), "float32")}, Method.TOPK)["w"]
    assert np.flatnonzero(got).tolist() == idx and got[idx].tolist() == [1, 2, 3, 4, 5]
    x = np.random.default_rng(1).standard_normal(1_000_003).astype(F32)
    body, sent = encode_delta({"w": x}, Compression.parse("topk:0.001"))
    assert np.array_equal(decode_delta(body, {"w": (x.shape, "float32")}, Method.TOPK)["w"], sent["w"])
    assert np.count_nonzero(sent["w"]) == 1001


def test_topk_keeps_exactly_the_k_largest_magnitudes_and_ties_go_to_the_lowest_index():
    x = np.random.default_rng(3).standard_normal(1000).astype(F32)
    _, sent = encode_delta({"w": x}, Compression.parse("topk:0.05"))
    kept = np.flatnonzero(sent["w"])
    assert kept.tolist() == sorted(np.argsort(-np.abs(x), kind="stable")[:50].tolist())
    assert np.array_equal(sent["w"][kept], x[kept])
    assert np.abs(x[kept]).min() > np.abs(np.delete(x, kept)).max()
    ties = np.array([1, -5, 5, 2, -5, 5, 0], F32)
    _, sent = encode_delta({"w": ties}, Compression.parse("topk:0.4"))  # k = ceil(2.8) = 3
    assert sent["w"].tolist() == [0, -5, 5, 0, -5, 0, 0]


def test_stc_sends_plus_or_minus_mu_the_mean_kept_magnitude():
    x = np.random.default_rng(4).standard_normal((20, 50)).astype(F32)
    _, sent = encode_delta({"w": x}, Compression.parse("stc:0.02"))  # k = 20
    _, top = encode_delta({"w": x}, Compression.parse("topk:0.02"))
    kept = np.flatnonzero(top["w"])
    assert kept.tolist() == np.flatnonzero(sent["w"]).tolist() and len(kept) == 20
    mu = F32(np.abs(x.reshape(-1)[kept]).astype(np.float64).mean())
    assert np.array_equal(sent["w"].reshape(-1)[kept], np.where(x.reshape(-1)[kept] < 0, -mu, mu))
    assert set(np.unique(sent["w"]).tolist()) == {-float(mu), 0.0, float(mu)}


def test_int8_errs_by_at_most_half_a_step_and_keeps_the_extremes():
    x = np.random.default_rng(5).standard_normal((64, 64)).astype(F32) * F32(0.02)
    body, sent = encode_delta({"w": x}, Compression.parse("int8"))
    scale = F32(np.abs(x).max() / F32(127))
    assert struct.unpack_from("<f", body, 8)[0] == scale
    err = np.abs(x.astype(np.float64) - sent["w"])
    assert err.max() <= scale / 2 * (1 + 1e-6)
    assert np.abs(sent["w"]).max() == F32(127) * scale
    assert np.abs(np.rint(sent["w"] / scale)).max() == 127


def test_float64_input_is_cast_and_bad_input_is_refused():
    _, sent = encode_delta({"w": np.array([0.1, -0.2])}, Compression.parse("topk:1.0"))
    assert sent["w"].dtype == F32 and sent["w"].tolist() == [F32(0.1), F32(-0.2)]
    with pytest.raises(ValueError, match=r"^encode_delta needs a compression method, got 'none'"):
        encode_delta({"w": np.ones(2, F32)}, Compression())
    with pytest.raises(ValueError, match=r"^no tensors in the delta to encode$"):
        encode_delta({}, Compression.parse("int8"))
    for bad in (np.nan, np.inf, -np.inf):
        for text in ("int8", "int4", "sign", "topk", "stc"):
            with pytest.raises(ValueError, match=r"^tensor 'w' of the delta holds NaN or Inf$"):
                encode_delta({"w": np.array([1.0, bad], F32)}, Compression.parse(text))
    with pytest.raises(ValueError, match=r"^tensor 'w' has dtype int64; a delta is floating point$"):
        encode_delta({"w": np.arange(3)}, Compression.parse("int8"))


def test_keep_count():
    assert [keep_count(n, 0.01) for n in (0, 1, 99, 100, 101, 1000, 61706)] == [0, 1, 1, 1, 2, 10, 618]
    assert keep_count(7, 1.0) == 7 and keep_count(8, 0.25) == 2
    with pytest.raises(ValueError, match=r"^n must be an integer >= 0, got -1$"):
        keep_count(-1, 0.5)
    with pytest.raises(ValueError, match=r"^fraction must be > 0.0, got 0$"):
        keep_count(5, 0)


# -- the setting ----------------------------------------------------------------


@pytest.mark.parametrize(("text", "method", "fraction", "canonical", "meta"), [
    ("none", Method.NONE, 0.01, "none", {"method": "none"}),
    ("int8", Method.INT8, 0.01, "int8", {"method": "int8"}),
    ("int4", Method.INT4, 0.01, "int4", {"method": "int4"}),
    (" sign", Method.SIGN, 0.01, "sign", {"method": "sign"}),
    ("topk", Method.TOPK, 0.01, "topk:0.01", {"method": "topk", "fraction": 0.01}),
    ("topk:0.25", Method.TOPK, 0.25, "topk:0.25", {"method": "topk", "fraction": 0.25}),
    (" stc:0.005 ", Method.STC, 0.005, "stc:0.005", {"method": "stc", "fraction": 0.005}),
    ("stc:1", Method.STC, 1.0, "stc:1.0", {"method": "stc", "fraction": 1.0}),
])
def test_compression_parse_str_and_meta_round_trip(text, method, fraction, canonical, meta):
    comp = Compression.parse(text)
    assert (comp.method, comp.fraction, str(comp), comp.to_meta()) == (method, fraction, canonical, meta)
    assert comp.enabled is (method is not Method.NONE)
    assert Compression.parse(str(comp)) == comp == Compression.from_meta(comp.to_meta())


def test_compression_equality_ignores_the_fraction_where_the_method_does():
    assert Compression("int8", 0.5) == Compression(Method.INT8) and Compression("int8", 0.5).fraction == 0.01
    assert Compression("topk", 0.5) != Compression("topk")
    assert Compression().method is Method.NONE and not Compression().enabled


@pytest.mark.parametrize(("text", "match"), [
    ("gzip", r"^compression must be 'none', 'int8', 'int4', 'sign', 'rsign', 'rtern', 'rint2', 'topk\[:fraction\]' or 'stc\[:fraction\]', got 'gzip'$"),
    ("TOPK", r"^compression must be .* got 'TOPK'$"),
    ("int8:0.5", r"^compression must be .* got 'int8:0.5'$"),
    ("sign:0.5", r"^compression must be 'none', 'int8', 'int4', 'sign', .* got 'sign:0.5'$"),
    ("int4:1", r"^compression must be .* got 'int4:1'$"),
    ("INT4", r"^compression must be .* got 'INT4'$"),
    ("topk:0", r"^compression fraction must be > 0.0, got 0.0$"),
    ("topk:1.5", r"^compression fraction must be <= 1.0, got 1.5$"),
    ("stc:nan", r"^compression fraction must be a finite number, got nan$"),
    ("stc:-0.1", r"^compression fraction must be > 0.0, got -0.1$"),
    ("topk:", r"^compression fraction must be a number in \(0, 1\], got '' in 'topk:'$"),
    ("topk:half", r"^compression fraction must be a number in \(0, 1\], got 'half' in 'topk:half'$"),
])
def test_compression_parse_refuses_bad_text(text, match):
    with pytest.raises(ValueError, match=match):
        Compression.parse(text)


def test_compression_refuses_bad_values_and_meta():
    with pytest.raises(ValueError, match=r"^compression method must be one of \['none', 'int8', 'topk', 'stc', 'sign', 'int4', "
                                         r"'rsign', 'rint2', 'rtern'\], got 'zip'$"):
        Compression("zip")
    with pytest.raises(ValueError, match=r"^compression fraction must be a finite number, got True$"):
        Compression("topk", True)
    with pytest.raises(ValueError, match=r"^compression meta must be a mapping, got str$"):
        Compression.from_meta("topk")
    with pytest.raises(ValueError, match=r"^compression meta must have 'method' and at most 'fraction', "
                                         r"got keys \['fraction', 'level', 'method'\]$"):
        Compression.from_meta({"method": "topk", "fraction": 0.1, "level": 3})
    with pytest.raises(ValueError, match=r"a fraction goes with topk and stc, and only with them$"):
        Compression.from_meta({"method": "topk"})
    with pytest.raises(ValueError, match=r"a fraction goes with topk and stc, and only with them$"):
        Compression.from_meta({"method": "int8", "fraction": 0.1})
    with pytest.raises(ValueError, match=r"a fraction goes with topk and stc, and only with them$"):
        Compression.from_meta({"method": "sign", "fraction": 0.1})
    assert Compression("int4", 0.5) == Compression.from_meta({"method": "int4"}) == Compression.parse("int4")
    with pytest.raises(ValueError, match=r"^compression fraction must be a finite number, got '0.1'$"):
        Compression.from_meta({"method": "stc", "fraction": "0.1"})


def test_the_package_exports_the_agreed_names():
    assert compress.__all__ == sorted(compress.__all__) == [
        "Compression", "ErrorFeedback", "Method", "Step", "add_change", "apply_catchup", "apply_steps", "catchup_body",
        "catchup_size", "chain_body", "decode_delta", "encode_delta", "keep_count", "parse_chain"]
    assert [m.value for m in Method] == ["none", "int8", "topk", "stc", "sign", "int4", "rsign", "rint2", "rtern"]


# -- hostile bodies -------------------------------------------------------------

W10 = {"w": ((10,), "float32")}


def test_hostile_headers_are_refused():
    good = encode_delta({"w": np.arange(10, dtype=F32)}, Compression.parse("topk:0.2"))[0]
    refused(good[:7], W10, Method.TOPK, "compressed-header", r"^body of 7 bytes is shorter than the 8-byte header$")
    refused(b"FX" + good[2:], W10, Method.TOPK, "compressed-header", r"^not a compressed delta \(magic b'FX'")
    refused(good[:2] + b"\x03" + good[3:], W10, Method.TOPK, "compressed-header", r"version 3\)$")
    int8 = encode_delta({"w": np.arange(10, dtype=F32)}, Compression.parse("int8"))[0]
    refused(int8[:2] + b"\x02" + int8[3:], W10, Method.INT8, "compressed-header", r"version 2\)$")  # sparse only
    refused(good[:8] + good[8:12] + b"\x07" + good[13:], W10, Method.TOPK, "compressed-index",
            r"^tensor 'w': index coding 7 \(parameter 0\) is unknown$")
    refused(head(2, 2) + good[8:], W10, Method.TOPK, "compressed-header", r"^body holds 2 tensors, the spec 1$")
    refused(good, W10, Method.STC, "compressed-method", r"^method byte 2, expected 3 \(stc\)$")
    refused(head(9) + good[8:], W10, Method.TOPK, "compressed-method", r"^method byte 9, expected 2 \(topk\)$")
    refused(good + b"\x00", W10, Method.TOPK, "compressed-length", r"^1 trailing bytes after the last tensor$")
    assert decode_delta(good, W10, Method.TOPK)["w"].tolist() == [0] * 8 + [8, 9]


def test_counts_that_lie_are_refused_before_anything_is_allocated():
    refused(head(2) + sparse(11, b"\x00" * 11) + f32s(*[0] * 11), W10, Method.TOPK, "compressed-count",
            r"^tensor 'w': k 11 > 10 entries$")
    tracemalloc.start()
    try:
        refused(head(2) + sparse(2**32 - 1, b"", m=2**32 - 1), W10, Method.TOPK, "compressed-count",
                r"^tensor 'w': k 4294967295 > 10 entries$")
        huge = {"w": ((2**32 - 1,), "float32")}  # the receiver's spec allows it; the body's counts still lie
        refused(head(2) + sparse(2**32 - 1, b"", m=2**32 - 1), huge, Method.TOPK, "compressed-length",
                r"^tensor 'w': 4294967295 index bytes and 17179869180 bytes of values needs 21474836475 bytes, 0 left$")
        refused(head(3) + sparse(2**32 - 1, b"\x01", m=2**32 - 1), huge, Method.STC, "compressed-length",
                r"^tensor 'w': 4294967295 index bytes and 536870916 bytes of values needs 4831838211 bytes, 1 left$")
        assert tracemalloc.get_traced_memory()[1] < 1_000_000
    finally:
        tracemalloc.stop()
    refused(head(2) + sparse(2, b"\x01", m=1) + f32s(1, 2), W10, Method.TOPK, "compressed-count",
            r"^tensor 'w': index block of 1 bytes for k 2 \(must be 2 to 10\)$")
    refused(head(2) + sparse(1, b"\x80" * 5 + b"\x01") + f32s(1), W10, Method.TOPK, "compressed-count",
            r"^tensor 'w': index block of 6 bytes for k 1 \(must be 1 to 5\)$")
    refused(head(1) + f32s(1.0) + b"\x01" * 9, W10, Method.INT8, "compressed-length",
            r"^tensor 'w': scale and 10 int8 entries needs 14 bytes, 13 left$")
    refused(head(2) + sparse(2, b"\x01\x01") + f32s(1.0), W10, Method.TOPK, "compressed-length",
            r"^tensor 'w': 2 index bytes and 8 bytes of values needs 10 bytes, 6 left$")
    refused(head(2) + b"\x01\x00\x00", W10, Method.TOPK, "compressed-length",
            r"^tensor 'w': k needs 4 bytes, 3 left$")


@pytest.mark.parametrize(("block", "k", "match"), [
    (b"\x01\x01\x81", 2, r"^tensor 'w': the index block ends inside a varint$"),
    (b"\x81\x01", 2, r"^tensor 'w': the index block holds 1 varints, k is 2$"),
    (b"\x80\x80\x80\x80\x80\x01\x01", 2, r"^tensor 'w': a varint of 6 bytes \(at most 5\)$"),
    (b"\xff\xff\xff\xff\x1f", 1, r"^tensor 'w': a varint of 8589934591 \(at most 2\*\*32 - 1\)$"),
    (b"\x81\x00", 1, r"^tensor 'w': a varint ends with a needless zero byte$"),
    (b"\x0a", 1, r"^tensor 'w': index 10 out of range for 10 entries$"),
    (b"\x03\x00", 2, r"^tensor 'w': a gap of 0 \(a duplicate index\)$"),
    # indices [5, 2] as a careless or hostile encoder writes them: the gap -3 as a u32
    (b"\x05" + leb(-3 & 0xFFFFFFFF), 2, r"^tensor 'w': index 4294967298 out of range for 10 entries$"),
])
def test_bad_index_blocks_are_refused(block, k, match):
    for method, tail in ((Method.TOPK, f32s(*[1.0] * k)), (Method.STC, f32s(1.0) + b"\x00")):
        refused(head(_code(method)) + sparse(k, block) + tail, W10, method, "compressed-index", match)


def _code(method: Method) -> int:
    return {Method.INT8: 1, Method.TOPK: 2, Method.STC: 3}[method]


@pytest.mark.parametrize(("method", "tail", "match"), [
    (Method.INT8, f32s(math.nan) + b"\x00" * 10, r"^tensor 'w': scale is nan; it must be finite and >= 0$"),
    (Method.INT8, f32s(math.inf) + b"\x00" * 10, r"^tensor 'w': scale is inf; it must be finite and >= 0$"),
    (Method.INT8, f32s(-1.0) + b"\x00" * 10, r"^tensor 'w': scale is -1.0; it must be finite and >= 0$"),
    (Method.INT8, f32s(-0.0) + b"\x00" * 10, r"^tensor 'w': scale is -0.0; it must be finite and >= 0$"),
    (Method.INT8, f32s(1.0) + b"\x00" * 9 + b"\x80", r"^tensor 'w': int8 entry -128 \(the range is \[-127, 127\]\)$"),
    (Method.TOPK, sparse(2, b"\x01\x01") + f32s(1.0, math.nan), r"^tensor 'w': a value is NaN or Inf$"),
    (Method.TOPK, sparse(2, b"\x01\x01") + f32s(-math.inf, 1.0), r"^tensor 'w': a value is NaN or Inf$"),
    (Method.STC, sparse(2, b"\x01\x01") + f32s(math.inf) + b"\x00", r"^tensor 'w': mu is inf; it must be finite"),
    (Method.STC, sparse(2, b"\x01\x01") + f32s(math.nan) + b"\x00", r"^tensor 'w': mu is nan; it must be finite"),
    (Method.STC, sparse(2, b"\x01\x01") + f32s(-0.5) + b"\x00", r"^tensor 'w': mu is -0.5; it must be finite"),
    (Method.STC, sparse(3, b"\x01\x01\x01") + f32s(0.5) + b"\x08",
     r"^tensor 'w': padding bits set in the last sign byte$"),
    (Method.STC, sparse(2, b"\x01\x01") + f32s(0.5) + b"\x80", r"^tensor 'w': padding bits set in the last sign byte$"),
])
def test_bad_values_are_refused(method, tail, match):
    refused(head(_code(method)) + tail, W10, method, "compressed-value", match)


def test_hand_built_bodies_that_follow_the_format_are_read():
    assert decode_delta(head(3) + sparse(3, b"\x01\x01\x01") + f32s(0.5) + b"\x05", W10, Method.STC)["w"].tolist() == [
        0, -0.5, 0.5, -0.5, 0, 0, 0, 0, 0, 0]
    assert decode_delta(head(2) + sparse(0, b""), W10, Method.TOPK)["w"].tolist() == [0] * 10  # k = 0: allowed
    got = decode_delta(head(1) + f32s(0.5) + np.array([127, -127, 0, 1, 2, 3, 4, 5, 6, -1], np.int8).tobytes(),
                       W10, Method.INT8)["w"]
    assert got.tolist() == [63.5, -63.5, 0, 0.5, 1, 1.5, 2, 2.5, 3, -0.5]


def test_decode_refuses_a_bad_spec_or_method_as_the_callers_error():
    body = encode_delta({"w": np.ones(10, F32)}, Compression.parse("int8"))[0]
    with pytest.raises(ValueError, match=r"^method must be one of \['int8', 'topk', 'stc', 'sign', 'int4', 'rsign', 'rint2', 'rtern'\], "
                       r"got <Method.NONE"):
        decode_delta(body, W10, Method.NONE)
    with pytest.raises(ValueError, match=r"^spec entry 'w' has dtype int8; a delta is floating point$"):
        decode_delta(body, {"w": ((10,), "int8")}, Method.INT8)
    with pytest.raises(ValueError, match=r"^spec entry 'w' must be \(shape, dtype\), got \(10, 'float32'\)"):
        decode_delta(body, {"w": (10, "float32")}, Method.INT8)
    assert decode_delta(body, {"w": ((10,), "float64")}, "int8")["w"].dtype == F32


# -- error feedback ---------------------------------------------------------------


def _delta(seed: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((8, 25)).astype(F32) * F32(scale), "b": rng.standard_normal(7).astype(F32)}


def test_feedback_carries_the_unsent_part_into_the_next_delta():
    comp = Compression.parse("topk:0.1")
    fb = ErrorFeedback(comp)
    d1, d2 = _delta(1), _delta(2)
    body, sent = fb.compress("k0", d1)
    assert body == encode_delta(d1, comp)[0]
    residual = {n: np.subtract(d1[n], sent[n]) for n in d1}
    assert fb.keys == ["k0"]
    assert fb.residual_norm("k0") == pytest.approx(math.sqrt(sum(float(np.sum(r.astype(np.float64) ** 2))
                                                                  for r in residual.values())), rel=1e-12)
    body2, sent2 = fb.compress("k0", d2)
    total = {n: np.add(d2[n], residual[n]) for n in d2}
    expected_body, expected_sent = encode_delta(total, comp)
    assert body2 == expected_body
    assert all(sent2[n].tobytes() == expected_sent[n].tobytes() for n in d2)
    body3, sent3 = fb.compress("k0", {n: np.zeros_like(a) for n, a in d2.items()})  # only the residual is left
    rest = {n: np.subtract(total[n], sent2[n]) for n in d2}
    assert body3 == encode_delta(rest, comp)[0] and any(np.any(s != 0) for s in sent3.values())
    assert fb.residual_norm("other") == 0.0


def test_the_sum_of_what_was_sent_follows_the_sum_of_the_deltas():
    comp = Compression.parse("topk:0.05")
    fb = ErrorFeedback(comp)
    rng = np.random.default_rng(9)
    base = rng.standard_normal(400).astype(F32)
    total_delta = np.zeros(400, np.float64)
    total_sent = np.zeros(400, np.float64)
    total_plain = np.zeros(400, np.float64)
    for _ in range(300):
        d = base + F32(0.1) * rng.standard_normal(400).astype(F32)
        total_delta += d
        total_sent += fb.compress("k", {"w": d})[1]["w"]
        total_plain += encode_delta({"w": d}, comp)[1]["w"]
    rel = np.linalg.norm(total_sent - total_delta) / np.linalg.norm(total_delta)
    plain = np.linalg.norm(total_plain - total_delta) / np.linalg.norm(total_delta)
    assert rel < 0.05 < 0.5 < plain  # without feedback 95 % of every delta is lost for good
    assert np.linalg.norm(total_sent - total_delta) == pytest.approx(fb.residual_norm("k"), rel=1e-3)


def test_feedback_resets_drops_mismatched_residuals_and_survives_a_bad_delta(caplog):
    comp = Compression.parse("stc:0.1")
    fb = ErrorFeedback(comp)
    d = _delta(1)
    fb.compress("k0", d)
    fb.compress("k1", d)
    fb.reset("k0")
    assert fb.keys == ["k1"] and fb.residual_norm("k0") == 0.0
    assert fb.compress("k0", d)[0] == encode_delta(d, comp)[0]
    fb.reset()
    assert fb.keys == []
    fb.compress("k0", d)
    other = {"a": np.ones(3, F32)}
    with caplog.at_level(logging.WARNING, logger="edge_sdk.compress.feedback"):
        assert fb.compress("k0", other)[0] == encode_delta(other, comp)[0]
    assert "the residual of model 'k0' has other tensors than its delta; dropped" in caplog.text
    norm = fb.residual_norm("k0")
    with pytest.raises(ValueError, match=r"^tensor 'a' of the delta holds NaN or Inf$"):
        fb.compress("k0", {"a": np.array([1, np.nan, 0], F32)})
    assert fb.residual_norm("k0") == norm
    with pytest.raises(ValueError, match=r"^model key must be a non-empty string without '/', got 'a/b'$"):
        fb.compress("a/b", d)


def test_set_compression_resets_only_on_a_change():
    fb = ErrorFeedback(Compression.parse("topk:0.1"))
    fb.compress("k", _delta(1))
    fb.set_compression(Compression.parse("topk:0.1"))
    assert fb.keys == ["k"]
    fb.set_compression(Compression.parse("topk:0.2"))
    assert fb.keys == [] and fb.comp == Compression("topk", 0.2)
    with pytest.raises(ValueError, match=r"^comp must be a Compression, got 'int8'$"):
        fb.set_compression("int8")


def test_feedback_saves_and_loads_its_residuals(tmp_path):
    comp = Compression.parse("topk:0.1")
    fb = ErrorFeedback(comp)
    fb.compress("k0", _delta(1))
    fb.compress("k1", {"s": np.array(0.5, F32), "e": np.zeros((0, 2), F32), "w": np.arange(30, dtype=F32)})
    path = fb.save(tmp_path / "state")
    assert path == tmp_path / "state" / "residual.safetensors" and path.is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == ["residual.safetensors"]
    back = ErrorFeedback(comp)
    assert back.load(tmp_path / "state") is True
    assert back.keys == ["k0", "k1"]
    for key in back.keys:
        assert back.residual_norm(key) == fb.residual_norm(key)
    d2 = _delta(2)
    assert back.compress("k0", d2)[0] == fb.compress("k0", d2)[0]
    nxt = {"s": np.array(1.0, F32), "e": np.zeros((0, 2), F32), "w": np.ones(30, F32)}
    assert back.compress("k1", nxt)[0] == fb.compress("k1", nxt)[0]


def test_feedback_ignores_files_it_cannot_trust(tmp_path, caplog):
    comp = Compression.parse("topk:0.1")
    fb = ErrorFeedback(comp)
    assert fb.load(tmp_path) is False  # none there
    fb.compress("k0", _delta(1))
    fb.save(tmp_path)
    other = ErrorFeedback(Compression.parse("stc:0.1"))
    other.compress("mine", _delta(3))
    with caplog.at_level(logging.INFO, logger="edge_sdk.compress.feedback"):
        assert other.load(tmp_path) is False
    assert "holds residuals of compression 'topk:0.1', not stc:0.1; ignored" in caplog.text
    assert other.keys == ["mine"]
    (tmp_path / "residual.safetensors").write_bytes(b"not safetensors at all")
    fresh = ErrorFeedback(comp)
    assert fresh.load(tmp_path) is False and fresh.keys == []
    from safetensors.numpy import save_file

    save_file({"k0/a": np.array([1.0, np.nan], F32)}, str(tmp_path / "residual.safetensors"),
              metadata={"compression": "topk:0.1"})
    assert fresh.load(tmp_path) is False
    save_file({"noslash": np.ones(2, F32)}, str(tmp_path / "residual.safetensors"),
              metadata={"compression": "topk:0.1"})
    assert fresh.load(tmp_path) is False
    save_file({"k0/a": np.ones(2, np.float64)}, str(tmp_path / "residual.safetensors"),
              metadata={"compression": "topk:0.1"})
    assert fresh.load(tmp_path) is False and fresh.keys == []


# -- chains of model changes --------------------------------------------------------


def _server_chain(comp, versions=4, first=0):
    """A server's model at versions first..first+versions and the steps between them, built with apply_steps."""
    rng = np.random.default_rng(11)
    w = {"conv": rng.standard_normal((3, 2, 2)).astype(F32), "bias": np.array(0.25, F32)}
    models, steps = {first: w}, []
    for v in range(first, first + versions):
        change = {n: F32(0.1) * rng.standard_normal(np.shape(a)).astype(F32) for n, a in w.items()}
        step = Step(v, v + 1, encode_delta(change, comp)[0])
        v2, w = apply_steps(v, w, [step], comp.method)
        assert v2 == v + 1
        models[v + 1] = w
        steps.append(step)
    return models, steps


@pytest.mark.parametrize("text", ["int8", "topk:0.3", "stc:0.3"])
def test_chains_round_trip_and_bring_any_held_version_up_to_date(text):
    comp = Compression.parse(text)
    models, steps = _server_chain(comp)
    body = chain_body(steps)
    assert body[:8] == b"FC\x01" + bytes([_code(comp.method)]) + struct.pack("<I", 4)
    assert len(body) == 8 + sum(12 + len(s.body) for s in steps)
    assert parse_chain(body, comp.method) == steps
    for held in range(5):
        held_weights = {n: a.copy() for n, a in models[held].items()}
        version, got = apply_steps(held, held_weights, parse_chain(body, comp.method), comp.method)
        assert version == 4
        assert all(got[n].dtype == F32 and got[n].tobytes() == models[4][n].tobytes() for n in got)
        assert all(held_weights[n].tobytes() == models[held][n].tobytes() for n in got)  # never modified
        assert all(got[n] is not held_weights[n] for n in got)


def test_apply_steps_refuses_a_gap_before_the_first_step():
    comp = Compression.parse("topk:0.5")
    models, steps = _server_chain(comp, first=3)
    with pytest.raises(ValueError, match=r"^model version 2 held; the changes start at 3$"):
        apply_steps(2, models[3], steps, comp.method)
    version, got = apply_steps(9, models[3], steps, comp.method)  # newer than the chain: nothing to do
    assert version == 9 and got["conv"].tobytes() == models[3]["conv"].tobytes()
    with pytest.raises(ValueError, match=r"^steps are not consecutive: version 4, then a step from 5$"):
        apply_steps(3, models[3], [steps[0], steps[2]], comp.method)
    bad = Step(3, 4, steps[0].body[:-1])
    with pytest.raises(ProtocolError, match=r"^tensor 'conv': \d+ index bytes and 24 bytes of values needs \d+ bytes, "
                                            r"\d+ left$") as err:
        apply_steps(3, models[3], [bad, *steps[1:]], comp.method)
    assert err.value.reason == "compressed-length"


def test_chain_body_refuses_what_it_cannot_write():
    comp = Compression.parse("int8")
    _, steps = _server_chain(comp)
    with pytest.raises(ValueError, match=r"^a chain needs at least one step$"):
        chain_body([])
    with pytest.raises(ValueError, match=r"^steps are not consecutive: version 1, then a step from 2$"):
        chain_body([steps[0], steps[2]])
    with pytest.raises(ValueError, match=r"^step 0 -> 1: the body is not a compressed delta$"):
        chain_body([Step(0, 1, b"FZ")])
    topk = Step(4, 5, encode_delta({"a": np.ones(3, F32)}, Compression.parse("topk"))[0])
    with pytest.raises(ValueError, match=r"^the step bodies mix methods \[1, 2\]; a chain has one$"):
        chain_body([*steps, topk])
    with pytest.raises(ValueError, match=r"^step version must be base \+ 1 = 3, got 4$"):
        Step(2, 4, b"")


def _chain(code=1, count=None, steps=((0, 1, b"FZ\x01\x01body"),), magic=b"FC"):
    out = struct.pack("<2sBBI", magic, 1, code, len(steps) if count is None else count)
    return out + b"".join(struct.pack("<III", b, v, len(body)) + body for b, v, body in steps)


@pytest.mark.parametrize(("body", "reason", "match"), [
    (b"FC\x01\x01\x01\x00\x00", "compressed-header", r"^chain of 7 bytes is shorter than the 8-byte header$"),
    (_chain(magic=b"FZ"), "compressed-header", r"^not a chain of changes \(magic b'FZ', version 1\)$"),
    (_chain(code=3), "compressed-method", r"^chain method byte 3, expected 1 \(int8\)$"),
    (_chain(count=0, steps=()), "compressed-count", r"^chain of 0 steps \(1 to 4\)$"),
    (_chain(steps=[(i, i + 1, b"x") for i in range(5)]), "compressed-count", r"^chain of 5 steps \(1 to 4\)$"),
    (_chain(count=2), "compressed-length", r"^2 steps need 24 bytes, 20 left$"),
    (_chain(steps=[(0, 1, b"x" * 20)])[:-1], "compressed-length", r"^step 0: a body of 20 bytes, 19 left$"),
    (_chain(count=2, steps=[(0, 1, b"x" * 12)]), "compressed-length", r"^step 1: its header runs past the end$"),
    (_chain(steps=[(0, 2, b"x")]), "compressed-index", r"^step 0: 0 -> 2 \(not consecutive\)$"),
    (_chain(steps=[(0, 1, b"x"), (2, 3, b"y")]), "compressed-index",
     r"^step 1: 2 -> 3 after version 1 \(not consecutive\)$"),
    (_chain(steps=[(2**32 - 1, 0, b"x")]), "compressed-index", r"^step 0: 4294967295 -> 0 \(not consecutive\)$"),
    (_chain() + b"\x00", "compressed-length", r"^1 trailing bytes after the last step$"),
])
def test_hostile_chains_are_refused(body, reason, match):
    with pytest.raises(ProtocolError, match=match) as err:
        parse_chain(body, Method.INT8, max_steps=4)
    assert err.value.reason == reason


def test_parse_chain_reads_steps_back_without_decoding_them():
    steps = parse_chain(_chain(steps=[(7, 8, b"a"), (8, 9, b"")]), Method.INT8)
    assert steps == [Step(7, 8, b"a"), Step(8, 9, b"")]
