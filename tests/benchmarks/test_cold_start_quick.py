"""benchmarks/cold_start.py --quick (digits): new devices get their cluster's model from one sketch, over a broker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.broker
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cold_start.py"


def test_quick_cold_start_places_every_new_device_and_sends_it_one_model(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-progress", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["served"] == s["new_devices"] == 12
    # measured over --seed 0-3 (this machine): ARI 1.0 on each; kept model 0.611-0.739, global 0.278-0.328, another
    # group's 0.144-0.189
    assert s["cold_start_ari"] == 1.0
    # the kept model beats the global model and another group's model on the device's own data
    assert s["cold_start_acc"] > s["global_acc"], s
    assert s["cold_start_acc"] > s["wrong_cluster_acc"], s
    # one model down and nothing else big; one sketch (and a hello, a status) up
    assert s["model_bytes"] <= s["cold_start_bytes_down"] <= 1.05 * s["model_bytes"], s
    assert 0 < s["cold_start_bytes_up"] < 2000, s
    assert s["cold_start_ms"] > 0 and s["cold_start_ms_max"] >= s["cold_start_ms"]
    assert {"trained_acc", "rounds", "clients", "epochs", "data"} <= set(s)
    rows = json.loads((tmp_path / "results.json").read_text())["devices"]
    assert len(rows) == 12 and all(r["exit_code"] == 0 and r["received"].get("MODEL") == 1 for r in rows)
    assert all(r["sent"].get("SKETCH") == 1 and "UPDATE" not in r["sent"] for r in rows)
    png = tmp_path / "cold_start.png"
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"
