"""The settings of a server run: :class:`ServerConfig`, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from edge_sdk.validation import check_choice

from ..rounds.goals import DEFAULT_REPORT_GOAL

__all__ = ["MODEL_DELIVERY", "ServerConfig"]

#: How models reach the clients (see :mod:`server_kit.drivers.delivery`).
MODEL_DELIVERY = ("auto", "client", "cluster")


@dataclass(frozen=True)
class ServerConfig:
    """Settings of a server run (validated on construction).

    The defaults of a round's close protect a fleet and leave a lab as it
    was: a report goal of 0.9 asks for every update of a group that needs
    fewer than 10 (``ceil(0.9 x n) = n``), 9 of 10, 18 of 20; spares
    (``over_select`` None) go only to the groups that need at least 10
    devices, 10 % more rounded up (1 for 10, 2 for 20:
    :func:`~server_kit.rounds.plan.spare_count`). A number given for
    ``over_select`` applies to every group. A device that sends no usable
    update (refused, or silent while online) in ``bench_after`` rounds in a
    row is tasked no more.
    """

    federation: str = "default"
    root: str = "fedsketch"
    rounds: int = 10
    min_clients: int = 2
    register_timeout_s: float = 60.0
    #: At the registration deadline, the run starts if this share of ``min_clients`` was admitted.
    register_quorum: float = 0.5
    sketch_quorum: float = 1.0
    sketch_timeout_s: float = 60.0
    #: A round (and the final evaluation) closes once each group sent this share of the answers it needs, rounded
    #: up (then a grace): 0.9 asks for all below 10 devices.
    report_goal: float = DEFAULT_REPORT_GOAL
    #: Each round tasks this share more devices per group than it needs (spares), so a slow one holds nothing;
    #: None: 0.1, only in the groups that need at least 10 devices.
    over_select: float | None = None
    #: Once every group has its goal, the stragglers' grace, as a share of the time the goal took.
    straggler_grace: float = 0.2
    #: A device with no usable update (refused, or silent while online) in this many rounds in a row is not
    #: tasked again in the run (0: never).
    bench_after: int = 3
    round_timeout_s: float = 120.0
    #: Deadline of the first round, which includes every device's start-up (default: 3 x round_timeout_s).
    first_round_timeout_s: float | None = None
    #: A round stays open this long past a device's last "still training" report (a device reports every 10 s).
    progress_grace_s: float = 30.0
    #: Longest any round may stay open, progress or not (default: 10 x round_timeout_s).
    max_round_s: float | None = None
    eval_timeout_s: float = 60.0
    #: Share of the assigned devices the final evaluation asks (a seeded sample, at least one per cluster).
    eval_fraction: float = 1.0
    num_classes: int = 10
    flip_prob: float = 0.1
    #: None: the shipped encoder that takes the fleet's samples.
    encoder: str | None = None
    latent_dim: int | None = None
    #: None: the shipped classifier that takes the fleet's samples.
    architecture: str | None = None
    seed: int = 0
    checkpoint_dir: str | None = None
    stop_clients: bool = True
    model_delivery: str = "auto"
    #: Where int8 and int4 updates are decoded: "intake" (as they arrive), "sum" (only where they are summed, the
    #: card on a GPU server) or "auto" ("sum" where a model's sums are on a GPU) (server_kit.rounds.decoding).
    decode_updates: str = "auto"
    #: How long a round's close waits for the aggregators' partial sums (server_kit.partials).
    partial_timeout_s: float = 60.0
    #: A device that said it sent its update, and whose update has not arrived this long after, is asked for
    #: it again, once (server_kit.rounds.reask).
    reask_lost_s: float = 10.0
    #: An update larger than this (bytes; the shipped 1 MB packet: one that goes in chunks) is announced by its
    #: device and asked for when its receiver has room (server_kit.rounds.reask).
    announce_above_bytes: int = 1_000_000
    #: Most bytes of announced updates on their way to one receiver at once (the server, or each ingest
    #: worker): within the shipped broker's queue per client (256 MB) and the reassembly memory (512 MB).
    transfer_budget_bytes: int = 256_000_000
    #: Memory of each ingest worker for the updates it holds until their round closes (bytes); the rest wait in
    #: files on its disk (server_kit.partials.aggregator).
    hold_memory_bytes: int = 256_000_000

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {self.rounds}")
        if self.min_clients < 1:
            raise ValueError(f"min_clients must be a positive integer, got {self.min_clients}")
        for name in ("sketch_quorum", "report_goal", "register_quorum", "eval_fraction"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        for name in ("register_timeout_s", "sketch_timeout_s", "round_timeout_s", "eval_timeout_s",
                     "progress_grace_s", "partial_timeout_s", "reask_lost_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("first_round_timeout_s", "max_round_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive or None, got {getattr(self, name)}")
        for name in ("announce_above_bytes", "transfer_budget_bytes", "hold_memory_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.over_select is not None and not 0.0 <= self.over_select <= 10.0:
            raise ValueError(f"over_select must be in [0, 10], got {self.over_select}")
        if not 0.0 <= self.straggler_grace <= 10.0:
            raise ValueError(f"straggler_grace must be in [0, 10], got {self.straggler_grace}")
        if isinstance(self.bench_after, bool) or not isinstance(self.bench_after, int) or self.bench_after < 0:
            raise ValueError(f"bench_after must be an integer >= 0, got {self.bench_after!r}")
        if not 0.0 <= self.flip_prob <= 0.5:
            raise ValueError(f"flip_prob must be in [0, 0.5], got {self.flip_prob}")
        check_choice(self.model_delivery, "model_delivery", MODEL_DELIVERY)
        check_choice(self.decode_updates, "decode_updates", ("auto", "intake", "sum"))
