"""Where a round's compressed updates are decoded: as they arrive, or only where they are summed.

On a GPU server the sums of a large model live on the card
(:class:`~server_kit.aggregate.StreamingFedAvg`'s staged path). There an
``int8`` or ``int4`` update need not be decoded on the host at all: the
intake checks its body whole, codes included, and keeps its codes as they
came with the norm of the change they stand for
(:func:`edge_sdk.compress.frames.coded_change`); the screening judges that
norm; the sum sends the codes across the bus (an eighth of the float32
weights for ``int4``) and decodes them on the card
(:meth:`~server_kit.aggregate.StreamingFedAvg.add_coded`), with the bits of
decoding them on the host. A clipped update's change is scaled there.

That serves the methods whose combination only sums each model's updates
(those that take partial sums, with ``--aggregator fedavg``) and a run
without central DP, which clips each update from its decoded weights. Any
other run decodes at intake, as does every update of another codec.
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Any

from edge_sdk.compress.frames import FRAMED_METHODS
from edge_sdk.compress.update_codec import CompressedDelta, UpdateCodec

from ..aggregate import sums_on_gpu
from ..strategies.capabilities import partials_refusal

__all__ = ["DecodeAt", "Decoding", "decode_at_sum", "why_decoded_at_intake"]

log = logging.getLogger(__name__)


class DecodeAt(str, Enum):
    """Where ``int8`` and ``int4`` updates are decoded (``--decode-updates``)."""

    #: Each update decoded on the host as it arrives.
    INTAKE = "intake"
    #: Kept as they came and decoded where they are summed (the card on a GPU server, else the host).
    SUM = "sum"
    #: ``sum`` where the model's sums are on a GPU, else ``intake``.
    AUTO = "auto"


def why_decoded_at_intake(strategy: Any, codec: UpdateCodec) -> str | None:
    """Why a run's updates cannot be kept coded until summed (None: they can)."""
    if not isinstance(codec, CompressedDelta) or codec.compression.method not in FRAMED_METHODS:
        return f"its updates are {codec.compression.method.value}, and only int8 and int4 are decoded where summed"
    if strategy.robust.aggregator != "fedavg":
        return f"the {strategy.robust.aggregator} of the updates reads each update's weights"
    refusal = partials_refusal(strategy.capabilities, strategy.robust.aggregator)
    if refusal is not None:
        return refusal
    if strategy.dp is not None:
        return "central DP clips each update from its decoded weights"
    return None


def decode_at_sum(setting: DecodeAt | str, strategy: Any, codec: UpdateCodec) -> bool:
    """Whether a run keeps its updates coded until they are summed (``setting``, the run's method and codec)."""
    setting = DecodeAt(setting)
    if setting is DecodeAt.INTAKE:
        return False
    why = why_decoded_at_intake(strategy, codec)
    if why is not None:
        if setting is DecodeAt.SUM:
            log.info("updates decoded as they arrive, not where summed: %s", why)
        return False
    if setting is DecodeAt.SUM:
        return True
    models = list(strategy.models.values())
    return bool(models) and sums_on_gpu(models[0])


class Decoding:
    """A run's choice of where its updates are decoded, made once, at its first update (the strategy set up)."""

    def __init__(self, setting: DecodeAt | str = DecodeAt.AUTO) -> None:
        self.setting = DecodeAt(setting)
        self._at_sum: bool | None = None

    def at_sum(self, strategy: Any, codec: UpdateCodec) -> bool:
        """Whether the run's updates are kept coded until summed (decided at the first call, then kept)."""
        if self._at_sum is None:
            self._at_sum = decode_at_sum(self.setting, strategy, codec)
            if self._at_sum:
                log.info("%s updates kept as they came and decoded where they are summed",
                         codec.compression.method.value)
        return self._at_sum
