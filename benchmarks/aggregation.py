"""Streaming FedAvg against stack-then-average: time and peak memory on the server.

Question: how much faster, and how much lighter, is adding updates one at a
time into one accumulator (:class:`server_kit.aggregate.StreamingFedAvg`)
than buffering every update and then averaging them with ``np.stack`` and
``np.average`` (the naive baseline)?

Workloads: 100 LeNet-5 updates and 20 ResNet-18 updates. Update ``i`` is
the seeded initial model plus Gaussian noise (sd 0.01) drawn from
``default_rng([seed, i])``, as a ``{name: float32 array}`` dict like those
decoded from the wire; sample counts are drawn from the same seed. Both
methods generate the updates on the fly: the naive one keeps them all (it
must, to stack them), the streaming one drops each right after ``add``.

Each method runs in its own subprocess. Memory is that process's peak RSS
(``VmHWM``) during aggregation minus its RSS just before (after imports and
building the base model; the high-water mark is reset there through
``/proc/self/clear_refs`` where the kernel allows it). Time counts the
aggregation work only (all ``add`` calls plus ``result()``; the
stack-and-average for the naive method), not the generation of the updates,
best of ``--repeats`` passes; the streaming figure includes its validation
of every update (names, shapes, NaN/Inf), which the naive baseline skips.
"Latency after the last update" is the time from the last arrival to the
result: the last ``add`` plus ``result()``, against the whole naive
aggregation. The two results are compared element-wise.

Run: ``.venv/bin/python benchmarks/aggregation.py [--repeats 3] [--seed 0]``.
The last line is JSON with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = {
    "lenet5": ("lenet5_1x28x28_10", 100),
    "resnet18": ("resnet18_3x32x32_10", 20),
}
NOISE_SD = 0.01


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def naive_average(updates: list[dict[str, np.ndarray]], counts: list[int]) -> dict[str, np.ndarray]:
    """Stack every update's tensor and take the weighted mean (integers: the maximum)."""
    w = np.asarray(counts, dtype=np.float64)
    out = {}
    for name in updates[0]:
        stacked = np.stack([u[name] for u in updates])
        if np.issubdtype(stacked.dtype, np.floating):
            out[name] = np.average(stacked, axis=0, weights=w).astype(stacked.dtype)
        else:
            out[name] = stacked.max(axis=0)
        del stacked
    return out


def child(method: str, workload: str, seed: int, repeats: int, save: str) -> dict:
    """Run one method on one workload in this process; return its figures."""
    import torch

    from server_kit.aggregate import StreamingFedAvg
    from server_kit.nets import build_model

    architecture, n_updates = WORKLOADS[workload]
    torch.manual_seed(seed)
    base = {k: v.detach().numpy().copy() for k, v in build_model(architecture).state_dict().items()}
    counts = [int(c) for c in np.random.default_rng([seed, 10**6]).integers(10, 1000, n_updates)]
    model_bytes = sum(v.nbytes for v in base.values())

    def update(i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([seed, i])
        out = {}
        for k, v in base.items():
            if np.issubdtype(v.dtype, np.floating):
                noise = rng.standard_normal(v.shape, dtype=np.float32)
                noise *= NOISE_SD
                noise += v
                out[k] = noise
            else:
                out[k] = v + i % 3
        return out

    reset_ok = _reset_peak()
    rss0 = _status_kib("VmRSS") if reset_ok else _status_kib("VmHWM")
    times, last_latency = [], []
    result: dict[str, np.ndarray] = {}
    if method == "naive":
        updates = [update(i) for i in range(n_updates)]  # buffered, as they arrived
        for _ in range(repeats):
            result = {}  # drop the previous pass's result before the next pass
            t0 = time.perf_counter()
            result = naive_average(updates, counts)
            times.append(time.perf_counter() - t0)
        last_latency = times
    else:
        agg = StreamingFedAvg(base, device="cpu")
        for _ in range(repeats):
            result = {}  # drop the previous pass's result before the next pass
            agg.reset()
            spent = 0.0
            for i in range(n_updates):
                w = update(i)
                t0 = time.perf_counter()
                agg.add(w, counts[i])
                dt = time.perf_counter() - t0
                spent += dt
                del w
            t0 = time.perf_counter()
            result = agg.result()
            t_result = time.perf_counter() - t0
            times.append(spent + t_result)
            last_latency.append(dt + t_result)
    peak = _status_kib("VmHWM")
    np.savez(save, **result)
    return {
        "method": method,
        "workload": workload,
        "n_updates": n_updates,
        "model_mb": model_bytes / 2**20,
        "seconds": min(times),
        "after_last_seconds": min(last_latency),
        "rss_before_kib": rss0,
        "peak_kib": peak,
        "extra_peak_mb": (peak - rss0) / 1024,
        "peak_reset": reset_ok,
        "torch_threads": torch.get_num_threads(),
    }


def run_child(method: str, workload: str, seed: int, repeats: int, save: Path) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        method,
        workload,
        "--seed",
        str(seed),
        "--repeats",
        str(repeats),
        "--save",
        str(save),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{method}/{workload} child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timed passes per method (best is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", nargs=2, metavar=("METHOD", "WORKLOAD"), help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.seed, args.repeats, args.save)))
        return 0

    summary: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workload, (architecture, n_updates) in WORKLOADS.items():
            figs = {}
            for method in ("naive", "streaming"):
                figs[method] = run_child(
                    method, workload, args.seed, args.repeats, Path(tmp) / f"{method}.npz"
                )
            with np.load(Path(tmp) / "naive.npz") as a, np.load(Path(tmp) / "streaming.npz") as b:
                diff = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a.files)
            nv, st = figs["naive"], figs["streaming"]
            speedup = nv["seconds"] / st["seconds"]
            latency = nv["after_last_seconds"] / st["after_last_seconds"]
            mem = nv["extra_peak_mb"] / st["extra_peak_mb"]
            print(
                f"{workload}: {n_updates} updates of {architecture} ({nv['model_mb']:.2f} MB each, "
                f"float32), torch threads {st['torch_threads']}, best of {args.repeats}"
            )
            for m in ("naive", "streaming"):
                f = figs[m]
                print(
                    f"  {m:<9} aggregate {f['seconds'] * 1e3:9.1f} ms   after last update "
                    f"{f['after_last_seconds'] * 1e3:8.1f} ms   extra peak RSS {f['extra_peak_mb']:8.1f} MB"
                    f"   (peak {f['peak_kib'] / 1024:.0f} MB)"
                )
            print(
                f"  streaming vs naive: {speedup:.2f}x aggregation time, {latency:.1f}x latency after "
                f"the last update, {mem:.1f}x less extra peak memory; max |diff| {diff:.2e}"
            )
            summary.update(
                {
                    f"{workload}_streaming_speedup": round(speedup, 3),
                    f"{workload}_after_last_speedup": round(latency, 2),
                    f"{workload}_peak_mem_ratio": round(mem, 2),
                    f"{workload}_naive_seconds": round(nv["seconds"], 5),
                    f"{workload}_streaming_seconds": round(st["seconds"], 5),
                    f"{workload}_naive_extra_peak_mb": round(nv["extra_peak_mb"], 1),
                    f"{workload}_streaming_extra_peak_mb": round(st["extra_peak_mb"], 1),
                    f"{workload}_max_abs_diff": diff,
                }
            )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
