"""Which devices a run admits, and which models it runs when nobody said.

A device's hello says what it holds and can do: its sample shape, its
largest label, its capabilities (``train-torch`` when torch is installed).
The server checks each one against the run's models (:func:`refusal`) and
either admits it, with what it should use, or refuses it with a reason that
both sides log. A device without torch is admitted to sketch and evaluate
and left out of training (:func:`can_train`).

When the server is given no ``--encoder`` / ``--architecture``,
:func:`choose_models` picks the shipped pair that takes the fleet's samples
(the shape most devices have): 8x8 images the digits encoder and CNN, 28x28
grey images the Fashion-MNIST encoder and LeNet-5.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = ["can_train", "choose_models", "refusal", "sample_size"]

log = logging.getLogger(__name__)


def sample_size(hello: Mapping[str, Any]) -> int | None:
    """Values in one of the device's samples (None when its hello does not say)."""
    shape = hello.get("input_shape")
    if not shape:
        return None
    n = 1
    for d in shape:
        n *= int(d)
    return n


def can_train(hello: Mapping[str, Any]) -> bool:
    """Whether the device says it can train (torch installed)."""
    return "train-torch" in hello.get("capabilities", ())


def _shape_text(hello: Mapping[str, Any]) -> str:
    return "x".join(str(d) for d in hello.get("input_shape") or ()) or "?"


def choose_models(hellos: Mapping[str, Mapping[str, Any]], encoder: str | None, architecture: str | None
                  ) -> tuple[str, str, str]:
    """The run's encoder and architecture: those given, else the shipped pair for the fleet's samples.

    Returns
    -------
    (encoder, architecture, how)
        ``how`` says, for the log, where they come from.

    Raises
    ------
    ValueError
        When one must be chosen and no shipped model takes the fleet's samples.
    """
    if encoder is not None and architecture is not None:
        return encoder, architecture, "as given"
    from edge_sdk.models.artifacts import models_for_shape

    sizes = Counter(s for s in (sample_size(h) for h in hellos.values()) if s is not None)
    if not sizes:
        raise ValueError("no --encoder/--architecture given and no device said the shape of its samples "
                         "(an older fedsketch-client?): give --encoder and --architecture")
    size, count = sizes.most_common(1)[0]
    shape = next(_shape_text(h) for h in hellos.values() if sample_size(h) == size)
    enc, arch = models_for_shape((size,))
    if (encoder is None and enc is None) or (architecture is None and arch is None):
        raise ValueError(f"no shipped model takes the fleet's samples ({shape}, {size} values, "
                         f"{count} of {len(hellos)} devices): give --encoder and --architecture")
    how = (f"chosen for the fleet's samples ({shape}: {count} of {len(hellos)} devices); "
           "give --encoder/--architecture to choose")
    return encoder or enc, architecture or arch, how


def refusal(hello: Mapping[str, Any], *, input_size: int | None, num_classes: int) -> str | None:
    """Why a device cannot take part in this run, or None when it can.

    Parameters
    ----------
    hello : mapping
        The device's checked hello meta.
    input_size : int, optional
        Values per sample the run's models take (None: not known, not checked).
    num_classes : int
        The run's number of classes.
    """
    size = sample_size(hello)
    if input_size is not None and size is not None and size != input_size:
        return (f"its samples are {_shape_text(hello)} ({size} values); this federation's models take "
                f"{input_size} values per sample")
    label_max = hello.get("label_max")
    if label_max is not None and label_max >= num_classes:
        return f"its labels go up to {label_max}; this federation has {num_classes} classes (0 to {num_classes - 1})"
    return None
