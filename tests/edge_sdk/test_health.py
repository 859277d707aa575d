"""A device's health: read from the board (or a fake one), carried by the hello and the status, checked by the schema."""

from __future__ import annotations

import dataclasses
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.client.commands import send_update
from edge_sdk.client.state import kept_label
from edge_sdk.health import (
    NOT_EXPOSED,
    THROTTLED_NOW,
    THROTTLING_NOW,
    UNDER_VOLTAGE_NOW,
    BoardFiles,
    DeviceHealth,
    meminfo_kib,
    read_health,
)
from edge_sdk.models.held_models import HeldModel
from edge_sdk.models.keeping import ModelKeeper
from edge_sdk.models.model_folder import WEIGHTS, ModelEntry, weights_sha256
from edge_sdk.protocol import Kind, Message, ProtocolError
from edge_sdk.schema import check_fields, check_meta
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker

FED = "health"


def fake_board(tmp_path, zones=(("acpitz", "41000"), ("cpu-thermal", "48312")), throttled="50005\n",
               meminfo="MemTotal:        3884000 kB\nMemFree:  100 kB\nMemAvailable:    2048000 kB\n") -> BoardFiles:
    """A folder imitating /sys/class/thermal, the Pi's get_throttled file and /proc/meminfo."""
    root = tmp_path / "thermal"
    root.mkdir(parents=True)
    for i, (kind, milli) in enumerate(zones):
        zone = root / f"thermal_zone{i}"
        zone.mkdir()
        (zone / "type").write_text(kind + "\n")
        (zone / "temp").write_text(milli + "\n")
    (root / "cooling_device0").mkdir()
    if throttled is not None:
        (tmp_path / "get_throttled").write_text(throttled)
    (tmp_path / "meminfo").write_text(meminfo)
    return BoardFiles(thermal_root=str(root), throttled=str(tmp_path / "get_throttled"),
                      vcgencmd=str(tmp_path / "no-vcgencmd"), meminfo=str(tmp_path / "meminfo"))


# -- reading the board -------------------------------------------------------------------


def test_read_health_on_this_machine_gives_what_proc_gives():
    load_before = round(os.getloadavg()[0], 2)
    h = read_health()
    load_after = round(os.getloadavg()[0], 2)
    total_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    assert h.mem_total_mb == round(total_kib / 1024, 1)
    assert 0 < h.mem_available_mb <= h.mem_total_mb
    assert min(load_before, load_after) <= h.load1 <= max(load_before, load_after)
    assert (h.round_s, h.model_version, h.kept) == (None, None, None)  # known only by the device


def test_the_cpu_zone_the_firmware_bits_and_memory_come_from_their_files(tmp_path):
    h = read_health(fake_board(tmp_path), round_s=2.5, model_version=7, kept="c0@1a2b3c4d5e6f")
    assert h.cpu_temp_c == 48.3  # the cpu-thermal zone, not zone 0
    assert h.throttled == 0x50005 and h.throttling_now is True
    assert h.throttle_flags == ("under-voltage now", "throttled now", "under-voltage since boot",
                                "throttled since boot")
    assert (h.mem_total_mb, h.mem_available_mb) == (round(3884000 / 1024, 1), 2000.0)
    assert (h.round_s, h.model_version, h.kept) == (2.5, 7, "c0@1a2b3c4d5e6f")
    assert h.not_exposed() == ""


def test_zone_0_without_a_cpu_zone_and_throttling_past_only(tmp_path):
    h = read_health(fake_board(tmp_path, zones=(("acpitz", "41000"), ("iwlwifi", "39000")), throttled="50000\n"))
    assert h.cpu_temp_c == 41.0
    assert h.throttled == 0x50000 and h.throttling_now is False  # under-voltage and throttled since boot only
    assert (UNDER_VOLTAGE_NOW, THROTTLED_NOW, THROTTLING_NOW) == (0x1, 0x4, 0x5)
    assert DeviceHealth(throttled=0x4).throttling_now and DeviceHealth(throttled=0x1).throttling_now
    assert DeviceHealth(throttled=0x2).throttling_now is False  # frequency capped: not counted
    assert DeviceHealth().throttling_now is None


def test_a_board_that_exposes_nothing_says_not_exposed(tmp_path):
    files = BoardFiles(thermal_root=str(tmp_path / "none"), throttled=str(tmp_path / "none"),
                       vcgencmd=str(tmp_path / "no-vcgencmd"), meminfo=str(tmp_path / "none"))
    h = read_health(files)
    assert (h.cpu_temp_c, h.throttled, h.mem_total_mb, h.mem_available_mb) == (None, None, None, None)
    assert h.not_exposed() == ("temperature not exposed (no thermal_zone*/temp); "
                               "throttling not exposed (no get_throttled file, no vcgencmd); "
                               "memory not exposed (no /proc/meminfo)")
    broken = fake_board(tmp_path / "b", zones=(("cpu-thermal", "hot"),), throttled="not hex\n", meminfo="MemTotal: x\n")
    h = read_health(broken)  # unreadable values: None, nothing raised
    assert (h.cpu_temp_c, h.throttled, h.mem_total_mb) == (None, None, None)
    assert meminfo_kib(str(tmp_path / "none")) == {}


def test_vcgencmd_is_asked_only_without_the_firmware_file(tmp_path):
    tool = tmp_path / "vcgencmd"
    tool.write_text("#!/bin/sh\necho throttled=0x4\n")
    tool.chmod(0o755)
    files = dataclasses.replace(fake_board(tmp_path, throttled=None), vcgencmd=str(tool))
    assert read_health(files).throttled == 0x4
    (tmp_path / "get_throttled").write_text("0\n")
    assert read_health(files).throttled == 0


def test_reading_is_cheap_where_nothing_is_slow(tmp_path):
    files = fake_board(tmp_path)
    read_health(files)
    t0 = time.perf_counter()
    for _ in range(50):
        read_health(files)
    assert (time.perf_counter() - t0) / 50 < 0.005  # well under a millisecond alone; a shared machine is slower


# -- the meta and the schema -------------------------------------------------------------


def test_to_meta_keeps_the_known_fields_and_from_meta_reads_them_back():
    h = DeviceHealth(cpu_temp_c=51.2, throttled=0, mem_available_mb=812.5, mem_total_mb=3792.0, load1=0.42,
                     round_s=12.75, model_version=4, kept="c1@0123456789ab")
    meta = h.to_meta()
    assert DeviceHealth.from_meta(meta) == h
    assert DeviceHealth(load1=1.0).to_meta() == {"load1": 1.0}
    assert DeviceHealth.from_meta({"load1": 1.0, "new_reading": 3}) == DeviceHealth(load1=1.0)
    # the dataclass and the schema declare the same fields
    assert set(check_fields(Kind.HELLO, {"n_samples": 1, "health": meta})["health"]) == set(meta) == {
        f.name for f in dataclasses.fields(DeviceHealth)} > set(NOT_EXPOSED)


@pytest.mark.parametrize("health, message", [
    ({"cpu_temp_c": float("nan")}, "meta field 'health.cpu_temp_c' must be a finite number in [-60, 200], got nan"),
    ({"cpu_temp_c": 250.0}, "meta field 'health.cpu_temp_c' must be a finite number in [-60, 200], got 250.0"),
    ({"load1": float("inf")}, "meta field 'health.load1' must be a finite number in [0, 1e+06], got inf"),
    ({"mem_total_mb": "3792"}, "meta field 'health.mem_total_mb' must be a finite number in [0, 1e+09], got '3792'"),
    ({"mem_available_mb": -1}, "meta field 'health.mem_available_mb' must be a finite number in [0, 1e+09], got -1"),
    ({"throttled": 1.5}, "meta field 'health.throttled' must be an integer in [0, 4.29497e+09], got 1.5"),
    ({"throttled": 2**32}, "meta field 'health.throttled' must be an integer in [0, 4.29497e+09], got 4294967296"),
    ({"model_version": True}, "meta field 'health.model_version' must be an integer in [0, 4.29497e+09], got True"),
    ({"round_s": 1e9}, "meta field 'health.round_s' must be a finite number in [0, 1e+08], got 1000000000.0"),
    ({"kept": "c" * 65}, "meta field 'health.kept' must be a string of at most 64 characters, got '" + "c" * 65 + "'"),
    ([1, 2], "meta field 'health' must be an object, got [1, 2]"),
])
@pytest.mark.parametrize("kind", [Kind.HELLO, Kind.STATUS])
def test_the_schema_refuses_a_bad_health_field_by_name(kind, health, message):
    meta = {"n_samples": 5} if kind == Kind.HELLO else {}
    with pytest.raises(ProtocolError) as info:
        check_fields(kind, {**meta, "health": health})
    assert info.value.reason == "meta-field" and str(info.value) == message


def test_a_hello_and_a_status_with_health_pass_unknown_keys_dropped():
    health = {"cpu_temp_c": 48, "throttled": 0x50005, "mem_available_mb": 812.5, "mem_total_mb": 3792,
              "load1": 0.5, "round_s": 3.25, "model_version": 2, "kept": "c0@1a2b3c4d5e6f"}
    clean = check_meta(Message(Kind.HELLO, FED, "c1", 0, {"n_samples": 7, "health": {**health, "fan_rpm": 1}}))
    assert clean["health"] == health  # numbers as sent (ints accepted for floats), fan_rpm dropped
    status = {"state": "online", "sent": 3, "health": {"round_s": 3.25, "surprise": [1]}}
    assert check_meta(Message(Kind.STATUS, FED, "c1", 3, status)) == {"state": "online", "sent": 3,
                                                                        "health": {"round_s": 3.25}}
    assert "health" not in check_meta(Message(Kind.STATUS, FED, "c1", 0, {"state": "online"}))


# -- the device sends it -----------------------------------------------------------------


def _device(broker: MemoryBroker, **kw) -> EdgeClient:
    rng = np.random.default_rng(0)
    w = LocalWorker("c1", rng.random((20, 8, 8), dtype=np.float32), np.arange(20) % 10, seed=0)
    ec = EdgeClient(MemoryTransport(broker, "c1", federation=FED), w, federation=FED, **kw)
    ec.transport.connect()
    return ec


def test_the_hello_and_the_sent_status_carry_the_health():
    broker = MemoryBroker()
    seen: list[Message] = []
    server = MemoryTransport(broker, "server", federation=FED)
    server.subscribe(f"fedsketch/{FED}/clients/+/#", lambda topic, msg: seen.append(msg))
    server.connect()
    ec = _device(broker)
    ec.hello()
    (hello,) = seen
    clean = check_meta(hello)
    assert set(clean["health"]) >= {"mem_total_mb", "mem_available_mb", "load1"}
    assert "round_s" not in clean["health"] and "model_version" not in clean["health"]
    ec.state.model_key = "c0"
    ec.store.put("c0", HeldModel(3, {"w": np.zeros(2, np.float32)}, version=5))
    seen.clear()
    send_update(ec.state, ec.context, 3, {"round": 3, "model_key": "c0", "n_samples": 20, "loss": 0.1},
                b"body", started=time.monotonic() - 1.5)
    update, status = seen
    assert update.kind == Kind.UPDATE and status.kind == Kind.STATUS
    health = check_meta(status)["health"]
    assert check_meta(status)["sent"] == 3 and health["model_version"] == 5
    assert 1.5 <= health["round_s"] < 60 and ec.state.round_s == pytest.approx(health["round_s"], abs=1e-3)


def test_the_kept_model_is_its_key_and_the_start_of_its_sha256(tmp_path):
    keeper = ModelKeeper(tmp_path / "models")
    assert kept_label(keeper) is None and kept_label(None) is None
    weights = {"w": np.arange(6, dtype=np.float32)}
    entry = ModelEntry(key="c0", architecture="digits_cnn_1x8x8_10", input_shape=(8, 8), num_classes=10, run="r1")
    assert keeper.offer(entry, weights, lambda arch, w: None).kept_new
    assert kept_label(keeper) == "c0@" + weights_sha256(weights)[:12]
    long = SimpleNamespace(key="k" * 64, files={WEIGHTS: "ab" * 32})
    assert len(kept_label(SimpleNamespace(kept=lambda: long))) == 64
