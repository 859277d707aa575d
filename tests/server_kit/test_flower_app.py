"""The example Flower app (``examples/flower``) as a user runs it: ``flwr run``, a local SuperLink, Ray.

One run on scikit-learn's digits, 8 virtual nodes in 4 rotation groups, 2
rounds of one local epoch, IFCA chosen through the run config: what the README's commands do, on
a private ``FLWR_HOME`` and free ports (:mod:`server_kit.flower.local_run`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from server_kit.flower.local_run import flwr_run  # noqa: E402

APP = Path(__file__).resolve().parents[2] / "examples" / "flower"
pytestmark = pytest.mark.slow


def test_flwr_run_of_the_example_app(tmp_path):
    report = tmp_path / "report.json"
    log = tmp_path / "flwr.log"
    # one local epoch (the app's default is 5): the run's wiring, not what the nodes learn, is checked here
    flwr_run(APP, {"num-server-rounds": 2, "min-nodes": 8, "fraction": 1.0, "strategy": "ifca", "strategy-params": "k = 4",
                   "local-epochs": 1, "report": str(report)}, 8, log=log, timeout=600)
    r = json.loads(report.read_text())
    assert r["strategy"] == "ifca" and r["nodes"] == 8 and len(r["rounds"]) == 2
    assert sorted(r["assignment"]) == [f"c{i:02d}" for i in range(8)]
    assert r["config"]["params"] == {"k": 4} and r["rejected"] == {}
    assert r["bytes"]["up"]["UPDATE"]["messages"] == 8 * 2
    text = log.read_text()
    assert "FedSketch ifca: 8 nodes" in text  # the summary line a user reads under --stream
