"""The models of a run: the encoder the devices sketch with, the classifier architecture and its template.

They are chosen once (given, or after registration from the fleet's hellos,
or from a checkpoint); :class:`RunModels` then holds what the server checks
the devices' messages against: the tensor spec of an update, the latent size
of a sketch, the input size a device must have.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..strategies.base import Strategy

__all__ = ["RunModels", "encoder_latent"]

log = logging.getLogger(__name__)


def encoder_latent(name: str) -> int:
    """The latent size of the shipped encoder ``name`` (from the model manifest)."""
    from edge_sdk.models.artifacts import load_manifest

    spec = load_manifest().get(name)
    if spec is None or spec.latent_dim is None:
        raise ValueError(f"encoder {name!r} is not in the model manifest or has no latent size")
    return spec.latent_dim


class RunModels:
    """The run's encoder and architecture, and what follows from them (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        The run's strategy (whether it sketches with an encoder; IFCA builds its K models from the architecture).
    encoder, architecture : str or None
        As configured (None: chosen after registration).
    seed : int
        Seed of the initial weights.
    latent_dim : int or None
        The sketches' latent size, if configured (default: the encoder's).
    template : mapping or None
        The initial weights, if given.
    """

    def __init__(self, strategy: Strategy, encoder: str | None, architecture: str | None, *, seed: int,
                 latent_dim: int | None = None, template: Mapping[str, np.ndarray] | None = None) -> None:
        self.strategy = strategy
        self.seed = seed
        self.latent_dim = latent_dim
        #: The encoder the clients sketch with (the federated one after pre-training); None until chosen.
        self.encoder = encoder
        #: The classifier architecture of the run; None until chosen (or when a template was given).
        self.architecture = architecture
        self.template: dict[str, np.ndarray] | None = None
        #: Whether the template is ``initial_weights(architecture, seed)``, which every device can build itself.
        self.portable_template = False
        #: Name -> (shape, dtype) of every tensor of an update.
        self.spec: dict[str, tuple[tuple[int, ...], str]] = {}
        #: The sketches' latent size (when the strategy sketches with an encoder).
        self.latent: int | None = None
        self.input_size: int | None = None
        #: The federated encoder as it is delivered (meta, .onnx bytes), after pre-training.
        self.encoder_msg: tuple[dict[str, Any], bytes] | None = None
        #: Where the federated encoder was exported when no checkpoint folder was given.
        self.encoder_tmp: tempfile.TemporaryDirectory[str] | None = None
        if template is not None:
            self.template = {k: np.asarray(v) for k, v in template.items()}
        if (self.template is not None or architecture) and (encoder or not self.needs_encoder()):
            self.use(encoder, architecture, "as given")

    def needs_encoder(self) -> bool:
        """Whether the devices sketch with a shipped encoder the server must name."""
        return (self.strategy.capabilities.needs_sketches and self.strategy.capabilities.summary_kind == "sketch"
                and self.strategy.capabilities.pretrain is None)

    @property
    def chosen(self) -> bool:
        """Whether the models are chosen (the template is known)."""
        return self.template is not None

    def use(self, encoder: str | None, architecture: str | None, how: str) -> None:
        """Fix the run's encoder and architecture: template, tensor spec, latent size, input size."""
        from edge_sdk.models.artifacts import input_size

        self.encoder, self.architecture = encoder, architecture
        if self.template is None:
            from edge_sdk.training.trainer import initial_weights

            self.template = {k: np.asarray(v) for k, v in initial_weights(architecture, self.seed).items()}
            self.portable_template = True
        self.spec = {k: (tuple(v.shape), str(v.dtype)) for k, v in self.template.items()}
        if self.needs_encoder():
            self.latent = self.latent_dim or encoder_latent(encoder)
        self.input_size = ((input_size(architecture) if architecture else None)
                           or (input_size(encoder) if encoder else None))
        if hasattr(self.strategy, "architecture") and self.strategy.architecture is None:
            self.strategy.architecture = architecture  # IFCA builds its K models from it
        if how != "as given":
            log.info("models: encoder %s, architecture %s (%s)", encoder, architecture, how)

    def welcome(self) -> dict[str, str]:
        """What a welcome tells a device to use: the architecture and the encoder, those chosen."""
        out = {}
        if self.architecture:
            out["architecture"] = self.architecture
        if self.encoder:
            out["encoder"] = self.encoder
        return out
