"""Compressed rounds on the paper's MNIST scenario: bytes to 95 %, accuracy, and the codec's speed and memory.

Ours (the centrally pre-trained encoder) with whole float32 models (``none``)
and with each compression method, and IFCA (K = 4) with the best of them, on
the partition, seeds and local settings of ``benchmarks/paper_mnist.py`` (100
clients, Dirichlet alpha = 10 label skew, four rotations, 50 clients per round,
LeNet-5 with its two convolutions shared, Adam 1e-3, batch 32, 5 local epochs,
P = 0.1), in the in-process simulator, which counts the bytes of the real
encoded bodies both ways (updates up; models down, each as the chain of
compressed changes since the version the device holds, or whole).

"best" is the compressed method that reaches the target with the fewest bytes
among those whose final accuracy (mean of the last 5 rounds) is within
``--tolerance`` of ``none``'s (the fewest bytes overall, flagged, if none is).

It also times the codec on one thread: encoding (with error feedback) and
decoding a LeNet-5 delta and a ResNet-18 one, and the peak memory the
encoding of a ResNet-18 delta adds (tracemalloc, over the model's size).

``--quick`` runs on scikit-learn's digits (12 clients, 6 rounds; no data
folder needed) against a target it reaches (``target``): the smoke test of
``make test``.

Run: ``.venv/bin/python benchmarks/compression.py [--rounds 20] [--jobs 2]``.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from paper_mnist import DEFAULT_DATA, architecture_of, build_clients  # noqa: E402

METHODS = ("none", "int8", "topk:0.01", "stc:0.01")


def run_one(label: str, args) -> dict:
    """One run (``ours:<method>`` or ``ifca:<method>``): accuracy per round and cumulative bytes per round."""
    from edge_sdk import OnnxEncoder
    from edge_sdk.nets import BASE_LAYERS
    from edge_sdk.tasks import TrainSettings
    from server_kit.drivers.simulate import Simulator
    from server_kit.metrics import final_accuracy, rounds_to_target
    from server_kit.strategies.fedsketch import SketchClustered
    from server_kit.strategies.ifca import IFCA

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    method, _, comp = label.partition(":")
    arch = architecture_of(args)
    clients = build_clients(args)
    settings = TrainSettings(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size)
    common = dict(settings=settings, fraction=args.fraction, seed=args.seed, compression=comp)
    t0 = time.perf_counter()
    if method == "ifca":
        strategy, encoder = IFCA(k=4, architecture=arch, **common), None
    else:
        shared = dict(shared_prefixes=BASE_LAYERS.get(arch, ())) if args.shared_base else {}
        strategy = SketchClustered(min_cluster_size=max(3, args.clients // 10), **shared, **common)
        encoder = OnnxEncoder(args.encoder)
    res = Simulator(strategy, clients, architecture=arch, encoder=encoder, flip_prob=args.flip_prob,
                    seed=args.seed).run(args.rounds)
    accs = res.accuracies
    r95 = rounds_to_target(accs, args.target)
    row = {"label": label, "accuracy": accs, "bytes": [r.bytes_total for r in res.rounds],
           "rounds_to_target": r95, "bytes_to_target": res.bytes_until(r95) if r95 else None,
           "final_acc": final_accuracy(accs), "ari": res.ari, "total_bytes": res.total_bytes(),
           "by_kind": res.ledger.as_dict(), "seconds": time.perf_counter() - t0}
    print(f"  {label:16s} final {row['final_acc']:.4f}  to {args.target:.0%}: round {r95}, "
          f"{(row['bytes_to_target'] or 0) / 1e6:8.2f} MB  ARI {res.ari:.3f}  all {row['total_bytes'] / 1e6:8.2f} MB  "
          f"{row['seconds']:.0f} s", flush=True)
    return row


def codec_speed(arch: str, comp_text: str, repeats: int) -> dict:
    """Milliseconds to encode (with feedback) and decode one delta of ``arch`` on one thread; peak extra memory."""
    import torch

    from edge_sdk.compress import Compression, ErrorFeedback, decode_delta
    from edge_sdk.trainer import initial_weights

    torch.set_num_threads(1)
    w = initial_weights(arch, 0)
    rng = np.random.default_rng(0)
    delta = {n: (rng.normal(size=v.shape) * 1e-3).astype(np.float32) for n, v in w.items()}
    spec = {n: (v.shape, "float32") for n, v in delta.items()}
    comp = Compression.parse(comp_text)
    fb = ErrorFeedback(comp)
    enc, dec = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        body, _ = fb.compress("c0", delta)
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        decode_delta(body, spec, comp.method)
        dec.append(time.perf_counter() - t)
    model_bytes = sum(v.nbytes for v in delta.values())
    fresh = ErrorFeedback(comp)
    tracemalloc.start()  # the device's side: its delta in hand, what compressing it adds (residual kept included)
    body, sent = fresh.compress("c0", delta)
    _, peak = tracemalloc.get_traced_memory()
    del sent
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    decode_delta(body, spec, comp.method)  # the server's side
    _, dec_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"encode_ms": 1e3 * float(np.median(enc)), "decode_ms": 1e3 * float(np.median(dec)),
            "model_bytes": model_bytes, "body_bytes": len(body), "peak_extra_over_model": peak / model_bytes,
            "decode_peak_over_model": (dec_peak - base) / model_bytes}


def pick_best(rows: dict, tolerance: float) -> tuple[str, bool]:
    """The compressed run that reaches the target with the fewest bytes, within ``tolerance`` of none's accuracy."""
    base = rows["ours:none"]["final_acc"]
    cands = [k for k, r in rows.items() if k.startswith("ours:") and k != "ours:none" and r["bytes_to_target"]]
    good = [k for k in cands if rows[k]["final_acc"] >= base - tolerance]
    pool = good or cands
    if not pool:
        return "ours:none", False
    return min(pool, key=lambda k: rows[k]["bytes_to_target"]), bool(good)


def plot(path: Path, rows: dict, target: float) -> None:
    from server_kit.report.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, r in rows.items():
        ax.plot(np.asarray(r["bytes"]) / 1e6, r["accuracy"], marker=".", label=label)
    ax.axhline(target, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())  # the decades only: the minor labels overlap
    ax.set_xlabel("cumulative bytes, up and down (MB, log scale)")
    ax.set_ylabel("mean local test accuracy")
    ax.set_title("Accuracy against the bytes moved, per method")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> dict:
    from server_kit.report import write_json

    labels = [f"ours:{m}" for m in args.methods]
    print(f"{args.dataset}: {args.clients} clients, {args.rounds} rounds x {args.epochs} epochs, fraction "
          f"{args.fraction}, target {args.target:.0%}; {', '.join(labels)}, then IFCA with the best", flush=True)
    t0 = time.perf_counter()
    rows = _run_all(labels, args)
    best, within = pick_best(rows, args.tolerance)
    ifca = f"ifca:{best.partition(':')[2]}"
    rows[ifca] = _run_all([ifca], args)[ifca]
    none, b, fc = rows["ours:none"], rows[best], rows[ifca]
    speed = {k: codec_speed(a, best.partition(":")[2] if best != "ours:none" else "topk:0.01", args.repeats)
             for k, a in (("lenet", "lenet5_1x28x28_10"), ("resnet18", "resnet18_3x32x32_10"))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(out / "accuracy_vs_bytes.png", rows, args.target)
    summary = {
        "target": args.target, "best": best.partition(":")[2], "best_within_tolerance": within,
        "bytes_to_95_none": none["bytes_to_target"], "bytes_to_95_best": b["bytes_to_target"],
        "bytes_ratio_to_95": _ratio(none["bytes_to_target"], b["bytes_to_target"]),
        "rounds_to_95_none": none["rounds_to_target"], "rounds_to_95_best": b["rounds_to_target"],
        "final_acc_none": round(none["final_acc"], 4), "final_acc_best": round(b["final_acc"], 4),
        "ifca_bytes_over_ours_best": _ratio(fc["total_bytes"], b["total_bytes"]),
        "ifca_final_acc": round(fc["final_acc"], 4),
        "methods": {k: {"bytes_to_target": r["bytes_to_target"], "rounds_to_target": r["rounds_to_target"],
                        "final_acc": round(r["final_acc"], 4), "ari": r["ari"], "total_bytes": r["total_bytes"]}
                    for k, r in rows.items()},
        "encode_ms_lenet": round(speed["lenet"]["encode_ms"], 3), "decode_ms_lenet": round(speed["lenet"]["decode_ms"], 3),
        "encode_ms_resnet18": round(speed["resnet18"]["encode_ms"], 1),
        "decode_ms_resnet18": round(speed["resnet18"]["decode_ms"], 1),
        "resnet18_peak_extra_over_model": round(speed["resnet18"]["peak_extra_over_model"], 3),
        "dataset": args.dataset, "clients": args.clients, "rounds": args.rounds,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_json(out / "results.json", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                      "speed": speed, "summary": summary})
    print(f"\nbest: {best} ({'within' if within else 'NOT within'} {args.tolerance} of none's final accuracy)")
    print(f"to {args.target:.0%}: none {none['bytes_to_target']} B in {none['rounds_to_target']} rounds, "
          f"best {b['bytes_to_target']} B in {b['rounds_to_target']} rounds: {summary['bytes_ratio_to_95']}x fewer")
    print(f"IFCA with {best.partition(':')[2]}: {summary['ifca_bytes_over_ours_best']}x ours' bytes")
    print(f"codec, one thread: LeNet-5 {summary['encode_ms_lenet']} ms / {summary['decode_ms_lenet']} ms, ResNet-18 "
          f"{summary['encode_ms_resnet18']} ms / {summary['decode_ms_resnet18']} ms; ResNet-18 peak extra "
          f"{summary['resnet18_peak_extra_over_model']}x the model")
    print(f"report: {out}/results.json, {out}/accuracy_vs_bytes.png")
    return summary


def _ratio(a, b):
    return round(a / b, 2) if a and b else None


def _run_all(labels: list[str], args) -> dict:
    if args.jobs == 1 or len(labels) == 1:
        return {label: run_one(label, args) for label in labels}
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {label: pool.submit(run_one, label, args) for label in labels}
        return {label: futures[label].result() for label in labels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the MNIST IDX files")
    ap.add_argument("--dataset", choices=["mnist", "digits"], default="mnist")
    ap.add_argument("--test-set", choices=["mnist-test", "held-out"], default="held-out",
                    help="each device's test set (paper_mnist.py's --test-set): 20 %% of its training shard "
                         "(held-out, the default and the protocol of this benchmark's recorded figures) or its "
                         "shard of MNIST's test images")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--alpha", type=float, default=10.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--tolerance", type=float, default=0.003, help="final accuracy a method may lose against none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--no-shared-base", dest="shared_base", action="store_false")
    ap.add_argument("--encoder", default=None, help="default: fmnist_fc_encoder (mnist), digits_encoder (digits)")
    ap.add_argument("--repeats", type=int, default=5, help="timings of the codec (the median is reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--jobs", type=int, default=1, help="runs side by side in this many processes")
    ap.add_argument("--out", default="reports/compression")
    ap.add_argument("--quick", action="store_true", help="digits, 12 clients, 6 rounds: the smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.dataset, args.clients, args.rounds, args.epochs = "digits", 12, 6, 3
        args.fraction, args.alpha, args.lr, args.batch_size, args.target = 1.0, 0.0, 1e-2, 16, 0.85
        args.tolerance, args.repeats = 0.05, 2
        args.out = args.out if args.out != "reports/compression" else "reports/compression_quick"
    args.methods = [m for m in args.methods.split(",") if m]
    if "none" not in args.methods:
        ap.error("--methods must include none (the baseline)")
    if args.encoder is None:
        args.encoder = "digits_encoder" if args.dataset == "digits" else "fmnist_fc_encoder"
    if args.dataset == "mnist" and not Path(args.data).is_dir():
        print(f"MNIST not found in {args.data}: pass --data DIR, or --quick for the digits version", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
