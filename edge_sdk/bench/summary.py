"""The few figures of a benchmark a device may send with its hello, from a result or from its ``--json`` file.

:func:`summary_for_hello` and :func:`load_bench_summary` give the same flat
dict (at most 9 keys, values str, int or float; a figure not measured is
left out rather than sent as null)::

    {"encoder": "digits_encoder", "sketch_ms": 0.29, "architecture": "digits_cnn_1x8x8_10",
     "epoch_ms": 154.2, "epoch_over_sketch": 531.7, "cpu": "Raspberry Pi 4 Model B Rev 1.1",
     "cores": 4, "mem_mb": 3794, "kernel": "cython"}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

from .ratios import PAIRS
from .results import FORMAT, FORMAT_VERSION, BenchResult

__all__ = ["HELLO_KEYS", "hello_fields", "load_bench_summary", "summary_for_hello"]

#: Every key the summary may hold, in order.
HELLO_KEYS = ("encoder", "sketch_ms", "architecture", "epoch_ms", "epoch_over_sketch", "cpu", "cores", "mem_mb",
              "kernel")
#: Longest ``cpu`` string sent.
MAX_CPU_CHARS = 64

Summary = dict[str, Union[str, int, float]]


def _summary(d: Mapping[str, Any], encoder: Optional[str], architecture: Optional[str]) -> Summary:
    """The hello summary of a result in its ``to_dict()`` form."""
    sketches = {s["encoder"]: float(s["seconds"]) for s in d["stages"] if s["stage"] == "sketch" and s["seconds"]}
    if encoder is None:
        encoder = next(iter(sketches), None)
    if architecture is None and encoder is not None:
        architecture = next((a for a, (e, _) in PAIRS.items() if e == encoder), None)
    epochs = {t["architecture"]: float(t["seconds"]) for t in d["training"] if t["seconds"]}
    ratios = {(r["architecture"], r["encoder"]): float(r["ratio"]) for r in d["ratios"]}
    m = d["machine"]
    out: dict[str, Any] = {
        "encoder": encoder if encoder in sketches else None,
        "sketch_ms": round(sketches[encoder] * 1e3, 3) if encoder in sketches else None,
        "architecture": architecture if architecture in epochs else None,
        "epoch_ms": round(epochs[architecture] * 1e3, 1) if architecture in epochs else None,
        "epoch_over_sketch": (round(ratios[(architecture, encoder)], 1)
                              if (architecture, encoder) in ratios else None),
        "cpu": str(m["cpu"])[:MAX_CPU_CHARS] if m.get("cpu") else None,
        "cores": int(m["cores"]) if m.get("cores") else None,
        "mem_mb": int(m["mem_mb"]) if m.get("mem_mb") else None,
        "kernel": str(m["kernel"]) if m.get("kernel") else None,
    }
    return {k: out[k] for k in HELLO_KEYS if out[k] is not None}


def summary_for_hello(result: BenchResult, *, encoder: Optional[str] = None,
                      architecture: Optional[str] = None) -> Summary:
    """The figures of ``result`` a device could send with its hello: a flat dict of at most 9 keys.

    Parameters
    ----------
    result : BenchResult
        What ``fedsketch bench`` measured.
    encoder : str, optional
        The device's encoder; default: the first one sketched (with
        ``--data``, the one its data fits).
    architecture : str, optional
        The device's classifier; default: the one paired with the encoder
        (digits_encoder: DigitsCNN, fmnist_fc_encoder: LeNet-5,
        conv_ae_encoder: ResNet-18).

    Returns
    -------
    dict
        Keys among :data:`HELLO_KEYS` (``encoder``, ``sketch_ms``,
        ``architecture``, ``epoch_ms``, ``epoch_over_sketch``, ``cpu``,
        ``cores``, ``mem_mb``, ``kernel``), values str, int or float; a
        figure not measured (no torch: no ``epoch_ms``) is left out.
    """
    return _summary(result.to_dict(), encoder, architecture)


def _not_a_result(path: Union[str, os.PathLike[str]], why: str) -> ValueError:
    return ValueError(f"{path} is not a fedsketch bench result ({why}); write one with: fedsketch bench --json FILE")


def load_bench_summary(path: Union[str, os.PathLike[str]], *, encoder: Optional[str] = None,
                       architecture: Optional[str] = None) -> Summary:
    """:func:`summary_for_hello` of a ``fedsketch bench --json`` file.

    Raises
    ------
    ValueError
        ``"<path> is not a fedsketch bench result (<why>); write one with:
        fedsketch bench --json FILE"`` for a file that is not one (not JSON,
        no ``"format": "fedsketch-bench"``, another format version, missing
        fields).
    OSError
        When the file cannot be read (FileNotFoundError for a missing one).
    """
    raw = Path(path).read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _not_a_result(path, "not JSON") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _not_a_result(path, f'no "format": "{FORMAT}"')
    if data.get("format_version") != FORMAT_VERSION:
        raise _not_a_result(path, f"format_version {data.get('format_version')!r}, this fedsketch reads "
                                  f"{FORMAT_VERSION}")
    try:
        return _summary(data, encoder, architecture)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _not_a_result(path, f"missing or malformed field {e}") from None


def hello_fields(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The summary as the hello carries it (:data:`edge_sdk.schema` ``HELLO``): ``cpu`` and ``bench``.

    ``bench`` holds the numbers (``sketch_ms``, ``epoch_ms``, ``epoch_over_sketch``, ``cores``, ``mem_mb``);
    ``cpu`` names the CPU, with the kernel and what was timed (``"Cortex-A72 (cython; digits_encoder,
    digits_cnn_1x8x8_10)"``), within the schema's 128 characters.
    """
    numbers = {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    timed = ", ".join(str(summary[k]) for k in ("encoder", "architecture") if k in summary)
    notes = "; ".join(x for x in (str(summary.get("kernel") or ""), timed) if x)
    cpu = f"{summary.get('cpu') or 'CPU not said'}" + (f" ({notes})" if notes else "")
    return {"cpu": cpu[:128], "bench": numbers}
