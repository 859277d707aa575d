"""What a server run returns: :class:`RunResult`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunResult"]


@dataclass(frozen=True)
class RunResult:
    """The result of :meth:`server_kit.drivers.orchestrator.Orchestrator.run`.

    :meth:`to_dict` is what ``results.json`` is built from
    (:func:`server_kit.report.build_results`).
    """

    #: The strategy's name (``--strategy``).
    strategy: str
    #: Each device's cluster index.
    assignment: dict[str, int]
    #: One record per round (:meth:`server_kit.rounds.training.RoundReport.to_dict`).
    history: list[dict[str, Any]]
    #: The final evaluation (``server_kit.drivers.records.eval_result``).
    final: dict[str, Any]
    #: Seconds per phase: ``register_s``, ``sketch_collect_s``, ``clustering_s``, ``training_s``, ``total_s``...
    timings: dict[str, float]
    #: Refused messages per reason.
    rejected: dict[str, int]
    #: The server transport's counters (``Transport.stats()``).
    transport: dict[str, Any]
    #: Bytes of models and encoders the devices downloaded, per kind.
    delivered: dict[str, int]
    #: The encoder the devices sketched with, and the classifier architecture.
    encoder: str | None
    architecture: str | None
    #: The autoencoder pre-training's rounds (``fedsketch-fedae``).
    pretrain: list[dict[str, Any]] = field(default_factory=list)
    #: Devices refused at registration, with the reason they were told.
    refused: dict[str, str] = field(default_factory=dict)
    #: Admitted devices that never trained (no torch), with the reason.
    not_training: dict[str, str] = field(default_factory=dict)
    #: Devices offline at the end, since when.
    dropped: dict[str, str] = field(default_factory=dict)
    #: Devices not tasked again after their updates were refused round after round, with the reason.
    benched: dict[str, str] = field(default_factory=dict)
    #: A run that follows drift: its counts added up (``server_kit.drivers.resketch.drift_totals``).
    drift: dict[str, int] | None = None
    #: The run's id, as announced on the server's status topic.
    run_id: str | None = None
    #: Each device's own benchmark, as its hello said it (``cpu`` and figures such as ``sketch_ms``, ``epoch_ms``).
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The phase the run is in (``done`` at its end) and its round.
    phase: str = "done"
    round: int = 0
    #: Every admitted device: online, cluster, seconds since its last message, rounds done, refusals, its last
    #: round's seconds, benched, its bench's sketch time, its last health (``server_kit.drivers.device_table``).
    fleet: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: What the run gave away: ``sketch`` (each device's sketch epsilon, :mod:`server_kit.privacy.sketch_report`),
    #: ``dp`` (each cluster's accountant, with ``--dp-epsilon``), ``secure`` (the secure sums, with ``--secure``).
    privacy: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (``drift`` only when the run follows drift), for ``results.json``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["drift"] is None:
            del out["drift"]
        return out
