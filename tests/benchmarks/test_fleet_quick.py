"""benchmarks/fleet.py --quick: 100 emulated devices, the real server and Mosquitto with the shipped settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server_kit.broker import find_mosquitto

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fleet.py"


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_fleet_benchmark_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("register_s_3550", "sketch_s_3550", "cluster_s_3550", "ari_3550", "lost_3550", "register_s_10000",
                "ari_10000", "server_us_per_msg_10000"):
        assert key in summary and summary[key] is None, key  # sizes not run here
    assert summary["sizes"] == [100]
    assert summary["lost_100"] == 0 and summary["ari_100"] == 1.0
    # every device registered and was clustered (lost_100 == 0 above); the phase times are reported, not bounded
    assert summary["register_s_100"] > 0 and summary["sketch_s_100"] > 0 and summary["cluster_s_100"] > 0
    print(f"100 devices: register {summary['register_s_100']} s, sketches {summary['sketch_s_100']} s, "
          f"clustering {summary['cluster_s_100']} s")
    assert summary["server_us_per_msg_100"] > 0
    assert "[fleet N=100" in proc.stderr  # progress lines
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows[0]["server_received"]["HELLO"]["messages"] >= 100 and rows[0]["broker_drop_lines"] == 0
    assert rows[0]["device_exit_codes"] == {"0": 100}
