"""What ``fedsketch bench`` prints: a table for people, then one compact JSON line of the main figures."""

from __future__ import annotations

import json
from typing import Any, Optional

from .machine import describe_thermal
from .results import BenchResult, BrokerTiming, MachineInfo, Throttled

__all__ = ["compact_line", "format_table"]

#: Stage rows of the table, in order: key -> label.
STAGE_ROWS = {
    "load": "load encoder (once)",
    "encode_one": "encode 1 image (batch 1)",
    "encode_batch": "encode all images",
    "class_means": "class means",
    "quantise_pack_cython": "quantise + pack, cython",
    "quantise_pack_numpy": "quantise + pack, numpy",
    "sketch": "whole sketch",
}


def _ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.4f} ms" if ms < 0.1 else f"{ms:.3f} ms" if ms < 10 else f"{ms:.1f} ms"


def _secs(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


def _stages(result: BenchResult) -> list[str]:
    encoders = list(dict.fromkeys(s.encoder for s in result.stages))
    if not encoders:
        return []
    cells = {(s.encoder, s.stage): s for s in result.stages}
    width = max(14, *(len(e) + 2 for e in encoders))
    samples = {s.encoder: s.samples for s in result.stages if s.stage == "sketch"}
    lines = [f"Sketch path, median of {result.settings.repeats} (kernel in use: {result.machine.kernel})",
             f"  {'stage':26s}" + "".join(f"{e:>{width}s}" for e in encoders),
             f"  {'(samples)':26s}" + "".join(f"{samples.get(e, 0):>{width}d}" for e in encoders)]
    for key, label in STAGE_ROWS.items():
        row = []
        for e in encoders:
            s = cells.get((e, key))
            text = "-" if s is None else _ms(s.seconds) if s.seconds is not None else (
                "not compiled" if s.note.startswith("not compiled") else "-")
            row.append(f"{text:>{width}s}")
        lines.append(f"  {label:26s}" + "".join(row))
    return lines


def _training(result: BenchResult) -> list[str]:
    if not result.training:
        return []
    lines = ["Local training, one epoch (train_local: batch 32, Adam, lr 1e-3)"]
    for t in result.training:
        if t.seconds is None:
            lines.append(f"  {t.label:10s} {t.architecture:22s} {t.note}")
            continue
        extra = f"; {t.note}" if t.note else ""
        lines.append(f"  {t.label:10s} {t.architecture:22s} {_secs(t.seconds):>10s}  {t.samples} samples, "
                     f"{t.threads} thread(s){extra}")
    return lines


def _ratios(result: BenchResult) -> list[str]:
    if not result.ratios:
        return []
    lines = ["Epoch / sketch (the paper's Figure 6, Raspberry Pi 4: LeNet-5 4x, ResNet-18 115x)"]
    labels = {t.architecture: t.label for t in result.training}
    for r in result.ratios:
        paper = f"  (paper: {r.paper:g}x)" if r.paper is not None else ""
        name = f"{labels.get(r.architecture, r.architecture)} epoch / {r.encoder} sketch"
        lines.append(f"  {name:44s} {r.ratio:10.1f}x{paper}  [{r.samples} samples each]")
    return lines


def _sizes(result: BenchResult) -> list[str]:
    if not result.sizes:
        return []
    lines = ["Message sizes, bytes",
             f"  {'message':8s} {'of':22s} {'body':>12s} {'envelope':>12s} {'on the wire':>12s} {'compressed':>11s}"]
    for m in result.sizes:
        if m.envelope_bytes is None:
            lines.append(f"  {m.kind:8s} {m.name:22s} {m.note}")
            continue
        comp = "-" if m.compressed_bytes is None else f"{m.compressed_bytes:,}"
        lines.append(f"  {m.kind:8s} {m.name:22s} {m.body_bytes:>12,} {m.envelope_bytes:>12,} "
                     f"{m.wire_bytes:>12,} {comp:>11s}")
    return lines


def _broker(b: Optional[BrokerTiming]) -> list[str]:
    if b is None:
        return []
    return [f"Broker {b.url} as {b.client_id} on {b.topic}",
            f"  round trip (PUBACK)  median {b.rtt_median_s * 1e3:.2f} ms, p90 {b.rtt_p90_s * 1e3:.2f} ms "
            f"over {b.messages} messages",
            f"  upload               {b.upload_bytes / 1e6:.2f} MB in {b.upload_seconds:.2f} s = "
            f"{b.upload_mb_s:.2f} MB/s",
            f"  ({b.note})"]


def _throttled(t: Optional[Throttled]) -> str:
    if t is None:
        return "not exposed"
    return f"{', '.join(t.flags) or 'never'} ({t.raw:#x})"


def _machine(m: MachineInfo) -> list[str]:
    rows = [
        ("cpu", m.cpu + (f" ({m.cpu_part})" if m.cpu_part and m.cpu_part != m.cpu else "")),
        ("cores", str(m.cores)),
        ("memory", f"{m.mem_mb} MB" if m.mem_mb else "unknown"),
        ("bit kernel", f"{m.kernel} (available: {', '.join(m.kernels_available)})"),
        ("onnxruntime", f"{m.onnxruntime} ({', '.join(m.providers)})"),
        ("torch", m.torch or "not installed"),
        ("python", f"{m.python}, {m.platform}, fedsketch {m.fedsketch}"),
        ("peak RSS", f"{m.peak_rss_mib} MiB (after the sketch stages: {m.sketch_peak_rss_mib} MiB)"),
    ]
    if m.temp_before or m.temp_after:
        rows.append(("temperature", f"{describe_thermal(m.temp_before)} before, {describe_thermal(m.temp_after)} after"))
    if m.throttled_before or m.throttled_after:
        rows.append(("throttling", f"{_throttled(m.throttled_before)} before, {_throttled(m.throttled_after)} after"))
    if m.thermal_note:
        rows.append(("thermal", m.thermal_note))
    return ["Machine"] + [f"  {k:12s} {v}" for k, v in rows]


def format_table(result: BenchResult) -> str:
    """The whole result as text, one section per kind of figure."""
    s = result.settings
    source = f"--data {s.data}" if s.data else f"{s.samples} generated samples (seed {s.seed})"
    head = [f"fedsketch bench: {source}, {s.classes} classes, P = {s.flip_prob:g}"]
    sections = [head, _stages(result), _training(result), _ratios(result), _sizes(result), _broker(result.broker),
                _machine(result.machine)]
    return "\n\n".join("\n".join(lines) for lines in sections if lines)


def compact_line(result: BenchResult) -> str:
    """One JSON line: sketch ms per encoder, epoch s per architecture, the ratios, the machine in brief."""
    out: dict[str, Any] = {
        "sketch_ms": {s.encoder: round(s.seconds * 1e3, 4) for s in result.stages
                      if s.stage == "sketch" and s.seconds is not None},
        "epoch_s": {t.architecture: round(t.seconds, 4) for t in result.training if t.seconds is not None},
        "epoch_over_sketch": {r.architecture: round(r.ratio, 1) for r in result.ratios},
        "kernel": result.machine.kernel,
        "cpu": result.machine.cpu,
        "cores": result.machine.cores,
        "peak_rss_mib": result.machine.peak_rss_mib,
    }
    if result.broker is not None:
        out["rtt_ms"] = round(result.broker.rtt_median_s * 1e3, 3)
        out["upload_mb_s"] = round(result.broker.upload_mb_s, 3)
    return json.dumps(out, separators=(",", ":"))
