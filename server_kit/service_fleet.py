"""Devices in service mode run after run, as real processes: for the tests and ``benchmarks/service.py``.

:func:`start_service_devices` starts ``fedsketch-client --serve`` processes,
each with its own temporary-files folder (``TMPDIR``) and log file, so that
what a device leaves on disk and how its memory moves can be read between
runs (:meth:`ServiceDevice.rss_kib`, :meth:`ServiceDevice.files`).
:func:`run_server` runs one ``fedsketch-server`` process to its end (or
kills it, to play a crash) and returns its :class:`ServerRun`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ServerRun", "ServiceDevice", "run_server", "start_service_devices", "stop_devices",
           "write_rotated_digits"]


def _bin(name: str) -> str:
    """The console script ``name`` beside this Python (the venv's), else on the PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else name


def write_rotated_digits(folder: str | Path, n: int, groups: int = 2, seed: int = 0) -> list[Path]:
    """``n`` devices' shards of scikit-learn's digits in ``groups`` rotation groups: ``c00.npz``, ``c01.npz``...

    Written as ``fedsketch-data split`` writes them (with ``truth.json``); returns the shards' paths.
    """
    from .data.partition import load_digits_images, rotation_partition
    from .data.split_output import write_clients

    x, y = load_digits_images()
    clients = rotation_partition(x, y, n, groups=groups, seed=seed)
    write_clients(clients, folder)
    return [Path(folder) / f"{c.cid}.npz" for c in clients]


@dataclass
class ServiceDevice:
    """One ``fedsketch-client --serve`` process."""

    cid: str
    proc: subprocess.Popen
    tmpdir: Path
    log_path: Path

    def rss_kib(self) -> int:
        """Its resident memory now (``VmRSS``), in KiB; 0 once it has exited."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def files(self) -> list[str]:
        """What it has left in its temporary-files folder (relative paths, files and folders)."""
        return sorted(str(p.relative_to(self.tmpdir)) for p in self.tmpdir.rglob("*"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_bytes(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0


def start_service_devices(broker: str, data: list[Path], folder: str | Path, *, federation: str,
                          server_key: str | None = None, extra: list[str] | None = None) -> list[ServiceDevice]:
    """One service-mode device per shard in ``data`` (client ids from the file names), logs in ``folder``."""
    base = Path(folder)
    devices = []
    for path in data:
        cid = path.stem
        tmp = base / f"{cid}-tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        log_path = base / f"{cid}.log"
        cmd = [_bin("fedsketch-client"), "--serve", "--broker", broker, "--federation", federation,
               "--client-id", cid, "--data", str(path), "--seed", cid[1:], "--hello-jitter", "0",
               *(["--server-key", server_key] if server_key else []), *(extra or [])]
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        devices.append(ServiceDevice(cid, proc, tmp, log_path))
    return devices


def stop_devices(devices: list[ServiceDevice], timeout: float = 20.0) -> list[int | None]:
    """SIGTERM each device still running (systemd's stop); their exit codes (None: killed after ``timeout``)."""
    for d in devices:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
    codes: list[int | None] = []
    for d in devices:
        try:
            codes.append(d.proc.wait(timeout))
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
            codes.append(None)
    return codes


@dataclass
class ServerRun:
    """One ``fedsketch-server`` process: its exit code, its results (None if it wrote none), its log."""

    rc: int | None
    results: dict[str, Any] | None
    log: str
    seconds: float
    killed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def run_server(broker: str, report_dir: str | Path, *, federation: str, min_clients: int, rounds: int = 1,
               signing_key: str | None = None, kill_when: str | None = None, timeout: float = 300.0,
               extra: list[str] | None = None) -> ServerRun:
    """Run ``fedsketch-server`` (fedsketch strategy on the digits) to its end, or kill it (SIGKILL).

    ``kill_when``: a text whose appearance in the server's log kills it at once (a crash: no stop, no
    clean disconnect, so the broker publishes its last will).
    """
    report = Path(report_dir)
    report.mkdir(parents=True, exist_ok=True)
    log_path = report / "server.log"
    cmd = [_bin("fedsketch-server"), "--broker", broker, "--federation", federation, "--strategy", "fedsketch",
           "--min-clients", str(min_clients), "--rounds", str(rounds), "--architecture", "digits_cnn_1x8x8_10",
           "--encoder", "digits_encoder", "--num-classes", "10", "--epochs", "1", "--seed", "0",
           "--report-dir", str(report), "--register-timeout", "120", "--round-timeout", "60",
           *(["--signing-key", signing_key] if signing_key else []), *(extra or [])]
    t0 = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    killed = False
    try:
        with open(log_path, "rb") as tail:
            seen = b""
            while proc.poll() is None and time.monotonic() - t0 < timeout:
                if kill_when is not None:
                    seen = seen[-len(kill_when):] + tail.read()  # only what the log gained since
                    if kill_when.encode() in seen:
                        proc.kill()
                        killed = True
                        break
                time.sleep(0.1)
        if proc.poll() is None and not killed:
            proc.kill()
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    res_file = report / "results.json"
    results = json.loads(res_file.read_text()) if res_file.exists() and not killed else None
    return ServerRun(rc=rc, results=results, log=log_path.read_text(errors="replace"),
                     seconds=time.monotonic() - t0, killed=killed)
