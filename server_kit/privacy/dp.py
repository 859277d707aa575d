"""Differentially private cluster models: DP-FedAvg per cluster, user level (McMahan et al. 2018).

Each round of a cluster's model:

1. every update's change from the round's model is clipped to L2 norm
   ``clip`` (after it was decoded: the bound holds whatever the codec did on
   the device, so compression and DP compose; the model sent down is the
   noisy one, and compressing it is post-processing, free);
2. the clipped changes are summed with equal weights (a device's sample
   count would otherwise scale its contribution past the clip), at most
   the cluster's planned sample per round (spares past it are left out);
3. Gaussian noise of standard deviation ``noise_multiplier * clip`` is added
   to every coordinate of the sum, which is divided by the planned number of
   devices (a fixed denominator: the sensitivity stays ``clip / m``);
4. the cluster's accountant (:mod:`.accountant`) adds the round; a round that
   would take the cluster past ``epsilon`` at ``delta`` is not run: the
   cluster's model stays as it is and its devices are not asked again.

The guarantee is against everyone who sees the models (devices, the export,
whoever reads the report); the server sees the updates (or, with secure
aggregation, their sum) before the noise. The noise is drawn from the
operating system's entropy unless a seed is given (a seeded run is for
benchmarks and is not private).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_sdk.tasks import Update

from ..robust.screening import clip_update
from .accountant import epsilon_after, noise_for_budget

__all__ = ["ClusterAccount", "DPFedAvg", "DPSettings"]

log = logging.getLogger(__name__)

Weights = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class DPSettings:
    """``--dp-epsilon``, ``--dp-delta``, ``--dp-clip``, ``--dp-noise``; ``rounds``: the run's planned rounds."""

    epsilon: float
    delta: float = 1e-5
    clip: float = 1.0
    noise_multiplier: float | None = None
    rounds: int = 10
    noise_seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"--dp-epsilon must be a finite number > 0, got {self.epsilon!r}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"--dp-delta must be in (0, 1), got {self.delta!r}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"--dp-clip must be a finite number > 0, got {self.clip!r}")
        if self.noise_multiplier is not None and not (math.isfinite(self.noise_multiplier)
                                                      and self.noise_multiplier > 0):
            raise ValueError(f"--dp-noise must be a finite number > 0, got {self.noise_multiplier!r}")
        if self.rounds < 1:
            raise ValueError(f"DP needs at least one planned round, got {self.rounds}")


@dataclass
class ClusterAccount:
    """One cluster's privacy so far."""

    members: int
    expected: int
    noise_multiplier: float
    rounds: int = 0
    epsilon: float = 0.0
    clipped: int = 0
    #: Why its rounds stopped (its budget), or None.
    stopped: str | None = None
    per_round: list[float] = field(default_factory=list)

    @property
    def q(self) -> float:
        return min(1.0, self.expected / max(1, self.members))

    def to_dict(self) -> dict[str, Any]:
        return {"members": self.members, "per_round": self.expected, "sampling_rate": round(self.q, 6),
                "noise_multiplier": round(self.noise_multiplier, 6), "rounds": self.rounds,
                "epsilon": round(self.epsilon, 6), "epsilon_per_round": [round(e, 6) for e in self.per_round],
                "clipped": self.clipped, "stopped": self.stopped}


class DPFedAvg:
    """The DP step of a strategy's aggregation (see the module docstring); one accountant per model."""

    def __init__(self, settings: DPSettings) -> None:
        self.settings = settings
        self.accounts: dict[str, ClusterAccount] = {}
        self._rng = np.random.default_rng(settings.noise_seed)

    def account(self, key: str, members: int, expected: int) -> ClusterAccount:
        """The model's accountant, made at its first round (its noise fitted to the budget over the run)."""
        acct = self.accounts.get(key)
        if acct is None or acct.rounds == 0 and (acct.members, acct.expected) != (members, expected):
            s = self.settings
            q = min(1.0, expected / max(1, members))
            z = s.noise_multiplier if s.noise_multiplier is not None else noise_for_budget(
                s.epsilon, s.delta, s.rounds, q)
            acct = self.accounts[key] = ClusterAccount(members, expected, z)
            log.info("DP model %s: %d devices, %d per round (sampling rate %.3g), noise multiplier %.4g for "
                     "epsilon %g at delta %g over %d rounds, clip %g", key, members, expected, q, z, s.epsilon,
                     s.delta, s.rounds, s.clip)
        return acct

    def admits(self, key: str, rnd: int) -> bool:
        """Whether model ``key`` may have round ``rnd`` (its next round stays within the budget)."""
        acct = self.accounts.get(key)
        if acct is None:
            return True
        if acct.stopped is None:
            s = self.settings
            nxt = epsilon_after(acct.rounds + 1, acct.q, acct.noise_multiplier, s.delta)
            if nxt > s.epsilon:
                acct.stopped = (f"round {rnd}: one more round would bring epsilon to {nxt:.3g}, past the budget "
                                f"{s.epsilon:g} (delta {s.delta:g}); the model stays as it is")
                log.warning("DP model %s: %s", key, acct.stopped)
        return acct.stopped is None

    @property
    def stopped(self) -> frozenset[str]:
        return frozenset(k for k, a in self.accounts.items() if a.stopped is not None)

    def clip(self, updates: Sequence[Update], references: Mapping[str, Weights], rnd: int,
             expected: Mapping[str, int]) -> list[Update]:
        """Each model's updates clipped to the norm bound and weighed alike, at most its planned number."""
        kept: list[Update] = []
        taken: dict[str, int] = {}
        clip = self.settings.clip
        for u in sorted(updates, key=lambda u: u.cid):
            key = u.model_key
            if not self.admits(key, rnd) or taken.get(key, 0) >= expected.get(key, 0):
                continue
            ref = references[key]
            norm = math.sqrt(sum(float(np.sum((np.asarray(u.weights[n], np.float64) - ref[n]) ** 2)) for n in ref))
            if not math.isfinite(norm):
                log.warning("DP model %s: the update of %s is not finite: left out", key, u.cid)
                continue
            if norm > clip:
                u = dataclasses.replace(u, weights=clip_update(u.weights, ref, clip, norm))
                self.accounts[key].clipped += 1
            kept.append(dataclasses.replace(u, n_samples=1))
            taken[key] = taken.get(key, 0) + 1
        return kept

    def release(self, key: str, base: Weights, mean: Weights, reported: int) -> dict[str, np.ndarray]:
        """The noisy model: ``base + (reported * (mean - base) + N(0, (z clip)^2)) / expected``; one round
        accounted."""
        acct = self.accounts[key]
        s = self.settings
        sd = acct.noise_multiplier * s.clip
        out = {}
        for n, b in base.items():
            b64 = np.asarray(b, np.float64)
            total = reported * (np.asarray(mean[n], np.float64) - b64) + self._rng.normal(0.0, sd, size=b64.shape)
            out[n] = (b64 + total / acct.expected).astype(np.asarray(b).dtype)
        acct.rounds += 1
        acct.epsilon = epsilon_after(acct.rounds, acct.q, acct.noise_multiplier, s.delta)
        acct.per_round.append(acct.epsilon)
        log.info("DP model %s: round %d noised (%d updates, %d planned): epsilon %.3g of %g at delta %g", key,
                 acct.rounds, reported, acct.expected, acct.epsilon, s.epsilon, s.delta)
        return out

    def state(self) -> dict[str, Any]:
        """The accountants, for a checkpoint."""
        return {k: dataclasses.asdict(a) for k, a in self.accounts.items()}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """The accountants of a checkpoint: a resumed run spends what is left of the budget."""
        self.accounts = {k: ClusterAccount(**a) for k, a in state.items()}

    def to_dict(self) -> dict[str, Any]:
        """``results.json``'s ``privacy.dp``."""
        s = self.settings
        return {"epsilon_budget": s.epsilon, "delta": s.delta, "clip": s.clip,
                "noise_multiplier": s.noise_multiplier, "noise_seeded": s.noise_seed is not None,
                "clusters": {k: a.to_dict() for k, a in sorted(self.accounts.items())},
                "epsilon": max((a.epsilon for a in self.accounts.values()), default=0.0)}
