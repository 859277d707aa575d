"""What a strategy can do: one declared, typed set that the drivers read, never flags probed one by one.

A method declares its :class:`Capabilities` once, as the class attribute
``capabilities``; a setting of the instance that changes one (FedSketch's
``follow_drift`` or ``pretrain``, LADD's ``b``) replaces it in ``__init__``
with :func:`dataclasses.replace`. The drivers (the MQTT orchestrator, the
simulator, the Flower adapter, the CLI) read ``strategy.capabilities`` and
nothing else to know what a run of the method needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Capabilities", "partials_refusal"]


@dataclass(frozen=True)
class Capabilities:
    """What a method does before and during training, and what it cannot take."""

    #: Whether the drivers collect one summary per device before training and hand them to ``on_sketches``
    #: (the methods that cluster before training: ours, LADD).
    needs_sketches: bool = False
    #: Which summary: "sketch" (bits, :class:`edge_sdk.sketch.Sketch`) or a key of
    #: :data:`edge_sdk.features.SUMMARIES` (a float32 array per device).
    summary_kind: str = "sketch"
    #: Keyword arguments of the device-side summary function.
    summary_params: Mapping[str, Any] = field(default_factory=dict)
    #: Whether sketches sent during training (asked, or unasked by a drifting device) are acted on
    #: (``Strategy.on_resketch``).
    follows_drift: bool = False
    #: The federated pre-training of the sketches' autoencoder with the devices (its settings,
    #: :func:`server_kit.pretrain.settings.pretrain_config`), or None: the encoder is ready (shipped ONNX).
    pretrain: Mapping[str, Any] | None = None
    #: Whether a device picks its model among all of them (IFCA: the lowest loss on a local batch), which a
    #: device that arrives after training does too (:func:`server_kit.serving.handover.hand_over`).
    devices_choose_model: bool = False
    #: Why the method cannot take compressed updates (None: it can): refused at start with this reason.
    refuses_compression: str | None = None
    #: Why the method cannot take partial sums from aggregators (None: it can; see :func:`partials_refusal`).
    refuses_partials: str | None = None


def partials_refusal(capabilities: Capabilities, aggregator: str) -> str | None:
    """Why a run of a method with ``capabilities`` and the rule ``aggregator`` cannot combine partial sums (None: it can).

    A partial sum is a weighted mean: it serves FedAvg per model, not a
    method that reads each update, nor a median or trimmed mean.
    """
    if capabilities.refuses_partials:
        return capabilities.refuses_partials
    if aggregator != "fedavg":
        return (f"the {aggregator} of the updates needs every update, and an aggregator sends a "
                "weighted sum (use --aggregator fedavg)")
    return None
