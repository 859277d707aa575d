"""What a run knows of each model it trained: :func:`model_offers`, one :class:`~edge_sdk.models.keep_offer.KeepOffer` per key.

The one place where a strategy's models become the figures that the export
(``models.json``) and the ``keep`` command give: each key's cluster index,
its members and their samples, the round, the version, the sha256 of its
weights (as :func:`edge_sdk.models.model_folder.weights_bytes` writes them) and the
server's accuracy (the mean over the devices that evaluated it, with their
count; None before a final evaluation).
"""

from __future__ import annotations

from collections.abc import Mapping

from edge_sdk.models.keep_offer import KeepOffer
from edge_sdk.models.model_folder import weights_sha256

from ..strategies.base import ClientInfo, Strategy  # noqa: TC001 - strategies sit below serving

__all__ = ["model_offers"]


def model_offers(strategy: Strategy, *, rnd: int, clients: Mapping[str, ClientInfo],
                 accuracy: Mapping[str, tuple[float, int]] | None = None) -> dict[str, KeepOffer]:
    """One offer per model key of ``strategy.models`` (see the module docstring)."""
    clusters = strategy.clusters()
    members: dict[str, list[str]] = {}
    index: dict[str, int] = {}
    for cid, k in clusters.items():
        key = strategy.model_key_for(cid)
        members.setdefault(key, []).append(cid)
        index[key] = int(k)
    versions = strategy.versions.state()  # empty with compression off
    accuracy = accuracy or {}
    out = {}
    for key in sorted(strategy.models):
        who = members.get(key, [])
        acc = accuracy.get(key)
        out[key] = KeepOffer(
            key, weights_sha256(strategy.models[key]), round=int(rnd),
            version=None if versions.get(key) is None else int(versions[key]), cluster=index.get(key),
            members=len(who), samples=sum(clients[c].n_samples for c in who if c in clients),
            accuracy=None if acc is None else acc[0], evaluated=0 if acc is None else acc[1])
    return out
