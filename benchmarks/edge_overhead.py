"""What sketching costs a device, against one local training epoch (the paper's Figure 6).

The sketch path (ONNX Runtime encoder -> per-class means -> quantise -> pack)
runs in a fresh Python process that imports only ``edge_sdk``, so its peak
memory and the absence of torch are those a Raspberry Pi would see. The
baseline, one LeNet-5 training epoch on the same 600 samples (torch, batch 32,
Adam 1e-3: ``edge_sdk.training.trainer.train_local``), runs in this process. The
paper measured sketching at 4x less time than an epoch on a Raspberry Pi 4.
The timing loop, the peak RSS reader and the epoch are those of ``fedsketch
bench`` (:mod:`edge_sdk.bench`), which times every stage on the device itself.

Run: ``.venv/bin/python benchmarks/edge_overhead.py [--data ../shared/data/mnist]``.
The last line is JSON with the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mnist"

# Runs in the child process: only edge_sdk and numpy. The timing loop and the peak RSS are fedsketch
# bench's (edge_sdk.bench.timing.measure, edge_sdk.bench.machine.peak_rss_kib).
SKETCH_CHILD = r"""
import json, sys, time, tracemalloc


def start_kib():
    # the interpreter alone, read before edge_sdk (and numpy) can be imported; ru_maxrss would
    # carry the parent's peak across fork+exec on Linux
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


rss0 = start_kib()
import numpy as np
from edge_sdk import OnnxEncoder, Sketcher
from edge_sdk.bench.machine import peak_rss_kib
from edge_sdk.bench.timing import measure, median
x = np.load(sys.argv[1], allow_pickle=False)
y = np.load(sys.argv[2], allow_pickle=False)
repeats = int(sys.argv[3]); threads = int(sys.argv[4]) or None
t0 = time.perf_counter()
enc = OnnxEncoder("fmnist_fc_encoder", threads=threads)
sk = Sketcher(enc, num_classes=10, flip_prob=0.1, seed=1)
first = sk.sketch(x, y)
t_cold = time.perf_counter() - t0
tracemalloc.start()
times = measure(lambda: sk.sketch(x, y), repeats, warmup=False)
_, py_peak = tracemalloc.get_traced_memory()
s = sk.sketch(x, y)
assert s.bits == first.bits
print(json.dumps({
    "sketch_s": min(times), "sketch_median_s": median(times), "cold_s": t_cold,
    "maxrss_kib": peak_rss_kib(), "start_rss_kib": rss0,
    "py_peak_bytes": py_peak, "torch_imported": "torch" in sys.modules,
    "onnxruntime_imported": "onnxruntime" in sys.modules, "bytes": s.nbytes, "n_bits": s.n_bits,
    "kernel": __import__("edge_sdk").BACKEND,
}))
"""


def load_samples(data: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """``n`` MNIST training samples in [0, 1], or MNIST-shaped noise if the files are absent."""
    rng = np.random.default_rng(seed)
    try:
        from server_kit.data.idx import load_idx_dataset

        images, labels = load_idx_dataset(data, "train")
        idx = rng.choice(len(labels), size=n, replace=False)
        return images[idx].astype(np.float32) / 255.0, labels[idx].astype(np.int64), f"MNIST from {data}"
    except (FileNotFoundError, OSError) as e:
        logging.warning("MNIST not found (%s): using random 28x28 images", e)
        return rng.random((n, 28, 28), dtype=np.float32), rng.integers(0, 10, n), "random 28x28"


def time_sketch(x: np.ndarray, y: np.ndarray, repeats: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        xp, yp = Path(tmp) / "x.npy", Path(tmp) / "y.npy"
        np.save(xp, x)
        np.save(yp, y)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        out = subprocess.run(
            [sys.executable, "-c", SKETCH_CHILD, str(xp), str(yp), str(repeats), str(threads)],
            capture_output=True, text=True, check=True, env=env, cwd=str(ROOT),
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_epochs(x: np.ndarray, y: np.ndarray, epochs: int, seed: int) -> list[float]:
    """Seconds of ``epochs`` LeNet-5 epochs (fedsketch bench's: ``train_local``, batch 32, Adam 1e-3, fresh weights)."""
    from edge_sdk.bench.training import time_epoch

    xs = x.reshape(-1, 1, 28, 28)
    return [time_epoch("lenet5_1x28x28_10", xs, y, threads=None, seed=seed, warmup=32 if i == 0 else 0) for i in range(epochs)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with MNIST IDX files")
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=20, help="sketch repetitions (best is kept)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs timed (median is kept)")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: its default)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    x, y, source = load_samples(args.data, args.samples, seed=0)
    print(f"data: {args.samples} samples, {source}")
    sk = time_sketch(x, y, args.repeats, args.threads)
    print(f"sketch (ONNX Runtime, fmnist_fc_encoder, P=0.1, kernel {sk['kernel']}): "
          f"{sk['sketch_s'] * 1e3:.2f} ms best, {sk['sketch_median_s'] * 1e3:.2f} ms median, "
          f"{sk['cold_s'] * 1e3:.1f} ms cold (session creation included); {sk['bytes']} bytes")
    print(f"sketch process: peak RSS {sk['maxrss_kib'] / 1024:.1f} MiB "
          f"(interpreter before imports {sk['start_rss_kib'] / 1024:.1f} MiB), "
          f"Python allocations peak {sk['py_peak_bytes'] / 2**20:.2f} MiB, torch imported: {sk['torch_imported']}")
    epochs = time_epochs(x, y, args.epochs, seed=0)
    epoch = float(np.median(epochs))
    print(f"LeNet-5 epoch (torch {__import__('torch').__version__}, batch 32, Adam): "
          f"{epoch * 1e3:.1f} ms median of {[round(t * 1e3, 1) for t in epochs]}")
    ratio = epoch / sk["sketch_s"]
    print(f"one epoch takes {ratio:.1f}x the time of one sketch (paper, Raspberry Pi 4: 4x)")
    print(json.dumps({
        "epoch_over_sketch": round(ratio, 2),
        "epoch_over_cold_sketch": round(epoch / sk["cold_s"], 2),
        "sketch_ms": round(sk["sketch_s"] * 1e3, 3),
        "epoch_ms": round(epoch * 1e3, 2),
        "sketch_peak_mib": round(sk["maxrss_kib"] / 1024, 1),
        "sketch_imports_torch": sk["torch_imported"],
        "samples": args.samples,
        "data": source,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
