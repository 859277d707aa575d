"""The machine a benchmark ran on: CPU, cores, memory, peak RSS, versions, temperature and throttling.

Every path is a module constant and a keyword argument, so that tests can
point a reader at a fake ``/proc`` or ``/sys`` folder. Nothing here fails on
a board that exposes less: a missing file gives None or an empty tuple, and
:func:`thermal_note` says "not exposed" in one line.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import onnxruntime

from .. import cpu as _cpu
from ..info import info
from .results import MachineInfo, ThermalZone, Throttled

__all__ = [
    "CPUINFO",
    "MEMINFO",
    "PROC_STATUS",
    "THERMAL_ROOT",
    "THROTTLE_BITS",
    "VCGENCMD",
    "cpu_names",
    "decode_throttled",
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
MEMINFO = "/proc/meminfo"
THERMAL_ROOT = "/sys/class/thermal"
#: The Raspberry Pi firmware tool; looked up on PATH.
VCGENCMD = "vcgencmd"

#: Bits of ``vcgencmd get_throttled`` (Raspberry Pi firmware documentation).
THROTTLE_BITS: dict[int, str] = {
    0: "under-voltage now",
    1: "frequency capped now",
    2: "throttled now",
    3: "soft temperature limit now",
    16: "under-voltage since boot",
    17: "frequency capped since boot",
    18: "throttled since boot",
    19: "soft temperature limit since boot",
}


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
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def read_thermal(root: str = THERMAL_ROOT) -> tuple[ThermalZone, ...]:
    """Every ``thermal_zone*/temp`` under ``root`` (millidegrees), with the zone's ``type``; () where none."""
    zones = []
    try:
        folders = sorted(Path(root).glob("thermal_zone*"), key=lambda p: (len(p.name), p.name))
    except OSError:
        return ()
    for folder in folders:
        try:
            milli = int((folder / "temp").read_text().strip())
        except (OSError, ValueError):
            continue
        try:
            kind = (folder / "type").read_text().strip()
        except OSError:
            kind = ""
        zones.append(ThermalZone(zone=folder.name, type=kind, celsius=round(milli / 1000.0, 1)))
    return tuple(zones)


def decode_throttled(raw: int) -> tuple[str, ...]:
    """The flags set in ``vcgencmd get_throttled``'s value, in bit order (0x50005: under-voltage and throttled,
    now and since boot)."""
    return tuple(name for bit, name in sorted(THROTTLE_BITS.items()) if raw >> bit & 1)


def read_throttled(command: str = VCGENCMD, *, run: Callable[..., subprocess.CompletedProcess] = subprocess.run
                   ) -> Optional[Throttled]:
    """``vcgencmd get_throttled`` decoded, or None where the command is missing or says nothing readable."""
    exe = shutil.which(command)
    if exe is None:
        return None
    try:
        out = run([exe, "get_throttled"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"throttled=(0x[0-9a-fA-F]+|\d+)", out.stdout or "")
    if found is None:
        return None
    raw = int(found.group(1), 0)
    return Throttled(raw=raw, flags=decode_throttled(raw))


def describe_thermal(zones: tuple[ThermalZone, ...]) -> str:
    """``"48.3 C (cpu-thermal)"``, zones joined by commas, or ``"not exposed"``."""
    if not zones:
        return "not exposed"
    return ", ".join(f"{z.celsius:.1f} C ({z.type or z.zone})" for z in zones)


def thermal_note(zones: tuple[ThermalZone, ...], throttled: Optional[Throttled]) -> str:
    """What the board does not expose, in one line ("" when it exposes both)."""
    missing = []
    if not zones:
        missing.append("temperature not exposed (no thermal_zone*/temp)")
    if throttled is None:
        missing.append("throttling not exposed (no vcgencmd)")
    return "; ".join(missing)


def _mib(kib: Optional[int]) -> Optional[float]:
    return None if kib is None else round(kib / 1024.0, 1)


def machine_info(*, temp_before: tuple[ThermalZone, ...] = (), throttled_before: Optional[Throttled] = None,
                 sketch_peak_kib: Optional[int] = None, cpuinfo_path: str = CPUINFO, meminfo_path: str = MEMINFO,
                 thermal_root: str = THERMAL_ROOT, vcgencmd: str = VCGENCMD) -> MachineInfo:
    """This machine now (the "after" readings and the peak RSS so far), with the "before" readings given.

    torch's version is looked up (package metadata), never imported.
    """
    inst = info()
    cpu, part = cpu_names(_cpu.read_cpuinfo(cpuinfo_path))
    after = read_thermal(thermal_root)
    throttled_after = read_throttled(vcgencmd)
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
