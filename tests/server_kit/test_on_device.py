"""The torch path (server_kit/clustering/on_device.py) gives the numpy path's labels and distances, to the bit.

Here torch runs on the CPU ("torch-cpu"); the CUDA comparison runs only where torch sees a GPU.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from scipy.spatial.distance import pdist

import server_kit.clustering.on_device as on_device
from edge_sdk.bits import hamming_pdist, unpack_bits
from server_kit.clustering.centroids import nearest_centroids
from server_kit.clustering.distances import bits_pdist, block_clipped_pdist, sketch_pdist

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def packed_rows(rng: np.random.Generator, n: int, n_bits: int) -> np.ndarray:
    """Random packed rows, padding bits included (both paths must ignore them)."""
    return rng.integers(0, 256, size=(n, (n_bits + 7) // 8), dtype=np.uint8)


def group_means(packed: np.ndarray, n_bits: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` centroids: means of random groups of rows, the last a copy of the first (a duplicate)."""
    bits = unpack_bits(packed, n_bits).astype(np.float64)
    groups = rng.integers(0, k - 1, size=bits.shape[0])
    means = np.stack([bits[groups == g].mean(axis=0) for g in range(k - 1)])
    return np.vstack([means, means[:1]])


@needs_torch
@pytest.mark.parametrize("n_bits", [200, 203, 13])
def test_nearest_centroids_on_torch_give_the_numpy_labels(n_bits, monkeypatch):
    rng = np.random.default_rng(n_bits)
    packed = packed_rows(rng, 400, n_bits)
    centroids = group_means(packed, n_bits, 8, rng)
    want = nearest_centroids(packed, n_bits, centroids, device="cpu")
    monkeypatch.setattr(on_device, "DEVICE_CHUNK", 37)  # several chunks, the last one short
    got = on_device.nearest_centroids_torch(packed, n_bits, centroids, "cpu")
    assert got.dtype == np.intp
    assert np.array_equal(got, want)
    assert np.array_equal(nearest_centroids(packed, n_bits, centroids, device="torch-cpu"), want)
    assert len(np.unique(want)) >= 3 and 7 not in want  # varied labels; the duplicate never wins


@needs_torch
def test_ties_go_to_the_lower_label_on_both_paths():
    n_bits = 203
    rng = np.random.default_rng(5)
    x0 = rng.integers(0, 2, size=n_bits).astype(np.float64)

    def flipped(*at: int) -> np.ndarray:
        x = x0.copy()
        x[list(at)] = 1 - x[list(at)]
        return x

    near = flipped(3)  # at distance 1 from x0 ...
    near[4] += 1e-5 if x0[4] == 0 else -1e-5  # ... plus 1e-10: inside the tolerance (2.03e-7)
    off = flipped(3)
    off[4] += 1e-3 if x0[4] == 0 else -1e-3  # ... plus 1e-6: outside it
    centroids = np.stack([1 - x0, flipped(5), flipped(7), flipped(5), near, off, flipped(3)])
    rows = np.stack([x0, flipped(7), 1 - x0, flipped(5, 7), flipped(5), flipped(3, 9)])
    packed = np.packbits(rows.astype(np.uint8), axis=1)
    # x0: 1 from labels 1, 2, 3, 6 and 1 + 1e-10 from 4: label 1; flipped(5) sits on labels 1 and 3: 1;
    # flipped(3, 9): 1 + 1e-10 from 4, 1 from 6, 1 + 1e-6 from 5: the tie of 4 and 6 goes to 4
    want = [1, 2, 0, 1, 1, 4]
    assert nearest_centroids(packed, n_bits, centroids, device="cpu").tolist() == want
    assert on_device.nearest_centroids_torch(packed, n_bits, centroids, "cpu").tolist() == want
    assert nearest_centroids(packed[[5]], n_bits, centroids[[5, 6]], device="torch-cpu").tolist() == [1]


@needs_torch
@pytest.mark.parametrize("n_bits", [200, 203, 13])
def test_hamming_on_torch_gives_the_compiled_distances(n_bits, monkeypatch):
    rng = np.random.default_rng(n_bits)
    packed = packed_rows(rng, 90, n_bits)
    want = hamming_pdist(packed, n_bits)
    assert np.array_equal(want, np.rint(pdist(unpack_bits(packed, n_bits), "hamming") * n_bits))
    monkeypatch.setattr(on_device, "_PDIST_ENTRIES", 90 * 9)  # chunks of 9 rows
    got = on_device.hamming_pdist_torch(packed, n_bits, "cpu")
    assert got.dtype == np.int32 and np.array_equal(got, want)
    assert np.array_equal(sketch_pdist(packed, n_bits, device="torch-cpu"), want)
    assert np.array_equal(bits_pdist(unpack_bits(packed, n_bits), n_bits, device="torch-cpu"), want)


@needs_torch
@pytest.mark.parametrize("n_bits, block_bits, clip", [(200, 20, 9), (203, 7, 2), (210, 7, 3), (130, 65, 30)])
def test_block_clipped_on_torch_gives_the_numpy_distances(n_bits, block_bits, clip, monkeypatch):
    rng = np.random.default_rng(n_bits + block_bits)
    packed = packed_rows(rng, 70, n_bits)
    bits = unpack_bits(packed, n_bits)
    want = block_clipped_pdist(bits, block_bits, clip)
    monkeypatch.setattr(on_device, "_PDIST_ENTRIES", 70 * 11 * (n_bits // block_bits))  # chunks of 11 rows
    got = on_device.block_clipped_pdist_torch(packed, n_bits, block_bits, clip, "cpu")
    assert got.dtype == np.int32 and np.array_equal(got, want)
    assert 0 < want.min() and want.max() <= clip * (n_bits // block_bits)
    assert np.array_equal(sketch_pdist(packed, n_bits, block_bits, clip, device="torch-cpu"), want)
    assert np.array_equal(bits_pdist(bits, n_bits, block_bits, clip, device="torch-cpu"), want)
    default = bits_pdist(bits, n_bits, block_bits, device="cpu")  # the default clip, on both paths
    assert np.array_equal(sketch_pdist(packed, n_bits, block_bits, device="torch-cpu"), default)


@needs_torch
def test_small_cases_by_hand():
    packed = np.array([[0x00], [0xFF], [0x0F]], dtype=np.uint8)
    assert on_device.hamming_pdist_torch(packed, 8, "cpu").tolist() == [8, 4, 4]
    assert on_device.block_clipped_pdist_torch(packed, 8, 4, 1, "cpu").tolist() == [2, 1, 1]
    assert on_device.hamming_pdist_torch(packed[:1], 8, "cpu").shape == (0,)
    with pytest.raises(ValueError, match="^8 bits do not split into blocks of 3$"):
        on_device.block_clipped_pdist_torch(packed, 8, 3, 1, "cpu")


@needs_torch
def test_the_device_choice():
    import torch

    assert on_device.choose_device("cpu", 10**7) is None
    assert on_device.choose_device("torch-cpu", 1) == torch.device("cpu")
    assert on_device.choose_device("auto", on_device.AUTO_MIN_ROWS - 1) is None  # too small for the GPU
    with pytest.raises(ValueError, match=r"^device must be one of \['auto', 'cpu', 'cuda', 'torch-cpu'\], "
                                         r"got 'gpu'$"):
        on_device.choose_device("gpu", 1)
    if torch.cuda.is_available():
        assert on_device.choose_device("auto", 10**7) == torch.device("cuda")
    else:  # this machine: numpy, and "cuda" refused by name
        assert on_device.choose_device("auto", 10**7) is None
        with pytest.raises(ValueError, match="^device 'cuda' asked but torch sees no CUDA device$"):
            on_device.choose_device("cuda", 1)
        with pytest.raises(ValueError, match="^device 'cuda' asked but torch sees no CUDA device$"):
            nearest_centroids(np.zeros((2, 1), np.uint8), 8, np.zeros((1, 8)), device="cuda")


def test_without_torch_auto_is_numpy_and_the_torch_settings_are_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert on_device.choose_device("auto", 10**7) is None
    for device in ("cuda", "torch-cpu"):
        with pytest.raises(ValueError, match=f"^device '{device}' asked but torch is not installed$"):
            on_device.choose_device(device, 1)
    packed = np.array([[0x00], [0xFF]], dtype=np.uint8)
    assert nearest_centroids(packed, 8, np.array([[1.0] * 8, [0.0] * 8])).tolist() == [1, 0]


@pytest.mark.skipif(not _cuda(), reason="torch sees no CUDA device")
def test_cuda_gives_the_numpy_labels_and_distances():
    rng = np.random.default_rng(0)
    packed = packed_rows(rng, 100_000, 200)
    centroids = group_means(packed[:5000], 200, 8, rng)
    want = nearest_centroids(packed, 200, centroids, device="cpu")
    assert np.array_equal(nearest_centroids(packed, 200, centroids, device="cuda"), want)
    few = packed[:1500]
    assert np.array_equal(sketch_pdist(few, 200, device="cuda"), hamming_pdist(few, 200))
    assert np.array_equal(sketch_pdist(few, 200, 20, 9, device="cuda"),
                          block_clipped_pdist(unpack_bits(few, 200), 20, 9))
