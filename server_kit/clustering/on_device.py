"""The packed-sketch distances and the nearest-centroid rule in torch, on a GPU (or torch's CPU).

Same results as the numpy path, on any torch device:

- :func:`nearest_centroids_torch` is :func:`~server_kit.clustering.centroids.nearest_centroids`:
  the squared Euclidean distance ``|x| - 2 x.c + |c|^2`` in float64, ties
  (within ``1e-9 * max(1, n_bits)``) to the lower label. The packed bytes go
  to the device :data:`DEVICE_CHUNK` rows at a time and are unpacked there
  (shift and mask, most significant bit first, as :func:`numpy.unpackbits`).
- :func:`hamming_pdist_torch` and :func:`block_clipped_pdist_torch` are
  :func:`edge_sdk.bits.hamming_pdist` and
  :func:`~server_kit.clustering.distances.block_clipped_pdist`: condensed
  int32 distances in :func:`scipy.spatial.distance.pdist` order, each block's
  Hamming distance as ``|a| + |b| - 2 a.b`` (0/1 products of small integers,
  exact in float32).

:func:`choose_device` turns a setting (:data:`DEVICES`) into a torch device,
or ``None`` for the numpy path. torch is optional: this module imports it only
when a torch path runs, and ``"auto"`` falls back to numpy without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from edge_sdk.training.torch_support import resolve_device
from edge_sdk.validation import check_choice

from .params import check_packed

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "AUTO_MIN_PDIST_ROWS",
    "AUTO_MIN_ROWS",
    "DEVICES",
    "DEVICE_CHUNK",
    "block_clipped_pdist_torch",
    "choose_device",
    "hamming_pdist_torch",
    "nearest_centroids_torch",
]

#: The settings of ``device``: ``"auto"`` (CUDA when it is there and the work
#: is large enough, else numpy), ``"cpu"`` (numpy), ``"cuda"`` (torch on the
#: GPU, or a ValueError) and ``"torch-cpu"`` (the torch code on the CPU: tests, measurements).
DEVICES = ("auto", "cpu", "cuda", "torch-cpu")

#: Rows from which ``"auto"`` sends the nearest-centroid rule to the GPU. A
#: guess (the copies and the start of CUDA cost a fixed time), to be measured by ``benchmarks/gpu.py``.
AUTO_MIN_ROWS = 1 << 16

#: Rows (clients) from which ``"auto"`` sends the pairwise distances to the
#: GPU (8 million pairs). A guess too, to be measured by ``benchmarks/gpu.py``.
AUTO_MIN_PDIST_ROWS = 1 << 12

#: Packed rows sent to the device at a time by :func:`nearest_centroids_torch`:
#: 2**18 rows of 200 bits are 420 MB of float64 bits there.
DEVICE_CHUNK = 1 << 18

#: Float32 entries of a chunk's ``blocks x rows x clients`` distances in the pdist functions (128 MB).
_PDIST_ENTRIES = 1 << 25


def choose_device(device: str, n_rows: int, min_rows: int = AUTO_MIN_ROWS) -> torch.device | None:
    """The torch device that ``device`` (one of :data:`DEVICES`) asks for ``n_rows`` rows, or None for numpy.

    ``"auto"`` gives CUDA when torch is importable, sees a CUDA device and
    ``n_rows >= min_rows``; it looks at the row count first, so a small job
    never imports torch.
    """
    check_choice(device, "device", DEVICES)
    if device == "cpu" or (device == "auto" and n_rows < min_rows):
        return None
    try:
        import torch
    except ImportError:
        if device == "auto":
            return None
        raise ValueError(f"device {device!r} asked but torch is not installed") from None
    if device == "torch-cpu":
        return torch.device("cpu")
    return torch.device("cuda") if resolve_device(device) == "cuda" else None  # the one rule of auto and cuda


def _unpack(packed: torch.Tensor, n_bits: int) -> torch.Tensor:
    """uint8 0/1 values of the first ``n_bits`` bits of each packed row, most significant bit first."""
    import torch

    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(packed.shape[0], -1)[:, :n_bits]


def _to_device(rows: np.ndarray, dev: torch.device) -> torch.Tensor:
    """A numpy array copied onto ``dev`` (a writeable contiguous host copy first when it must be)."""
    import torch

    return torch.from_numpy(np.require(rows, requirements=["C", "W"])).to(dev)


def nearest_centroids_torch(packed: np.ndarray, n_bits: int, centroids: np.ndarray,
                            device: Any) -> np.ndarray:
    """:func:`~server_kit.clustering.centroids.nearest_centroids` on a torch device: the same labels (intp).

    ``device``: a ``torch.device`` or its name (``"cuda"``, ``"cpu"``). The
    centroids' squared norms are computed by numpy as the numpy path does, so
    both paths add the same ``|c|^2``; ``x.c`` may differ in its last bits
    (another summation order), far below the tie tolerance.
    """
    import torch

    dev = torch.device(device)
    n_bits = int(n_bits)
    p = check_packed(packed, n_bits)
    c = np.asarray(centroids)
    cc = torch.from_numpy(np.einsum("ij,ij->i", c, c).astype(np.float64)).to(dev)[None, :]
    ct = _to_device(np.asarray(c, dtype=np.float64).T.copy(), dev)  # (n_bits, k)
    k = c.shape[0]
    labels = torch.arange(k, device=dev)
    tol = 1e-9 * max(1, n_bits)
    out = np.empty(p.shape[0], dtype=np.intp)
    for i in range(0, p.shape[0], DEVICE_CHUNK):
        x = _unpack(_to_device(p[i : i + DEVICE_CHUNK], dev), n_bits).to(torch.float64)
        d = x.sum(dim=1, keepdim=True) - 2.0 * (x @ ct) + cc
        near = d <= d.amin(dim=1, keepdim=True) + tol
        lowest = torch.where(near, labels, k).amin(dim=1)  # the lowest label among the nearest
        out[i : i + x.shape[0]] = lowest.cpu().numpy()
    return out


def hamming_pdist_torch(packed: np.ndarray, n_bits: int, device: Any) -> np.ndarray:
    """:func:`edge_sdk.bits.hamming_pdist` on a torch device: the same int32 distances (padding bits ignored)."""
    import torch

    n_bits = int(n_bits)
    dev = torch.device(device)
    bits = _unpack(_to_device(check_packed(packed, n_bits), dev), n_bits)
    return _condensed(bits, n_bits, None)


def block_clipped_pdist_torch(packed: np.ndarray, n_bits: int, block_bits: int, noise_clip: int,
                              device: Any) -> np.ndarray:
    """:func:`~server_kit.clustering.distances.block_clipped_pdist` of packed rows on a torch device.

    The same int32 distances: the sum over blocks of ``min(Hamming of the
    block, noise_clip)``, pdist order. The bits are unpacked on the device.
    """
    import torch

    n_bits, block_bits = int(n_bits), int(block_bits)
    if n_bits % block_bits:
        raise ValueError(f"{n_bits} bits do not split into blocks of {block_bits}")
    dev = torch.device(device)
    bits = _unpack(_to_device(check_packed(packed, n_bits), dev), n_bits)
    return _condensed(bits, block_bits, int(noise_clip))


def _condensed(bits: torch.Tensor, block_bits: int, clip: int | None) -> np.ndarray:
    """Condensed int32 distances of 0/1 rows on their device: per block ``|a| + |b| - 2 a.b``, clipped, summed.

    Rows ``start:stop`` are compared with rows ``start + 1:`` only; their
    pairs ``(i, j > i)`` are, in row-major order, one stretch of the condensed
    vector, so a mask picks them out of the chunk in pdist order.
    """
    import torch

    n = bits.shape[0]
    out = np.empty(n * (n - 1) // 2, dtype=np.int32)
    if n < 2:
        return out
    dev = bits.device
    blocks = bits.shape[1] // block_bits
    ones = bits.to(torch.float32).reshape(n, blocks, block_bits).permute(1, 0, 2).contiguous()
    counts = ones.sum(dim=2)  # (blocks, n): exact small integers
    step = max(1, _PDIST_ENTRIES // (blocks * n))
    pos = 0
    for start in range(0, n - 1, step):
        stop = min(n - 1, start + step)
        h = torch.bmm(ones[:, start:stop], ones[:, start + 1:].transpose(1, 2))  # (blocks, rows, n - start - 1)
        h.mul_(-2.0).add_(counts[:, start:stop, None]).add_(counts[:, None, start + 1:])
        if clip is not None:
            h.clamp_(max=float(clip))
        total = h.sum(dim=0)
        later = (torch.arange(start + 1, n, device=dev)[None, :]
                 > torch.arange(start, stop, device=dev)[:, None])
        piece = total[later].round().to(torch.int32).cpu().numpy()
        out[pos : pos + piece.size] = piece
        pos += piece.size
    return out
