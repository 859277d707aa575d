"""Every metric FedSketch exports to Prometheus: one catalogue, its names, types, labels and help.

The server (``fedsketch-server --metrics-port``) and the aggregators
(``fedsketch-aggregator --metrics-port``, and the ingest workers the server
starts) export the metrics of this catalogue and nothing else of their own;
the collectors (:mod:`~server_kit.watch.collector`) build each family from
its :class:`MetricSpec`, and the Grafana dashboard shipped in
``deploy/grafana/`` is checked against :func:`exported_names` by a test, so
that no panel queries a metric that does not exist.

Names follow Prometheus' conventions: a ``fedsketch_`` prefix, the unit in
the name (``_seconds``, ``_bytes``, ``_celsius``), ``_total`` on counters
(the exposition adds it: a counter's :attr:`MetricSpec.name` has none), and
labels of bounded cardinality (a reason, a message kind, a model key, a
phase). Per-device series (``device`` label) exist only for the devices the
watch picks, at most ``--metrics-devices`` of them (the slowest and the
most refused); every fleet-wide figure is an aggregate.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["AGGREGATOR_METRICS", "MetricKind", "MetricSpec", "PROCESS_METRICS", "SERVER_METRICS",
           "exported_names"]


class MetricKind(Enum):
    """The Prometheus type of a metric."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its name (a counter's without ``_total``), type, help and label names."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()

    @property
    def exposed(self) -> tuple[str, ...]:
        """The series names this metric appears under in the exposition (what PromQL can query)."""
        if self.kind is MetricKind.COUNTER:
            return (self.name + "_total",)
        if self.kind is MetricKind.HISTOGRAM:
            return (self.name + "_bucket", self.name + "_sum", self.name + "_count")
        return (self.name,)


_C, _G, _H = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM

#: The server's metrics, by short key (what the collector looks them up by).
SERVER_METRICS: dict[str, MetricSpec] = {s.name.removeprefix("fedsketch_"): s for s in (
    MetricSpec("fedsketch_run_info", _G, "The run being watched (always 1): its id, strategy and federation",
               ("run_id", "strategy", "federation")),
    MetricSpec("fedsketch_run_phase", _G, "1 for the phase the run is in, 0 for the others", ("phase",)),
    MetricSpec("fedsketch_round", _G, "The training round the run is in (0 before training)"),
    MetricSpec("fedsketch_rounds_planned", _G, "The training rounds the run will do"),
    MetricSpec("fedsketch_rounds_closed", _C, "Training rounds closed, by what closed them "
               "(all-answered, goal, deadline, cap)", ("reason",)),
    MetricSpec("fedsketch_devices", _G, "Devices the server knows, by state (admitted, online, offline, benched, "
               "not_training; refused: refused at registration)", ("state",)),
    MetricSpec("fedsketch_round_devices", _G, "Devices of the open round (or of the last one when none is open), "
               "by state: tasked, reported, refused, awaited", ("state",)),
    MetricSpec("fedsketch_stragglers", _C, "Tasked online devices whose update had not come when their round "
               "closed"),
    MetricSpec("fedsketch_messages_rejected", _C, "Messages the server refused (transport, envelope, schema, "
               "handler), by reason", ("reason",)),
    MetricSpec("fedsketch_updates_refused", _C, "Updates the rounds refused, by reason", ("reason",)),
    MetricSpec("fedsketch_messages", _C, "Messages the server sent and received, by kind and direction",
               ("kind", "direction")),
    MetricSpec("fedsketch_message_bytes", _C, "MQTT payload bytes the server sent and received, by kind and "
               "direction", ("kind", "direction")),
    MetricSpec("fedsketch_downloaded_bytes", _C, "Bytes of models and encoders the devices downloaded, by kind "
               "(a model on a cluster topic counts once per device)", ("kind",)),
    MetricSpec("fedsketch_round_duration_seconds", _H, "Training rounds' durations, from plan to close"),
    MetricSpec("fedsketch_round_goal_seconds", _H, "Seconds from a round's start until every group had its "
               "report goal (rounds that reached it)"),
    MetricSpec("fedsketch_aggregation_seconds", _H, "Seconds each round spent combining its updates"),
    MetricSpec("fedsketch_clustering_seconds", _G, "Seconds the clustering before training took"),
    MetricSpec("fedsketch_accuracy", _G, "Accuracy of each model, the last the devices measured (before "
               "training in the next round, or in the final evaluation)", ("model",)),
    MetricSpec("fedsketch_accuracy_mean", _G, "Mean accuracy over the devices, the last measured"),
    MetricSpec("fedsketch_loss", _G, "Mean training loss of the last round's updates, per model", ("model",)),
    MetricSpec("fedsketch_devices_health_exposed", _G, "Devices whose last message carried the health figure "
               "named (cpu_temperature, throttled, memory, load)", ("figure",)),
    MetricSpec("fedsketch_devices_throttled", _G, "Devices whose last health said the board throttles now or "
               "is under-volted now"),
    MetricSpec("fedsketch_device_cpu_temperature_max_celsius", _G, "The hottest CPU the devices reported"),
    MetricSpec("fedsketch_watch_cpu_seconds", _C, "CPU seconds the watch itself took on the server: its views "
               "of the run (part views) and its answers to /metrics and the live page (part answers)", ("part",)),
    MetricSpec("fedsketch_watched_devices", _G, "Devices with series of their own (the slowest and the most "
               "refused, at most --metrics-devices)"),
    MetricSpec("fedsketch_device_round_seconds", _G, "A watched device's last round: seconds from its task to "
               "its update", ("device",)),
    MetricSpec("fedsketch_device_refusals", _C, "A watched device's refused updates", ("device",)),
    MetricSpec("fedsketch_device_last_seen_seconds", _G, "Seconds since a watched device's last message",
               ("device",)),
    MetricSpec("fedsketch_device_cpu_temperature_celsius", _G, "A watched device's CPU temperature, as it last "
               "said", ("device",)),
    MetricSpec("fedsketch_device_throttled_flags", _G, "A watched device's throttling flags (the Raspberry Pi's "
               "get_throttled bits), as it last said", ("device",)),
    MetricSpec("fedsketch_device_memory_available_bytes", _G, "A watched device's available memory, as it last "
               "said", ("device",)),
    MetricSpec("fedsketch_device_load1", _G, "A watched device's 1-minute load average, as it last said",
               ("device",)),
)}

#: An aggregator's metrics (a site aggregator, or an ingest worker the server started).
AGGREGATOR_METRICS: dict[str, MetricSpec] = {s.name.removeprefix("fedsketch_aggregator_"): s for s in (
    MetricSpec("fedsketch_aggregator_info", _G, "The aggregator (always 1): its id and federation",
               ("aggregator", "federation")),
    MetricSpec("fedsketch_aggregator_round", _G, "The round the aggregator collects for"),
    MetricSpec("fedsketch_aggregator_receipts", _C, "Updates the aggregator took and sent a receipt of"),
    MetricSpec("fedsketch_aggregator_updates_refused", _C, "Updates the aggregator refused, by reason",
               ("reason",)),
    MetricSpec("fedsketch_aggregator_partials", _C, "Partial sums the aggregator sent"),
    MetricSpec("fedsketch_aggregator_held_updates", _G, "Updates the aggregator holds for the open round"),
    MetricSpec("fedsketch_aggregator_held_bytes", _G, "Bytes of the updates it holds, in memory and on disk",
               ("place",)),
    MetricSpec("fedsketch_aggregator_message_bytes", _C, "MQTT payload bytes the aggregator sent and received, "
               "by kind and direction", ("kind", "direction")),
)}

#: The process's own figures (prometheus-client's process collector, Linux): exported by every part.
PROCESS_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("process_cpu_seconds", _C, "CPU time of the process (user and system)"),
    MetricSpec("process_resident_memory_bytes", _G, "Resident memory of the process"),
    MetricSpec("process_virtual_memory_bytes", _G, "Virtual memory of the process"),
    MetricSpec("process_open_fds", _G, "Open file descriptors of the process"),
    MetricSpec("process_max_fds", _G, "The most file descriptors the process may open"),
    MetricSpec("process_start_time_seconds", _G, "Start of the process, seconds since the epoch"),
)


def exported_names() -> frozenset[str]:
    """Every series name a FedSketch part exports (what a dashboard may query)."""
    specs = [*SERVER_METRICS.values(), *AGGREGATOR_METRICS.values(), *PROCESS_METRICS]
    return frozenset(n for s in specs for n in s.exposed)
