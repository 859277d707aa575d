"""What ``fedsketch-server`` runs beside itself to scale out: its ingest workers and the site aggregators it accepts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from edge_sdk.protocol import ProtocolError, check_id
from edge_sdk.signing import Verifier, load_verifier

from ..drivers.remote import Ingest
from ..strategies.capabilities import partials_refusal
from .ingest import IngestWorkers

__all__ = ["ScaleOut", "load_aggregator_keys"]

log = logging.getLogger(__name__)


def load_aggregator_keys(folder: str | Path, own: str | Path | None = None) -> dict[str, Verifier]:
    """The site aggregators' public keys in ``folder``: ``ID.pub`` each (``fedsketch keygen --name ID``).

    ``own``: the server's public key file; a file in ``folder`` with the same key (``server.pub`` when the
    server's pair was made in the same folder) is the server's, not an aggregator's, and is passed over.
    ValueError for a folder without any, a file name that is not an id, or a file that is not an Ed25519 key.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--aggregator-keys {folder}: not a folder")
    mine = Path(own).read_bytes() if own is not None else None
    out = {}
    for path in sorted(root.glob("*.pub")):
        if mine is not None and path.read_bytes() == mine:
            log.info("--aggregator-keys: %s is the server's own public key, not an aggregator's", path)
            continue
        try:
            aid = check_id(path.stem, "aggregator id")
        except ProtocolError as e:
            raise ValueError(f"--aggregator-keys: {path.name}: {e}") from None
        if aid.startswith("ingest-"):
            raise ValueError(f"--aggregator-keys: {path.name}: ids starting with 'ingest-' are the ingest workers'")
        out[aid] = load_verifier(path)
    if not out:
        raise ValueError(f"--aggregator-keys {folder}: no ID.pub file in it (fedsketch keygen DIR --name ID)")
    return out


class ScaleOut:
    """The ingest workers to start and the site aggregators to accept, for one run (a context manager).

    Parameters
    ----------
    workers : IngestWorkers, optional
    sites : mapping of str to Verifier
        The site aggregators' keys, by id.
    """

    def __init__(self, workers: IngestWorkers | None = None, sites: dict[str, Verifier] | None = None) -> None:
        self.workers = workers
        self.sites = dict(sites or {})
        self._verifiers: dict[str, Verifier] = {}

    @classmethod
    def from_args(cls, args: Any, bcfg: Any, config: Any, strategy: Any) -> ScaleOut:
        """From ``--ingest-workers`` and ``--aggregator-keys``; ValueError for a combination that cannot work."""
        count = getattr(args, "ingest_workers", 0) or 0
        folder = getattr(args, "aggregator_keys", None)
        if count < 0:
            raise ValueError(f"--ingest-workers must be 0 or more, got {count}")
        if not count and not folder:
            return cls()
        why = partials_refusal(strategy.capabilities, strategy.robust.aggregator)
        if why:
            raise ValueError(f"--strategy {strategy.name} cannot take partial sums "
                             f"({'--ingest-workers' if count else '--aggregator-keys'}): {why}")
        if strategy.capabilities.pretrain:
            raise ValueError(f"{'--ingest-workers' if count else '--aggregator-keys'} does not take the autoencoder "
                             "pre-training's updates (fedsketch-fedae)")
        server_pub = _public_of(getattr(args, "signing_key", None))
        sites = load_aggregator_keys(folder, own=server_pub) if folder else {}
        workers = None
        if count:
            workers = IngestWorkers(count, bcfg, config.federation, root=config.root, server_key=server_pub,
                                    hold_memory_bytes=config.hold_memory_bytes,
                                    metrics_port=getattr(args, "metrics_port", None),
                                    metrics_host=getattr(args, "metrics_host", "127.0.0.1"),
                                    threads=getattr(args, "worker_threads", None))
        return cls(workers, sites)

    def __enter__(self) -> ScaleOut:
        self._verifiers = dict(self.sites)
        if self.workers is not None:
            self._verifiers.update(self.workers.start())
        if self.sites:
            log.info("accepting partial sums from %d site aggregator(s): %s", len(self.sites),
                     ", ".join(sorted(self.sites)))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.workers is not None:
            self.workers.stop()

    def orchestrator_args(self) -> dict[str, Any]:
        """The :class:`~server_kit.drivers.orchestrator.Orchestrator` keywords of this scale-out."""
        if not self._verifiers:
            return {}
        workers = self.workers
        if workers is None:
            return {"aggregators": self._verifiers}
        ingest = Ingest(workers.ids, alive=lambda aid: aid in self.sites or workers.alive(aid), revive=workers.revive)
        return {"aggregators": self._verifiers, "ingest": ingest}


def _public_of(signing_key: str | None) -> str | None:
    """The public half of ``--signing-key`` beside it (``server.pub`` for ``server.key``), if there is one."""
    if not signing_key:
        return None
    pub = Path(signing_key).with_suffix(".pub")
    return str(pub) if pub.is_file() else None
