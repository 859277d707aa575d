"""The main job, scaled down: real broker, real client processes, report folder, JSON last line."""

from __future__ import annotations

import json

import pytest

from server_kit.broker import find_mosquitto
from server_kit.demo import main

pytest.importorskip("torch")
pytestmark = pytest.mark.broker


@pytest.mark.parametrize("broker", ["mosquitto", "amqtt"])
def test_small_demo_runs_end_to_end(tmp_path, capsys, broker):
    if broker == "mosquitto" and find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    report = tmp_path / "report"
    assert main(["--clients", "8", "--groups", "2", "--rounds", "2", "--epochs", "1", "--broker", broker,
                 "--report-dir", str(report)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert set(summary) == {"ari", "clustered_acc", "fedavg_acc", "seconds", "sketch_bytes"}
    assert summary["ari"] == 1.0
    assert summary["sketch_bytes"] <= 64
    for name in ("results.json", "accuracy.png", "threshold_search.png", "bytes.png"):
        assert (report / name).read_bytes()[:1], name
    results = json.loads((report / "results.json").read_text())
    assert len(results["clustered_accuracy"]) == 2 and len(results["fedavg_accuracy"]) == 2
