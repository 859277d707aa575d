"""A device's model folder: the model it keeps after a run, the one before it, and the rule that swaps them.

The folder (``fedsketch-client --model-dir DIR``)::

    DIR/current  -> versions/<run>-<key>          the model the owner's application runs
    DIR/previous -> versions/...                  the one it replaced
    DIR/versions/<run>-<key>/                     model folders (edge_sdk.models.model_folder)

A new model is written whole into its own folder first, then ``current`` is
switched to it in one step (:func:`~edge_sdk.models.model_folder.swap_link`), so an
application reading the folder (:class:`edge_sdk.LocalModel`) sees the old
model or the new one, never half of one. Folders no link names are removed.

:class:`KeepPolicy` says when a run's model replaces the kept one. ``best``
(the default) evaluates both on the device's own test split and keeps the
new one unless it is worse by more than ``margin`` (accuracy, default one
point); ``latest`` always takes the new one. A full or read-only disk is
logged and the kept model stays.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import numpy as np

from .local_model import CURRENT, PREVIOUS
from .model_folder import (
    WEIGHTS,
    ModelEntry,
    ModelFolderError,
    read_model_folder,
    swap_link,
    weights_sha256,
    write_model_folder,
)

__all__ = ["DEFAULT_MARGIN", "KeepDecision", "KeepPolicy", "ModelKeeper"]

log = logging.getLogger(__name__)

#: How much worse (accuracy on the device's own test split) a new model may be and still replace the kept one.
DEFAULT_MARGIN = 0.01

#: What evaluates weights on the device's own test split: (accuracy, test samples), None without a test split.
Evaluator = Callable[[str, Mapping[str, np.ndarray]], "tuple[float, int] | None"]


class KeepPolicy(str, Enum):
    """When a run's model replaces the one a device keeps."""

    #: Unless it is worse on the device's own test split by more than the margin.
    BEST = "best"
    #: Always.
    LATEST = "latest"


@dataclass(frozen=True)
class KeepDecision:
    """What :meth:`ModelKeeper.offer` did, and why (the line the device logs)."""

    kept_new: bool
    reason: str
    #: The new model's and the kept one's accuracy on the device's test split (None: not measured).
    new_accuracy: float | None = None
    old_accuracy: float | None = None
    #: The folder ``current`` names after the offer (None: nothing kept).
    current: Path | None = None


class ModelKeeper:
    """A device's model folder (see the module docstring)."""

    def __init__(self, root: str | Path, policy: KeepPolicy | str = KeepPolicy.BEST,
                 margin: float = DEFAULT_MARGIN) -> None:
        self.root = Path(root)
        self.policy = KeepPolicy(policy)
        if not 0.0 <= float(margin) <= 1.0:
            raise ValueError(f"keep margin must be an accuracy difference in [0, 1], got {margin!r}")
        self.margin = float(margin)

    def current(self) -> Path | None:
        """The folder of the kept model (None: none kept)."""
        link = self.root / CURRENT
        return link.resolve() if link.exists() else None

    def kept(self) -> ModelEntry | None:
        """The kept model's entry, checked (None: none kept, or the kept one is broken: logged)."""
        folder = self.current()
        if folder is None:
            return None
        try:
            return read_model_folder(folder)[0]
        except ModelFolderError as e:
            log.warning("the kept model is unusable: %s", e)
            return None

    def offer(self, entry: ModelEntry, weights: Mapping[str, np.ndarray], evaluate: Evaluator) -> KeepDecision:
        """Keep ``weights`` (described by ``entry``) if the policy says so; see the module docstring."""
        old_folder = self.current()
        old = self._read_kept(old_folder)
        if old is not None and (old[0].files.get(WEIGHTS) == weights_sha256(weights) and old[0].run == entry.run
                                and old[0].key == entry.key):
            return KeepDecision(False, f"model {entry.key} of run {entry.run} is already kept",
                                old[0].device_accuracy, old[0].device_accuracy, old_folder)
        new_eval = evaluate(entry.architecture, weights)
        new_acc = None if new_eval is None else new_eval[0]
        entry = replace(entry, device_accuracy=new_acc, device_test_n=0 if new_eval is None else new_eval[1])
        old_acc = None
        if old is not None and self.policy is KeepPolicy.BEST and new_acc is not None \
                and old[0].architecture == entry.architecture:
            old_eval = evaluate(old[0].architecture, old[1])
            old_acc = None if old_eval is None else old_eval[0]
            if old_acc is not None and new_acc < old_acc - self.margin:
                return KeepDecision(
                    False, f"kept the previous model ({old[0].key} of run {old[0].run}, accuracy {old_acc:.4f} on "
                           f"this device's test split): the new {entry.key} of run {entry.run} scores "
                           f"{new_acc:.4f}, worse by more than the margin {self.margin:g}",
                    new_acc, old_acc, old_folder)
        try:
            folder = self._install(entry, weights)
        except OSError as e:
            return KeepDecision(False, f"model {entry.key} of run {entry.run} not kept: cannot write in "
                                       f"{self.root} ({e.strerror or e}); the kept model stays",
                                new_acc, old_acc, old_folder)
        return KeepDecision(True, f"kept model {entry.key} of run {entry.run} "
                                  f"({self._why(new_acc, old_acc, old_folder is not None)})", new_acc, old_acc, folder)

    def _read_kept(self, folder: Path | None) -> tuple[ModelEntry, dict[str, np.ndarray]] | None:
        if folder is None:
            return None
        try:
            return read_model_folder(folder)
        except ModelFolderError as e:
            log.warning("the kept model is unusable (%s): a new one replaces it", e)
            return None

    def _why(self, new_acc: float | None, old_acc: float | None, had_one: bool) -> str:
        """Why a new model was kept, for the log."""
        if new_acc is None:
            why = "no test split on this device to compare with" if had_one else "first model"
        elif old_acc is None:
            why = f"accuracy {new_acc:.4f} on this device's test split" + ("" if had_one else "; first model")
        else:
            why = f"accuracy {new_acc:.4f} against {old_acc:.4f} for the one before (margin {self.margin:g})"
        return f"policy latest; {why}" if self.policy is KeepPolicy.LATEST and had_one else why

    def _install(self, entry: ModelEntry, weights: Mapping[str, np.ndarray]) -> Path:
        """Write the model into its own folder, then make it ``current`` (the old one ``previous``)."""
        versions = self.root / "versions"
        versions.mkdir(parents=True, exist_ok=True)
        parts = (entry.run or time.strftime("%Y%m%dT%H%M%S", time.gmtime()), entry.key)
        name = "-".join(re.sub(r"[^A-Za-z0-9_.-]", "_", str(p))[:40] for p in parts)
        folder = versions / name
        n = 1
        while folder.exists():
            n += 1
            folder = versions / f"{name}.{n}"
        old = self.current()
        try:
            write_model_folder(folder, entry, weights)
            swap_link(self.root / CURRENT, folder)  # the one step that changes what the owner runs
        except OSError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if old is not None:
            try:
                swap_link(self.root / PREVIOUS, old)
            except OSError as e:  # the new model is kept; only the link to the one before is stale
                log.warning("the previous model's link not updated in %s: %s", self.root, e)
        self._tidy()
        return folder

    def _tidy(self) -> None:
        """Remove the version folders neither link names (a failure to is harmless: tried again next time)."""
        named = {p.resolve() for p in (self.root / CURRENT, self.root / PREVIOUS) if p.exists()}
        try:
            for d in (self.root / "versions").iterdir():
                if d.resolve() not in named:
                    shutil.rmtree(d, ignore_errors=True)
        except OSError as e:
            log.debug("old model folders not removed from %s: %s", self.root, e)

