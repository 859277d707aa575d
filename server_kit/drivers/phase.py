"""The phases of a server run, and the one table of the moves between them.

A run of the MQTT driver goes through these phases in this order (a phase
may be skipped: pre-training only for ``fedsketch-fedae``, clustering only
for the strategies that cluster before training; a resumed run goes from
registration straight to training):

``REGISTER`` -> ``PRETRAIN`` -> ``CLUSTER`` -> ``TRAIN`` -> ``EVALUATE`` -> ``DONE`` (-> ``SERVE`` -> ``DONE``)

``SERVE`` follows a finished run that keeps serving its models
(``fedsketch-server --serve-models``), or comes straight after registration
for a server that only serves an export (``--serve-models-from``).

:class:`RunPhase` holds the phase and the round number the server stamps on
what it sends; :meth:`RunPhase.enter` is the only way to change the phase,
and refuses a move the table does not list (a driver bug, never a device's
doing). The final evaluation's round number on the wire is the last
training round plus one: the devices answer with it, so that a late
update of the last round is told apart from an evaluation.
"""

from __future__ import annotations

from enum import Enum

from edge_sdk.logs import log_context

__all__ = ["MOVES", "Phase", "RunPhase"]


class Phase(Enum):
    """Where a server run is."""

    #: Devices say hello; admitted or refused once the run's models are chosen.
    REGISTER = "register"
    #: Federated pre-training of the sketch autoencoder (``fedsketch-fedae``).
    PRETRAIN = "pretrain"
    #: Sketches (or features) collected, then one clustering.
    CLUSTER = "cluster"
    #: Training rounds.
    TRAIN = "train"
    #: The final evaluation.
    EVALUATE = "evaluate"
    #: Finished: the devices were told to stop (or to wait for the next run).
    DONE = "done"
    #: After the run (or from an export, with no run): the trained models handed to devices that arrive.
    SERVE = "serve"

    @property
    def trains(self) -> bool:
        """Whether the run is past its clustering: a device that comes now is placed as a late one."""
        return self in (Phase.TRAIN, Phase.EVALUATE, Phase.SERVE)

    @property
    def registering(self) -> bool:
        """Whether the fleet is still gathering (admissions past the first few are logged at DEBUG)."""
        return self in (Phase.REGISTER, Phase.CLUSTER)


#: The moves a run may make: from each phase, the phases it may enter next.
MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.REGISTER: frozenset({Phase.PRETRAIN, Phase.CLUSTER, Phase.TRAIN, Phase.SERVE, Phase.DONE}),
    Phase.PRETRAIN: frozenset({Phase.CLUSTER, Phase.TRAIN, Phase.DONE}),
    Phase.CLUSTER: frozenset({Phase.TRAIN, Phase.DONE}),
    Phase.TRAIN: frozenset({Phase.EVALUATE, Phase.DONE}),
    Phase.EVALUATE: frozenset({Phase.DONE}),
    Phase.DONE: frozenset({Phase.SERVE}),
    Phase.SERVE: frozenset({Phase.DONE}),
}


class RunPhase:
    """The phase of a run and its current round; :meth:`enter` and :meth:`begin_round` change them."""

    def __init__(self) -> None:
        self._phase = Phase.REGISTER
        self._round = 0

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def round(self) -> int:
        """The round the server is in (0 before training; during pre-training, the autoencoder's round)."""
        return self._round

    def enter(self, phase: Phase, *, rnd: int | None = None) -> None:
        """Move to ``phase`` (its round ``rnd``, else unchanged); a move the table does not list raises."""
        if phase is not self._phase and phase not in MOVES[self._phase]:
            raise RuntimeError(f"a run cannot go from {self._phase.value} to {phase.value}")
        self._phase = phase
        if rnd is not None:
            self._round = int(rnd)
            log_context.set(round=self._round)

    def begin_round(self, rnd: int) -> None:
        """Round ``rnd`` of the current phase (training, or the autoencoder's pre-training) begins."""
        if self._phase not in (Phase.TRAIN, Phase.PRETRAIN):
            raise RuntimeError(f"no round begins in the {self._phase.value} phase")
        self._round = int(rnd)
        log_context.set(round=self._round)
