"""The server's side of federated AE pre-training, one implementation for both drivers.

:class:`AEPretraining` holds what the rounds share: the global autoencoder
weights and their tensor spec, the clients tasked in the open round, the
answers received, the stopping rule (a quorum of the tasked clients) and the
sample-weighted FedAvg that closes a round. A driver only carries the
messages: :func:`~server_kit.pretrain.federated_ae_pretrain` in one process
(real envelopes, direct calls), the MQTT orchestrator over a broker. Which
clients a round tasks stays the driver's rule (the in-process driver draws
a count from one seeded generator; the orchestrator draws a fraction of its
trainable clients with :func:`sample_fraction`).

torch is imported only when a round is averaged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from edge_sdk.training.trainer import state_spec

from ..rounds.goals import goal_count

__all__ = ["AEPretraining", "AERound", "sample_fraction"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AERound:
    """How one pre-training round closed (:meth:`AEPretraining.close_round`).

    Attributes
    ----------
    round : int
        The round number.
    clients : list of str
        The tasked clients that answered, sorted: the order of the average.
    missing : list of str
        The tasked clients that did not, sorted.
    loss : float or None
        Mean of the answered losses weighted by sample count; None when no
        client answered.
    n_samples : int
        Sum of the answers' sample counts.
    """

    round: int
    clients: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    loss: Optional[float] = None
    n_samples: int = 0


def sample_fraction(pool: Sequence[str], fraction: float, seed: int, rnd: int) -> list[str]:
    """The clients of ``pool`` tasked in round ``rnd``: ``ceil(fraction * len(pool))``, at least one.

    Every client of ``pool``, in its order, when that count covers it;
    otherwise a sorted sample without replacement drawn by
    ``numpy.random.default_rng([seed, rnd, 7919])``, so that a round's
    choice does not depend on the rounds before it (the MQTT driver's rule).
    """
    m = max(1, int(np.ceil(fraction * len(pool))))
    if m >= len(pool):
        return list(pool)
    rng = np.random.default_rng([seed, rnd, 7919])
    return sorted(rng.choice(pool, size=m, replace=False).tolist())


class AEPretraining:
    """The global autoencoder, the open round's tasked clients and answers, and their average.

    A driver calls :meth:`begin_round` with the clients it tasks, sends
    them :attr:`weights`, hands each answer to :meth:`receive` (already
    decoded with ``parse_tensors(body, spec=self.spec)``), waits while
    :meth:`has_quorum` is false (and anyone is left to answer), then calls
    :meth:`close_round`. The answers of a round are kept until it closes and
    averaged in client-id order, so the result does not depend on the order
    they arrived in, and a second answer from a client replaces its first.

    Parameters
    ----------
    weights : mapping of str to numpy.ndarray
        The starting global ``state_dict`` (kept, not copied).
    device : str or torch.device, optional
        Where the average is summed (:class:`~server_kit.aggregate.StreamingFedAvg`;
        default :func:`~server_kit.aggregate.server_device`).

    Attributes
    ----------
    weights : dict of str to numpy.ndarray
        The global weights: the start, then each closed round's average.
    spec : dict
        ``state_spec(weights)``: the names, shapes and dtypes every answer must have.
    round : int
        The open round (0 before the first).
    tasked : frozenset of str
        The clients tasked in it.
    updates : dict
        Client id -> ``(weights, n_samples, loss)`` of the answers so far.
    """

    def __init__(self, weights: Mapping[str, np.ndarray], *, device: Any = None) -> None:
        self.weights = weights
        self.spec = state_spec(weights)
        self.device = device
        self.round = 0
        self.tasked: frozenset[str] = frozenset()
        self.updates: dict[str, tuple[Mapping[str, np.ndarray], int, float]] = {}

    def begin_round(self, rnd: int, clients: Iterable[str]) -> None:
        """Open round ``rnd`` with ``clients`` tasked and no answer yet."""
        self.round = int(rnd)
        self.tasked = frozenset(clients)
        self.updates = {}

    def receive(self, cid: str, weights: Mapping[str, np.ndarray], n_samples: int, loss: float) -> None:
        """Keep client ``cid``'s answer: its trained weights, its sample count, its training loss.

        Raises
        ------
        ValueError
            If ``cid`` was not tasked in the open round (the driver checks first).
        """
        if cid not in self.tasked:
            raise ValueError(f"client {cid!r} was not tasked in pre-training round {self.round}")
        self.updates[cid] = (weights, n_samples, loss)

    def has_quorum(self, quorum: float = 1.0) -> bool:
        """The stopping rule: at least ``ceil(quorum * tasked)`` clients (and one) answered (:func:`goal_count`)."""
        return len(self.updates) >= goal_count(quorum, len(self.tasked))

    def close_round(self) -> AERound:
        """Average the answers (by sample count) into :attr:`weights` and say how the round went.

        Without any answer the weights stay as they were and the loss is None. An answer the GPU's
        aggregator finds not finite (:meth:`~server_kit.aggregate.StreamingFedAvg.settle`; answers are
        checked when decoded, so it should not happen) is logged and left out of the average, the
        clients and the loss.
        """
        from server_kit.aggregate import StreamingFedAvg

        got = [(cid, *self.updates[cid]) for cid in sorted(self.updates)]
        if got:
            agg = StreamingFedAvg(self.weights, device=self.device)
            for cid, w, n, _ in got:
                agg.add(w, n, tag=cid)
            refused = agg.settle()
            for r in refused:
                log.warning("pre-training round %d: answer of %s refused: %s", self.round, r.tag, r.message)
            got = [g for g in got if g[0] not in {r.tag for r in refused}]
            if got:
                self.weights = agg.result()
        n_tot = sum(n for _, _, n, _ in got)
        loss = sum(loss * n for _, _, n, loss in got) / n_tot if n_tot else None
        done = AERound(self.round, [c for c, *_ in got], sorted(self.tasked - set(self.updates)), loss, n_tot)
        self.updates = {}
        return done
