"""Bit kernels against their baselines, in one process.

1. The fused quantise-and-pack kernel (``edge_sdk._bits``) against the
   straightforward numpy pipeline a person would write (min-max, round,
   ``Generator.random() < P``, xor, ``np.packbits``) on the same float input,
   and against the package's own bit-identical numpy twin.
2. Hamming ``pdist`` on packed 64-bit words against ``scipy.spatial.distance.pdist``
   with ``metric='hamming'`` on the unpacked booleans (the FEMNIST scale of the
   paper: 3,550 clients x 1,240 bits).
3. How close each comes to the machine's limit: bytes per second against a
   plain memory copy (``np.copyto``) of a buffer of the same size.

Run: ``.venv/bin/python benchmarks/bits.py`` (``--quick`` for a smaller run).
The last line is JSON with the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable

import numpy as np
from scipy.spatial.distance import pdist

from edge_sdk import bits


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Smallest wall time of ``repeats`` calls (seconds)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def numpy_pipeline(vecs: np.ndarray, p: float, rng: np.random.Generator) -> np.ndarray:
    """The straightforward numpy version of Algorithm 1's quantisation step."""
    lo = vecs.min(axis=2, keepdims=True)
    span = vecs.max(axis=2, keepdims=True) - lo
    norm = (vecs - lo) / np.where(span > 0, span, 1.0)
    b = np.round(norm).astype(bool)
    b ^= rng.random(b.shape) < p
    return np.packbits(b.reshape(b.shape[0], -1), axis=1)


def memcpy_time(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return best_of(lambda: np.copyto(dst, src), repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=3550)
    ap.add_argument("--classes", type=int, default=62)
    ap.add_argument("--latent", type=int, default=20)
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--scipy-repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="500 clients, fewer repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.repeats, args.scipy_repeats = 500, 3, 1
    if "cython" not in bits.available_backends():
        print("the compiled kernel is not built: run `make venv` first", file=sys.stderr)
        return 2

    n, c, l_ = args.clients, args.classes, args.latent
    n_bits = c * l_
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(n, c, l_)).astype(np.float32)
    in_bytes = vecs.nbytes
    print(f"input: {n} sketches x {c} classes x {l_} latent (float32, {in_bytes / 2**20:.1f} MiB), "
          f"{n_bits} bits each, P = {args.flip_prob}")

    t_kernel = best_of(lambda: bits.quantize_pack(vecs, args.flip_prob, 1, backend="cython"), args.repeats)
    t_twin = best_of(lambda: bits.quantize_pack(vecs, args.flip_prob, 1, backend="numpy"), args.repeats)
    gen = np.random.default_rng(1)
    t_numpy = best_of(lambda: numpy_pipeline(vecs, args.flip_prob, gen), args.repeats)
    t_copy = memcpy_time(in_bytes, args.repeats * 3)
    same = np.array_equal(
        bits.quantize_pack(vecs, args.flip_prob, 1, backend="cython"),
        bits.quantize_pack(vecs, args.flip_prob, 1, backend="numpy"),
    )
    print("\n[quantise + pack]")
    print(f"  cython fused kernel       {t_kernel * 1e3:9.2f} ms  {in_bytes / t_kernel / 1e9:6.2f} GB/s")
    print(f"  numpy straightforward     {t_numpy * 1e3:9.2f} ms  ({t_numpy / t_kernel:.1f}x slower)")
    print(f"  numpy twin (same bits)    {t_twin * 1e3:9.2f} ms  ({t_twin / t_kernel:.1f}x slower)")
    print(f"  memcpy of the same bytes  {t_copy * 1e3:9.2f} ms  {in_bytes / t_copy / 1e9:6.2f} GB/s")
    print(f"  cython == numpy twin: {same}")

    # One device's sketch (MNIST: 10 classes x 20 latent), the call a Pi makes,
    # through the public validating function against the numpy pipeline.
    one = rng.normal(size=(1, 10, 20))
    calls = 2000
    t_one = best_of(lambda: [bits.quantize_pack(one[0], args.flip_prob, 1) for _ in range(calls)], 3) / calls
    t_one_np = best_of(lambda: [numpy_pipeline(one, args.flip_prob, gen) for _ in range(calls)], 3) / calls
    print(f"\n[one 10 x 20 sketch, public API with validation]  {t_one * 1e6:.1f} us vs numpy "
          f"pipeline {t_one_np * 1e6:.1f} us ({t_one_np / t_one:.1f}x)")

    bool_bits = rng.integers(0, 2, size=(n, n_bits)).astype(bool)
    packed = np.packbits(bool_bits, axis=1)
    t_ham = best_of(lambda: bits.hamming_pdist(packed, n_bits, backend="cython"), args.repeats)
    t_ham_np = best_of(lambda: bits.hamming_pdist(packed, n_bits, backend="numpy"), max(1, args.repeats // 3))
    t_scipy = best_of(lambda: pdist(bool_bits, "hamming"), args.scipy_repeats)
    ours = bits.hamming_pdist(packed, n_bits)
    agree = np.array_equal(ours, np.rint(pdist(bool_bits, "hamming") * n_bits).astype(np.int32))
    pairs = n * (n - 1) // 2
    words = (packed.shape[1] + 7) // 8
    streamed = pairs * 2 * words * 8  # bytes the popcount loop reads (from cache)
    t_copy_h = memcpy_time(min(streamed, 1 << 28), 3) * (streamed / min(streamed, 1 << 28))
    print(f"\n[Hamming pdist: {n} rows x {n_bits} bits = {pairs:,} pairs]")
    print(f"  cython popcount           {t_ham * 1e3:9.2f} ms  {pairs / t_ham / 1e6:8.1f} M pairs/s")
    print(f"  numpy twin                {t_ham_np * 1e3:9.2f} ms  ({t_ham_np / t_ham:.1f}x slower)")
    print(f"  scipy pdist('hamming')    {t_scipy * 1e3:9.2f} ms  ({t_scipy / t_ham:.1f}x slower)")
    print(f"  bytes read by popcount    {streamed / t_ham / 1e9:6.2f} GB/s vs memcpy "
          f"{streamed / t_copy_h / 1e9:6.2f} GB/s")
    print(f"  equal to scipy * n_bits: {agree}")

    result = {
        "kernel_speedup_vs_numpy": round(t_numpy / t_kernel, 2),
        "kernel_speedup_vs_numpy_twin": round(t_twin / t_kernel, 2),
        "hamming_speedup_vs_scipy": round(t_scipy / t_ham, 2),
        "hamming_speedup_vs_numpy_twin": round(t_ham_np / t_ham, 2),
        "kernel_fraction_of_memcpy": round(t_copy / t_kernel, 3),
        "single_sketch_us": round(t_one * 1e6, 2),
        "single_sketch_speedup_vs_numpy": round(t_one_np / t_one, 2),
        "hamming_fraction_of_memcpy": round(t_copy_h / t_ham, 3),
        "kernel_ms": round(t_kernel * 1e3, 3),
        "numpy_ms": round(t_numpy * 1e3, 3),
        "hamming_ms": round(t_ham * 1e3, 3),
        "scipy_ms": round(t_scipy * 1e3, 3),
        "bits_identical": bool(same and agree),
        "clients": n,
        "n_bits": n_bits,
        "machine": platform.machine(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
