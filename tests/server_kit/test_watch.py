"""Watching a run: a real Prometheus scraping a real federation, its live page in headless Chromium, bad ports.

The federation: 8 digits devices (EdgeClient threads over real sockets) and
``fedsketch-server`` (its ``main``, in a thread) behind Mosquitto, with
``--metrics-port``; an intruder sends one status with a health out of range
and one message that is not an envelope, which the server must refuse and
count. Prometheus (Debian's package: ``.ci/run`` installs it) scrapes the
server every second; its HTTP API must answer the run's values. Chromium
(Debian's ``chromium``) loads the live page during the run and after it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from edge_sdk.protocol import Kind, Message, Topics
from edge_sdk.transport import BrokerConfig, MqttTransport
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.cli import main

from helpers import ARCH

pytestmark = pytest.mark.broker
FED = "watched"
PROMETHEUS = shutil.which("prometheus")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = check()
        except OSError:
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _dom(url: str) -> str:
    """The page as headless Chromium renders it (its DOM after load)."""
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          "--no-first-run", "--dump-dom", url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _promql(port: int, query: str) -> dict[tuple, float]:
    """Prometheus' instant query: {label values (sorted by label name, __name__ left out): value}."""
    reply = json.loads(_get(f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(query)}"))
    assert reply["status"] == "success", reply
    return {tuple(v for k, v in sorted(r["metric"].items()) if k not in ("__name__", "instance", "job")):
            float(r["value"][1]) for r in reply["data"]["result"]}


def _start_devices(url: str, clients) -> list[threading.Thread]:
    from edge_sdk.client import EdgeClient
    from edge_sdk.worker import LocalWorker

    threads = []
    for i, c in enumerate(clients):
        w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
        t = MqttTransport(BrokerConfig.from_url(url, reconnect_min_s=0.1), c.cid, federation=FED)
        ec = EdgeClient(t, w, federation=FED, seed=i, model_timeout_s=30)
        th = threading.Thread(target=ec.run, kwargs={"max_idle_s": 60}, daemon=True)
        th.start()
        threads.append(th)
    return threads


def _intrude(url: str) -> None:
    """One status whose health is out of range, one payload that is no envelope: both refused and counted."""
    t = MqttTransport(BrokerConfig.from_url(url), "intruder", federation=FED)
    t.connect(timeout=10)
    try:
        topics = Topics("fedsketch", FED)
        t.publish(topics.status("intruder"), Message(Kind.STATUS, FED, "intruder", 0,
                                                     {"state": "online", "health": {"cpu_temp_c": 999.0}}))
        t._client.publish(topics.status("intruder"), b"\x00not an envelope", qos=1).wait_for_publish(5)
    finally:
        t.close()


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (Debian's prometheus package; "
                                               ".ci/run installs it)")
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian's chromium package; .ci/run "
                                             "installs it)")
def test_prometheus_scrapes_a_federation_and_chromium_shows_it_live(tmp_path, digits8, monkeypatch):
    from server_kit.drivers.orchestrator import Orchestrator

    gate = threading.Event()  # round 3 waits until Chromium has seen the run in its second round
    run_round = Orchestrator._run_round
    monkeypatch.setattr(Orchestrator, "_run_round",
                        lambda self, rnd: (rnd != 3 or gate.wait(60) or True) and run_round(self, rnd))
    metrics_port, prom_port = _free_port(), _free_port()
    report = tmp_path / "report"
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: fedsketch-server, static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]}}]\n")
    with MosquittoBroker() as broker:
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            rc: list[int] = []
            server = threading.Thread(target=lambda: rc.append(main([
                "--broker", broker.url, "--federation", FED, "--min-clients", "8", "--rounds", "3",
                "--epochs", "2", "--lr", "0.01", "--encoder", "digits_encoder", "--architecture", ARCH,
                "--min-cluster-size", "2", "--report-dir", str(report), "--metrics-port", str(metrics_port),
                "--watch-after", "6"])), daemon=True)
            server.start()
            page = f"http://127.0.0.1:{metrics_port}/"
            _until(lambda: _get(page + "metrics"), 20, "the metrics endpoint")
            devices = _start_devices(broker.url, digits8)
            # during the run (held before round 3), the live page says where the run is
            _until(lambda: json.loads(_get(page + "state.json")).get("rounds", 0) >= 2, 120, "round 2")
            _intrude(broker.url)  # only now: the page is up before the server subscribes, and MQTT keeps nothing
            live = _dom(page)
            gate.set()
            assert 'http-equiv="refresh"' in live and "<h2>Now</h2>" in live
            assert 'id="now-phase">train<' in live and 'id="now-round">2 of 3<' in live, live[:3000]
            assert "8 online of 8 admitted" in live
            assert live.count('<td class="l">c0') >= 8  # the devices table: one row per device
            assert '<svg id="accuracy"' in live
            # after it: the page is the final report itself
            _until(lambda: not server.is_alive() or json.loads(_get(page + "state.json")).get("phase") == "done",
                   180, "the end of the run")
            final_html = (report / "report.html").read_bytes()
            assert _get(page) == final_html
            assert _get(page + "state.json") == (report / "results.json").read_bytes()
            after = _dom(page)
            assert "<h2>Now</h2>" not in after and "refresh" not in after
            assert after.count('<td class="l">c0') >= 8 and "accuracy.png" in after
            results = json.loads((report / "results.json").read_text())
            assert results["phase"] == "done" and results["rounds"] == 3
            # Prometheus has the run's values, scraped from the server
            def scraped():
                return _promql(prom_port, "sum(fedsketch_rounds_closed_total)") == {(): 3.0} and _promql(
                    prom_port, "fedsketch_run_phase") .get(("done",)) == 1.0
            _until(scraped, 20, "Prometheus' scrape of the finished run")
            assert _promql(prom_port, "fedsketch_round_duration_seconds_count") == {(): 3.0}
            total = _promql(prom_port, "fedsketch_round_duration_seconds_sum")[()]
            assert total == pytest.approx(sum(h["seconds"] for h in results["history"]), rel=1e-6)
            le_inf = _promql(prom_port, 'fedsketch_round_duration_seconds_bucket{le="+Inf"}')
            assert le_inf == {("+Inf",): 3.0}
            rejected = _promql(prom_port, "sum by (reason) (fedsketch_messages_rejected_total)")
            assert {k[0]: int(v) for k, v in rejected.items()} == results["rejected"]
            assert results["rejected"].get("meta-field", 0) >= 1, results["rejected"]
            assert _promql(prom_port, 'fedsketch_devices{state="admitted"}') == {("admitted",): 8.0}
            assert _promql(prom_port, 'fedsketch_devices_health_exposed{figure="memory"}') == {("memory",): 8.0}
        finally:
            prom.terminate()
            prom.wait(timeout=20)
        server.join(timeout=60)
        for th in devices:
            th.join(timeout=30)
    assert rc == [0]


@pytest.fixture(scope="module")
def digits8():
    pytest.importorskip("torch")
    from server_kit.data.partition import load_digits_images, rotation_partition

    images, labels = load_digits_images()
    return rotation_partition(images, labels, 8, groups=2, seed=0)


def test_a_port_in_use_is_one_line_and_exit_2(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--broker", "mqtt://127.0.0.1:1", "--metrics-port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedsketch-server: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_an_address_it_may_not_bind_is_one_line_and_exit_2(capsys):
    assert main(["--broker", "mqtt://127.0.0.1:1", "--metrics-port", "9", "--metrics-host", "192.0.2.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedsketch-server: error: cannot listen on 192.0.2.1:9: Cannot assign requested address"]


@pytest.mark.parametrize(("argv", "why"), [
    (["--strategy", "fedcref"], "--metrics-port and --live-port watch the model-averaging strategies' runs, not fedcref"),
    (["--serve-models-from", "export"], "--metrics-port and --live-port watch a training run; --serve-models-from "
                                        "trains nothing"),
])
def test_a_watch_of_what_it_cannot_watch_is_refused(argv, why, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--broker", "mqtt://127.0.0.1:1", "--metrics-port", "0", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"fedsketch-server: error: {why}"]


def test_a_port_out_of_range_is_refused_by_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--metrics-port", "70000"])
    assert e.value.code == 2
    assert "argument --metrics-port: a port is a number from 0 to 65535, got 70000" in capsys.readouterr().err


def test_scrapes_report_the_page_path_untouched(tmp_path):
    """Files outside the report folder are never served, whatever the path says."""
    from server_kit.watch.http import _inside

    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "accuracy.png").write_bytes(b"png")
    (tmp_path / "secret").write_text("no")
    assert _inside(tmp_path / "report", "/accuracy.png") == (tmp_path / "report" / "accuracy.png").resolve()
    for bad in ("/../secret", "/%2e%2e/secret", "/.hidden", "/", "/missing.png"):
        assert _inside(tmp_path / "report", bad) is None, bad
    assert Path(tmp_path / "report").is_dir()


def _view(**kw):
    from server_kit.drivers.device_table import DeviceRow, DeviceTally
    from server_kit.drivers.phase import Phase
    from server_kit.watch.view import HealthSummary, OpenRoundView, RoundTotals, RunView

    totals = RoundTotals()
    for rec in ({"close": "goal", "stragglers": ["c3"], "refused": {"c1": "nan-weights"}, "seconds": 1.5,
                 "goal_s": 1.2, "aggregate_s": 0.02},
                {"close": "goal", "stragglers": [], "refused": {"c1": "nan-weights", "c2": "stale-round"},
                 "seconds": 7.0, "goal_s": None, "aggregate_s": 0.3, "acc_before_per_model": {"c0": 0.5, "c1": 0.75},
                 "acc_before": 0.625, "loss_per_model": {"c0": 0.9}},
                {"close": "deadline", "seconds": 700.0, "aggregate_s": 0.001}):
        totals.add(rec)
    row = DeviceRow(device="c1", online=True, cluster="c0", last_seen_s=3.0, tally=DeviceTally(2, 2, 1.25, "x"),
                    benched=None, sketch_ms=12.0, health={"cpu_temp_c": 61.5, "throttled": 0x50005,
                                                          "mem_available_mb": 512.0, "load1": 0.5})
    base = dict(run_id="r1", strategy="fedsketch", federation="lab", phase=Phase.TRAIN, round=4, rounds_planned=5,
                devices={"admitted": 10, "online": 9, "offline": 1, "benched": 1, "not_training": 0, "refused": 2},
                open_round=OpenRoundView(round=4, tasked=8, reported=5, refused=1, awaited=2, elapsed_s=3.0,
                                         goal_met=False),
                last_round={}, totals=totals, rejected={"meta-field": 3, "envelope": 1},
                transport={"sent": {"MODEL": {"messages": 4, "bytes": 4000}},
                           "received": {"UPDATE": {"messages": 5, "bytes": 5000}}},
                delivered={"MODEL": 9000}, clustering_s=1.5,
                health=HealthSummary({"cpu_temperature": 1, "throttled": 1, "memory": 9, "load": 9}, 1, 61.5),
                watched=(row,))
    base.update(kw)
    return RunView(**base)


def _samples(view):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from server_kit.watch.collector import server_registry

    text = generate_latest(server_registry(lambda: view)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_metrics_say_the_runs_figures_exactly():
    s = _samples(_view())
    assert s[("fedsketch_run_phase", (("phase", "train"),))] == 1 and s[("fedsketch_run_phase", (("phase", "done"),))] == 0
    assert s[("fedsketch_round", ())] == 4 and s[("fedsketch_rounds_planned", ())] == 5
    assert s[("fedsketch_rounds_closed_total", (("reason", "goal"),))] == 2
    assert s[("fedsketch_rounds_closed_total", (("reason", "deadline"),))] == 1
    assert s[("fedsketch_stragglers_total", ())] == 1
    assert s[("fedsketch_updates_refused_total", (("reason", "nan-weights"),))] == 2
    assert s[("fedsketch_messages_rejected_total", (("reason", "meta-field"),))] == 3
    assert s[("fedsketch_round_devices", (("state", "awaited"),))] == 2
    assert s[("fedsketch_devices", (("state", "refused"),))] == 2
    assert s[("fedsketch_message_bytes_total", (("direction", "received"), ("kind", "UPDATE")))] == 5000
    assert s[("fedsketch_downloaded_bytes_total", (("kind", "MODEL"),))] == 9000
    # histograms: cumulative buckets, the sum and the count of the rounds' durations
    le = lambda v: (("le", v),)  # noqa: E731
    assert s[("fedsketch_round_duration_seconds_bucket", le("2.0"))] == 1
    assert s[("fedsketch_round_duration_seconds_bucket", le("10.0"))] == 2
    assert s[("fedsketch_round_duration_seconds_bucket", le("600.0"))] == 2
    assert s[("fedsketch_round_duration_seconds_bucket", le("+Inf"))] == 3
    assert s[("fedsketch_round_duration_seconds_sum", ())] == 708.5
    assert s[("fedsketch_round_goal_seconds_count", ())] == 1
    assert s[("fedsketch_aggregation_seconds_bucket", le("0.005"))] == 1
    assert s[("fedsketch_accuracy", (("model", "c1"),))] == 0.75 and s[("fedsketch_accuracy_mean", ())] == 0.625
    assert s[("fedsketch_loss", (("model", "c0"),))] == 0.9
    # health: the fleet's aggregates and the watched device's own series
    assert s[("fedsketch_devices_throttled", ())] == 1
    assert s[("fedsketch_device_cpu_temperature_max_celsius", ())] == 61.5
    assert s[("fedsketch_device_cpu_temperature_celsius", (("device", "c1"),))] == 61.5
    assert s[("fedsketch_device_throttled_flags", (("device", "c1"),))] == 0x50005
    assert s[("fedsketch_device_memory_available_bytes", (("device", "c1"),))] == 512 * 2**20
    assert s[("fedsketch_device_refusals_total", (("device", "c1"),))] == 2
    assert s[("process_resident_memory_bytes", ())] > 0
    # every series is in the catalogue (what the dashboard is checked against)
    from server_kit.watch.names import exported_names

    assert {name for name, _ in s} <= exported_names()


def test_a_closed_round_counts_its_devices_when_none_is_open():
    s = _samples(_view(open_round=None, last_round={"tasked": 8, "reported": 7, "refused": 1}))
    assert s[("fedsketch_round_devices", (("state", "reported"),))] == 7
    assert s[("fedsketch_round_devices", (("state", "awaited"),))] == 0


def test_ten_thousand_devices_make_only_the_bounded_series():
    from server_kit.drivers.device_table import DeviceTallies, most_watched

    tallies = DeviceTallies()
    known = {f"d{i:05d}": None for i in range(10_000)}
    tallies.add_round({"reported_s": {c: float(i % 977) for i, c in enumerate(known)},
                       "refused": {f"d{i:05d}": "nan-weights" for i in range(0, 10_000, 500)}})
    tallies.add_round({"reported_s": {}, "refused": {"d00500": "nan-weights"}})
    watched = most_watched(tallies, known, 20)
    assert len(watched) == 20 and len(set(watched)) == 20
    assert watched[0] == "d00500"  # refused twice: the most refused first
    assert set(watched[:10]) <= {f"d{i:05d}" for i in range(0, 10_000, 500)}
    slow = [c for c in watched if tallies.get(c).refusals == 0]
    assert slow and all(tallies.get(c).round_s == 976.0 for c in slow)  # then the slowest
    assert most_watched(tallies, known, 0) == []
