"""An aggregator's Prometheus metrics: a site aggregator's (``fedsketch-aggregator --metrics-port``) or an ingest
worker's (the server's ``--metrics-port`` P: worker p on P+1+p).

:class:`AggregatorCollector` reads a :class:`~server_kit.partials.aggregator.PartialAggregator`'s
own counters at each scrape (:data:`~.names.AGGREGATOR_METRICS`);
:func:`serve_aggregator_metrics` serves them with the process's CPU and
memory on ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from .collector import family
from .http import WatchServer
from .names import AGGREGATOR_METRICS

__all__ = ["AggregatorCollector", "serve_aggregator_metrics"]


class AggregatorCollector(Collector):
    """The families of one aggregator (``agg``) of ``federation``."""

    def __init__(self, agg: Any, federation: str) -> None:
        self.agg = agg
        self.federation = federation

    def collect(self) -> Iterator[Metric]:
        agg, m = self.agg, AGGREGATOR_METRICS
        info = family(m["info"])
        info.add_metric([agg.aid, self.federation], 1)
        yield info
        held, in_memory, on_disk = agg.holding()
        base = agg.base
        for key, value in (("round", 0 if base is None else base.round), ("receipts", agg.receipts),
                           ("partials", agg.sent_partials), ("held_updates", held)):
            f = family(m[key])
            f.add_metric([], float(value))
            yield f
        refused = family(m["updates_refused"])
        for reason, n in sorted(dict(agg.refused).items()):
            refused.add_metric([reason], float(n))
        yield refused
        held_bytes = family(m["held_bytes"])
        held_bytes.add_metric(["memory"], float(in_memory))
        held_bytes.add_metric(["disk"], float(on_disk))
        yield held_bytes
        nbytes = family(m["message_bytes"])
        stats = agg.transport.stats()
        for direction in ("sent", "received"):
            for kind, c in sorted((stats.get(direction) or {}).items()):
                nbytes.add_metric([kind, direction], float(c.get("bytes", 0)))
        yield nbytes


def serve_aggregator_metrics(agg: Any, federation: str, *, host: str = "127.0.0.1", port: int = 0) -> WatchServer:
    """Serve ``agg``'s metrics and its process's on ``http://host:port/metrics`` (started); raises
    :class:`~.http.WatchError` when the address cannot be listened on."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AggregatorCollector(agg, federation))
    ProcessCollector(registry=registry)
    return WatchServer(None, registry, lambda r: r, host=host, port=port).start()
