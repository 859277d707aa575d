"""The encoders the server sent a device: checked against their sha256, each kept in a private folder.

In the federated pre-training of the sketch autoencoder (``train_ae``), the
server sends the exported encoder as raw ONNX bytes on the ``encoder`` model
topic. :class:`ReceivedEncoders` keeps it only if its bytes have the sha256 of
its meta and of its manifest entry, writes it with that entry in a folder of
its own under one temporary root, and loads it (:class:`~edge_sdk.encoder.OnnxEncoder`)
when a sketch request names it. A new run drops them all; nothing of a run
stays on the device's disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..protocol import Message

__all__ = ["ReceivedEncoders"]

# the device's log keeps its one name: these lines were the client's and still are
log = logging.getLogger("edge_sdk.client")


class ReceivedEncoders:
    """The encoders received by one device, by name, and the cache of loaded encoders.

    Parameters
    ----------
    cid : str
        The device (its folders are named after it).
    cv : threading.Condition
        The condition the device's models are waited on (:attr:`ModelStore.cv`):
        an encoder received wakes a sketch request waiting for it.
    loaded : dict, optional
        The cache of loaded ONNX encoders (name -> encoder). Clients in one
        process may share one dict, and so one ONNX Runtime session per
        encoder (an emulated fleet); by default each device has its own.

    Attributes
    ----------
    dirs : dict of str to Path
        Each encoder received: the folder holding it and its manifest.
    rejected : list of str
        Why received encoders were refused (for logs and tests).
    """

    def __init__(self, cid: str, cv: threading.Condition, loaded: dict[str, Any] | None = None) -> None:
        self.cid = cid
        self.cv = cv
        self.loaded: dict[str, Any] = {} if loaded is None else loaded
        self.dirs: dict[str, Path] = {}
        self.rejected: list[str] = []
        self._root: Path | None = None

    def _reject(self, reason: str) -> None:
        self.rejected.append(reason)
        log.error("rejected encoder: %s", reason)

    def receive(self, msg: Message) -> None:
        """Keep an encoder the server sent, if its bytes match the sha256 of its meta and entry."""
        m = msg.meta
        name, sha, entry = m.get("name"), m.get("sha256"), m.get("entry")
        if not isinstance(name, str) or not name or Path(name).name != name or name.startswith("."):
            return self._reject(f"invalid encoder name {name!r}")
        if not isinstance(sha, str) or not isinstance(entry, dict):
            return self._reject(f"encoder {name!r}: meta lacks sha256 or its manifest entry")
        actual = hashlib.sha256(msg.body).hexdigest()
        if actual != sha.lower():
            return self._reject(f"encoder {name!r}: bytes have sha256 {actual}, meta says {sha}")
        if str(entry.get("sha256", "")).lower() != actual:
            return self._reject(f"encoder {name!r}: manifest entry sha256 differs from the bytes'")
        fname = entry.get("file")
        if not isinstance(fname, str) or Path(fname).name != fname or not fname.endswith(".onnx"):
            return self._reject(f"encoder {name!r}: invalid file name {fname!r}")
        try:
            from ..models.artifacts import ArtifactSpec

            ArtifactSpec.from_entry(name, entry)
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix=f"fedsketch-{self.cid}-encoders-"))
            folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._root))
            (folder / fname).write_bytes(msg.body)
            (folder / "manifest.json").write_text(json.dumps({"artifacts": {name: entry}}, indent=1))
        except (ValueError, TypeError, KeyError, OSError) as e:
            return self._reject(f"encoder {name!r}: {e}")
        with self.cv:
            self.dirs[name] = folder
            self.loaded.pop(name, None)
            self.cv.notify_all()
        log.info("received encoder %s (%d bytes)", name, len(msg.body))

    def get(self, name: str, *, wait_s: float = 0.0) -> Any:
        """The encoder ``name``: a received one, else the shipped one; loaded once.

        An encoder that is neither received nor shipped (a federated one, on
        its way) is waited for up to ``wait_s`` seconds.
        """
        encoder = self.loaded.get(name)
        if encoder is not None:  # loaded once (a new one received replaces it): no manifest read per sketch
            return encoder
        if wait_s > 0 and name not in self.dirs:
            from ..models.artifacts import load_manifest

            try:
                shipped = name in load_manifest()
            except (OSError, ValueError):
                shipped = False
            if not shipped:  # a federated encoder: it may still be on its way
                deadline = time.monotonic() + wait_s
                with self.cv:
                    while name not in self.dirs and time.monotonic() < deadline:
                        self.cv.wait(timeout=0.5)
        if name not in self.loaded:
            from ..encoder import OnnxEncoder

            self.loaded[name] = OnnxEncoder(name, models_dir=self.dirs.get(name))
        return self.loaded[name]

    def clear(self) -> None:
        """Forget every encoder received (a new run) and delete their folders."""
        with self.cv:
            for name in self.dirs:
                self.loaded.pop(name, None)
            self.dirs.clear()
        self.remove_folders()

    def remove_folders(self) -> None:
        """Delete the folder of the encoders received (nothing of a run stays on the device's disk)."""
        root, self._root = self._root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
