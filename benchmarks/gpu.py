"""The GPU server against its own CPU: aggregation, a simulated round, and a million sketches assigned.

Three questions, each answered by ratios measured in this one process:

1. **Aggregation per update.** How long does :class:`server_kit.aggregate.StreamingFedAvg` take per
   ResNet-18 update (42.7 MB) and per LeNet-5 update (246 KB): on the GPU through pinned staging
   buffers (``kernels="staged"``), against numpy on the CPU, and against the time of the pinned
   host-to-device copy alone of one ResNet-18 update (the card's and bus's limit). The updates are
   distinct seeded arrays, made before the clock starts; the time runs from the first ``add`` to the
   end of ``settle()`` (the device synchronised), divided by the updates. Every update must be
   counted and the average must equal the float64 numpy reference within float32 summation error,
   or the script fails rather than report a rate. The same updates as ``int4`` bodies: decoded on the
   host then added, against their codes sent to where the sums live and decoded there
   (``StreamingFedAvg.add_coded``, :mod:`server_kit.coded_sum`); the two sums must be bit for bit equal.
2. **A round of the paper's MNIST scenario.** 100 clients in 4 rotation groups (Dirichlet 10 label
   skew), 50 of them in the round, LeNet-5, 5 local epochs, batch 32, Adam 1e-3, all from one model:
   trained together on the GPU (:class:`server_kit.drivers.sim_training.RoundTraining`, batched),
   one by one on the CPU (as the simulator trained before), and together on the CPU; each batched order
   with each way of running its steps (``--steps``: eager, ``torch.compile``, and on the GPU compiled and
   replayed as CUDA graphs; a compiled order's first call, which compiles, is timed apart). Each order must
   return the 50 updates; the mean accuracy of the 50 trained models on their clients' test images
   is printed for each, so the orders can be seen to train the same models.
3. **1,000,000 sketches assigned** to their nearest of 8 centroids (200 bits), on the GPU and with
   numpy; the labels must be identical.
4. **Where the card starts to pay** (``_gpu_thresholds.py``): the aggregation, the sketches' pairwise
   distances and the assignment timed on both sides at growing sizes, against the thresholds in the
   code (``GPU_MIN_BYTES``, ``AUTO_MIN_PDIST_ROWS``, ``AUTO_MIN_ROWS``).

Without a GPU the GPU parts are skipped (their keys are null) and the script says so. ``--data``
names the MNIST IDX folder; without it the round runs on scikit-learn's digits (8x8, the digits CNN).
``--quick`` shrinks everything to seconds (``make test`` runs it).

Run: ``.venv/bin/python benchmarks/gpu.py [--data ../shared/data/mnist] [--quick]``. The last line
is JSON with the keys ``agg_ms_resnet18_gpu``, ``agg_ms_resnet18_cpu``, ``agg_ms_lenet5_gpu``,
``agg_ms_lenet5_cpu``, ``pinned_transfer_ms_resnet18``, ``agg_ms_resnet18_int4_gpu``,
``int4_on_gpu_over_float32_transfer``, ``round_s_gpu_batched``,
``round_s_cpu_sequential``, ``round_s_cpu_batched``, ``batched_over_sequential_cpu``,
``assign_1m_s_gpu``, ``assign_1m_s_cpu``, ``gpu`` (the card's name or null) and more.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mnist"
#: Relative bound between a float32 accumulator's average and the float64 reference: about N * 2**-24.
F32_BOUND = 2.0 ** -24


class BenchFailure(RuntimeError):
    """The work timed was not all done, or not right: no rate is reported."""


# --------------------------------------------------------------------------- aggregation


def make_updates(architecture: str, count: int, seed: int) -> list[tuple[dict[str, np.ndarray], int]]:
    """``count`` distinct updates of an architecture: its seeded weights plus noise (sd 0.01), with counts."""
    from edge_sdk.training.trainer import initial_weights

    base = initial_weights(architecture, seed)
    out = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        w = {k: (v + rng.standard_normal(v.shape, dtype=np.float32) * np.float32(0.01)) if v.dtype.kind == "f"
             else v.copy() for k, v in base.items()}
        out.append((w, int(rng.integers(10, 1000))))
    return out


def aggregate_ms(updates: list[tuple[dict[str, np.ndarray], int]], device: str | None, kernels: str,
                 repeats: int) -> float:
    """Best per-update milliseconds of adding every update and settling; the result checked.

    ``device=None, kernels="auto"``: where the server puts this model by itself.
    """
    from server_kit.aggregate import StreamingFedAvg, fedavg

    agg = StreamingFedAvg(updates[0][0], device=device, kernels=kernels)
    best = timed_passes(agg, updates, lambda a, w, n: a.add(w, n), repeats, f"{device}/{kernels}")
    got, ref = agg.result(), fedavg(updates)
    bound = 4 * len(updates) * F32_BOUND
    for k, v in ref.items():
        if v.dtype.kind == "f":
            err = float(np.abs(got[k].astype(np.float64) - v).max() / max(float(np.abs(v).max()), 1e-30))
            if err > bound:
                raise BenchFailure(f"{device}/{kernels}: {k} differs from the float64 reference by {err:.2e} "
                                   f"(bound {bound:.2e})")
    return 1000.0 * best / len(updates)


def timed_passes(agg: Any, items: list[tuple[Any, int]], add: Any, repeats: int, label: str) -> float:
    """Best seconds of ``add(agg, item, n)`` for every item then ``settle()``, after a warm-up; every item counted."""
    for item, n in items[:2]:  # warm up: allocations, index maps, the first CUDA kernels
        add(agg, item, n)
    agg.settle()
    best = float("inf")
    for _ in range(repeats):
        agg.reset()
        t0 = time.perf_counter()
        for item, n in items:
            add(agg, item, n)
        refused = agg.settle()
        best = min(best, time.perf_counter() - t0)
        if refused or agg.count != len(items):
            raise BenchFailure(f"{label}: {agg.count} of {len(items)} updates summed, refused {refused}")
    return best


def coded_updates(updates: list[tuple[dict[str, np.ndarray], int]], method: str
                  ) -> tuple[dict[str, np.ndarray], list[tuple[bytes, int]]]:
    """The updates as compressed bodies of ``method`` (their change from the first update's model), and that base."""
    from edge_sdk.compress import Compression, encode_delta

    base = updates[0][0]
    comp = Compression.parse(method)
    bodies = []
    for w, n in updates:
        delta = {k: np.subtract(v, base[k], dtype=np.float32) for k, v in w.items()}
        bodies.append((encode_delta(delta, comp)[0], n))
    return base, bodies


def aggregate_coded_ms(base: dict[str, np.ndarray], bodies: list[tuple[bytes, int]], method: str, device: str,
                       decode_on_device: bool, repeats: int, kernels: str = "staged") -> float:
    """Best per-update milliseconds of adding every compressed body (framed or decoded on the clock) and settling.

    Each body goes the server's round's way, with the norm its screening reads. ``decode_on_device``: checked
    whole and kept coded, its norm from the codes (``coded_change``), the codes cross to ``device`` and are
    decoded there (``add_coded``); otherwise decoded on the host (``decode_delta`` and ``with_delta``), its norm
    from the decoded weights (``delta_norm``) and its float32 weights added. The two sums must be bit for bit
    equal, and every update counted, or no rate is reported.
    """
    from edge_sdk.compress import Method, decode_delta
    from edge_sdk.compress.frames import coded_change
    from edge_sdk.compress.update_codec import with_delta
    from server_kit.aggregate import StreamingFedAvg
    from server_kit.robust.screening import delta_norm

    m = Method(method)
    spec = {k: (v.shape, "float32") for k, v in base.items()}

    def one(agg: StreamingFedAvg, body: bytes, n: int) -> None:
        if decode_on_device:
            agg.add_coded(coded_change(body, spec, m).frames, m, base, n)
        else:
            w = with_delta(base, decode_delta(body, spec, m))
            delta_norm(w, base)
            agg.add(w, n)

    agg = StreamingFedAvg(base, device=device, kernels=kernels)
    best = timed_passes(agg, bodies, one, repeats, f"{method} on {device}")
    ref = StreamingFedAvg(base, device=device, kernels=kernels)
    for body, n in bodies:
        ref.add(with_delta(base, decode_delta(body, spec, m)), n)
    got, want = agg.result(), ref.result()
    if any(got[k].tobytes() != want[k].tobytes() for k in want):
        raise BenchFailure(f"{method} on {device}: the sum differs from the host-decoded sum")
    return 1000.0 * best / len(bodies)


def _placement_text(template: dict[str, np.ndarray]) -> str:
    """Where ``StreamingFedAvg(template)`` sums, said: ``"cuda, staged"`` or ``"cpu, numpy"``."""
    from server_kit.aggregate import StreamingFedAvg

    agg = StreamingFedAvg(template)
    return f"{agg.device.type}, {agg.kernels}"


def aggregation(args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    """The aggregation figures: per update, GPU and CPU, against the pinned transfer."""
    from server_kit.staging import pinned_transfer_seconds

    out: dict[str, Any] = {}
    sizes = {"resnet18": ("resnet18_3x32x32_10", 3 if args.quick else 20),
             "lenet5": ("lenet5_1x28x28_10", 10 if args.quick else 200)}
    for name, (arch, count) in sizes.items():
        updates = make_updates(arch, count, args.seed)
        nbytes = sum(v.nbytes for v in updates[0][0].values() if v.dtype.kind == "f")
        out[f"agg_ms_{name}_cpu"] = aggregate_ms(updates, "cpu", "numpy", args.repeats)
        out[f"agg_ms_{name}_cpu_staged"] = aggregate_ms(updates, "cpu", "staged", args.repeats)
        out[f"agg_ms_{name}_auto"] = aggregate_ms(updates, None, "auto", args.repeats)
        out[f"auto_places_{name}"] = _placement_text(updates[0][0])
        out[f"agg_ms_{name}_gpu"] = aggregate_ms(updates, "cuda", "staged", args.repeats) if gpu else None
        out[f"agg_ms_{name}_gpu_per_tensor"] = aggregate_ms(updates, "cuda", "torch", args.repeats) if gpu else None
        base, bodies = coded_updates(updates, "int4")
        out[f"int4_body_mb_{name}"] = len(bodies[0][0]) / 1e6
        out[f"agg_ms_{name}_int4_cpu_host_decode"] = aggregate_coded_ms(base, bodies, "int4", "cpu", False,
                                                                         args.repeats)
        out[f"agg_ms_{name}_int4_cpu_staged"] = aggregate_coded_ms(base, bodies, "int4", "cpu", True, args.repeats)
        out[f"agg_ms_{name}_int4_cpu_numpy_host_decode"] = aggregate_coded_ms(base, bodies, "int4", "cpu", False,
                                                                               args.repeats, "numpy")
        out[f"agg_ms_{name}_int4_cpu_numpy_at_sum"] = aggregate_coded_ms(base, bodies, "int4", "cpu", True,
                                                                          args.repeats, "numpy")
        out[f"agg_ms_{name}_int4_gpu"] = aggregate_coded_ms(base, bodies, "int4", "cuda", True, args.repeats) \
            if gpu else None
        out[f"agg_ms_{name}_int4_gpu_host_decode"] = aggregate_coded_ms(base, bodies, "int4", "cuda", False,
                                                                         args.repeats) if gpu else None
        if name == "resnet18":
            out["update_mb_resnet18"] = nbytes / 1e6
            out["pinned_transfer_ms_resnet18"] = 1000.0 * pinned_transfer_seconds(nbytes) if gpu else None
            if gpu:
                out["int4_on_gpu_over_float32_transfer"] = out["agg_ms_resnet18_int4_gpu"] / \
                    out["pinned_transfer_ms_resnet18"]
        print(f"{name} update ({nbytes / 1e6:.2f} MB, {count} updates): CPU numpy {out[f'agg_ms_{name}_cpu']:.3f} ms "
              f"(staged on the CPU {out[f'agg_ms_{name}_cpu_staged']:.3f} ms)", end="")
        print(f"; by itself the server puts it {out[f'auto_places_{name}']}: {out[f'agg_ms_{name}_auto']:.3f} ms",
              end="")
        if gpu:
            g = out[f"agg_ms_{name}_gpu"]
            print(f"; GPU staged {g:.3f} ms ({out[f'agg_ms_{name}_cpu'] / g:.1f}x faster than the CPU), "
                  f"GPU per tensor {out[f'agg_ms_{name}_gpu_per_tensor']:.3f} ms", end="")
            if name == "resnet18":
                p = out["pinned_transfer_ms_resnet18"]
                print(f"; pinned transfer alone {p:.3f} ms: the update takes {g / p:.2f}x the transfer", end="")
        print(f"\n  as int4 bodies ({out[f'int4_body_mb_{name}']:.2f} MB), each with its norm: on the CPU's numpy "
              f"sums decoded at intake {out[f'agg_ms_{name}_int4_cpu_numpy_host_decode']:.3f} ms, at the sum "
              f"{out[f'agg_ms_{name}_int4_cpu_numpy_at_sum']:.3f} ms; on the staged sums (the GPU's code, run on the "
              f"CPU) at intake {out[f'agg_ms_{name}_int4_cpu_host_decode']:.3f} ms, by the sum "
              f"{out[f'agg_ms_{name}_int4_cpu_staged']:.3f} ms", end="")
        if gpu:
            print(f"; on the GPU: host-decoded {out[f'agg_ms_{name}_int4_gpu_host_decode']:.3f} ms, decoded on the "
                  f"card {out[f'agg_ms_{name}_int4_gpu']:.3f} ms", end="")
            if name == "resnet18":
                print(f" = {out['int4_on_gpu_over_float32_transfer']:.2f}x the float32 pinned transfer", end="")
        print()
    return out


# --------------------------------------------------------------------------- a round


def round_clients(args: argparse.Namespace) -> tuple[list[Any], str, str]:
    """The scenario's clients, their architecture, and what data they hold."""
    from server_kit.data.partition import load_digits_images, rotation_groups

    n_clients = 8 if args.quick else 100
    if not args.quick and args.data.is_dir():
        from server_kit.data.idx import load_mnist

        images, labels = load_mnist(args.data, "train")
        clients = rotation_groups(images, labels, n_clients, groups=4, seed=args.seed, alpha=10.0, min_size=10)
        return clients, "lenet5_1x28x28_10", f"MNIST from {args.data}"
    images, labels = load_digits_images()
    clients = rotation_groups(images, labels, n_clients, groups=4, seed=args.seed, alpha=10.0, min_size=10)
    why = "--quick" if args.quick else f"no MNIST at {args.data}"
    return clients, "digits_cnn_1x8x8_10", f"scikit-learn's digits ({why})"


def one_round(clients: list[Any], arch: str, epochs: int, device: str, batched: bool,
              seed: int, lr: float, step: str = "eager") -> tuple[float, float]:
    """Seconds to train half the clients for one round from one model, and their models' mean accuracy."""
    from edge_sdk.tasks import Task, TrainSettings
    from edge_sdk.training.trainer import initial_weights
    from edge_sdk.worker import LocalWorker
    from server_kit.drivers.sim_training import RoundTraining

    workers = {c.cid: LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=arch, seed=i)
               for i, c in enumerate(clients)}
    chosen = sorted(np.random.default_rng(seed).choice(len(clients), len(clients) // 2, replace=False))
    start = initial_weights(arch, seed)
    settings = TrainSettings(epochs=epochs, lr=lr, batch_size=32)
    tasks = [Task(clients[i].cid, 1, {"global": start}, settings, evaluate_first=False) for i in chosen]
    training = RoundTraining(workers, device=device, batched=batched, step=step)
    t0 = time.perf_counter()
    updates = training.train(tasks)
    seconds = time.perf_counter() - t0
    if [u.cid for u in updates] != [t.cid for t in tasks]:
        raise BenchFailure(f"{device} batched={batched}: {len(updates)} updates for {len(tasks)} tasks")
    acc = float(np.mean([workers[u.cid].evaluate(u.weights)["accuracy"] for u in updates]))
    return seconds, acc


def round_runs(gpu: bool, steps: list[str]) -> list[tuple[str, str, bool, str]]:
    """(name, device, batched, step) of each order timed: one by one on the CPU, batched with each step."""
    tails = {step: "" if step == "eager" else f"_{step}" for step in steps}
    on_gpu = [(f"gpu_batched{tails[s]}", "cuda", True, s) for s in steps] if gpu else []
    # CUDA graphs only on CUDA: on the CPU "graphs" is "compile"
    on_cpu = [(f"cpu_batched{tails[s]}", "cpu", True, s) for s in steps if s != "graphs"]
    return [*on_gpu, ("cpu_sequential", "cpu", False, "eager"), *on_cpu]


def simulated_round(args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    """The round figures: GPU batched (each step), CPU one by one, CPU batched (each step)."""
    clients, arch, what = round_clients(args)
    digits = arch.startswith("digits")
    epochs, lr = (3 if args.quick else 5), (1e-2 if digits else 1e-3)  # the digits CNN learns little at 1e-3
    print(f"a round: {len(clients) // 2} of {len(clients)} clients, {arch}, {epochs} epochs, lr {lr:g}, {what}")
    out: dict[str, Any] = {"round_data": what, "round_clients": len(clients) // 2}
    steps = (args.steps or ("eager" if args.quick else "eager,compile,graphs")).split(",")
    for name, device, batched, step in round_runs(gpu, steps):
        try:
            # warm up: first calls, CUDA's start; a compiled step compiles for the round's shape (timed apart)
            t0 = time.perf_counter()
            one_round(clients if step != "eager" else clients[:4], arch, 1, device, batched, args.seed, lr, step)
            if step != "eager":
                out[f"round_first_s_{name}"] = time.perf_counter() - t0
            seconds, acc = one_round(clients, arch, epochs, device, batched, args.seed, lr, step)
        except Exception as e:  # a compiler's failure on this machine is a finding, not the end of the run
            if step == "eager" or isinstance(e, BenchFailure):
                raise
            out[f"round_s_{name}"] = out[f"round_acc_{name}"] = None
            out[f"round_error_{name}"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"  {name.replace('_', ', ')}: failed, {out[f'round_error_{name}']}")
            continue
        out[f"round_s_{name}"], out[f"round_acc_{name}"] = seconds, acc
        first = f" (its first 1-epoch call {out[f'round_first_s_{name}']:.1f} s)" if step != "eager" else ""
        print(f"  {name.replace('_', ', ')}: {seconds:.2f} s, the models' mean accuracy {acc:.4f}{first}")
    out.setdefault("round_s_gpu_batched", None)
    sequential = out["round_s_cpu_sequential"]
    if "round_s_cpu_batched" in out:
        out["batched_over_sequential_cpu"] = sequential / out["round_s_cpu_batched"]
        print(f"  batched on the CPU: {out['batched_over_sequential_cpu']:.2f}x the speed of one by one")
    for name in [n for n, *_ in round_runs(gpu, steps) if n.startswith("gpu") and out[f"round_s_{n}"]]:
        out[f"{name}_over_cpu_sequential"] = sequential / out[f"round_s_{name}"]
        print(f"  {name.replace('_', ', ')}: {out[f'{name}_over_cpu_sequential']:.1f}x the speed of one by one "
              "on the CPU")
    return out


# --------------------------------------------------------------------------- assignment


def assignment(args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    """Seconds to assign the sketches to their nearest centroid, numpy and GPU; the labels compared."""
    from server_kit.clustering.centroids import nearest_centroids

    n, n_bits, k = (20_000 if args.quick else 1_000_000), 200, 8
    rng = np.random.default_rng(args.seed)
    centres = rng.integers(0, 2, (k, n_bits))
    flips = rng.random((n, n_bits)) < 0.2
    bits = (centres[rng.integers(0, k, n)] ^ flips).astype(np.uint8)
    packed = np.packbits(bits, axis=1)
    centroids = np.clip(centres + rng.normal(0, 0.1, centres.shape), 0, 1)
    t0 = time.perf_counter()
    cpu = nearest_centroids(packed, n_bits, centroids, device="cpu")
    out: dict[str, Any] = {"assign_rows": n, "assign_1m_s_cpu": time.perf_counter() - t0, "assign_1m_s_gpu": None}
    print(f"{n:,} sketches assigned to {k} centroids: numpy {out['assign_1m_s_cpu']:.2f} s", end="")
    if gpu:
        nearest_centroids(packed[:1000], n_bits, centroids, device="cuda")  # CUDA's start, outside the clock
        t0 = time.perf_counter()
        labels = nearest_centroids(packed, n_bits, centroids, device="cuda")
        out["assign_1m_s_gpu"] = time.perf_counter() - t0
        if not np.array_equal(labels, cpu):
            raise BenchFailure(f"the GPU gave {int((labels != cpu).sum())} labels other than numpy's")
        out["assign_same_labels"] = True
        print(f"; GPU {out['assign_1m_s_gpu']:.3f} s ({out['assign_1m_s_cpu'] / out['assign_1m_s_gpu']:.1f}x), "
              "the same labels", end="")
    print()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the MNIST IDX folder (else digits)")
    ap.add_argument("--quick", action="store_true", help="seconds, not minutes: small sizes everywhere")
    ap.add_argument("--repeats", type=int, default=3, help="aggregation passes (the best is kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", default=None,
                    help="how the batched rounds' steps run, each timed: eager, compile, graphs (CUDA graphs; on a "
                         "GPU only) (default: all three; with --quick: eager)")
    ap.add_argument("--parts", default="aggregation,round,assignment,thresholds",
                    help="which parts to run (thresholds: where the card starts to pay, _gpu_thresholds.py)")
    args = ap.parse_args(argv)
    import torch

    gpu = bool(torch.cuda.is_available())
    name = torch.cuda.get_device_name(0) if gpu else None
    print(f"GPU: {name}" if gpu else "no GPU: torch sees no CUDA device, so only the CPU parts run")
    from _gpu_thresholds import ThresholdFailure, thresholds

    parts = {"aggregation": aggregation, "round": simulated_round, "assignment": assignment,
             "thresholds": thresholds}
    out: dict[str, Any] = {"gpu": name, "quick": args.quick, "cpu_threads": torch.get_num_threads()}
    try:
        for part in args.parts.split(","):
            out.update(parts[part](args, gpu))
    except (BenchFailure, ThresholdFailure) as e:
        print(f"gpu.py: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
