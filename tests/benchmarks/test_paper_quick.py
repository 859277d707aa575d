"""The paper comparison's --quick run (digits): the smoke test of benchmarks/paper_mnist.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "paper_mnist.py"


def _quick(out: Path, *extra: str) -> tuple[dict, dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--out", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["seed"] for r in runs] == summary["seeds"]
    return summary, runs[0]["rows"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper_quick")
    return (*_quick(out), out)


def test_quick_reproduction_bounds(quick):
    # measured with --quick --seeds S, (S = 0-3), on this machine's floating-point path and with FPALT (AVX2,
    # 2 threads): the ranges below are over those 8 runs
    summary, rows, out = quick
    assert summary["rounds"] == 3 and summary["clients"] == 12
    assert summary["ours_ari"] == 1.0  # the sketches, before any training: 1.0 on every run
    # ours 0.428-0.499 against FedAvg 0.191-0.261: at least 0.17 apart on every seed
    assert summary["ours_final_acc"] > summary["fedavg_final_acc"]
    # structural: ours sends each device one model per update (1.0 on every run), IFCA every changed model of
    # its K = 4 (3.0), so per round (1 up + 4 down) / (1 + 1) = 2.496 on every run; bound 1.5 leaves room for
    # IFCA clusters that empty (1.83 seen in longer runs of benchmarks/compression.py)
    models = summary["models_down_per_update"]
    assert models["ours-central"] == 1.0 and models["ifca"] >= 2.5
    assert summary["ifca_round_bytes_over_ours"] > 1.5
    assert summary["ifca_bytes_over_ours"] > 1.5  # the 3 rounds whole: 1.997 on every run
    assert summary["ladd_ari"] < 0.6  # FFT amplitudes cannot tell 0 from 180 degrees: 0.185-0.430
    assert {"ours_rounds_to_95", "rounds", "clients", "epochs"} <= set(summary)
    assert set(rows) == {"ours-central", "ours-federated", "ifca", "ladd", "fedavg"}
    assert rows["ours-federated"]["pretrain_bytes"] > 0 and rows["ours-federated"]["seconds_pretrain"] > 0
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"


def test_jobs_run_methods_side_by_side_with_the_same_results(quick, tmp_path):
    _, seq, _ = quick
    methods = ["ours-central", "ladd", "fedavg"]
    summary, par = _quick(tmp_path, "--jobs", "2", "--methods", ",".join(methods))
    assert list(par) == methods  # the table keeps the order asked, whatever finished first
    for m in methods:
        assert par[m]["accuracy"] == seq[m]["accuracy"], m  # same seeds, same thread count: same training
        assert par[m]["ari"] == seq[m]["ari"]
        # sizes of update messages are taken from each run's first update, whose float metadata may differ
        assert abs(par[m]["bytes"] - seq[m]["bytes"]) < 1e-4 * seq[m]["bytes"]
    assert summary["ifca_bytes_over_ours"] is None and summary["ifca_round_bytes_over_ours"] is None
    assert summary["ladd_ari"] == seq["ladd"]["ari"]


def test_jobs_must_be_positive():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--jobs", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--jobs must be >= 1, got 0" in proc.stderr


def test_seeds_run_side_by_side_and_the_summary_is_their_mean(tmp_path):
    summary, _ = _quick(tmp_path, "--jobs", "2", "--methods", "fedavg", "--seeds", "2", "--rounds", "1")
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["seed"] for r in runs] == [0, 1] == summary["seeds"]
    assert summary["rounds"] == 1 and all(len(r["rows"]["fedavg"]["accuracy"]) == 1 for r in runs)
    finals = [r["rows"]["fedavg"]["final_acc"] for r in runs]
    assert finals[0] != finals[1]  # two different federations
    assert summary["fedavg_final_acc"] == round(sum(finals) / 2, 4)
    assert summary["ours_final_acc"] is None and summary["ours_final_acc_seeds"] is None
