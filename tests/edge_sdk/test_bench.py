"""fedsketch bench: the command end to end on the digits encoder, its one-line errors, its readers, its summary."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_sdk import bits
from edge_sdk.bench import (
    HELLO_KEYS,
    BenchResult,
    BenchSettings,
    MachineInfo,
    Ratio,
    StageTiming,
    ThermalZone,
    TrainTiming,
    load_bench_summary,
    summary_for_hello,
)
from edge_sdk.bench.machine import (
    cpu_names,
    describe_thermal,
    mem_total_mb,
    peak_rss_kib,
    read_thermal,
    read_throttled,
    thermal_note,
)
from edge_sdk.cli import main
from edge_sdk.health import decode_throttled
from edge_sdk.install import install_hint

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["load", "encode_one", "encode_batch", "class_means", "quantise_pack_cython", "quantise_pack_numpy", "sketch"]
# small and quick: the digits encoder, no training, the DigitsCNN's shipped weights for the sizes
QUICK = ["bench", "--encoder", "digits_encoder", "--samples", "60", "--repeats", "2", "--arch", "digits_cnn_1x8x8_10"]


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    rc, out, err = _run([*QUICK, "--no-train", "--json", str(path)])
    return rc, out, err, path


def test_the_json_file_holds_every_stage_with_a_positive_time(quick_run):
    rc, out, err, path = quick_run
    assert rc == 0, err
    data = json.loads(path.read_text())
    assert {"format", "format_version", "settings", "machine", "stages", "training", "ratios", "sizes", "broker",
            "created"} <= set(data)
    assert data["format"] == "fedsketch-bench" and data["broker"] is None and data["training"] == []
    assert [s["stage"] for s in data["stages"]] == STAGES
    for s in data["stages"]:
        assert s["encoder"] == "digits_encoder"
        if s["stage"] == "quantise_pack_cython" and "cython" not in bits.available_backends():
            assert s["seconds"] is None and s["note"].startswith("not compiled")
        else:
            assert s["seconds"] > 0 and s["best"] > 0, s
    assert [s["samples"] for s in data["stages"] if s["stage"] in ("encode_one", "sketch")] == [1, 60]
    machine = data["machine"]
    assert machine["cores"] == os.cpu_count() and machine["kernel"] == bits.BACKEND
    assert machine["peak_rss_mib"] > 0 and "CPUExecutionProvider" in machine["providers"]
    sizes = {(m["kind"], m["name"]): m for m in data["sizes"]}
    # 15 header + 1+7 federation "default" + 1+3 client "c07" + 4 shape + 25 bits
    assert sizes[("sketch", "digits_encoder")] | {"note": ""} == {
        "kind": "sketch", "name": "digits_encoder", "body_bytes": 25, "envelope_bytes": 56, "wire_bytes": 56,
        "compressed_bytes": None, "note": ""}
    update = sizes[("update", "digits_cnn_1x8x8_10")]
    assert update["body_bytes"] > 13706 * 4 and update["compressed_bytes"] is None
    assert sizes[("model", "digits_cnn_1x8x8_10")]["envelope_bytes"] > update["envelope_bytes"]  # signed


def test_stdout_is_a_table_then_one_json_line_and_stderr_shows_progress(quick_run):
    rc, out, err, _ = quick_run
    lines = out.strip().splitlines()
    last = json.loads(lines[-1])
    assert last["sketch_ms"]["digits_encoder"] > 0 and last["kernel"] == bits.BACKEND
    assert last["epoch_s"] == {} and "rtt_ms" not in last
    assert lines[0].startswith("fedsketch bench: 60 generated samples")
    assert any(line.strip().startswith("whole sketch") for line in lines)
    assert "digits_encoder: whole sketch of 60 images" in err


def test_a_kernel_that_is_not_compiled_says_so_in_its_row(monkeypatch):
    from edge_sdk.bench.stages import kernel_row

    monkeypatch.setattr(bits, "available_backends", lambda: ("numpy",))
    vectors = np.random.default_rng(0).random((10, 20))
    row = kernel_row("digits_encoder", "cython", vectors, 0.1, 1, repeats=2)
    assert row.seconds is None and row.note.startswith("not compiled")
    assert kernel_row("digits_encoder", "numpy", vectors, 0.1, 1, repeats=2).seconds > 0


# -- one-line errors -------------------------------------------------------------------


def _npz(path: Path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize(("arrays", "extra", "message"), [
    (dict(x=np.zeros((10, 5, 5), np.float32), y=np.zeros(10, np.int64)), ["--encoder", "digits_encoder"],
     "samples of shape 5x5 do not fit encoder digits_encoder, which takes 64 or 8x8"),
    (dict(x=np.zeros((10, 5, 5), np.float32), y=np.zeros(10, np.int64)), [],
     "no shipped encoder takes samples of shape 5x5; the shipped encoders take: conv_ae_encoder (3x32x32), "
     "digits_encoder (64 or 8x8), fmnist_fc_encoder (784 or 28x28)"),
    (dict(x=np.zeros((10, 8, 8), np.float32)), [],
     "no array y (it holds ['x']); bench needs x (the samples) and y (their integer labels)"),
    (dict(x=np.array([{"a": 1}] * 10, dtype=object), y=np.zeros(10, np.int64)), [],
     "array 'x' holds pickled Python objects, which bench does not load; save numeric arrays "
     "(Object arrays cannot be loaded when allow_pickle=False)"),
    (dict(x=np.full((10, 64), "a"), y=np.zeros(10, np.int64)), [],
     "x has dtype <U1; bench takes float images in [0, 1] or integer pixels in [0, 255]"),
    (dict(x=np.zeros((10, 64), np.float32), y=np.full(10, 12)), [],
     "labels span [12, 12]; with --classes 10 they must lie in [0, 10)"),
], ids=["wrong-shape", "fits-no-encoder", "no-y", "pickled", "strings", "labels"])
def test_a_data_file_bench_cannot_use_is_one_line_and_exit_2(tmp_path, capsys, arrays, extra, message):
    path = _npz(tmp_path / "data.npz", **arrays)
    assert main(["bench", "--data", path, "--no-train", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"fedsketch bench: error: --data {path}: {message}"]


def test_a_missing_data_file_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "nope.npz"
    assert main(["bench", "--data", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"fedsketch bench: error: --data {path}: no such file"]


def test_data_that_fits_is_benched_with_the_encoders_it_fits(tmp_path):
    x = (np.random.default_rng(0).random((40, 8, 8)) * 255).astype(np.uint8)  # integer pixels: divided by 255
    path = _npz(tmp_path / "mine.npz", x=x, y=np.arange(40) % 10)
    rc, out, err = _run(["bench", "--data", path, "--repeats", "1", "--no-train", "--arch", "digits_cnn_1x8x8_10"])
    assert rc == 0, err
    assert list(json.loads(out.splitlines()[-1])["sketch_ms"]) == ["digits_encoder"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_broker_that_cannot_be_reached_is_one_line_and_exit_3(capsys):
    port = _closed_port()
    assert main([*QUICK, "--no-train", "--broker", f"mqtt://127.0.0.1:{port}", "--client-id", "c07"]) == 3
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1] == (f"fedsketch bench: error: broker mqtt://127.0.0.1:{port}: cannot reach "
                                    f"127.0.0.1:{port} (Connection refused)")
    assert len([line for line in err.splitlines() if "error" in line]) == 1


@pytest.mark.broker
def test_the_real_broker_round_trip_and_upload_rate_as_the_device(tmp_path, shipped_acl):
    from server_kit.broker.mosquitto import MosquittoBroker, find_mosquitto

    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    good, bad = tmp_path / "c07.pw", tmp_path / "wrong.pw"
    good.write_text("secret7\n")
    bad.write_text("guess\n")
    with MosquittoBroker(acl=shipped_acl("default"), passwords={"c07": "secret7", "server": "s"}) as broker:
        base = [*QUICK, "--samples", "20", "--repeats", "1", "--no-train", "--broker", broker.url, "--username", "c07",
                "--rtt-messages", "5", "--upload-messages", "1", "--upload-mb", "0.3"]
        rc, out, err = _run([*base, "--password-file", str(good), "--json", str(tmp_path / "b.json")])
        assert rc == 0, err
        b = json.loads((tmp_path / "b.json").read_text())["broker"]
        assert b["topic"] == "fedsketch/default/clients/c07/status" and b["method"] == "puback"
        assert b["messages"] == 5 and b["rtt_median_s"] > 0 and b["rtt_p90_s"] >= b["rtt_median_s"]
        assert b["upload_bytes"] > 300_000 and b["upload_mb_s"] > 0
        assert json.loads(out.splitlines()[-1])["rtt_ms"] > 0
        rc, out, err = _run([*base, "--password-file", str(bad)])
    assert rc == 3 and out == ""
    assert err.splitlines()[-1] == f"fedsketch bench: error: broker {broker.url}: refused c07: Not authorized"


# -- training ------------------------------------------------------------------------------


def test_one_digits_cnn_epoch_and_its_ratio_to_the_sketch(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "train.json"
    rc, out, err = _run([*QUICK, "--samples", "64", "--repeats", "1", "--json", str(path)])
    assert rc == 0, err
    data = json.loads(path.read_text())
    [row] = data["training"]
    assert row["architecture"] == "digits_cnn_1x8x8_10" and row["label"] == "DigitsCNN"
    assert row["seconds"] > 0 and row["measured_samples"] == row["samples"] == 64 and row["threads"] >= 1
    [ratio] = data["ratios"]
    assert ratio["encoder"] == "digits_encoder" and ratio["paper"] is None
    assert ratio["ratio"] == pytest.approx(row["seconds"] / data["stages"][-1]["seconds"])
    assert json.loads(out.splitlines()[-1])["epoch_over_sketch"]["digits_cnn_1x8x8_10"] > 0
    summary = load_bench_summary(path)
    assert summary["architecture"] == "digits_cnn_1x8x8_10" and summary["epoch_ms"] > 0
    assert summary["epoch_over_sketch"] > 0


def test_without_torch_the_training_rows_say_what_to_install(tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from edge_sdk.cli import main\n"
            f"rc = main({[*QUICK, '--repeats', '1', '--samples', '20', '--json', str(tmp_path / 'n.json')]!r})\n"
            "print('imported:', sorted(m for m in ('torch', 'matplotlib') if sys.modules.get(m)), file=sys.stderr)\n"
            "raise SystemExit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    [row] = json.loads((tmp_path / "n.json").read_text())["training"]
    assert row["seconds"] is None
    assert row["note"] == f"not measured: torch is not installed; {install_hint('train')}"
    assert install_hint("train") in r.stdout
    assert json.loads(r.stdout.splitlines()[-1])["epoch_s"] == {}
    assert "imported: []" in r.stderr


# -- the machine ---------------------------------------------------------------------------


def test_thermal_zones_from_a_fake_sysfs(tmp_path):
    zone = tmp_path / "thermal_zone0"
    zone.mkdir()
    (zone / "temp").write_text("48312\n")
    (zone / "type").write_text("cpu-thermal\n")
    (tmp_path / "cooling_device0").mkdir()
    zones = read_thermal(str(tmp_path))
    assert zones == (ThermalZone(zone="thermal_zone0", type="cpu-thermal", celsius=48.3),)
    assert describe_thermal(zones) == "48.3 C (cpu-thermal)"


def test_a_board_without_thermal_files_or_vcgencmd_says_not_exposed(tmp_path):
    assert read_thermal(str(tmp_path)) == () == read_thermal(str(tmp_path / "absent"))
    assert describe_thermal(()) == "not exposed"
    assert read_throttled(str(tmp_path / "vcgencmd"), path=str(tmp_path / "get_throttled")) is None
    assert thermal_note((), None) == ("temperature not exposed (no thermal_zone*/temp); "
                                      "throttling not exposed (no get_throttled file, no vcgencmd)")


def test_throttled_bits_decoded():
    assert decode_throttled(0x50005) == ("under-voltage now", "throttled now", "under-voltage since boot",
                                         "throttled since boot")
    assert decode_throttled(0) == ()
    assert decode_throttled(0xF000F) == ("under-voltage now", "frequency capped now", "throttled now",
                                         "soft temperature limit now", "under-voltage since boot",
                                         "frequency capped since boot", "throttled since boot",
                                         "soft temperature limit since boot")


def test_vcgencmd_output_is_read(tmp_path):
    tool = tmp_path / "vcgencmd"
    tool.write_text("#!/bin/sh\necho throttled=0x50005\n")
    tool.chmod(0o755)
    t = read_throttled(str(tool), path=str(tmp_path / "get_throttled"))
    assert t.raw == 0x50005 and t.flags == decode_throttled(0x50005)
    (tmp_path / "get_throttled").write_text("50000\n")  # the firmware's sysfs file comes first
    assert read_throttled(str(tool), path=str(tmp_path / "get_throttled")).raw == 0x50000


PI4_CPUINFO = """processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm crc32 cpuid
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd08

Hardware\t: BCM2835
Model\t\t: Raspberry Pi 4 Model B Rev 1.1
"""


def test_cpu_names_of_a_raspberry_pi_and_of_x86(tmp_path):
    assert cpu_names(PI4_CPUINFO) == ("Raspberry Pi 4 Model B Rev 1.1", "Cortex-A72, Raspberry Pi 4")
    assert cpu_names(PI4_CPUINFO.replace("0xd08", "0xd99").replace("Model\t\t", "Board")) == (
        "CPU implementer 0x41, part 0xd99", "CPU implementer 0x41, part 0xd99")
    assert cpu_names("model name\t: AMD EPYC 7B13\nflags\t: fpu sse\n") == ("AMD EPYC 7B13", "")
    (tmp_path / "meminfo").write_text("MemTotal:        3884000 kB\nMemFree: 1 kB\n")
    (tmp_path / "status").write_text("Name: python\nVmHWM:\t  123456 kB\n")
    assert mem_total_mb(str(tmp_path / "meminfo")) == 3792 and mem_total_mb(str(tmp_path / "none")) is None
    assert peak_rss_kib(str(tmp_path / "status")) == 123456
    assert peak_rss_kib(str(tmp_path / "none")) > 0  # getrusage


# -- the hello summary and the plot -----------------------------------------------------------


def _result() -> BenchResult:
    settings = BenchSettings(encoders=("fmnist_fc_encoder",), architectures=("lenet5_1x28x28_10",), samples=600,
                             resnet_samples=16, repeats=5, classes=10, flip_prob=0.1, batch_size=256, threads=None,
                             seed=0, data=None, train=True)
    machine = MachineInfo(cpu="Raspberry Pi 4 Model B Rev 1.1", cpu_part="Cortex-A72, Raspberry Pi 4", cores=4,
                          mem_mb=3792, kernel="cython", kernels_available=("cython", "numpy"), onnxruntime="1.20",
                          providers=("CPUExecutionProvider",), torch=None, python="3.11.2",
                          platform="linux-aarch64", fedsketch="0.1.0", peak_rss_mib=80.0)
    stages = (StageTiming("fmnist_fc_encoder", "encode_one", "encode 1 image (batch 1)", 0.0004, 0.0003, 1, 5),
              StageTiming("fmnist_fc_encoder", "sketch", "whole sketch", 0.0125, 0.012, 600, 5))
    training = (TrainTiming("lenet5_1x28x28_10", "LeNet-5", 2.5, 600, 2.5, 600, 1),)
    ratios = (Ratio("lenet5_1x28x28_10", "fmnist_fc_encoder", 2.5, 0.0125, 200.0, 4.0, 600),)
    return BenchResult(settings=settings, machine=machine, stages=stages, training=training, ratios=ratios)


def test_summary_for_hello_is_small_flat_and_read_back_from_the_json(tmp_path):
    result = _result()
    summary = summary_for_hello(result)
    assert summary == {"encoder": "fmnist_fc_encoder", "sketch_ms": 12.5, "architecture": "lenet5_1x28x28_10",
                       "epoch_ms": 2500.0, "epoch_over_sketch": 200.0, "cpu": "Raspberry Pi 4 Model B Rev 1.1",
                       "cores": 4, "mem_mb": 3792, "kernel": "cython"}
    assert list(summary) == list(HELLO_KEYS) and len(summary) <= 10
    assert all(isinstance(v, (str, int, float)) for v in summary.values())
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result.to_dict()))
    assert load_bench_summary(path) == summary
    # no epoch measured (a device without torch): those keys are left out, not null
    assert set(summary_for_hello(result, architecture="digits_cnn_1x8x8_10")) == set(HELLO_KEYS) - {
        "architecture", "epoch_ms", "epoch_over_sketch"}


def test_the_cli_json_reads_back_as_a_summary(quick_run):
    summary = load_bench_summary(quick_run[3])
    assert summary["encoder"] == "digits_encoder" and summary["sketch_ms"] > 0
    assert "epoch_ms" not in summary and summary["cores"] == os.cpu_count()


@pytest.mark.parametrize(("text", "why"), [
    ("not json", "not JSON"),
    ('{"fedsketch": "0.1.0", "kernel": "cython"}', 'no "format": "fedsketch-bench"'),
    ('{"format": "fedsketch-bench", "format_version": 1, "stages": []}', "missing or malformed field 'training'"),
])
def test_a_file_that_is_not_a_bench_result_is_one_value_error(tmp_path, text, why):
    path = tmp_path / "other.json"
    path.write_text(text)
    message = f"{path} is not a fedsketch bench result ({why}); write one with: fedsketch bench --json FILE"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_bench_summary(path)


def test_the_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from edge_sdk.bench.plot import write_plot

    write_plot(_result(), str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main([*QUICK, "--no-train", "--plot", str(tmp_path / "b.png")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "fedsketch bench: error: --plot needs matplotlib, which is not installed: pip install matplotlib "
        "(the table, --json and the last JSON line need nothing more)"]
