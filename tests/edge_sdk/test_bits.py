"""The bit kernels: compiled vs numpy agreement, exact bits, flip statistics, Hamming."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from scipy.spatial.distance import cdist, pdist

from edge_sdk import _bits_numpy, bits

HAS_EXT = "cython" in bits.available_backends()
needs_ext = pytest.mark.skipif(not HAS_EXT, reason="compiled kernel not built")

SHAPES = [
    (1, 1, 1),
    (1, 1, 7),
    (1, 3, 3),
    (2, 10, 20),  # 200 bits: MNIST sketch
    (3, 62, 20),  # 1,240 bits: FEMNIST sketch
    (4, 1, 64),
    (2, 1, 65),
    (5, 7, 13),  # 91 bits
    (1, 10, 768),  # 7,680 bits: CIFAR-10 sketch
    (3, 2, 1),
]


def test_compiled_backend_is_the_default_when_built():
    if os.environ.get("FEDSKETCH_PURE_NUMPY", "") not in ("", "0"):
        assert bits.BACKEND == "numpy"
    elif os.environ.get("FEDSKETCH_ALLOW_NUMPY"):
        pytest.skip("pure-numpy install allowed by FEDSKETCH_ALLOW_NUMPY")
    else:
        # make test builds the extension; a silent fallback would hide a broken build
        assert bits.BACKEND == "cython", "edge_sdk._bits was not built"


def test_generator_pinned_to_splitmix64():
    # splitmix64 seeded with 0 first returns 0xE220A8397B1DCDAF (published reference value)
    gamma = 0x9E3779B97F4A7C15
    assert int(_bits_numpy.mix64(gamma)) == 0xE220A8397B1DCDAF
    if HAS_EXT:
        from edge_sdk import _bits

        assert _bits.mix64(gamma) == 0xE220A8397B1DCDAF
        for z in (0, 1, 2**63, 2**64 - 1, 123456789):
            assert _bits.mix64(z) == int(_bits_numpy.mix64(z))


@needs_ext
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.3333, 0.5])
def test_compiled_and_numpy_agree_bit_for_bit(shape, dtype, p):
    rng = np.random.default_rng(hash((shape, p)) % 2**32)
    v = rng.normal(size=shape).astype(dtype)
    v[0, 0, :] = 1.25  # a constant vector
    for seed in (0, 7, 2**64 - 1):
        a = bits.quantize_pack(v, p, seed, backend="cython")
        b = bits.quantize_pack(v, p, seed, backend="numpy")
        assert a.dtype == np.uint8 and a.shape == (shape[0], math.ceil(shape[1] * shape[2] / 8))
        np.testing.assert_array_equal(a, b)


def test_exact_bits_hand_computed():
    # [0, 1, .5, .6, .2] -> normalised identical -> round (ties to even) -> 0 1 0 1 0
    # second vector [3, 3, 3, 3, 3] is constant -> zeros; 10 bits -> 2 bytes
    v = np.array([[0.0, 1.0, 0.5, 0.6, 0.2], [3.0, 3.0, 3.0, 3.0, 3.0]])
    for backend in bits.available_backends():
        out = bits.quantize_pack(v, 0.0, 1, backend=backend)
        assert out.tolist() == [0b01010000, 0b00000000]
    # 9 bits: normalised 0 1 .75 .25 .5 .525 1 0 .975 -> 0 1 1 0 0 1 1 0 | 1 + 7 zero pad bits
    w = np.array([[-2.0, 2.0, 1.0, -1.0, 0.0, 0.1, 2.0, -2.0, 1.9]])
    for backend in bits.available_backends():
        assert bits.quantize_pack(w, 0.0, 1, backend=backend).tolist() == [0b01100110, 0b10000000]


@pytest.mark.parametrize("backend", bits.available_backends())
def test_p_zero_is_plain_rounding(backend):
    rng = np.random.default_rng(3)
    v = rng.random((6, 10, 20))
    lo = v.min(axis=2, keepdims=True)
    norm = (v - lo) / (v.max(axis=2, keepdims=True) - lo)
    expected = np.packbits(np.round(norm).astype(np.uint8).reshape(6, -1), axis=1)
    for seed in (1, 99):
        np.testing.assert_array_equal(bits.quantize_pack(v, 0.0, seed, backend=backend), expected)


@pytest.mark.parametrize("backend", bits.available_backends())
@pytest.mark.parametrize("p", [0.01, 0.1, 0.2, 0.5])
def test_flip_rate_within_binomial_bound(backend, p):
    rng = np.random.default_rng(11)
    v = rng.normal(size=(50, 100, 40))  # 200,000 bits
    n = v.size
    clean = bits.unpack_bits(bits.quantize_pack(v, 0.0, 5, backend=backend), 4000)
    noisy = bits.unpack_bits(bits.quantize_pack(v, p, 5, backend=backend), 4000)
    flips = int((clean != noisy).sum())
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(flips - n * p) < 5 * sigma, (flips, n * p, sigma)
    # flips must be spread evenly over bit positions, not stuck to some of them
    per_position = (clean != noisy).mean(axis=0)
    assert per_position.min() > p - 6 * math.sqrt(p * (1 - p) / 50) - 1e-9


def test_seed_reproducible_and_os_seed_fresh():
    v = np.random.default_rng(0).normal(size=(10, 20))
    a = bits.quantize_pack(v, 0.2, 42)
    assert np.array_equal(a, bits.quantize_pack(v, 0.2, 42))
    assert not np.array_equal(a, bits.quantize_pack(v, 0.2, 43))
    fresh = {bits.quantize_pack(v, 0.2).tobytes() for _ in range(5)}
    assert len(fresh) == 5  # 200 bits at P=0.2: a repeat is astronomically unlikely


def test_batch_equals_one_by_one_with_offset_streams():
    v = np.random.default_rng(1).normal(size=(4, 3, 5))
    batch = bits.quantize_pack(v, 0.0, 9)
    for i in range(4):
        np.testing.assert_array_equal(batch[i], bits.quantize_pack(v[i], 0.0, 9))
    noisy = bits.quantize_pack(v, 0.5, 9)
    assert len({row.tobytes() for row in noisy}) == 4  # each sketch has its own stream


@pytest.mark.parametrize(
    ("vectors", "p", "seed", "message"),
    [
        (np.array([[np.nan, 1.0]]), 0.1, 1, "NaN or Inf"),
        (np.array([[np.inf, 1.0]]), 0.1, 1, "NaN or Inf"),
        (np.ones((2, 3), dtype=np.int64), 0.1, 1, "float32 or float64, got dtype int64"),
        (np.ones(5), 0.1, 1, r"shape \(groups, dim\)"),
        (np.ones((2, 0)), 0.1, 1, "at least one group and one dimension"),
        (np.ones((2, 3)), 0.6, 1, r"flip_prob must be in \[0, 0.5\], got 0.6"),
        (np.ones((2, 3)), -0.1, 1, r"flip_prob must be in \[0, 0.5\]"),
        (np.ones((2, 3)), float("nan"), 1, r"flip_prob must be in \[0, 0.5\]"),
        (np.ones((2, 3)), 0.1, -1, r"seed must be an integer in \[0, 2\*\*64\)"),
        (np.ones((2, 3)), 0.1, 2**64, r"seed must be an integer in \[0, 2\*\*64\)"),
        (np.ones((2, 3)), 0.1, 1.5, "seed must be an integer"),
    ],
)
def test_quantize_pack_rejects_bad_input(vectors, p, seed, message):
    with pytest.raises(ValueError, match=message):
        bits.quantize_pack(vectors, p, seed)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend 'fortran' is not available"):
        bits.quantize_pack(np.ones((1, 2)), 0.0, 1, backend="fortran")


@pytest.mark.parametrize("backend", bits.available_backends())
@pytest.mark.parametrize("n_bits", [1, 7, 8, 63, 64, 65, 200, 1240])
@pytest.mark.parametrize("n", [1, 2, 17])
def test_hamming_pdist_equals_scipy(backend, n_bits, n):
    rng = np.random.default_rng(n_bits * 31 + n)
    x = rng.integers(0, 2, size=(n, n_bits)).astype(bool)
    d = bits.hamming_pdist(np.packbits(x, axis=1), n_bits, backend=backend)
    assert d.dtype == np.int32
    expected = pdist(x, "hamming") * n_bits if n > 1 else np.empty(0)
    np.testing.assert_array_equal(d, np.rint(expected).astype(np.int32))


@pytest.mark.parametrize("backend", bits.available_backends())
@pytest.mark.parametrize("n_bits", [5, 64, 200, 1240])
def test_hamming_cdist_equals_scipy(backend, n_bits):
    rng = np.random.default_rng(n_bits)
    a = rng.integers(0, 2, size=(9, n_bits)).astype(bool)
    b = rng.integers(0, 2, size=(4, n_bits)).astype(bool)
    d = bits.hamming_cdist(np.packbits(a, axis=1), np.packbits(b, axis=1), n_bits, backend=backend)
    np.testing.assert_array_equal(d, np.rint(cdist(a, b, "hamming") * n_bits).astype(np.int32))


def test_hamming_ignores_padding_bits_and_checks_lengths():
    a = np.array([[0b10100000]], dtype=np.uint8)
    b = np.array([[0b10111111]], dtype=np.uint8)  # differs only in padding past bit 3
    assert bits.hamming_cdist(a, b, n_bits=3)[0, 0] == 0
    assert bits.hamming_cdist(a, b)[0, 0] == 5  # without n_bits every bit counts
    with pytest.raises(ValueError, match="200 bits need 25 bytes per row, got 24"):
        bits.hamming_pdist(np.zeros((3, 24), dtype=np.uint8), n_bits=200)
    with pytest.raises(ValueError, match="rows differ in length: 3 vs 4 bytes"):
        bits.hamming_cdist(np.zeros((1, 3), np.uint8), np.zeros((1, 4), np.uint8))
    with pytest.raises(ValueError, match="2-D uint8 array"):
        bits.hamming_pdist(np.zeros((3, 4), dtype=np.int64))


def test_unpack_and_pack_roundtrip():
    x = np.random.default_rng(2).integers(0, 2, size=(3, 21)).astype(np.uint8)
    packed = bits.pack_bits(x)
    assert packed.shape == (3, 3)
    np.testing.assert_array_equal(bits.unpack_bits(packed, 21), x)
    with pytest.raises(ValueError, match="21 bits need 3 bytes per row, got 4"):
        bits.unpack_bits(np.zeros((3, 4), np.uint8), 21)
    with pytest.raises(ValueError, match="only 0 and 1"):
        bits.pack_bits(np.array([0, 2, 1]))
