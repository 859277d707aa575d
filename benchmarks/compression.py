"""Compressed rounds on the paper's MNIST scenario: bytes to 95 % per pair of codecs (up, down), 5 seeds.

Ours (the centrally pre-trained encoder) with whole float32 models
(``none/none``) and with each pair of ``--combos`` (the codec of the
updates, then the codec of the models: ``sign/sign`` sends 1 bit per entry
both ways), and IFCA (K = 4) with the best pair, on the partition, test sets
and local settings of ``benchmarks/paper_mnist.py`` (100 clients, Dirichlet
alpha = 10 label skew, four rotations, each tested on its shard of MNIST's
test images, 50 clients per round, LeNet-5 with its two convolutions shared,
Adam 1e-3, batch 32, 5 local epochs, P = 0.1), in the in-process simulator,
which counts the bytes of the real encoded bodies both ways: every update,
every model a device is sent (nothing when it holds the current version, its
first model free when it is the portable initial one, else the chain of
changes, the exact merged catch-up or the whole model, whichever is smallest),
the sketches and the commands.

Each run stops at the first round whose mean accuracy reaches ``--target``
(or after ``--rounds``): its bytes then are ``bytes_to_target``, its
accuracy then ``final_acc``. Each seed draws its own partition and model.
"best" is the pair with the fewest mean bytes to the target among those
whose every seed reached it in at most ``none/none``'s rounds of that seed and whose
mean final accuracy is within ``--tolerance`` of ``none/none``'s (the fewest
bytes overall, flagged, if none is).

It also times the best upload codec on one thread (encoding with error
feedback, decoding) on a LeNet-5 delta and a ResNet-18 one, and measures a
device's extra memory for compression: the peak while it compresses plus the
residual it keeps (tracemalloc, over the model's size).

``--quick`` runs on scikit-learn's digits (12 clients, at most 4 rounds to 65 %, one seed, four pairs,
10 random threshold probes instead of 35, one timing; no data folder needed): the smoke test of ``make test``.

Run: ``.venv/bin/python benchmarks/compression.py --jobs 2``.
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

from _cli import add_device_options  # noqa: E402
from paper_mnist import DEFAULT_DATA, architecture_of, build_clients, models_per_update, round_bytes  # noqa: E402

COMBOS = ("none/none", "int4/int4", "rsign/rint2", "rsign/rtern")
BASELINE = "none/none"


def run_one(label: str, seed: int, args) -> dict:
    """One run (``ours:<up>/<down>`` or ``ifca:<up>/<down>``) of one seed, up to the first round at the target."""
    import argparse

    from edge_sdk import OnnxEncoder
    from edge_sdk.tasks import TrainSettings
    from edge_sdk.training.nets import BASE_LAYERS
    from server_kit.drivers.simulate import Simulator
    from server_kit.strategies.fedsketch import SketchClustered
    from server_kit.strategies.ifca import IFCA

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    method, _, combo = label.partition(":")
    up, _, down = combo.partition("/")
    seeded = argparse.Namespace(**{**vars(args), "seed": seed})
    arch = architecture_of(seeded)
    clients = build_clients(seeded)
    settings = TrainSettings(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size)
    common = dict(settings=settings, fraction=args.fraction, seed=seed, compress_up=up, compress_down=down)
    t0 = time.perf_counter()
    if method == "ifca":
        strategy, encoder = IFCA(k=4, architecture=arch, **common), None
    else:
        shared = dict(shared_prefixes=BASE_LAYERS.get(arch, ())) if args.shared_base else {}
        strategy = SketchClustered(min_cluster_size=max(3, args.clients // 10), clustering=args.clustering,
                                   **shared, **common)
        encoder = OnnxEncoder(args.encoder)
    res = Simulator(strategy, clients, architecture=arch, encoder=encoder, flip_prob=args.flip_prob,
                    seed=seed, device=args.device, batched=args.batched, step=args.step).run(args.rounds, stop=lambda s, r: r.accuracy >= args.target)
    lost = [(r.report.round, r.report.tasked, r.report.updates) for r in res.rounds
            if r.report.updates != r.report.tasked]
    if lost:  # bytes to the target count only over rounds whose every update was summed
        raise RuntimeError(f"{label} seed {seed}: rounds with updates lost (round, tasked, summed): {lost}")
    accs = res.accuracies
    reached = bool(accs) and accs[-1] >= args.target
    row = {"label": label, "seed": seed, "accuracy": accs, "bytes": [r.bytes_total for r in res.rounds],
           "rounds_to_target": len(accs) if reached else None,
           "bytes_to_target": res.total_bytes() if reached else None,
           "final_acc": accs[-1] if accs else 0.0, "ari": res.ari, "total_bytes": res.total_bytes(),
           "by_kind": res.ledger.as_dict(), "seconds": time.perf_counter() - t0}
    print(f"  {label:22s} seed {seed}  acc {row['final_acc']:.4f}  to {args.target:.0%}: round "
          f"{row['rounds_to_target']}, {(row['bytes_to_target'] or 0) / 1e6:8.2f} MB  ARI {res.ari:.3f}  "
          f"{row['seconds']:.0f} s", flush=True)
    return row


def summarise(runs: list[dict]) -> dict:
    """A label's runs over the seeds: means, 95 % intervals (t), every seed reached or not."""
    from scipy import stats

    def interval(values: list[float]) -> list[float] | None:
        if len(values) < 2:
            return None
        m, se = float(np.mean(values)), float(stats.sem(values))
        h = se * float(stats.t.ppf(0.975, len(values) - 1))
        return [m - h, m + h]

    b = [r["bytes_to_target"] for r in runs]
    reached = all(x is not None for x in b)
    rounds = [r["rounds_to_target"] for r in runs]
    acc = [r["final_acc"] for r in runs]
    return {"seeds": [r["seed"] for r in runs], "reached": reached,
            "bytes_to_target": float(np.mean(b)) if reached else None,
            "bytes_to_target_ci": interval(b) if reached else None, "bytes_per_seed": b,
            "rounds_to_target": rounds, "max_rounds_to_target": max(rounds) if reached else None,
            "final_acc": round(float(np.mean(acc)), 4), "final_acc_ci": interval(acc),
            "ari": [r["ari"] for r in runs], "total_bytes": float(np.mean([r["total_bytes"] for r in runs]))}


def pick_best(table: dict, tolerance: float) -> tuple[str, bool]:
    """The pair with the fewest bytes to the target, in none's rounds on every seed, accuracy within tolerance."""
    base = table[f"ours:{BASELINE}"]
    cands = [k for k, r in table.items() if k.startswith("ours:") and k != f"ours:{BASELINE}" and r["reached"]]
    good = [k for k in cands if r_ok(table[k], base, tolerance)]
    pool = good or cands
    if not pool:
        return f"ours:{BASELINE}", False
    return min(pool, key=lambda k: table[k]["bytes_to_target"]), bool(good)


def r_ok(row: dict, base: dict, tolerance: float) -> bool:
    """Within ``tolerance`` of the baseline's mean accuracy, and on every seed in at most the baseline's rounds of that seed."""
    in_time = all(b is None or (r is not None and r <= b) for r, b in zip(row["rounds_to_target"], base["rounds_to_target"]))
    return row["final_acc"] >= base["final_acc"] - tolerance and in_time


def device_memory(arch: str, comp_text: str, start: dict | None = None) -> dict:
    """A device's extra memory for compression over the model's size: the residual it held, plus the growth while compressing.

    The device path (:class:`edge_sdk.compress.update_codec.CompressedDelta` with
    the device's error feedback: a float16 residual, no dense copy of what was sent).
    """
    from edge_sdk.compress import Compression
    from edge_sdk.compress.update_codec import InMemoryFeedback, device_feedback, update_codec
    from edge_sdk.training.trainer import initial_weights

    start = initial_weights(arch, 0) if start is None else start
    rng = np.random.default_rng(0)
    trained = {n: (v + rng.normal(size=v.shape).astype(np.float32) * 1e-3) if v.dtype == np.float32 else v
               for n, v in start.items()}
    codec = update_codec(Compression.parse(comp_text))
    device = InMemoryFeedback(device_feedback(codec.compression))
    model_bytes = sum(v.nbytes for v in start.values())
    # a first round: the residual exists from then on; each call takes its own trained copy (the device's to lose)
    first, again = ({n: v.copy() for n, v in trained.items()} for _ in range(2))
    tracemalloc.start()
    codec.encode("c0", first, start, 0, device, lean=True)
    del first
    residual = device.feedback.residual_bytes()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    codec.encode("c0", again, start, 0, device, lean=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peak -= base  # beyond what was held before the call: the old residual (``residual``) is counted below
    return {"model_bytes": model_bytes, "peak_while_compressing": peak, "residual_bytes": residual,
            "extra_over_model": round((peak + residual) / model_bytes, 3)}


def codec_speed(arch: str, comp_text: str, repeats: int) -> dict:
    """Milliseconds to encode (with feedback) and decode one delta of ``arch`` on one thread."""
    import torch

    from edge_sdk.compress import Compression, ErrorFeedback, decode_delta
    from edge_sdk.training.trainer import initial_weights

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
    return {"encode_ms": 1e3 * float(np.median(enc)), "decode_ms": 1e3 * float(np.median(dec)),
            "model_bytes": sum(v.nbytes for v in delta.values()), "body_bytes": len(body),
            "memory": device_memory(arch, comp_text, w)}


def plot(path: Path, runs: dict, target: float) -> None:
    """Accuracy against cumulative bytes, one line per label (the first seed's run), log scale."""
    from server_kit.report.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, rows in runs.items():
        r = rows[0]
        ax.plot(np.asarray(r["bytes"]) / 1e6, r["accuracy"], marker=".", label=label)
    ax.axhline(target, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())  # the decades only: the minor labels overlap
    ax.set_xlabel("cumulative bytes, up and down (MB, log scale)")
    ax.set_ylabel("mean local test accuracy")
    ax.set_title(f"Accuracy against the bytes moved, per codec pair (up/down), seed {rows[0]['seed']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> dict:
    from server_kit.report import write_json

    labels = [f"ours:{c}" for c in args.combos]
    print(f"{args.dataset}: {args.clients} clients, at most {args.rounds} rounds x {args.epochs} epochs, fraction "
          f"{args.fraction}, target {args.target:.0%}, seeds {args.seeds}; {', '.join(labels)}, then IFCA with "
          "the best", flush=True)
    t0 = time.perf_counter()
    runs = _run_all(labels, args)
    table = {k: summarise(v) for k, v in runs.items()}
    best, within = pick_best(table, args.tolerance)
    combo = best.partition(":")[2]
    ifca = f"ifca:{combo}"
    runs.update(_run_all([ifca], args))
    table[ifca] = summarise(runs[ifca])
    none, b, fc = table[f"ours:{BASELINE}"], table[best], table[ifca]
    up = combo.partition("/")[0]
    speed = {k: codec_speed(a, up if up != "none" else "int8", args.repeats)
             for k, a in (("lenet", "lenet5_1x28x28_10"), ("resnet18", "resnet18_3x32x32_10"))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(out / "accuracy_vs_bytes.png", runs, args.target)
    summary = {
        "target": args.target, "seeds": args.seeds, "best": combo, "best_within_tolerance": within,
        "bytes_to_95_none": none["bytes_to_target"], "bytes_to_95_best": b["bytes_to_target"],
        "bytes_to_95_best_ci": b["bytes_to_target_ci"],
        "bytes_ratio_to_95": _ratio(none["bytes_to_target"], b["bytes_to_target"]),
        "bytes_ratio_to_95_per_seed": [_ratio(x, y) for x, y in zip(none["bytes_per_seed"], b["bytes_per_seed"])],
        "rounds_to_95_none": none["rounds_to_target"], "rounds_to_95_best": b["rounds_to_target"],
        "final_acc_none": none["final_acc"], "final_acc_best": b["final_acc"],
        "ifca_bytes_over_ours_best": _ratio(fc["bytes_to_target"] or fc["total_bytes"], b["bytes_to_target"]),
        "ifca_rounds_to_95": fc["rounds_to_target"], "ifca_final_acc": fc["final_acc"],
        "round_bytes_over_none": {k.partition(":")[2]: _ratio(round_bytes(runs[f"ours:{BASELINE}"][0]["bytes"]),
                                                              round_bytes(v[0]["bytes"]))
                                  for k, v in runs.items() if k.startswith("ours:")},
        "ifca_round_bytes_over_ours_best": _ratio(round_bytes(runs[ifca][0]["bytes"]), round_bytes(runs[best][0]["bytes"])),
        "models_down_per_update": {k: round(models_per_update(v[0]["by_kind"]), 3) for k, v in runs.items()},
        "bytes_to_95": {k: r["bytes_to_target"] for k, r in table.items()},
        "combos": table,
        "encode_ms_lenet": round(speed["lenet"]["encode_ms"], 3), "decode_ms_lenet": round(speed["lenet"]["decode_ms"], 3),
        "encode_ms_resnet18": round(speed["resnet18"]["encode_ms"], 1),
        "decode_ms_resnet18": round(speed["resnet18"]["decode_ms"], 1),
        "device_extra_memory_over_model_lenet": speed["lenet"]["memory"]["extra_over_model"],
        "device_extra_memory_over_model_resnet18": speed["resnet18"]["memory"]["extra_over_model"],
        "dataset": args.dataset, "test_set": args.test_set, "clients": args.clients, "max_rounds": args.rounds,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_json(out / "results.json", {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                      "speed": speed, "summary": summary})
    _print_table(table, args)
    print(f"\nbest: {combo} ({'within' if within else 'NOT within'} {args.tolerance} of none's accuracy and "
          "in none's rounds on every seed)")
    print(f"to {args.target:.0%}: none {none['bytes_to_target']} B, best {b['bytes_to_target']} B: "
          f"{summary['bytes_ratio_to_95']}x fewer (per seed {summary['bytes_ratio_to_95_per_seed']})")
    print(f"IFCA with {combo}: {summary['ifca_bytes_over_ours_best']}x ours' bytes to the target, "
          f"{summary['ifca_round_bytes_over_ours_best']}x per round; per round, none over each pair: "
          + ", ".join(f"{k} {v}x" for k, v in summary["round_bytes_over_none"].items()))
    print(f"codec {up}, one thread: LeNet-5 {summary['encode_ms_lenet']} ms / {summary['decode_ms_lenet']} ms, "
          f"ResNet-18 {summary['encode_ms_resnet18']} ms / {summary['decode_ms_resnet18']} ms; a device's extra "
          f"memory {summary['device_extra_memory_over_model_lenet']}x (LeNet-5), "
          f"{summary['device_extra_memory_over_model_resnet18']}x (ResNet-18) the model")
    print(f"report: {out}/results.json, {out}/accuracy_vs_bytes.png")
    return summary


def _print_table(table: dict, args) -> None:
    print(f"\n{'run':24s} {'MB to target (95% CI)':>28s} {'rounds':>10s} {'acc':>7s}")
    for k, r in table.items():
        ci = r["bytes_to_target_ci"]
        mb = (f"{r['bytes_to_target'] / 1e6:8.2f}" + (f" ({ci[0] / 1e6:.2f}-{ci[1] / 1e6:.2f})" if ci else "")
              if r["reached"] else "not reached")
        print(f"{k:24s} {mb:>28s} {str(r['rounds_to_target']):>10s} {r['final_acc']:7.4f}")


def _ratio(a, b):
    return round(a / b, 2) if a and b else None


def _run_all(labels: list[str], args) -> dict[str, list[dict]]:
    jobs = [(label, seed) for label in labels for seed in args.seeds]
    if args.jobs == 1 or len(jobs) == 1:
        done = {job: run_one(*job, args) for job in jobs}
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        print(f"threads: {args.jobs} processes, each with {args.threads or 'torch default'} torch thread(s)",
              file=sys.stderr, flush=True)
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = {job: pool.submit(run_one, *job, args) for job in jobs}
            done = {job: f.result() for job, f in futures.items()}
    return {label: [done[(label, seed)] for seed in args.seeds] for label in labels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_options(ap)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the MNIST IDX files")
    ap.add_argument("--dataset", choices=["mnist", "digits"], default="mnist")
    ap.add_argument("--test-set", choices=["mnist-test", "held-out"], default="mnist-test",
                    help="each device's test set (paper_mnist.py's --test-set): its shard of MNIST's test images "
                         "(mnist-test, the paper's protocol, the default) or 20 %% of its training shard")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=10, help="rounds at most (each run stops at the target)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--alpha", type=float, default=10.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--tolerance", type=float, default=0.003, help="accuracy a pair may lose against none/none")
    ap.add_argument("--seeds", default=None,
                    help="comma-separated seeds (partition, models, sampling); default 0,1,2,3,4 (--quick: 0)")
    ap.add_argument("--combos", default=",".join(COMBOS), help="comma-separated up/down codec pairs")
    ap.add_argument("--no-shared-base", dest="shared_base", action="store_false")
    ap.add_argument("--encoder", default=None, help="default: fmnist_fc_encoder (mnist), digits_encoder (digits)")
    ap.add_argument("--repeats", type=int, default=5, help="timings of the codec (the median is reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--jobs", type=int, default=1, help="runs side by side in this many processes")
    ap.add_argument("--out", default="reports/compression")
    ap.add_argument("--quick", action="store_true", help="digits, 12 clients, 4 rounds, one seed: the smoke test")
    args = ap.parse_args(argv)
    args.clustering = {}
    if args.quick:
        args.dataset, args.clients, args.rounds, args.epochs = "digits", 12, 4, 3
        args.fraction, args.alpha, args.lr, args.batch_size, args.target = 1.0, 0.0, 1e-2, 16, 0.65
        args.tolerance, args.repeats = 0.05, 1
        # 12 clients make at most 11 cuts: 10 random probes find the best as 35 do (ARI 1.0 both ways)
        args.clustering = {"n_calls": 10, "n_initial_points": 10}
        args.seeds = args.seeds or "0"
        args.combos = args.combos if args.combos != ",".join(COMBOS) else "none/none,int8/int8,int4/int4,rsign/rtern"
        args.out = args.out if args.out != "reports/compression" else "reports/compression_quick"
    args.seeds = args.seeds or "0,1,2,3,4"
    try:
        args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    args.combos = [c.strip() for c in args.combos.split(",") if c.strip()]
    if BASELINE not in args.combos:
        ap.error(f"--combos must include {BASELINE} (the baseline)")
    bad = [c for c in args.combos if c.count("/") != 1]
    if bad or not args.seeds:
        ap.error(f"--combos are up/down pairs such as sign/int4, got {bad}" if bad else "--seeds names no seed")
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
