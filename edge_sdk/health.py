"""A device's health: what its board exposes (CPU temperature, throttling, memory, load) and what it knows itself.

:func:`read_health` reads the board now; every reading is guarded, so that a
board exposing less gives None for that field and nothing fails (the device
says what is "not exposed", as ``fedsketch bench`` does:
:meth:`DeviceHealth.not_exposed`). The device adds what it knows itself (its
last round's duration, the version of its model, its kept model) and sends
:meth:`DeviceHealth.to_meta` with its hello and its status messages; the
server checks it with the one schema (:mod:`edge_sdk.schema`, ``health``) and
reads it back with :meth:`DeviceHealth.from_meta`.

The readings of the machine are defined here once: ``fedsketch bench``
(:mod:`edge_sdk.bench.machine`) reads its thermal zones, throttling and
memory through these functions. Every path is a module constant, and
:class:`BoardFiles` lets a test point the reader at a fake ``/proc`` or
``/sys`` folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "CPU_ZONE_TYPES",
    "MEMINFO",
    "NOT_EXPOSED",
    "THERMAL_ROOT",
    "THROTTLED_FILE",
    "THROTTLED_NOW",
    "THROTTLE_BITS",
    "THROTTLING_NOW",
    "UNDER_VOLTAGE_NOW",
    "VCGENCMD",
    "BoardFiles",
    "DeviceHealth",
    "cpu_temp_c",
    "decode_throttled",
    "meminfo_kib",
    "read_health",
    "read_throttled_raw",
    "thermal_zones",
    "zone_celsius",
    "zone_type",
]

MEMINFO = "/proc/meminfo"
THERMAL_ROOT = "/sys/class/thermal"
#: The Raspberry Pi firmware's throttling bitmask, as its kernel driver shows it (hexadecimal, no ``0x``).
THROTTLED_FILE = "/sys/devices/platform/soc/soc:firmware/get_throttled"
#: The Raspberry Pi firmware tool (looked up on PATH), asked only where :data:`THROTTLED_FILE` is missing.
VCGENCMD = "vcgencmd"
#: The thermal zone types that are the CPU's (Raspberry Pi, x86); else zone 0.
CPU_ZONE_TYPES = ("cpu-thermal", "x86_pkg_temp")

#: Bits of ``get_throttled`` (Raspberry Pi firmware documentation).
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
#: Bit 0 of ``get_throttled``: the supply is under-voltage now.
UNDER_VOLTAGE_NOW = 1 << 0
#: Bit 2 of ``get_throttled``: the CPU is throttled now.
THROTTLED_NOW = 1 << 2
#: The bits that mean the device is slowed down now (:attr:`DeviceHealth.throttling_now`).
THROTTLING_NOW = UNDER_VOLTAGE_NOW | THROTTLED_NOW

#: What a board that exposes less says, per reading (the device's log and ``fedsketch bench`` alike).
NOT_EXPOSED: dict[str, str] = {
    "cpu_temp_c": "temperature not exposed (no thermal_zone*/temp)",
    "throttled": "throttling not exposed (no get_throttled file, no vcgencmd)",
    "mem_available_mb": "memory not exposed (no /proc/meminfo)",
    "load1": "load not exposed (no load average)",
}
#: Seconds ``vcgencmd`` may take before its reading is given up.
VCGENCMD_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class DeviceHealth:
    """A device's health, as its hello and its status messages carry it; None: not known (not exposed)."""

    #: The CPU's temperature in degrees Celsius (the CPU's thermal zone, else zone 0).
    cpu_temp_c: Optional[float] = None
    #: The Raspberry Pi firmware's ``get_throttled`` bitmask (:data:`THROTTLE_BITS`).
    throttled: Optional[int] = None
    #: ``MemAvailable`` and ``MemTotal`` of ``/proc/meminfo``, in MiB.
    mem_available_mb: Optional[float] = None
    mem_total_mb: Optional[float] = None
    #: The load average over one minute.
    load1: Optional[float] = None
    #: Seconds the device's last round took, from its train command to its update sent.
    round_s: Optional[float] = None
    #: The version of the model it holds (models sent down compressed).
    model_version: Optional[int] = None
    #: The model it kept at the end of a run: its key and the first 12 hex digits of its sha256 (``c0@1a2b3c4d5e6f``).
    kept: Optional[str] = None

    @property
    def throttling_now(self) -> Optional[bool]:
        """Whether the board is under-voltage or throttled now (bits 0 and 2); None where it does not say."""
        return None if self.throttled is None else bool(self.throttled & THROTTLING_NOW)

    @property
    def throttle_flags(self) -> tuple[str, ...]:
        """The flags set in :attr:`throttled`, in bit order (() where it is not known)."""
        return () if self.throttled is None else decode_throttled(self.throttled)

    def to_meta(self) -> dict[str, Any]:
        """The fields that are known (not None), as the schema's ``health`` field carries them."""
        return {f.name: getattr(self, f.name) for f in _FIELDS if getattr(self, f.name) is not None}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> DeviceHealth:
        """A health from :meth:`to_meta`'s mapping, checked by the schema (other keys are ignored)."""
        return cls(**{f.name: meta[f.name] for f in fields(cls) if meta.get(f.name) is not None})

    def not_exposed(self) -> str:
        """What the board does not expose, in one line ("" when it exposes everything read)."""
        return "; ".join(text for name, text in NOT_EXPOSED.items() if getattr(self, name) is None)


#: DeviceHealth's fields, in order (to_meta reads them without dataclasses.asdict's deep copies).
_FIELDS = fields(DeviceHealth)


@dataclass(frozen=True)
class BoardFiles:
    """Where the board's readings are (tests point them at a fake folder)."""

    thermal_root: str = THERMAL_ROOT
    throttled: str = THROTTLED_FILE
    vcgencmd: str = VCGENCMD
    meminfo: str = MEMINFO


def thermal_zones(root: str = THERMAL_ROOT) -> list[Path]:
    """The ``thermal_zone*`` folders under ``root``, in their numbers' order ([] where none)."""
    try:
        return sorted(Path(root).glob("thermal_zone*"), key=lambda p: (len(p.name), p.name))
    except OSError:
        return []


def zone_type(zone: Path) -> str:
    """A thermal zone's ``type`` ("" where it cannot be read)."""
    try:
        return (zone / "type").read_text().strip()
    except OSError:
        return ""


def zone_celsius(zone: Path) -> Optional[float]:
    """A thermal zone's ``temp`` (millidegrees) in degrees Celsius, to 0.1; None where it cannot be read."""
    try:
        return round(int((zone / "temp").read_text().strip()) / 1000.0, 1)
    except (OSError, ValueError):
        return None


def cpu_temp_c(root: str = THERMAL_ROOT) -> Optional[float]:
    """The CPU's temperature: the first zone of a type in :data:`CPU_ZONE_TYPES`, else zone 0; None: none."""
    zones = thermal_zones(root)
    if not zones:
        return None
    cpu = next((z for z in zones if zone_type(z) in CPU_ZONE_TYPES), zones[0])
    return zone_celsius(cpu)


def meminfo_kib(path: str = MEMINFO) -> dict[str, int]:
    """``MemTotal`` and ``MemAvailable`` of ``/proc/meminfo`` in KiB, those it gives ({} where none)."""
    wanted = {"MemTotal:", "MemAvailable:"}
    out: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in wanted:
                    try:
                        out[parts[0][:-1]] = int(parts[1])
                    except (ValueError, IndexError):
                        pass
                    if len(out) == len(wanted):
                        break
    except (OSError, UnicodeDecodeError):
        pass
    return out


def decode_throttled(raw: int) -> tuple[str, ...]:
    """The flags set in a ``get_throttled`` value, in bit order (0x50005: under-voltage and throttled, now and
    since boot)."""
    return tuple(name for bit, name in sorted(THROTTLE_BITS.items()) if raw >> bit & 1)


def read_throttled_raw(path: str = THROTTLED_FILE, command: str = VCGENCMD, *,
                       run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                       timeout_s: float = VCGENCMD_TIMEOUT_S) -> Optional[int]:
    """The ``get_throttled`` bitmask: the firmware's sysfs file, else ``vcgencmd get_throttled`` if that
    command exists; None where neither says anything readable."""
    try:
        return int(Path(path).read_text().strip(), 16)
    except (OSError, ValueError):
        pass
    exe = shutil.which(command)
    if exe is None:
        return None
    try:
        out = run([exe, "get_throttled"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"throttled=(0x[0-9a-fA-F]+|\d+)", out.stdout or "")
    return None if found is None else int(found.group(1), 0)


def _load1() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # no load average on this platform
        return None


def _mib(kib: Optional[int]) -> Optional[float]:
    return None if kib is None else round(kib / 1024.0, 1)


def read_health(files: BoardFiles = BoardFiles(), **known: Any) -> DeviceHealth:
    """The device's health now: what the board exposes, with the fields the device knows itself.

    Parameters
    ----------
    files : BoardFiles
        Where the board's readings are.
    **known
        The fields the device knows (``round_s``, ``model_version``,
        ``kept``; None: not known); they replace a reading of the same name.

    Each reading is guarded: a missing or unreadable file leaves its field
    None. Where nothing is slow it costs a few file reads (well under a
    millisecond); ``vcgencmd`` runs only on a board without the firmware's
    sysfs file that has the command.
    """
    mem = meminfo_kib(files.meminfo)
    board = {"cpu_temp_c": cpu_temp_c(files.thermal_root),
             "throttled": read_throttled_raw(files.throttled, files.vcgencmd),
             "mem_available_mb": _mib(mem.get("MemAvailable")), "mem_total_mb": _mib(mem.get("MemTotal")),
             "load1": _load1()}
    return DeviceHealth(**{**board, **known})
