"""The paper comparison's --quick run (digits): the smoke test of benchmarks/paper_mnist.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


def test_quick_reproduction_bounds(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "paper_mnist.py"), "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ours_ari"] == 1.0
    assert summary["ours_final_acc"] > summary["fedavg_final_acc"]
    assert summary["ifca_bytes_over_ours"] > 1.5  # IFCA ships K = 4 models to each client
    assert summary["ladd_ari"] < 0.6  # FFT amplitudes cannot tell 0 from 180 degrees
    assert {"ours_rounds_to_95", "rounds", "clients", "epochs"} <= set(summary)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert set(rows) == {"ours-central", "ours-federated", "ifca", "ladd", "fedavg"}
    assert rows["ours-federated"]["pretrain_bytes"] > 0 and rows["ours-federated"]["seconds_pretrain"] > 0
    assert (tmp_path / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
