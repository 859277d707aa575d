"""Right clusters at every fleet size: ARI of the sketch clustering against the number of devices.

Issue 13: with the real ``fedsketch-server`` the clusters went wrong as the
fleet grew (ARI 0.97 at 100 digits devices, 0.56 at 1,000, 0.61 at 3,550).
This benchmark measures the clustering alone, on sketches made by the real
sketch pipeline from real data: the shipped ONNX encoder (ONNX Runtime) runs
once over every image of each group's transform and each device's class
means are taken from the rows of its own samples (the encoder is
deterministic per sample, so this is what the device computes, up to float
rounding of the batch size), then the device's own :class:`edge_sdk.Sketcher`
(absent-class noise, min-max, rounding, flips with P, packing by the compiled
kernel) with the device's seed. Scenarios:

* ``digits-rotation``: scikit-learn digits, 30 to 60 samples per device
  (uniform), 4 rotation groups (0, 90, 180, 270 degrees), ``digits_encoder``;
* ``mnist-rotation`` and ``mnist-flip``: MNIST, 226 samples per device on
  average (FEMNIST's mean; uniform 150 to 302), 4 rotation groups, or 4
  label-flip groups (``y -> (y - k) mod 10``), ``fmnist_fc_encoder``;
* ``fmnist-ocfl``: the OCFL paper's four splits of Fashion-MNIST
  (:data:`server_kit.data.partition.OCFL_SPLITS`) with 15 and 30 clients of
  600 samples, ``min_cluster_size`` 20 % of the clients as in
  ``benchmarks/clustering_quality.py``.

Devices draw their samples without replacement from the data set, so in big
fleets devices share images (10,000 MNIST devices hold 2.26 M samples of
60,000 images), as FEMNIST writers share letters. Device ``i`` is in group
``i mod 4``.

Readings of the method, side by side (``--readings``):

* ``default``: what the server runs (refinement, the separation check, the
  consolidation passes, each class block's Hamming distance clipped at 9 of
  its 20 bits: ``block_bits``, :func:`server_kit.clustering.distances.default_noise_clip`);
* ``hamming``: the default on plain Hamming distances (no clip; the
  server's default before the clip, ``fedsketch-server --set clip_noise=false``);
* ``flat``: ``refine=False`` (one level of the CH search, with the checks);
* ``paper``: the paper's flat choice (``refine=False``, no permutation test,
  no separation check, no consolidation);
* ``before``: this project's method before issue 13 (refinement without the
  separation check and the consolidation), plain Hamming.

Then the scale part (``--scale``): sample-and-assign against the exact method
at 20,000 and 30,000 digits devices (ARI between the two labelings), and the
time and peak resident memory (VmHWM, each size in a fresh process) of the
sample-and-assign clustering of 100,000 and 1,000,000 sketches.

Every cell (scenario, devices, reading) runs over 20 seeds (``--seeds``,
default 0 to 19): its table line and the JSON give ARI's mean, 5th
percentile, worst and share of fits under 0.95
(:class:`server_kit.metrics.SeedSpread`); the last line's
``min_p5_ari_default`` is the lowest 5th percentile of the default reading
over the cells run.

Run: ``.venv/bin/python benchmarks/fleet_clustering.py --data-dir ../shared/data``
(the whole sweep, 23 cells x 5 readings x 20 seeds: about 3 hours on 2
cores, estimated from 653 s for 2 readings and 3 seeds;
``--scenarios fmnist-ocfl --readings default``: about 4 minutes;
``--quick`` for digits at 100 and 300 devices over seeds 0 to 2, no data
directory needed). Prints a table per scenario; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from _cli import csv_list  # noqa: E402

from edge_sdk.encoder import OnnxEncoder  # noqa: E402
from edge_sdk.sketch import Sketcher  # noqa: E402
from server_kit.clustering import SketchClustering  # noqa: E402
from server_kit.metrics import SeedSpread  # noqa: E402

#: Settings of each reading; ``clip`` readings get ``block_bits`` (one block per class) as the server does.
READINGS: dict[str, dict[str, Any]] = {
    "default": {"clip": True},
    "hamming": {},
    "flat": {"clip": True, "refine": False},
    "paper": {"refine": False, "n_null": 0, "min_separation": None, "consolidate": 0},
    "before": {"min_separation": None, "consolidate": 0},
}
SCENARIOS = ("digits-rotation", "mnist-rotation", "mnist-flip", "fmnist-ocfl")
DEFAULT_DATA = REPO.parent / "shared" / "data"


class _Rows:
    """An encoder over precomputed latent rows: ``encode(indices)`` returns their rows."""

    def __init__(self, latents: np.ndarray) -> None:
        self.latents = latents
        self.latent_dim = latents.shape[1]

    def encode(self, idx: np.ndarray) -> np.ndarray:
        return self.latents[idx]


def encode_groups(x: np.ndarray, encoder: str, transforms: list[int]) -> list[np.ndarray]:
    """Latent rows of every image under each rotation (in quarter turns) through the real ONNX encoder."""
    enc = OnnxEncoder(encoder)
    return [np.asarray(enc.encode(np.rot90(x, k=k, axes=(1, 2)).copy()), dtype=np.float64) for k in transforms]


def fleet_sketches(latents: list[np.ndarray], y: np.ndarray, n: int, *, low: int, high: int, flips: bool,
                   flip_prob: float, seed: int) -> tuple[np.ndarray, int, np.ndarray]:
    """Packed sketches of ``n`` devices, device ``i`` in group ``i mod groups``; returns (packed, n_bits, truth)."""
    groups = 4
    rng = np.random.default_rng([seed, n])
    rows = []
    for i in range(n):
        g = i % groups
        idx = rng.choice(y.size, size=int(rng.integers(low, high + 1)), replace=False)
        lat = latents[0 if flips else g]
        labels = (y[idx] - g) % 10 if flips else y[idx]
        sk = Sketcher(_Rows(lat), 10, flip_prob, seed=seed * 1_000_003 + i)
        rows.append(np.frombuffer(sk.sketch(idx, labels).bits, dtype=np.uint8))
    return np.stack(rows), 10 * latents[0].shape[1], np.arange(n) % groups


def ari(a: np.ndarray, b: np.ndarray) -> float:
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score(a, b))


def cluster(packed: np.ndarray, n_bits: int, truth: np.ndarray, reading: str, mcs: int, seed: int) -> dict:
    t0 = time.perf_counter()
    kw = dict(READINGS[reading])
    if kw.pop("clip", False):
        kw["block_bits"] = n_bits // 10  # one block per class, 10 classes in every scenario
    m = SketchClustering(min_cluster_size=mcs, random_state=seed, **kw).fit(packed, n_bits)
    return {"reading": reading, "k": int(m.n_clusters_), "ari": round(ari(truth, m.labels_), 4),
            "seconds": round(time.perf_counter() - t0, 2)}


def run_fleets(args, scenario: str) -> list[dict]:
    if scenario == "digits-rotation":
        from server_kit.data.partition import load_digits_images

        x, y = load_digits_images()
        latents = encode_groups(x, "digits_encoder", [0, 1, 2, 3])
        spec = dict(low=30, high=60, flips=False)
    else:
        from server_kit.data.idx import load_mnist

        x, y = load_mnist(args.data_dir, "train")
        flips = scenario == "mnist-flip"
        latents = encode_groups(x, "fmnist_fc_encoder", [0] if flips else [0, 1, 2, 3])
        spec = dict(low=150, high=302, flips=flips)
    out = []
    for n in args.sizes:
        for seed in args.seeds:
            packed, n_bits, truth = fleet_sketches(latents, y, n, flip_prob=args.flip_prob, seed=seed, **spec)
            for reading in args.readings:
                row = {"scenario": scenario, "devices": n, "seed": seed,
                       **cluster(packed, n_bits, truth, reading, args.min_cluster_size, seed)}
                print_row(row)
                out.append(row)
    return out


def run_ocfl(args) -> list[dict]:
    from server_kit.data.idx import load_fashion_mnist
    from server_kit.data.partition import OCFL_SPLITS, class_set_groups

    x, y = load_fashion_mnist(args.data_dir, "train")
    enc = OnnxEncoder("fmnist_fc_encoder")
    out = []
    for n in args.ocfl_clients:
        for split in OCFL_SPLITS:
            for seed in args.seeds:
                clients = class_set_groups(x, y, n, samples_per_client=600, seed=seed, **OCFL_SPLITS[split])
                packed = np.stack([np.frombuffer(Sketcher(enc, 10, args.flip_prob, seed=seed * 1_000_003 + i)
                                                 .sketch(c.x_train, c.y_train).bits, dtype=np.uint8)
                                   for i, c in enumerate(clients)])
                truth = np.array([c.group for c in clients])
                for reading in args.readings:
                    row = {"scenario": f"fmnist-ocfl {split}", "devices": n, "seed": seed,
                           **cluster(packed, 10 * enc.latent_dim, truth, reading, max(2, round(0.2 * n)), seed)}
                    print_row(row)
                    out.append(row)
    return out


def print_row(row: dict) -> None:
    print(f"{row['scenario']:<34} {row['devices']:>7,} seed {row['seed']} {row['reading']:<8} k = {row['k']:<3} "
          f"ARI {row['ari']:.3f}  {row['seconds']:7.2f} s", flush=True)


def cell_table(rows: list[dict]) -> list[dict]:
    """One line per (scenario, devices, reading) over the seeds: ARI's mean, 5th percentile, worst and share
    under 0.95 (:class:`server_kit.metrics.SeedSpread`), the cluster counts, the slowest fit; printed."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["scenario"], r["devices"], r["reading"]), []).append(r)
    out = []
    if cells:
        print(f"\n{'scenario':<34} {'devices':>7} {'reading':<8} {'seeds':>5} {'mean ARI':>8} {'p5 ARI':>7} "
              f"{'min ARI':>7} {'< 0.95':>6}  k (seeds)        seconds")
    for (scenario, n, reading), rs in cells.items():
        spread = SeedSpread.of([r["ari"] for r in rs])
        ks = np.bincount([r["k"] for r in rs])
        c = {"scenario": scenario, "devices": n, "reading": reading, **spread.as_dict(),
             "k": {str(k): int(v) for k, v in enumerate(ks) if v}, "max_seconds": max(r["seconds"] for r in rs)}
        k_text = ", ".join(f"{k}: {v}" for k, v in c["k"].items())
        print(f"{scenario:<34} {n:>7,} {reading:<8} {spread.n:>5} {spread.mean:>8.3f} {spread.p5:>7.3f} "
              f"{spread.worst:>7.3f} {spread.below:>6.0%}  {k_text:<16} {c['max_seconds']:.2f}")
        out.append(c)
    return out


def plot_ari(cells: list[dict], path: Path) -> Path | None:
    """ari_vs_fleet.png: ARI's 5th percentile over the seeds against the number of devices, one panel per fleet scenario."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scenarios = [s for s in SCENARIOS if s != "fmnist-ocfl" and any(c["scenario"] == s for c in cells)]
    if not scenarios:
        return None
    fig = Figure(figsize=(4.2 * len(scenarios), 3.6))
    FigureCanvasAgg(fig)
    styles = {"default": ("C0", "o", "-"), "hamming": ("C1", "D", "-."), "before": ("C3", "s", "--"),
              "flat": ("C2", "^", ":"), "paper": ("0.5", "x", ":")}
    for i, scenario in enumerate(scenarios):
        ax = fig.add_subplot(1, len(scenarios), i + 1)
        for reading, (color, marker, ls) in styles.items():
            pts = sorted((c["devices"], c["p5"]) for c in cells
                         if c["scenario"] == scenario and c["reading"] == reading)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, color=color, marker=marker, ls=ls, label=reading)
        ax.axhline(0.95, color="0.7", lw=0.8)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("devices")
        ax.set_title(scenario, fontsize=10)
        if i == 0:
            ax.set_ylabel("ARI, 5th percentile over seeds")
            ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ----------------------------------------------------------------------------- scale


def _digits_sketches(n: int, seed: int) -> tuple[np.ndarray, int, np.ndarray]:
    from server_kit.data.partition import load_digits_images

    x, y = load_digits_images()
    return fleet_sketches(encode_groups(x, "digits_encoder", [0, 1, 2, 3]), y, n, low=30, high=60,
                          flips=False, flip_prob=0.1, seed=seed)


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scale_child(n: int, seed: int, exact: bool) -> None:
    """One size in this fresh process: sketches from a file, then the clustering alone; prints JSON."""
    data = np.load(REPO / "reports" / "fleet_clustering" / f"sketches_{n}.npz", allow_pickle=False)
    packed, n_bits = data["packed"], int(data["n_bits"])
    before = _vm_hwm_mib()
    t0 = time.perf_counter()
    m = SketchClustering(min_cluster_size=2, random_state=seed, block_bits=n_bits // 10,
                         max_exact_clients=None if exact else 10_000).fit(packed, n_bits)
    seconds = time.perf_counter() - t0
    np.save(REPO / "reports" / "fleet_clustering" / f"labels_{n}_{'exact' if exact else 'sampled'}.npy", m.labels_)
    print(json.dumps({"n": n, "exact": exact, "seconds": round(seconds, 2), "k": int(m.n_clusters_),
                      "ari": round(ari(data["truth"], m.labels_), 4), "peak_mib": round(_vm_hwm_mib(), 1),
                      "peak_before_fit_mib": round(before, 1)}))


def _child(n: int, seed: int, exact: bool) -> dict:
    cmd = [sys.executable, __file__, "--scale-child", str(n), "--seed", str(seed)] + (["--exact"] if exact else [])
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_scale(args) -> dict:
    outdir = REPO / "reports" / "fleet_clustering"
    outdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"agreement": [], "big": []}
    for n in sorted(set(args.agree_sizes) | set(args.big_sizes)):
        t0 = time.perf_counter()
        packed, n_bits, truth = _digits_sketches(n, args.seed)
        np.savez(outdir / f"sketches_{n}.npz", packed=packed, n_bits=n_bits, truth=truth)
        print(f"{n:,} sketches made in {time.perf_counter() - t0:.1f} s", flush=True)
    for n in args.agree_sizes:
        sampled, exact = _child(n, args.seed, False), _child(n, args.seed, True)
        agree = ari(np.load(outdir / f"labels_{n}_exact.npy"), np.load(outdir / f"labels_{n}_sampled.npy"))
        row = {"devices": n, "agreement_ari": round(agree, 4), "sampled": sampled, "exact": exact}
        print(f"{n:>9,} sample-and-assign vs exact: ARI {agree:.4f}; sampled {sampled['seconds']} s, "
              f"{sampled['peak_mib']:.0f} MiB, k = {sampled['k']}; exact {exact['seconds']} s, "
              f"{exact['peak_mib']:.0f} MiB, k = {exact['k']}", flush=True)
        result["agreement"].append(row)
    for n in args.big_sizes:
        row = _child(n, args.seed, False)
        print(f"{n:>9,} sample-and-assign: {row['seconds']} s, peak {row['peak_mib']:.0f} MiB "
              f"({row['peak_before_fit_mib']:.0f} MiB before the fit), k = {row['k']}, ARI {row['ari']}",
              flush=True)
        result["big"].append(row)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", type=csv_list(str, set(SCENARIOS)), default=list(SCENARIOS))
    ap.add_argument("--sizes", type=csv_list(int), default=[100, 300, 1000, 3550, 10000])
    ap.add_argument("--ocfl-clients", type=csv_list(int), default=[15, 30])
    ap.add_argument("--readings", type=csv_list(str, set(READINGS)), default=list(READINGS))
    ap.add_argument("--min-cluster-size", type=int, default=2, help="for the fleet scenarios (OCFL: 20 %%)")
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA, help="folder with mnist/ and fashion-mnist/")
    ap.add_argument("--seeds", type=csv_list(int), default=list(range(20)),
                    help="partitions and sketches, one fit each (default 0 to 19; --quick: 0, 1, 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the scale part")
    ap.add_argument("--scale", action="store_true", help="also the sample-and-assign agreement and big sizes")
    ap.add_argument("--scale-only", action="store_true", help="only the scale part")
    ap.add_argument("--agree-sizes", type=csv_list(int), default=[20000, 30000])
    ap.add_argument("--big-sizes", type=csv_list(int), default=[100000, 1000000])
    ap.add_argument("--quick", action="store_true", help="digits at 100 and 300 devices, default reading")
    ap.add_argument("--out", type=Path, default=REPO / "reports" / "fleet_clustering")
    ap.add_argument("--scale-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.scale_child is not None:
        scale_child(args.scale_child, args.seed, args.exact)
        return 0
    if args.quick:
        args.scenarios, args.sizes, args.readings = ["digits-rotation"], [100, 300], ["default"]
        args.seeds = args.seeds if args.seeds != list(range(20)) else [0, 1, 2]  # --seeds given: kept
    rows: list[dict] = []
    if args.scale_only:
        args.scale, args.scenarios = True, []
    for scenario in args.scenarios:
        rows += run_ocfl(args) if scenario == "fmnist-ocfl" else run_fleets(args, scenario)
    scale = run_scale(args) if args.scale else None
    cells = cell_table(rows)
    default = [c for c in cells if c["reading"] == "default"]
    summary = {
        "cells": len(default),
        "seeds": len(args.seeds),
        "min_p5_ari_default": min((c["p5"] for c in default), default=None),
        "min_mean_ari_default": min((c["mean"] for c in default), default=None),
        "min_ari_default": min((c["min"] for c in default), default=None),
        "cells_p5_below_0.95": [f"{c['scenario']} @ {c['devices']}" for c in default if c["p5"] < 0.95],
        "default": {f"{c['scenario']} @ {c['devices']}": {k: c[k] for k in ("mean", "p5", "min", "below_0.95")}
                    for c in default},
        "max_seconds_default": max((c["max_seconds"] for c in default), default=None),
    }
    if scale:
        summary["agreement_ari"] = {str(r["devices"]): r["agreement_ari"] for r in scale["agreement"]}
        summary["big"] = {str(r["n"]): {"seconds": r["seconds"], "peak_mib": r["peak_mib"]} for r in scale["big"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "cells": cells, "scale": scale,
                                                       "summary": summary}, indent=1))
    if plot_ari(cells, args.out / "ari_vs_fleet.png"):
        print(f"plot: {args.out / 'ari_vs_fleet.png'}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
