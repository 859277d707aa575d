"""Parts of a model by tensor-name prefix: :func:`select` a part, :func:`merge` parts back together.

A cluster model can be its per-cluster average with a part averaged over
every client put back in (LeNet-5's shared convolutions,
:data:`server_kit.nets.BASE_LAYERS`); :class:`server_kit.aggregate.StreamingFedAvg`
takes the same ``include=`` / ``exclude=`` filters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import numpy as np

__all__ = ["Prefixes", "merge", "prefixes", "select", "selected"]

Prefixes = Optional[Sequence[str]]
Weights = Mapping[str, np.ndarray]


def prefixes(value: Prefixes, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        raise ValueError(f"{what} must be a sequence of name prefixes, not the string {value!r}")
    out = tuple(value)
    if not all(isinstance(p, str) and p for p in out):
        raise ValueError(f"{what} must hold non-empty strings, got {list(out)!r}")
    return out


def selected(name: str, include: tuple[str, ...] | None, exclude: tuple[str, ...] | None) -> bool:
    if include is not None and not name.startswith(include):
        return False
    return not (exclude and name.startswith(exclude))


def select(
    weights: Weights, *, include: Prefixes = None, exclude: Prefixes = None
) -> dict[str, np.ndarray]:
    """The tensors of ``weights`` whose names pass the prefix filters (not copied).

    Parameters
    ----------
    weights : mapping of str to numpy.ndarray
        A ``state_dict``.
    include : sequence of str, optional
        Keep only names starting with one of these (default: all).
    exclude : sequence of str, optional
        Then drop names starting with one of these.

    Returns
    -------
    dict
        The selected name -> array entries, in the order of ``weights``.
    """
    inc, exc = prefixes(include, "include"), prefixes(exclude, "exclude")
    return {k: v for k, v in weights.items() if selected(k, inc, exc)}


def merge(base: Weights, override: Weights) -> dict[str, np.ndarray]:
    """``base`` with some tensors replaced by those of ``override``.

    Used to put together a cluster model from its per-cluster average and a
    shared part averaged over all clients. Arrays are not copied.

    Parameters
    ----------
    base : mapping of str to numpy.ndarray
        The full model.
    override : mapping of str to numpy.ndarray
        Replacement tensors; every name must exist in ``base`` with the same
        shape.

    Returns
    -------
    dict
        A new dict in the order of ``base``.

    Raises
    ------
    ValueError
        If ``override`` names a tensor that ``base`` lacks or changes a shape.
    """
    for name, value in override.items():
        if name not in base:
            raise ValueError(f"override tensor {name!r} is not in the base model")
        if np.shape(value) != np.shape(base[name]):
            raise ValueError(
                f"override tensor {name!r} has shape {np.shape(value)}, "
                f"the base model {np.shape(base[name])}"
            )
    return {k: override[k] if k in override else v for k, v in base.items()}
