"""A device's own drift signal (edge_sdk.drift) and what repeated sketches reveal to the server."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_sdk.bits import quantize_pack, unpack_bits
from edge_sdk.drift import DriftWatch, noise_margin_bits
from edge_sdk.sketch import Sketcher


class LinearEncoder:
    """A fixed random projection of 16 features to 8 (no ONNX needed)."""

    latent_dim = 8

    def __init__(self) -> None:
        self.w = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)

    def encode(self, x):
        return np.asarray(x, dtype=np.float32).reshape(len(x), -1) @ self.w


def _data(shift: float, seed: int = 0, n: int = 200):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 4
    x = rng.normal(size=(n, 16)).astype(np.float32) + shift * (y[:, None] + 1) * np.linspace(-1, 1, 16)
    return x.astype(np.float32), y


def test_noise_margin_is_z_standard_deviations_of_two_independent_flips():
    q = 2 * 0.1 * 0.9
    assert noise_margin_bits(200, 0.1) == pytest.approx(4 * math.sqrt(200 * q * (1 - q)))
    assert noise_margin_bits(200, 0.1, 2.0) == pytest.approx(2 * math.sqrt(200 * q * (1 - q)))
    assert round(noise_margin_bits(200, 0.1), 2) == 21.73
    with pytest.raises(ValueError, match="^z must be a positive number, got 0$"):
        noise_margin_bits(200, 0.1, 0)


def test_unchanged_data_is_never_reported_and_gives_the_same_bits():
    sk = Sketcher(LinearEncoder(), 4, 0.1, seed=7)
    watch = DriftWatch(sk)
    x, y = _data(1.0)
    first = watch.check(x, y)
    assert first is not None  # nothing sent yet: the first sketch always goes
    watch.sent(first)
    for _ in range(5):
        assert watch.check(x, y) is None
    assert sk.sketch(x, y).bits == first.bits  # averaging repeated sketches strips no flip noise


def test_changed_data_is_reported_and_the_server_sees_exactly_the_changed_bits():
    sk = Sketcher(LinearEncoder(), 4, 0.1, seed=7)
    watch = DriftWatch(sk)
    x, y = _data(1.0)
    watch.sent(sk.sketch(x, y))
    x2, y2 = _data(-1.0, seed=1)  # another kind of data
    new = watch.check(x2, y2)
    assert new is not None and watch.last.hamming(new) > watch.threshold_bits
    # the flip key is the same, so the two sketches differ exactly where the unflipped bits differ
    m1, _ = sk.class_means(x, y)
    m2, _ = sk.class_means(x2, y2)
    raw1 = unpack_bits(quantize_pack(m1, 0.0, 7), 32)
    raw2 = unpack_bits(quantize_pack(m2, 0.0, 7), 32)
    seen = np.bitwise_xor(unpack_bits(np.frombuffer(watch.last.bits, np.uint8), 32),
                          unpack_bits(np.frombuffer(new.bits, np.uint8), 32))
    assert np.array_equal(seen, np.bitwise_xor(raw1, raw2))
    # a few more samples of the same kind stay below the threshold
    x3, y3 = _data(1.0, seed=2, n=220)
    small = sk.sketch(x3, y3)
    assert watch.last.hamming(small) <= watch.threshold_bits and watch.check(x3, y3) is None
