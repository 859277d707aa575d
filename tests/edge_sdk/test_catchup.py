"""Exact merged catch-ups: bit-identical round trips, the bytes of a small case, sizes, hostile bodies."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from edge_sdk.compress.catchup import apply_catchup, catchup_body, catchup_size
from edge_sdk.protocol import ProtocolError

BIG = np.finfo(np.float32).max
TINY = np.float32(1e-45)  # the smallest subnormal


def _spec(weights):
    return {n: (a.shape, "float32") for n, a in weights.items()}


def _round_trip(old, new):
    body = catchup_body(old, new)
    kept = {n: a.copy() for n, a in old.items()}
    got = apply_catchup(old, body, _spec(old))
    assert sorted(got) == sorted(new) and len(body) == catchup_size(old, new)
    for n, a in new.items():
        assert got[n].dtype == np.float32 and got[n].shape == a.shape
        np.testing.assert_array_equal(got[n].view(np.uint32), a.view(np.uint32), err_msg=n)
        np.testing.assert_array_equal(old[n].view(np.uint32), kept[n].view(np.uint32))  # old never modified
    return body


def test_round_trips_are_bit_identical_across_sizes_and_special_values():
    rng = np.random.default_rng(0)
    old, new = {}, {}
    for n in (0, 1, 255, 256, 257, 3000):
        a = rng.normal(scale=0.05, size=n).astype(np.float32)
        old[f"t{n}"], new[f"t{n}"] = a, (a + rng.normal(scale=1e-3, size=n).astype(np.float32)).astype(np.float32)
    special = np.array([0.0, -0.0, 0.0, -0.0, TINY, -TINY, 1.0, -BIG, BIG, 3e-39], np.float32)
    old["s"], new["s"] = special, np.array([-0.0, 0.0, 0.0, -0.0, -TINY, 2e-39, -1.0, BIG, -BIG, 3e-39], np.float32)
    old["same"] = new["same"] = rng.normal(size=(40, 30)).astype(np.float32)
    old["m"], new["m"] = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(scale=1e30, size=(3, 4)).astype(np.float32)
    _round_trip(old, new)


def test_unchanged_tensors_cost_a_width_byte_per_block():
    w = {"a": np.ones(1000, np.float32), "b": np.zeros((20, 20), np.float32)}
    body = _round_trip(w, {n: a.copy() for n, a in w.items()})
    assert len(body) == 7 + (4 + 4) + (2 + 4)  # header; 4 widths of 0 and m = 0; 2 widths and m = 0


def test_the_bytes_of_a_hand_worked_catch_up():
    old = {"a": np.array([1.0, 0.0], np.float32)}
    new = {"a": np.array([np.nextafter(np.float32(1), np.float32(2)), -0.0], np.float32)}
    # d = [+1, -1], zigzag [2, 1]: width 2, bits 0,1 | 1,0 least significant first: 0b0110
    assert _round_trip(old, new) == b"FU\x01" + struct.pack("<I", 1) + b"\x02" + struct.pack("<I", 1) + b"\x06"


def test_a_change_of_1e3_on_85822_weights_costs_96_percent_of_the_float32_model():
    """Weights ~N(0, 0.05) each moved by ~N(0, 1e-3): 330,469 bytes against 343,288 (blocks hold sign crossings)."""
    rng = np.random.default_rng(0)
    old = {"w": rng.normal(scale=0.05, size=85_822).astype(np.float32)}
    new = {"w": (old["w"] + rng.normal(scale=1e-3, size=85_822).astype(np.float32)).astype(np.float32)}
    size = catchup_size(old, new)
    assert 0.9 * 343_288 < size < 0.97 * 343_288
    smaller = {"w": (old["w"] + rng.normal(scale=1e-5, size=85_822).astype(np.float32)).astype(np.float32)}
    assert len(_round_trip(old, smaller)) < 0.75 * 343_288


def test_the_sender_refuses_what_it_cannot_encode():
    a = {"a": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"^tensor 'a' holds NaN or Inf$"):
        catchup_body(a, {"a": np.array([0, np.inf, 0], np.float32)})
    with pytest.raises(ValueError, match=r"^tensor 'a': float32 only, got float32 and float64$"):
        catchup_body(a, {"a": np.zeros(3)})
    with pytest.raises(ValueError, match=r"^tensor 'a': shapes \(3,\) and \(4,\) differ$"):
        catchup_body(a, {"a": np.zeros(4, np.float32)})


def _refused(old, body, reason, message):
    with pytest.raises(ProtocolError, match=message) as e:
        apply_catchup(old, body, _spec(old))
    assert e.value.reason == reason


def test_hostile_bodies_are_refused_with_their_reason():
    old = {"a": np.array([1.0, 0.0], np.float32)}
    good = catchup_body(old, {"a": np.array([1.5, -0.0], np.float32)})
    head = b"FU\x01" + struct.pack("<I", 1)
    _refused(old, good[:5], "compressed-header", r"^body of 5 bytes is shorter than the 7-byte header$")
    _refused(old, b"FZ" + good[2:], "compressed-header", r"^not a catch-up \(magic b'FZ', version 1\)$")
    _refused(old, good[:2] + b"\x01" + struct.pack("<I", 2) + good[7:], "compressed-count",
             r"^body holds 2 tensors, the spec 1$")
    _refused(old, good[:-1], "compressed-length", r"^tensor 'a': \d+ packed bytes needs \d+ bytes, \d+ left$")
    _refused(old, good + b"\x00", "compressed-length", r"^1 trailing bytes after the last tensor$")
    _refused(old, head + b"\x22" + struct.pack("<I", 9) + bytes(9), "compressed-value",
             r"^tensor 'a': a block width of 34 \(at most 33\)$")
    _refused(old, head + b"\x02" + struct.pack("<I", 2) + b"\x06\x00", "compressed-count",
             r"^tensor 'a': m is 2, its block widths give 1$")
    _refused(old, head + b"\x02" + struct.pack("<I", 1) + b"\x86", "compressed-value",
             r"^tensor 'a': padding bits set in the last packed byte$")
    _refused(old, head + b"\x03" + struct.pack("<I", 1) + b"\x0a", "compressed-value",
             r"^tensor 'a': a block width above the bits of its largest value$")
    big = {"a": np.array([BIG, -BIG], np.float32)}  # +1 and -1 in ord: +Inf and -Inf
    _refused(big, head + b"\x02" + struct.pack("<I", 1) + b"\x06", "compressed-value",
             r"^tensor 'a': a result outside the finite float32 range$")
