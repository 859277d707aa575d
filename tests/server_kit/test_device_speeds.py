"""A device's own benchmark goes with its hello, and the server's report lists each device's speed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_sdk import cli as edge_cli
from edge_sdk.bench.summary import hello_fields, load_bench_summary
from edge_sdk.client import EdgeClient
from edge_sdk.client.cli import main as client_main
from edge_sdk.schema import check_meta
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker
from server_kit.drivers.fleet import DeviceSpeed
from server_kit.report import build_results
from server_kit.report.page import write_html

pytest.importorskip("torch")
FED = "speeds"


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    assert edge_cli.main(["bench", "--encoder", "digits_encoder", "--arch", "digits_cnn_1x8x8_10", "--samples", "64",
                          "--repeats", "1", "--json", str(path)]) == 0
    return path


def test_the_hello_carries_the_bench_and_the_report_lists_it(bench_file, tmp_path):
    fields = hello_fields(load_bench_summary(bench_file))
    assert set(fields) == {"cpu", "bench"}
    figures = fields["bench"]
    assert {"sketch_ms", "epoch_ms", "epoch_over_sketch", "cores"} <= set(figures)
    assert figures["sketch_ms"] > 0 and figures["epoch_ms"] > 0
    assert figures["epoch_over_sketch"] == pytest.approx(figures["epoch_ms"] / figures["sketch_ms"], rel=0.02)
    assert "(cython; digits_encoder, digits_cnn_1x8x8_10)" in fields["cpu"] or "(numpy;" in fields["cpu"]

    broker = MemoryBroker()
    seen = []
    server = MemoryTransport(broker, "server", federation=FED)
    server.subscribe("fedsketch/speeds/clients/+/hello", lambda topic, msg: seen.append(msg))
    server.connect()
    rng = np.random.default_rng(0)
    worker = LocalWorker("c1", rng.random((20, 8, 8), dtype=np.float32), np.arange(20) % 10, seed=0)
    ec = EdgeClient(MemoryTransport(broker, "c1", federation=FED), worker, federation=FED, bench=fields)
    ec.transport.connect()
    ec.hello()
    (hello,) = seen
    clean = check_meta(hello)  # the schema keeps both fields, unchanged
    assert clean["bench"] == figures and clean["cpu"] == fields["cpu"]
    speed = DeviceSpeed.from_hello(clean)
    assert speed == DeviceSpeed(fields["cpu"], figures)
    assert DeviceSpeed.from_hello({"n_samples": 3}) is None

    result = {"strategy": "fedsketch", "assignment": {"c1": 0, "c2": 0}, "history": [], "final": {},
              "devices": {"c1": speed.to_dict(), "c2": {"cpu": "Raspberry Pi 4 Model B Rev 1.1", "sketch_ms": 480.0}}}
    results = build_results(result)
    assert "devices" in results["definitions"]
    page = write_html(tmp_path / "report.html", results).read_text()
    assert "Devices' own benchmarks" in page
    slow, fast = page.index("Raspberry Pi 4 Model B Rev 1.1"), page.index(">c1<")
    assert slow < fast  # the slowest sketch first
    assert f"{figures['sketch_ms']:g}" in page


def test_a_bench_file_that_is_no_bench_result_is_refused_in_one_line(tmp_path, capsys):
    data = tmp_path / "c1.npz"
    np.savez(data, x=np.zeros((4, 8, 8), np.float32), y=np.arange(4))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"hello": 1}))
    assert client_main(["--client-id", "c1", "--data", str(data), "--bench", str(wrong)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f'fedsketch-client: error: {wrong} is not a fedsketch bench result (no "format": '
                   '"fedsketch-bench"); write one with: fedsketch bench --json FILE')
    assert client_main(["--client-id", "c1", "--data", str(data), "--bench", str(tmp_path / "none.json")]) == 2
    assert "No such file" in capsys.readouterr().err
