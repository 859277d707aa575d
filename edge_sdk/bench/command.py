"""``fedsketch bench``: check every option and input first, then measure, print, write.

Everything that can be wrong with the command line (a data file no encoder
takes, an unknown name, a missing matplotlib, a broker without a client id)
is found before the first timing, as one ``fedsketch bench: error: ...`` line
and exit 2; a broker that cannot be reached or refuses the credentials is
exit 3. Progress goes to stderr, a line per stage; the table, then one JSON
line (the last of stdout), go to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .. import bits
from ..protocol import ProtocolError, check_id
from ..transport import BrokerConfig
from ..validation import check_positive, check_positive_int
from .broker import probe_broker
from .errors import BenchError
from .inputs import (
    check_names,
    fitting_encoders,
    for_encoder,
    generated,
    load_data,
    shipped_encoders,
)
from .machine import machine_info, peak_rss_kib, read_thermal, read_throttled
from .plot import plot_missing, write_plot
from .ratios import figure6_ratios
from .report import compact_line, format_table
from .results import BenchResult, BenchSettings, BrokerTiming, StageTiming
from .sizes import message_sizes
from .stages import bench_encoder
from .training import ARCHITECTURES, train_rows

__all__ = ["run"]

#: The client id written in the size rows' envelopes when none is given.
SIZES_CLIENT_ID = "c07"


@dataclass(frozen=True)
class _Plan:
    """What to measure, checked: the settings, the device's data (if any), the broker (if any)."""

    settings: BenchSettings
    size_architectures: tuple[str, ...]
    data: Optional[tuple[np.ndarray, np.ndarray]]
    broker: Optional[BrokerConfig]
    client_id: Optional[str]


def _check_numbers(args: argparse.Namespace) -> None:
    for name in ("samples", "repeats", "classes", "batch_size", "resnet_samples", "rtt_messages",
                 "upload_messages", "max_payload"):
        check_positive_int(getattr(args, name), "--" + name.replace("_", "-"))
    if args.threads is not None:
        check_positive_int(args.threads, "--threads")
    check_positive(args.upload_mb, "--upload-mb", "number of MB")
    check_positive(args.connect_timeout, "--connect-timeout", "number of seconds")
    bits.flip_threshold(args.flip_prob)


def _check_outputs(args: argparse.Namespace) -> None:
    for opt, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise BenchError(f"{opt} {path}: folder {Path(path).resolve().parent} does not exist")
    if args.plot:
        missing = plot_missing()
        if missing:
            raise BenchError(missing)


def _broker(args: argparse.Namespace) -> tuple[Optional[BrokerConfig], Optional[str]]:
    cid = args.client_id or args.username
    if not args.broker:
        return None, cid
    if not cid:
        raise BenchError("--broker needs --client-id (this device's id, its broker user name) or --username")
    try:
        check_id(cid, "--client-id")
    except ProtocolError as e:
        raise BenchError(str(e)) from None
    return BrokerConfig.from_args(args, args.broker), cid


def _plan(args: argparse.Namespace) -> _Plan:
    try:
        _check_numbers(args)
        _check_outputs(args)
        cfg, cid = _broker(args)
    except (ValueError, OSError) as e:
        raise BenchError(" ".join(str(e).split())) from None
    wanted = check_names(args.encoder)
    data = load_data(args.data, args.classes) if args.data else None
    if data is not None:
        encoders = fitting_encoders(data[0], args.data, wanted)
    else:
        specs = shipped_encoders()
        encoders = wanted or sorted(specs, key=lambda n: (int(np.prod(specs[n].input_shape)), n))
    archs = tuple(dict.fromkeys(args.arch)) or ARCHITECTURES
    settings = BenchSettings(
        encoders=tuple(encoders), architectures=() if args.no_train else archs,
        samples=len(data[1]) if data is not None else args.samples, resnet_samples=args.resnet_samples,
        repeats=args.repeats, classes=args.classes, flip_prob=float(args.flip_prob), batch_size=args.batch_size,
        threads=args.threads, seed=args.seed, data=args.data, train=not args.no_train)
    return _Plan(settings=settings, size_architectures=archs, data=data, broker=cfg, client_id=cid)


def _stages(plan: _Plan, progress: Callable[[str], None]) -> tuple[list[StageTiming], dict]:
    s = plan.settings
    specs = shipped_encoders()
    stages: list[StageTiming] = []
    sketches = {}
    for name in s.encoders:
        if plan.data is not None:
            x, y = for_encoder(plan.data[0], specs[name]), plan.data[1]
        else:
            x, y = generated(specs[name].input_shape, s.samples, s.classes, s.seed)
        rows, sketches[name] = bench_encoder(name, x, y, repeats=s.repeats, classes=s.classes,
                                             flip_prob=s.flip_prob, batch_size=s.batch_size, threads=None,
                                             seed=s.seed, progress=progress)
        stages += rows
    return stages, sketches


def _measure(plan: _Plan, args: argparse.Namespace, progress: Callable[[str], None]) -> BenchResult:
    s = plan.settings
    broker: Optional[BrokerTiming] = None
    if plan.broker is not None:
        broker = probe_broker(plan.broker, str(plan.client_id), federation=args.federation, root=args.root,
                              messages=args.rtt_messages, upload_bytes=int(args.upload_mb * 1e6),
                              upload_messages=args.upload_messages, connect_timeout=args.connect_timeout,
                              quiet=not args.verbose, progress=progress)
    temp_before, throttled_before = read_thermal(), read_throttled()
    stages, sketches = _stages(plan, progress)
    sketch_peak = peak_rss_kib()
    training = train_rows(s.architectures, samples=args.samples, resnet_samples=s.resnet_samples,
                          threads=s.threads, seed=s.seed, progress=progress)
    progress("message sizes")
    sizes = message_sizes(sketches, plan.size_architectures, federation=args.federation,
                          client_id=plan.client_id or SIZES_CLIENT_ID, samples=s.samples,
                          max_payload=args.max_payload, seed=s.seed)
    machine = machine_info(temp_before=temp_before, throttled_before=throttled_before, sketch_peak_kib=sketch_peak)
    return BenchResult(settings=s, machine=machine, stages=tuple(stages), training=tuple(training),
                       ratios=tuple(figure6_ratios(training, stages)), sizes=tuple(sizes), broker=broker,
                       created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def run(args: argparse.Namespace) -> int:
    """Run ``fedsketch bench`` with parsed ``args``; returns the exit status (0, 2 or 3)."""
    start = time.monotonic()

    def progress(line: str) -> None:
        print(f"fedsketch bench [{time.monotonic() - start:5.1f} s] {line}", file=sys.stderr, flush=True)

    try:
        plan = _plan(args)
        result = _measure(plan, args, progress)
    except BenchError as e:
        print(f"fedsketch bench: error: {e}", file=sys.stderr)
        return e.code
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
        progress(f"wrote {args.json}")
    if args.plot:
        write_plot(result, args.plot)
        progress(f"wrote {args.plot}")
    print(compact_line(result), flush=True)
    return 0
