"""IFCA (Ghosh et al.), as compared in the FedSketch paper: clients pick their cluster every round.

The server keeps K models, each randomly initialised. In the first round
every sampled client trains one of them, chosen at random; from then on the
server offers all K models to every sampled client, which evaluates each on
one local batch and trains the one with the lowest loss
(:meth:`edge_sdk.worker.LocalWorker.select`). Each model is the FedAvg of the
updates of the clients that chose it. A client's cluster is its latest
choice, so clusters can change from round to round; sending all K models is
what doubles IFCA's communication in the paper's comparison.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edge_sdk.tasks import Task, Update
from edge_sdk.training.trainer import state_spec
from edge_sdk.validation import check_positive_int

from .base import ClientInfo, Strategy, Weights, add_updates
from .capabilities import Capabilities
from .clustered import ClusteredFedAvg

__all__ = ["IFCA", "perturbed_copy"]

log = logging.getLogger(__name__)


def perturbed_copy(weights: Weights, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A copy of ``weights`` with Gaussian noise of each tensor's own std added.

    Floating tensors ``v`` become ``v + N(0, std(v))`` (in their dtype); a
    constant tensor (std 0, such as fresh biases or BatchNorm scales) and
    integer buffers are copied unchanged. Tensors are visited in sorted name
    order, so the result depends on ``rng`` only.
    """
    out: dict[str, np.ndarray] = {}
    for name in sorted(weights):
        v = np.asarray(weights[name])
        if np.issubdtype(v.dtype, np.floating) and v.size > 1:
            std = float(v.std())
            out[name] = (v + rng.normal(0.0, std, v.shape)).astype(v.dtype) if std > 0 else v.copy()
        else:
            out[name] = np.array(v, copy=True)
    return {name: out[name] for name in weights}


class IFCA(Strategy):
    """Iterative Federated Clustering Algorithm with K models chosen by the clients.

    Parameters
    ----------
    k : int
        Number of cluster models (4 in the paper's comparison).
    architecture : str, optional
        Classifier key of :data:`edge_sdk.training.nets.ARCHITECTURES`; model ``j`` is
        then ``initial_weights(architecture, seed + j)`` (needs torch). Without
        it, model ``j`` is the template given to :meth:`setup` plus seeded
        Gaussian noise of each tensor's std (:func:`perturbed_copy`).
    settings, fraction, seed
        As for :class:`~server_kit.strategies.base.Strategy`: local training
        settings, the fraction of all clients sampled per round, the seed.

    Attributes
    ----------
    choices : dict of str to str
        Model key each client trained most recently (from its updates).
    """

    name = "ifca"
    capabilities = Capabilities(devices_choose_model=True)

    def __init__(self, *, k: int = 4, architecture: str | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.k = check_positive_int(k, "k")
        self.architecture = architecture
        self.keys = [ClusteredFedAvg.key(j) for j in range(self.k)]
        self.default_key = self.keys[0]
        self.choices: dict[str, str] = {}

    # -- lifecycle -------------------------------------------------------
    def setup(self, clients: Sequence[ClientInfo], template: Weights) -> None:
        """Register the clients and make the K randomly initialised models."""
        super().setup(clients, template)
        self.choices = {}
        if self.architecture is not None:
            from edge_sdk.training.trainer import initial_weights

            models = [initial_weights(self.architecture, self.seed + j) for j in range(self.k)]
            for j, w in enumerate(models):  # every device builds them: they go free
                self.versions.note_initial(self.architecture, self.seed + j, w)
            if state_spec(models[0]) != state_spec(template):
                raise ValueError(
                    f"architecture {self.architecture!r} does not match the template's tensor "
                    "names, shapes or dtypes"
                )
        else:
            models = [perturbed_copy(template, np.random.default_rng([self.seed, j])) for j in range(self.k)]
        self.models = dict(zip(self.keys, models))

    def initial_key(self, cid: str, rnd: int = 1) -> str:
        """The model a client trains in the first round: random, seeded by round and client id."""
        rng = np.random.default_rng([self.seed, int(rnd), zlib.crc32(cid.encode("utf-8"))])
        return self.keys[int(rng.integers(self.k))]

    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]:
        """Round 1: one random model per sampled client; later rounds: all K models."""
        chosen = self._sample([c for c in available if c in self.clients], rnd)
        if rnd <= 1:
            offers = {c: [self.initial_key(c, rnd)] for c in chosen}
        else:
            offers = {c: self.keys for c in chosen}
        return [Task(c, rnd, {key: self.models[key] for key in offers[c]}, self.settings) for c in chosen]

    def _combine(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        """FedAvg per chosen model; remember each client's choice."""
        summary: dict[str, Any] = {}
        accepted = 0
        for key in self.keys:
            agg = self._new_aggregator(self.models[key])
            n = add_updates(agg, updates, key)
            if n:
                self.models[key] = agg.result()
            summary[key] = n
            accepted += n
        for u in updates:
            if u.model_key in self.models:
                for cid in u.speaks_for:  # a partial sum speaks for its members
                    self.choices[cid] = u.model_key
            else:
                log.warning("round %d: update of %s names unknown model %r", rnd, u.cid, u.model_key)
        summary["updates"] = accepted
        summary["rejected"] = len(updates) - accepted
        return summary

    # -- who is where ----------------------------------------------------
    def model_key_for(self, cid: str) -> str:
        """The client's latest choice; a client never seen, its first-round random model."""
        return self.choices.get(cid) or self.initial_key(cid)

    def is_clustered(self, cid: str) -> bool:
        return cid in self.clients or cid in self.choices

    def clusters(self) -> dict[str, int]:
        index = {key: j for j, key in enumerate(self.keys)}
        return {cid: index[self.model_key_for(cid)] for cid in sorted(set(self.clients) | set(self.choices))}

    # -- checkpoints -------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        meta["k"] = self.k
        meta["choices"] = dict(self.choices)
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        if meta.get("name") == self.name and int(meta.get("k", self.k)) != self.k:
            raise ValueError(f"checkpoint has k={meta['k']} models, this strategy k={self.k}")
        super().load_state(meta, tensors)
        self.choices = {str(c): str(key) for c, key in meta.get("choices", {}).items()}
