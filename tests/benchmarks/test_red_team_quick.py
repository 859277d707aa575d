"""benchmarks/red_team.py --quick: hostile chunked transfers beside honest updates (real Mosquitto, real receiver)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server_kit.broker import find_mosquitto

pytestmark = [pytest.mark.broker, pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "red_team.py"


def test_quick_red_team_starves_no_honest_update_and_stays_within_the_memory_bound():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["never_finished"], summary["huge_announced"], summary["honest"]) == (120, 20, 4)
    assert summary["honest_lost"] == 0  # every honest update received whole (sha256 by device id)
    assert summary["within_bound"] is True and summary["receiver_growth_mb"] < summary["memory_bound_mb"]
    assert summary["peak_declared_mb"] <= summary["memory_bound_mb"]
    assert summary["shipped_limits"] is False and summary["chunk_timeout_s"] == 2.0  # the one limit --quick cuts
    rows = {r["scenario"]: r for r in summary["scenarios"]}
    assert set(rows) == {"baseline", "many", "few"}
    assert rows["baseline"]["rejected"] == {} and rows["baseline"]["honest_busy"] == 0
    for name in ("many", "few"):
        assert rows[name]["attack_sent"] == 140 and rows[name]["honest_lost"] == 0
    # 120 senders fill the receiver's 64 slots: the honest devices are told busy and asked again, and get in
    many = rows["many"]
    assert many["peak_pending"] == 64 and many["rejected"].get("busy", 0) > 0
    assert many["honest_busy"] == 4 and many["honest_resent"] >= 4 and many["last_honest_s"] is not None
    # 10 senders hold 2 transfers each at most: the rest are refused as theirs ("pending"), not the honest ones'
    few = rows["few"]
    assert few["rejected"].get("pending", 0) > 0 and few["peak_pending"] <= 10 * 2 + 10 * 2 + 4
    assert summary["last_honest_s"] is not None and summary["slowdown_vs_baseline"] is not None
