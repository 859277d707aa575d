"""What this installation is: versions, kernel backend, artifacts."""

from __future__ import annotations

import importlib.util
import platform
import sys
from typing import Any

import numpy as np

from . import bits
from ._version import __version__


def _version_of(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        from importlib.metadata import version

        return version({"onnxruntime": "onnxruntime", "paho": "paho-mqtt"}.get(module, module))
    except Exception:  # noqa: BLE001 - metadata may be missing for odd installs
        return "unknown"


def info() -> dict[str, Any]:
    """A dictionary describing this installation (what ``fedsketch info`` prints).

    ``kernel`` names the bit-kernel backend in use: ``"cython"`` for the
    compiled ``edge_sdk._bits``, ``"numpy"`` for the pure-numpy twin.
    Torch is looked up, never imported.
    """
    from .models.artifacts import load_manifest, models_dir

    try:
        mdir = models_dir()
        artifacts = sorted(load_manifest(mdir))
        mdir_s: str | None = str(mdir)
    except (FileNotFoundError, ValueError):
        artifacts, mdir_s = [], None
    return {
        "fedsketch": __version__,
        "kernel": bits.BACKEND,
        "kernels_available": list(bits.available_backends()),
        "python": platform.python_version(),
        "platform": f"{sys.platform}-{platform.machine()}",
        "numpy": np.__version__,
        "onnxruntime": _version_of("onnxruntime"),
        "paho_mqtt": _version_of("paho"),
        "safetensors": _version_of("safetensors"),
        "torch": _version_of("torch"),
        "models_dir": mdir_s,
        "artifacts": artifacts,
    }
