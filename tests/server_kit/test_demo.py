"""The main job, scaled down: real broker, real client processes, report folder, JSON last line."""

from __future__ import annotations

import json
import logging

import pytest

from server_kit.broker import find_mosquitto
from server_kit.demo import main

pytest.importorskip("torch")
pytestmark = pytest.mark.broker


@pytest.mark.parametrize("broker", ["mosquitto", "amqtt"])
def test_small_demo_runs_end_to_end(tmp_path, capsys, caplog, broker):
    if broker == "mosquitto" and find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    report = tmp_path / "report"
    with caplog.at_level(logging.INFO):
        # 4 device processes (2 per rotation group, clusters of 2 allowed): the wiring at the smallest fleet that
        # still clusters; each process costs an interpreter, its imports and its training
        assert main(["--clients", "4", "--groups", "2", "--min-cluster-size", "2", "--rounds", "2", "--epochs", "1",
                     "--broker", broker, "--report-dir", str(report)]) == 0
    # a clean run logs no error: neither the embedded broker (no probe connection) nor paho at the end
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert set(summary) == {"ari", "clustered_acc", "fedavg_acc", "seconds", "sketch_bytes", "compress_up",
                            "compress_down", "update_bytes", "model_bytes"}
    assert summary["ari"] == 1.0
    assert summary["sketch_bytes"] <= 64
    # the server's defaults, both ways; the bytes saved are printed
    from server_kit.cli_options import DEFAULT_COMPRESS_DOWN, DEFAULT_COMPRESS_UP

    assert (summary["compress_up"], summary["compress_down"]) == (DEFAULT_COMPRESS_UP, DEFAULT_COMPRESS_DOWN)
    assert f"compression up {DEFAULT_COMPRESS_UP}, down {DEFAULT_COMPRESS_DOWN}: updates" in out
    assert "x fewer bytes up" in out
    assert (report / "results.json").stat().st_size > 0
    from PIL import Image  # matplotlib's own dependency: it drew these

    for name in ("accuracy.png", "threshold_search.png", "bytes.png"):
        with Image.open(report / name) as img:
            assert img.format == "PNG", name
            size, colours = img.size, img.convert("RGB").getcolors(maxcolors=1 << 24)
        print(f"{name}: {size[0]}x{size[1]}, {len(colours)} colours")
        # a figure of a few inches at matplotlib's dpi, with something drawn on it (not one blank colour)
        assert 200 <= size[0] <= 4000 and 150 <= size[1] <= 4000, (name, size)
        assert len(colours) > 1, name
    results = json.loads((report / "results.json").read_text())
    assert len(results["clustered_accuracy"]) == 2 and len(results["fedavg_accuracy"]) == 2
