"""Where the GPU starts to pay: the sizes from which each server path is faster on the card than on the CPU.

Imported by ``gpu.py`` (its ``thresholds`` part). For each path the server sends to a GPU by itself
(``"auto"``), the same work is timed on the CPU (numpy) and on the card at growing sizes, and the
smallest size from which the card is faster at that size and every larger one is the measured
threshold, printed beside the constant the code uses:

- ``GPU_MIN_BYTES`` (:mod:`server_kit.aggregate`): a model's floating bytes, per update aggregated
  (numpy against ``kernels="staged"``);
- ``AUTO_MIN_PDIST_ROWS`` (:mod:`server_kit.clustering.on_device`): sketches whose pairwise distances
  the clustering search takes (200 bits, Hamming and block-clipped), the distances compared;
- ``AUTO_MIN_ROWS``: sketches assigned to their nearest of 8 centroids, the labels compared.

Without a GPU the card's side is the torch code on the CPU (``torch-cpu``, the same kernels): a
profile of that code, not a threshold; the keys ``threshold_*`` are then null.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class ThresholdFailure(RuntimeError):
    """The card's result differed from the CPU's: no threshold is reported."""


def _best(repeats: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[float, Any]:
    """The best of ``repeats`` timings of ``fn(*args, **kw)``, and its result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        best = min(best, time.perf_counter() - t0)
    return best, out


def crossover(sizes: Sequence[int], cpu_s: Sequence[float], card_s: Sequence[float]) -> int | None:
    """The smallest size from which the card is faster at it and at every larger size measured (None: never)."""
    found = None
    for size, c, g in reversed(list(zip(sizes, cpu_s, card_s))):
        if g >= c:
            break
        found = size
    return found


def _sketches(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.packbits(rng.integers(0, 2, (n, 200), dtype=np.uint8), axis=1)


def pdist_rows(card: str, quick: bool, repeats: int) -> dict[str, Any]:
    from server_kit.clustering.distances import sketch_pdist

    sizes = [128, 512] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
    rows: dict[str, list[float]] = {"cpu": [], "card": []}
    for n in sizes:
        packed = _sketches(n, n)
        for clip in (None, 20):
            c, a = _best(repeats, sketch_pdist, packed, 200, clip, device="cpu")
            g, b = _best(repeats, sketch_pdist, packed, 200, clip, device=card)
            if not np.array_equal(a, b):
                raise ThresholdFailure(f"pdist of {n} sketches (block {clip}) on {card} differs from numpy's")
            if clip is None:
                rows["cpu"].append(c), rows["card"].append(g)
            else:
                rows["cpu"][-1] += c
                rows["card"][-1] += g
    return {"sizes": sizes, "cpu_s": rows["cpu"], "card_s": rows["card"]}


def assign_rows(card: str, quick: bool, repeats: int) -> dict[str, Any]:
    from server_kit.clustering.centroids import nearest_centroids

    sizes = [1 << 10, 1 << 12] if quick else [1 << k for k in range(10, 21, 2)]
    centroids = np.random.default_rng(0).random((8, 200))
    cpu_s, card_s = [], []
    for n in sizes:
        packed = _sketches(n, n)
        c, a = _best(repeats, nearest_centroids, packed, 200, centroids, device="cpu")
        g, b = _best(repeats, nearest_centroids, packed, 200, centroids, device=card)
        if not np.array_equal(a, b):
            raise ThresholdFailure(f"{n} sketches assigned on {card}: labels other than numpy's")
        cpu_s.append(c), card_s.append(g)
    return {"sizes": sizes, "cpu_s": cpu_s, "card_s": card_s}


def _sum_all(agg: Any, updates: list[dict[str, np.ndarray]]) -> Any:
    """Every update added (weight 3) and settled; every one must be counted."""
    agg.reset()
    for u in updates:
        agg.add(u, 3)
    agg.settle()
    if agg.count != len(updates):
        raise ThresholdFailure(f"{agg.count} of {len(updates)} updates summed")
    return agg


def aggregate_bytes(card: str, quick: bool, repeats: int) -> dict[str, Any]:
    """Per update, a model of one float32 tensor of each size: numpy against the staged path on the card."""
    from server_kit.aggregate import StreamingFedAvg

    sizes = [1 << 16, 1 << 20] if quick else [1 << k for k in range(14, 27, 2)]
    device = "cpu" if card == "torch-cpu" else card
    cpu_s, card_s = [], []
    for nbytes in sizes:
        rng = np.random.default_rng(nbytes)
        updates = [{"w": rng.standard_normal(nbytes // 4, dtype=np.float32)} for _ in range(8)]

        numpy_agg = StreamingFedAvg(updates[0], device="cpu", kernels="numpy")
        staged = StreamingFedAvg(updates[0], device=device, kernels="staged")
        _sum_all(staged, updates)  # warm up: the slots, the first kernels
        c, _ = _best(repeats, _sum_all, numpy_agg, updates)
        g, _ = _best(repeats, _sum_all, staged, updates)
        cpu_s.append(c / len(updates)), card_s.append(g / len(updates))
    return {"sizes": sizes, "cpu_s": cpu_s, "card_s": card_s}


def thresholds(args: Any, gpu: bool) -> dict[str, Any]:
    """Each path timed on the CPU and on the card (or the torch code on the CPU), and where the card pays."""
    from server_kit.aggregate import GPU_MIN_BYTES
    from server_kit.clustering.on_device import AUTO_MIN_PDIST_ROWS, AUTO_MIN_ROWS

    card = "cuda" if gpu else "torch-cpu"
    out: dict[str, Any] = {}
    for key, fn, now in (("gpu_min_bytes", aggregate_bytes, GPU_MIN_BYTES),
                         ("auto_min_pdist_rows", pdist_rows, AUTO_MIN_PDIST_ROWS),
                         ("auto_min_rows", assign_rows, AUTO_MIN_ROWS)):
        got = fn(card, args.quick, args.repeats)
        found = crossover(got["sizes"], got["cpu_s"], got["card_s"]) if gpu else None
        out[f"threshold_{key}"] = found
        out[f"threshold_{key}_in_code"] = now
        out[f"threshold_{key}_timings"] = got
        table = ", ".join(f"{s:,}: {1e3 * c:.2f}/{1e3 * g:.2f} ms" for s, c, g in
                          zip(got["sizes"], got["cpu_s"], got["card_s"]))
        print(f"{key.upper()} (in the code {now:,}): CPU/{card} {table}"
              + (f"; the card pays from {found:,}" if gpu and found else "; the card never pays here" if gpu else
                 " (no GPU: a profile of the torch code, no threshold)"))
    return out
