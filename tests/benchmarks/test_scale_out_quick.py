"""The scale-out benchmark's --quick run: the smoke test of benchmarks/scale_out.py (real Mosquitto, real workers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server_kit.broker import find_mosquitto

pytestmark = [pytest.mark.broker, pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scale_out.py"


def test_quick_run_ingests_every_update_and_divides_the_site_uplink():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ingest_lost"] == 0  # every update summed, checked by device id and by value
    assert summary["ingest_lost_by_workers"] == {"1": 0, "2": 0}
    assert summary["ingest_updates_per_s"]["1"] > 0 and summary["ingest_updates_per_s"]["2"] > 0
    cores = summary["cores"]
    assert summary["worker_threads"] == {w: max(1, min(2, cores // (int(w) + 1))) for w in ("1", "2")}
    # a site of 10 devices: 10 whole updates against one partial sum (plus 10 receipts) per cluster
    assert 9.0 < summary["site_uplink_bytes_ratio"] <= 10.0
    assert 4.5 < summary["site_uplink_bytes_ratio_2_clusters"] <= 5.0
