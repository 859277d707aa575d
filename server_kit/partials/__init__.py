"""Partial aggregation: aggregators that take devices' updates and send the server partial sums.

- :mod:`~server_kit.partials.aggregator`: :class:`PartialAggregator`, one aggregator (the protocol's other end
  is :mod:`server_kit.drivers.remote`).
- :mod:`~server_kit.partials.ingest`: :class:`IngestWorkers`, W aggregator processes, worker p on
  partition p of the update topics (``fedsketch-server --ingest-workers W``), each probed at the start.
- :mod:`~server_kit.partials.scale_out`: what the server starts and accepts (:class:`ScaleOut`).
- :mod:`~server_kit.partials.cli`: ``fedsketch-aggregator``, a site aggregator beside a site broker.
"""

from __future__ import annotations

from .aggregator import PartialAggregator
from .ingest import IngestRefused, IngestWorkers
from .scale_out import ScaleOut, load_aggregator_keys

__all__ = ["IngestRefused", "IngestWorkers", "PartialAggregator", "ScaleOut", "load_aggregator_keys"]
