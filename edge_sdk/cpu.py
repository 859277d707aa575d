"""CPU features that decide how torch may run on a device.

torch's aarch64 wheels (PyPI's and download.pytorch.org's) contain ARMv8.1
LSE atomics (``ldaddal``, ``casal``) in code that runs as soon as torch uses
more than one thread; an ARMv8.0 core without them (Cortex-A72 of a
Raspberry Pi 4, Cortex-A53 of a Pi 3 or Zero 2) dies with SIGILL there
(seen on an emulated Raspberry Pi 4, a Cortex-A72 under qemu). One thread works. The kernel lists LSE as
``atomics`` on the ``Features`` line of ``/proc/cpuinfo``.

:func:`torch_threads` is what the trainer and the client call: the thread
count to use (1 on such a CPU, logged once at WARNING).
"""

from __future__ import annotations

import logging
import platform
from typing import Optional

log = logging.getLogger(__name__)

CPUINFO = "/proc/cpuinfo"

# (implementer, part) from /proc/cpuinfo -> the names a user recognises
_ARM_PARTS = {
    ("0x41", "0xd03"): "Cortex-A53, Raspberry Pi 3 / Zero 2",
    ("0x41", "0xd08"): "Cortex-A72, Raspberry Pi 4",
    ("0x41", "0xd0b"): "Cortex-A76, Raspberry Pi 5",
}

_warned = False


def read_cpuinfo(path: str = CPUINFO) -> str:
    """The text of ``/proc/cpuinfo``, or ``""`` where there is none (macOS, Windows)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _fields(cpuinfo: str) -> dict[str, str]:
    """``key: value`` lines of the first processor block that has each key (lower-case keys)."""
    out: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip().lower(), value.strip())
    return out


def cpu_features(cpuinfo: Optional[str] = None) -> frozenset[str]:
    """The CPU's feature flags: the ``Features`` line (ARM) or ``flags`` line (x86).

    Parameters
    ----------
    cpuinfo : str, optional
        Text in the format of ``/proc/cpuinfo``; default: read it.
    """
    fields = _fields(read_cpuinfo() if cpuinfo is None else cpuinfo)
    line = fields.get("features", fields.get("flags", ""))
    return frozenset(line.split())


def is_arm(cpuinfo: str) -> bool:
    """True when ``cpuinfo`` describes an ARM CPU (it has a ``Features`` line, x86 has ``flags``)."""
    fields = _fields(cpuinfo)
    return "features" in fields and "flags" not in fields


def lacks_lse_atomics(cpuinfo: Optional[str] = None) -> bool:
    """True on an ARM CPU whose features lack ``atomics`` (ARMv8.1 LSE).

    False on x86 and when nothing is known (no ``/proc/cpuinfo``): only a CPU
    known to lack LSE is limited.
    """
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return is_arm(text) and "atomics" not in cpu_features(text)


def describe_cpu(cpuinfo: Optional[str] = None) -> str:
    """A short name for an ARM core (``"Cortex-A72, Raspberry Pi 4"``), else the model name or ``""``."""
    fields = _fields(read_cpuinfo() if cpuinfo is None else cpuinfo)
    part = (fields.get("cpu implementer", "").lower(), fields.get("cpu part", "").lower())
    if part in _ARM_PARTS:
        return _ARM_PARTS[part]
    return fields.get("model name", "")


def torch_threads(requested: Optional[int], cpuinfo: Optional[str] = None) -> Optional[int]:
    """The torch intra-op thread count to use for ``requested`` on this CPU.

    On an ARM CPU without LSE atomics: 1, whatever was requested (None, torch's
    default of one thread per core, included), with a WARNING the first time
    in the process. Elsewhere: ``requested`` unchanged.

    Parameters
    ----------
    requested : int or None
        The wanted count; None leaves torch's default.
    cpuinfo : str, optional
        ``/proc/cpuinfo`` text, for tests; default: this machine's (read only
        on aarch64/arm machines).
    """
    global _warned
    if cpuinfo is None:
        if not platform.machine().lower().startswith(("aarch64", "arm")):
            return requested
        cpuinfo = read_cpuinfo()
    if not lacks_lse_atomics(cpuinfo):
        return requested
    if not _warned:
        _warned = True
        name = describe_cpu(cpuinfo) or "no 'atomics' in /proc/cpuinfo"
        log.warning("this CPU lacks LSE atomics (%s): torch runs on one thread", name)
    return 1
