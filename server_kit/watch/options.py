"""``fedsketch-server``'s options for watching a run, and the watch they start.

``--metrics-port`` (Prometheus' ``/metrics``, and the live page on the same
port), ``--live-port`` (the live page on a port of its own), ``--metrics-host``
(127.0.0.1 unless told otherwise: neither has authentication),
``--metrics-devices`` (the devices with series of their own) and
``--watch-after`` (seconds the final page and metrics stay up after the run).
:func:`start_watch` listens before the run connects anywhere: an address
that cannot be listened on is a :class:`~.http.WatchError`, exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the endpoint and the watch are imported by start_watch: a server that watches nothing
    from .http import WatchServer  # never loads prometheus-client
    from .watch import Watch

__all__ = ["DEVICE_LIMIT", "RunWatch", "WatchError", "add_watch_options", "start_watch"]

log = logging.getLogger(__name__)

#: Devices with per-device series by default (``--metrics-devices``).
DEVICE_LIMIT = 20


class WatchError(Exception):
    """The watch's address cannot be listened on, or its options do not fit (one line, for the command's error)."""


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, got {port}")
    return port


def add_watch_options(parser: argparse.ArgumentParser) -> None:
    """The options of watching a run (see the module docstring)."""
    g = parser.add_argument_group("watching a run (Prometheus metrics, the live page)")
    g.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://HOST:PORT/metrics and the live page on /; with ingest "
                        "workers, worker p exports its own on PORT+1+p (default: off)")
    g.add_argument("--live-port", type=_port, default=None, metavar="PORT",
                   help="serve the live page (and the metrics) on this port too (default: the metrics port)")
    g.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address they listen on (0.0.0.0 only behind a firewall: there is no "
                        "authentication) (default: 127.0.0.1)")
    g.add_argument("--metrics-devices", type=int, default=DEVICE_LIMIT, metavar="N",
                   help=f"devices with series of their own: the most refused and the slowest; every fleet-wide "
                        f"figure is an aggregate (default: {DEVICE_LIMIT})")
    g.add_argument("--watch-after", type=float, default=0.0, metavar="SECONDS",
                   help="keep the final page and the metrics up this long after the run (default: 0)")


@dataclass
class RunWatch:
    """A run's :class:`~.watch.Watch` and the endpoints serving it."""

    watch: Watch
    servers: list[WatchServer] = field(default_factory=list)
    after_s: float = 0.0

    def attach(self, orch: Any) -> None:
        self.watch.attach(orch)

    def finish(self, results: Mapping[str, Any] | None, report_dir: str | Path | None) -> None:
        """The run is over: its final results become the page."""
        if results is not None:
            self.watch.finish(results, report_dir)

    def close(self, *, linger: bool = True) -> None:
        """Stay up ``after_s`` seconds (the broker connection closed already: nothing else goes on), then stop."""
        if linger and self.after_s > 0:
            log.info("the final page and metrics stay up %g s at %s", self.after_s, self.servers[0].url)
            try:
                time.sleep(self.after_s)
            except KeyboardInterrupt:
                pass
        for s in self.servers:
            s.close()


def start_watch(args: argparse.Namespace, results_of: Callable[[Mapping[str, Any]], Any]) -> RunWatch | None:
    """The watch the options ask for, listening (None when neither port is given); raises :class:`WatchError`."""
    from .collector import server_registry
    from .http import WatchServer
    from .watch import Watch

    ports = [p for p in (args.metrics_port, args.live_port) if p is not None]
    if not ports:
        return None
    if args.watch_after < 0:
        raise WatchError(f"--watch-after must be 0 or more, got {args.watch_after:g}")
    try:
        watch = Watch(device_limit=args.metrics_devices)
    except ValueError as e:
        raise WatchError(str(e)) from None
    running = RunWatch(watch, after_s=args.watch_after)
    registry = server_registry(lambda: watch.view, lambda: {"views": watch.cpu_s,
                                                            "answers": sum(s.cpu_s for s in running.servers)})
    try:
        for port in dict.fromkeys(ports):
            running.servers.append(WatchServer(watch, registry, results_of, host=args.metrics_host,
                                               port=port).start())
    except WatchError:
        running.close(linger=False)
        raise
    for s in running.servers:
        log.info("watching the run at %s (live page) and %smetrics", s.url, s.url)
    return running
