"""The one epoch loop of every local training with torch: shuffled mini-batches, optimiser steps, the mean loss.

:func:`edge_sdk.training.trainer.train_local` (cross-entropy),
:func:`edge_sdk.training.trainer.train_autoencoder_local` (reconstruction MSE) and
FedCRef's cluster autoencoders run it. What differs between them (the model,
the loss, any extra term such as a proximal or regularisation penalty) lives
in the ``batch_loss`` callable they pass; the seeding, the threads and the
model's mode stay with the caller. torch is imported when the loop runs.
"""

from __future__ import annotations

import math
from typing import Any, Callable

__all__ = ["run_epochs"]


def run_epochs(
    optimizer: Any,
    batch_loss: Callable[[Any], Any],
    n: int,
    *,
    epochs: int,
    batch_size: int,
    generator: Any,
    device: Any = None,
) -> float:
    """Train for ``epochs`` shuffled passes over ``n`` samples; return the last epoch's mean loss.

    Each epoch draws one permutation ``torch.randperm(n, generator=generator)``
    (moved to ``device`` when given) and walks it in slices of
    ``batch_size`` indices (the last may be smaller). For each slice
    ``idx``: ``optimizer.zero_grad(set_to_none=True)``,
    ``loss = batch_loss(idx)``, ``loss.backward()``, ``optimizer.step()``,
    and ``loss * len(idx)`` is added to a float64 total. With the same
    generator state, data and threads the result is bit-identical.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Steps the model's parameters.
    batch_loss : callable
        ``batch_loss(idx) -> loss``: the scalar mean loss of the samples at
        the indices ``idx`` (an int64 tensor on ``device``), with any extra
        term included; the model is the caller's (in train mode).
    n : int
        Number of samples.
    epochs : int
        Passes over the data, each with a fresh shuffle.
    batch_size : int
        Mini-batch size.
    generator : torch.Generator
        Draws the shuffles (seeded by the caller).
    device : torch.device, optional
        Where the indices and the running total live (default: the CPU).

    Returns
    -------
    float
        Mean of ``batch_loss`` over the samples of the last epoch, weighted
        by batch size (NaN when ``epochs`` is 0).
    """
    import torch

    last = math.nan
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator)
        if device is not None:
            perm = perm.to(device)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = batch_loss(idx)
            loss.backward()
            optimizer.step()
            total += loss.detach().double() * idx.shape[0]
        last = float(total) / n
    return last
