"""``fedsketch-aggregator``: a site aggregator beside a site broker bridged to the core.

It takes the site's devices' updates from the site broker, checks and holds
them, and sends the server (through the bridge) a receipt per update and one
signed partial sum per model per round (:class:`~.aggregator.PartialAggregator`).
The bridge carries the site's hellos, sketches, statuses and metrics to the
core as usual, but not its updates (``deploy/site-broker.conf``).

Exit status: 0 on SIGTERM or Ctrl-C, 2 for bad options or key files, 3 when
the broker cannot be reached or refuses the credentials.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from edge_sdk.logs import add_log_format_argument, configure_logging
from edge_sdk.transport import BrokerConfig

from .aggregator import DEFAULT_HOLD_MEMORY_BYTES

__all__ = ["build_parser", "main"]

log = logging.getLogger("fedsketch.aggregator")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedsketch-aggregator", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Sum a site's device updates per model and send the server one signed partial sum per model "
                    "per round (run beside the site's broker, bridged to the core).")
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883", help="the site broker: mqtt://host:port or mqtts://")
    p.add_argument("--id", required=True, dest="aid", help="this aggregator's id (its key's name, its broker user)")
    p.add_argument("--key", required=True, metavar="PEM",
                   help="its Ed25519 private key (fedsketch keygen DIR --name ID); the server holds ID.pub")
    p.add_argument("--server-key", metavar="PEM", help="the server's public key: obey only its signed messages")
    p.add_argument("--federation", default="default")
    p.add_argument("--root", default="fedsketch", help="topic root")
    p.add_argument("--hold-memory-mb", type=float, default=DEFAULT_HOLD_MEMORY_BYTES / 1e6,
                   help="memory for the updates held until their round closes (MB); the rest wait on disk")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve this aggregator's Prometheus metrics on http://HOST:PORT/metrics (default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address the metrics listen on (0.0.0.0 only behind a firewall: no authentication)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="numpy/BLAS and torch threads (default: its share of the cores, at most 2: its sums are "
                        "bound by memory bandwidth)")
    BrokerConfig.add_arguments(p)
    p.add_argument("-v", "--verbose", action="count", default=0)
    add_log_format_argument(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, level=logging.DEBUG if args.verbose else logging.INFO,
                      component="aggregator", text_format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from edge_sdk.protocol import check_id
    from edge_sdk.signing import load_signer, load_verifier
    from edge_sdk.transport import MqttTransport

    from ..cores import Role, limit_threads, plan
    from .aggregator import PartialAggregator

    try:
        aid = check_id(args.aid, "--id")
        signer = load_signer(args.key)
        verifier = load_verifier(args.server_key) if args.server_key else None
        if not args.hold_memory_mb >= 0:
            raise ValueError(f"--hold-memory-mb must be >= 0, got {args.hold_memory_mb:g}")
        limit_threads(plan(Role.SITE_AGGREGATOR, override=args.threads))
        bcfg = BrokerConfig.from_args(args, args.broker)
        transport = MqttTransport(bcfg, args.username or aid, federation=args.federation, root=args.root)
    except (ValueError, OSError) as e:
        print(f"fedsketch-aggregator: error: {e}", file=sys.stderr)
        return 2
    transport.sign_with(signer)
    if verifier is not None:
        transport.verify_with(verifier, scopes=("aggregation",))
    else:
        log.warning("no --server-key: this aggregator cannot tell the server's messages from forged ones")
    agg = PartialAggregator(transport, aid, hold_memory_bytes=int(args.hold_memory_mb * 1e6))
    metrics = None
    if args.metrics_port is not None:
        from ..watch.aggregator import serve_aggregator_metrics
        from ..watch.options import WatchError

        try:
            metrics = serve_aggregator_metrics(agg, args.federation, host=args.metrics_host, port=args.metrics_port)
        except WatchError as e:
            print(f"fedsketch-aggregator: error: {e}", file=sys.stderr)
            return 2
        log.info("aggregator %s: metrics at %smetrics", aid, metrics.url)
    agg.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        transport.connect()
    except Exception as e:  # refused credentials, unreachable broker: one line
        print(f"fedsketch-aggregator: cannot connect to {bcfg.url}: {e}", file=sys.stderr)
        return 3
    log.info("aggregator %s serving the site broker %s (federation %s)", aid, bcfg.url, args.federation)
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        log.info("aggregator %s: %d partial sum(s) of %d update(s) sent; refused %s", aid, agg.sent_partials,
                 agg.summed, agg.refused or "none")
        transport.close()
        if metrics is not None:
            metrics.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
