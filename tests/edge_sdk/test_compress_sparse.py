"""Chunked encoding (the radix select of top-k and STC, int8 by chunks), in place and not, and the float16 residual."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edge_sdk.compress import Compression, ErrorFeedback, decode_delta, encode_delta
from edge_sdk.compress.blocks import CHUNK
from edge_sdk.compress.sparse import select

F32 = np.float32
ALL = ["int8", "int4", "sign", "topk:0.01", "topk:0.3", "stc:0.01", "stc:0.3"]


def reference_select(x: np.ndarray, k: int) -> list[int]:
    """The k largest |x|, ties to the lowest index, by a plain sort."""
    order = np.lexsort((np.arange(x.size), -np.abs(x.astype(np.float64))))
    return sorted(order[:k].tolist())


@pytest.mark.parametrize("n", [1, 7, CHUNK - 1, CHUNK + 3, 2 * CHUNK + 5])
def test_select_takes_the_largest_magnitudes_and_the_lowest_indexed_ties_across_chunks(n):
    rng = np.random.default_rng(n)
    x = rng.integers(-3, 4, n).astype(F32)  # few magnitudes: many ties, straddling chunks
    x[rng.random(n) < 0.1] = -0.0
    x[rng.random(n) < 0.01] = F32(1e-45)  # the smallest subnormal
    for k in sorted({0, 1, n // 3, n // 2, n - 1, n}):
        assert select(x, k).tolist() == reference_select(x, k), k
    y = (rng.standard_normal(n) * 1e-30).astype(F32)
    y[::97] = F32(3.0e38)
    for k in sorted({1, n // 100 + 1, n // 2}):
        assert select(y, k).tolist() == reference_select(y, k)


@pytest.mark.parametrize("text", ALL)
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 1000, 2 * CHUNK + 7])
def test_bodies_decode_to_what_was_sent_and_in_place_leaves_exactly_the_rest(text, n):
    comp = Compression.parse(text)
    rng = np.random.default_rng(n)
    x = (rng.standard_t(3, size=n) * 1e-3).astype(F32)
    if n > 3:
        x[:3] = [0.0, -0.0, x[3]]  # zeros of both signs and a tie
    body, sent = encode_delta({"w": x}, comp)
    back = decode_delta(body, {"w": ((n,), "float32")}, comp.method)
    assert back["w"].tobytes() == sent["w"].tobytes()
    rest = x.copy()
    lean, none = encode_delta({"w": rest}, comp, keep_sent=False)
    assert lean == body and none is None
    assert rest.tobytes() == np.subtract(x, sent["w"]).tobytes()


def test_in_place_refuses_arrays_it_cannot_overwrite():
    comp = Compression.parse("topk:0.1")
    for bad in (np.ones(10), np.ones((4, 4), F32).T, np.ones(10, F32)[::2]):
        with pytest.raises(ValueError, match=r"^tensor 'w': encoding in place needs a writeable C-contiguous float32 array$"):
            encode_delta({"w": bad}, comp, keep_sent=False)


@pytest.mark.parametrize("text", ALL)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_fifty_rounds_sent_trail_the_deltas_by_one_residual(text, dtype):
    """In place (a device): what was sent (decoded from the bodies) plus the residual is the sum of the deltas.

    With a float32 residual up to float32 rounding; with float16, each round's rest is rounded to
    float16 once, so the gap grows by at most half a float16 step of that rest a round (an absolute
    2**-25 where the rest is subnormal in float16: int8's rests of deltas near 1e-3 are).
    """
    comp = Compression.parse(text)
    fb = ErrorFeedback(comp, residual_dtype=dtype)
    rng = np.random.default_rng(5)
    n = 700
    total_delta, total_sent, slack = np.zeros(n), np.zeros(n), np.zeros(n)
    for _ in range(50):
        d = (rng.normal(size=n) * 1e-3).astype(F32)
        total_delta += d
        body, none = fb.compress("c0", {"w": d.copy()}, keep_sent=False)
        assert none is None
        total_sent += decode_delta(body, {"w": ((n,), "float32")}, comp.method)["w"]
        rest = np.abs(fb._residual["c0"]["w"].astype(np.float64))
        # half a step of the stored rest (float16 below 2**-14 is subnormal: steps of 2**-24), plus float32 rounding
        slack += rest * 2.0**-11 + 2.0**-25 if dtype is np.float16 else rest * 2.0**-23 + 1e-12
        slack += np.abs(d) * 2.0**-22
    residual = fb._residual["c0"]["w"]
    assert residual.dtype == dtype and fb.residual_bytes() == n * np.dtype(dtype).itemsize
    gap = np.abs(total_sent + residual.astype(np.float64) - total_delta)
    assert (gap <= slack).all(), float((gap / slack).max())
    assert np.linalg.norm(residual.astype(np.float64)) < np.linalg.norm(total_delta)


@pytest.mark.parametrize("text", ["int8", "sign", "stc:0.05"])
def test_in_place_and_kept_sent_give_the_same_bodies_round_after_round(text):
    comp = Compression.parse(text)
    kept, lean = ErrorFeedback(comp), ErrorFeedback(comp)
    rng = np.random.default_rng(8)
    for _ in range(5):
        d = {"a": rng.normal(size=(30, 20)).astype(F32), "s": np.array(rng.normal(), F32)}
        body, sent = kept.compress("k", d)
        assert lean.compress("k", {n: v.copy() for n, v in d.items()}, keep_sent=False) == (body, None)
        assert sent["s"].shape == () and sent["a"].shape == (30, 20)
    assert kept.residual_norm("k") == lean.residual_norm("k")


def test_a_float16_residual_is_clipped_to_its_range_with_one_warning(caplog):
    fb = ErrorFeedback(Compression.parse("topk:0.01"), residual_dtype=np.float16)
    d = np.zeros(1000, F32)
    d[:20] = [1e6, -1e6] * 10  # k = 10: ten of these stay behind
    with caplog.at_level(logging.WARNING, logger="edge_sdk.compress.feedback"):
        fb.compress("k", {"w": d.copy()}, keep_sent=False)
        fb.compress("k", {"w": d.copy()}, keep_sent=False)
    assert caplog.text.count("a residual beyond float16's range (65504) clipped") == 1
    r = fb._residual["k"]["w"]
    assert r.dtype == np.float16 and np.isfinite(r).all() and np.abs(r).max() == 65504
    with pytest.raises(ValueError, match=r"^residual_dtype must be float32 or float16, got <class 'numpy.float64'>$"):
        ErrorFeedback(Compression.parse("int8"), residual_dtype=np.float64)


def test_residual_files_are_read_into_either_dtype(tmp_path, caplog):
    comp = Compression.parse("sign")
    wide = ErrorFeedback(comp)
    x = np.array([1e6, 0.0, 0.0, 0.0, 1.0, -3.0], F32)  # a block of mean 250,001 / 6: rests beyond float16
    wide.compress("k", {"w": x})
    wide.save(tmp_path)
    narrow = ErrorFeedback(comp, residual_dtype=np.float16)
    with caplog.at_level(logging.WARNING, logger="edge_sdk.compress.feedback"):
        assert narrow.load(tmp_path)
    assert "clipped" in caplog.text
    r32, r16 = wide._residual["k"]["w"], narrow._residual["k"]["w"]
    assert r16.dtype == np.float16 and r16.tolist() == np.clip(r32, -65504, 65504).astype(np.float16).tolist()
    narrow.save(tmp_path / "16")
    again = ErrorFeedback(comp)
    assert again.load(tmp_path / "16") and again._residual["k"]["w"].dtype == F32
    assert again._residual["k"]["w"].tolist() == r16.astype(F32).tolist()  # float16 to float32: exact
