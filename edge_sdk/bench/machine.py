"""The machine a benchmark ran on: CPU, cores, memory, peak RSS, versions, temperature and throttling.

The board's readings (thermal zones, throttling, memory) are defined once, in
:mod:`edge_sdk.health`, which the device also reads for its status messages;
this module shapes them for the bench report. Every path is a keyword
argument, so that tests can point a reader at a fake ``/proc`` or ``/sys``
folder. Nothing here fails on a board that exposes less: a missing file gives
None or an empty tuple, and :func:`thermal_note` says "not exposed" in one line.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from typing import Callable, Optional

import onnxruntime

from .. import cpu as _cpu
from ..health import (
    MEMINFO,
    NOT_EXPOSED,
    THERMAL_ROOT,
    THROTTLED_FILE,
    VCGENCMD,
    decode_throttled,
    meminfo_kib,
    read_throttled_raw,
    thermal_zones,
    zone_celsius,
    zone_type,
)
from ..info import info
from .results import MachineInfo, ThermalZone, Throttled

__all__ = [
    "CPUINFO",
    "PROC_STATUS",
    "cpu_names",
    "describe_thermal",
    "machine_info",
    "mem_total_mb",
    "peak_rss_kib",
    "read_thermal",
    "read_throttled",
    "thermal_note",
]

PROC_STATUS = "/proc/self/status"
CPUINFO = _cpu.CPUINFO


def peak_rss_kib(status_path: str = PROC_STATUS) -> Optional[int]:
    """This process's peak resident memory in KiB: ``VmHWM`` of ``/proc/self/status``.

    Falls back on ``getrusage`` (``ru_maxrss``, KiB on Linux, bytes on
    macOS) where there is no such file.
    """
    try:
        with open(status_path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    except (OSError, ValueError):  # pragma: no cover - getrusage exists on every POSIX system
        return None
    return peak // 1024 if sys.platform == "darwin" else peak


def _first_fields(cpuinfo: str) -> dict[str, str]:
    """``key: value`` lines, keys as written (``Model`` differs from ``model name``), first of each."""
    out: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def cpu_names(cpuinfo: str) -> tuple[str, str]:
    """``(cpu, part)`` from ``/proc/cpuinfo`` text.

    On ARM, ``cpu`` is the board's ``Model`` line ("Raspberry Pi 4 Model B
    Rev 1.1") and ``part`` the core named by :func:`edge_sdk.cpu.describe_cpu`
    ("Cortex-A72, Raspberry Pi 4"), or the implementer and part numbers; on
    x86, ``cpu`` is the ``model name`` and ``part`` is empty. Unknown parts
    are empty strings.
    """
    fields = _first_fields(cpuinfo)
    if _cpu.is_arm(cpuinfo):
        part = _cpu.describe_cpu(cpuinfo)
        if not part and "CPU part" in fields:
            part = f"CPU implementer {fields.get('CPU implementer', '?')}, part {fields['CPU part']}"
        return fields.get("Model", "") or part, part
    return fields.get("model name", "") or platform.processor(), ""


def mem_total_mb(path: str = MEMINFO) -> Optional[int]:
    """``MemTotal`` of ``/proc/meminfo`` in MiB, or None."""
    kib = meminfo_kib(path).get("MemTotal")
    return None if kib is None else kib // 1024


def read_thermal(root: str = THERMAL_ROOT) -> tuple[ThermalZone, ...]:
    """Every ``thermal_zone*/temp`` under ``root`` (millidegrees), with the zone's ``type``; () where none."""
    zones = []
    for folder in thermal_zones(root):
        celsius = zone_celsius(folder)
        if celsius is not None:
            zones.append(ThermalZone(zone=folder.name, type=zone_type(folder), celsius=celsius))
    return tuple(zones)


def read_throttled(command: str = VCGENCMD, *, path: str = THROTTLED_FILE,
                   run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Optional[Throttled]:
    """``get_throttled`` decoded (the firmware's sysfs file, else ``vcgencmd``), or None where neither says
    anything readable."""
    raw = read_throttled_raw(path, command, run=run, timeout_s=5.0)
    return None if raw is None else Throttled(raw=raw, flags=decode_throttled(raw))


def describe_thermal(zones: tuple[ThermalZone, ...]) -> str:
    """``"48.3 C (cpu-thermal)"``, zones joined by commas, or ``"not exposed"``."""
    if not zones:
        return "not exposed"
    return ", ".join(f"{z.celsius:.1f} C ({z.type or z.zone})" for z in zones)


def thermal_note(zones: tuple[ThermalZone, ...], throttled: Optional[Throttled]) -> str:
    """What the board does not expose, in one line ("" when it exposes both)."""
    missing = []
    if not zones:
        missing.append(NOT_EXPOSED["cpu_temp_c"])
    if throttled is None:
        missing.append(NOT_EXPOSED["throttled"])
    return "; ".join(missing)


def _mib(kib: Optional[int]) -> Optional[float]:
    return None if kib is None else round(kib / 1024.0, 1)


def machine_info(*, temp_before: tuple[ThermalZone, ...] = (), throttled_before: Optional[Throttled] = None,
                 sketch_peak_kib: Optional[int] = None, cpuinfo_path: str = CPUINFO, meminfo_path: str = MEMINFO,
                 thermal_root: str = THERMAL_ROOT, vcgencmd: str = VCGENCMD,
                 throttled_path: str = THROTTLED_FILE) -> MachineInfo:
    """This machine now (the "after" readings and the peak RSS so far), with the "before" readings given.

    torch's version is looked up (package metadata), never imported.
    """
    inst = info()
    cpu, part = cpu_names(_cpu.read_cpuinfo(cpuinfo_path))
    after = read_thermal(thermal_root)
    throttled_after = read_throttled(vcgencmd, path=throttled_path)
    return MachineInfo(
        cpu=cpu or "unknown", cpu_part=part, cores=os.cpu_count(), mem_mb=mem_total_mb(meminfo_path),
        kernel=str(inst["kernel"]), kernels_available=tuple(inst["kernels_available"]),
        onnxruntime=onnxruntime.__version__, providers=tuple(onnxruntime.get_available_providers()),
        torch=inst["torch"], python=str(inst["python"]), platform=str(inst["platform"]),
        fedsketch=str(inst["fedsketch"]), sketch_peak_rss_mib=_mib(sketch_peak_kib),
        peak_rss_mib=_mib(peak_rss_kib()), temp_before=tuple(temp_before), temp_after=after,
        throttled_before=throttled_before, throttled_after=throttled_after,
        thermal_note=thermal_note(temp_before or after, throttled_before or throttled_after),
    )
