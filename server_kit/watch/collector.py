"""The server's Prometheus metrics, built at each scrape from the watch's last view.

:class:`ServerCollector` is a prometheus-client collector: at each scrape it
turns the last :class:`~.view.RunView` into the families of
:data:`~.names.SERVER_METRICS` (nothing is counted per message: the view
already holds the run's own counters). :func:`server_registry` puts it in a
registry of its own with the process collector (CPU, memory), so that a
test's servers never share series.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..drivers.phase import Phase
from .names import SERVER_METRICS, MetricKind, MetricSpec
from .view import RunView

__all__ = ["AGGREGATE_BUCKETS", "ROUND_BUCKETS", "ServerCollector", "family", "histogram", "server_registry"]

#: Upper bounds (seconds) of the round-duration and time-to-goal histograms.
ROUND_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
#: Upper bounds (seconds) of the aggregation histogram.
AGGREGATE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def family(spec: MetricSpec) -> Any:
    """An empty metric family of ``spec`` (counter or gauge), with its labels."""
    cls = CounterMetricFamily if spec.kind is MetricKind.COUNTER else GaugeMetricFamily
    return cls(spec.name, spec.help, labels=list(spec.labels))


def histogram(spec: MetricSpec, values: Sequence[float], bounds: Sequence[float]) -> HistogramMetricFamily:
    """The histogram family of ``values`` in the buckets ``bounds`` (cumulative, ``+Inf`` last)."""
    buckets = [(_le(b), float(sum(1 for v in values if v <= b))) for b in bounds]
    buckets.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(spec.name, spec.help, buckets=buckets, sum_value=float(sum(values)))


def _le(bound: float) -> str:
    return repr(float(bound))


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class ServerCollector(Collector):
    """The server's families from ``view()`` (None: nothing yet, only the run's absence)."""

    def __init__(self, view: Callable[[], RunView | None],
                 costs: Callable[[], Mapping[str, float]] = lambda: {}) -> None:
        self.view = view
        self.costs = costs

    def collect(self) -> Iterator[Metric]:
        m = SERVER_METRICS
        cost = family(m["watch_cpu_seconds"])
        for part, seconds in sorted(self.costs().items()):
            cost.add_metric([part], float(seconds))
        yield cost
        v = self.view()
        if v is None:
            return
        info = family(m["run_info"])
        info.add_metric([v.run_id or "", v.strategy, v.federation], 1)
        yield info
        phase = family(m["run_phase"])
        for p in Phase:
            phase.add_metric([p.value], 1 if p is v.phase else 0)
        yield phase
        yield from self._scalars(v)
        yield from self._by_label(v)
        yield from self._histograms(v)
        yield from self._health(v)
        yield from self._watched(v)

    def _scalars(self, v: RunView) -> Iterator[Metric]:
        m = SERVER_METRICS
        for key, value in (("round", v.round), ("rounds_planned", v.rounds_planned),
                           ("stragglers", v.totals.stragglers), ("clustering_seconds", v.clustering_s),
                           ("accuracy_mean", v.totals.accuracy_mean), ("watched_devices", len(v.watched))):
            if _finite(value):
                f = family(m[key])
                f.add_metric([], float(value))
                yield f

    def _by_label(self, v: RunView) -> Iterator[Metric]:
        m = SERVER_METRICS
        if v.open_round is not None:
            o = v.open_round
            round_devices = {"tasked": o.tasked, "reported": o.reported, "refused": o.refused, "awaited": o.awaited}
        else:
            round_devices = {**dict(v.last_round), "awaited": 0} if v.last_round else {}
        for key, values in (("devices", v.devices), ("round_devices", round_devices),
                            ("rounds_closed", v.totals.closed_by), ("messages_rejected", v.rejected),
                            ("updates_refused", v.totals.refused), ("downloaded_bytes", v.delivered),
                            ("accuracy", v.totals.accuracy), ("loss", v.totals.loss)):
            f = family(m[key])
            for label, value in sorted(values.items()):
                if _finite(value):
                    f.add_metric([str(label)], float(value))
            yield f
        messages, nbytes = family(m["messages"]), family(m["message_bytes"])
        for direction in ("sent", "received"):
            for kind, c in sorted((v.transport.get(direction) or {}).items()):
                messages.add_metric([kind, direction], float(c.get("messages", 0)))
                nbytes.add_metric([kind, direction], float(c.get("bytes", 0)))
        yield messages
        yield nbytes

    def _histograms(self, v: RunView) -> Iterator[Metric]:
        m, t = SERVER_METRICS, v.totals
        yield histogram(m["round_duration_seconds"], t.seconds, ROUND_BUCKETS)
        yield histogram(m["round_goal_seconds"], t.goal_seconds, ROUND_BUCKETS)
        yield histogram(m["aggregation_seconds"], t.aggregate_seconds, AGGREGATE_BUCKETS)

    def _health(self, v: RunView) -> Iterator[Metric]:
        m, h = SERVER_METRICS, v.health
        exposed = family(m["devices_health_exposed"])
        for figure, n in sorted(h.exposed.items()):
            exposed.add_metric([figure], float(n))
        yield exposed
        throttled = family(m["devices_throttled"])
        throttled.add_metric([], float(h.throttled))
        yield throttled
        if h.max_cpu_temp_c is not None:
            hottest = family(m["device_cpu_temperature_max_celsius"])
            hottest.add_metric([], float(h.max_cpu_temp_c))
            yield hottest

    def _watched(self, v: RunView) -> Iterator[Metric]:
        m = SERVER_METRICS
        per = {key: family(m[key]) for key in ("device_round_seconds", "device_refusals", "device_last_seen_seconds",
                                                "device_cpu_temperature_celsius", "device_throttled_flags",
                                                "device_memory_available_bytes", "device_load1")}
        for row in v.watched:
            health = row.health
            mem = health.get("mem_available_mb")
            for key, value in (("device_round_seconds", row.tally.round_s), ("device_refusals", row.tally.refusals),
                               ("device_last_seen_seconds", row.last_seen_s),
                               ("device_cpu_temperature_celsius", health.get("cpu_temp_c")),
                               ("device_throttled_flags", health.get("throttled")),
                               ("device_memory_available_bytes", None if mem is None else mem * 1024 * 1024),
                               ("device_load1", health.get("load1"))):
                if _finite(value):
                    per[key].add_metric([row.device], float(value))
        yield from per.values()


def server_registry(view: Callable[[], RunView | None],
                    costs: Callable[[], Mapping[str, float]] = lambda: {}) -> CollectorRegistry:
    """A registry of the server's metrics (from ``view()``; ``costs()``: the watch's own CPU seconds by part) and
    its process's CPU and memory."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(view, costs))
    ProcessCollector(registry=registry)
    return registry
