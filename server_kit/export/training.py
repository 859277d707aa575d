"""Training the shipped autoencoders: seeding, the MSE/Adam loop, the reconstruction error."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["BATCH_SIZE", "LEARNING_RATE", "evaluate_mse", "seed_everything", "train_autoencoder"]

logger = logging.getLogger(__name__)

BATCH_SIZE = 32
LEARNING_RATE = 1e-3


def seed_everything(seed: int) -> None:
    """Seed torch and numpy and ask torch for deterministic kernels.

    Parameters
    ----------
    seed : int
        The seed.
    """
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))  # noqa: NPY002 - the legacy global RNG, for third-party code
    torch.use_deterministic_algorithms(True, warn_only=True)


def _progress(iterable: Iterable[Any], desc: str, total: int | None = None) -> Iterable[Any]:
    """Wrap ``iterable`` in a tqdm bar when tqdm is installed and stderr is a terminal."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, disable=None)


def train_autoencoder(
    model: nn.Module,
    data: np.ndarray,
    *,
    epochs: int,
    seed: int,
    batch_size: int = BATCH_SIZE,
    lr: float = LEARNING_RATE,
    desc: str = "train",
    device: str = "cpu",
) -> list[float]:
    """Train an autoencoder to reconstruct ``data`` with MSE and Adam.

    Parameters
    ----------
    model : torch.nn.Module
        Maps a batch to its reconstruction (same shape).
    data : numpy.ndarray
        ``float32`` samples in [0, 1], first axis the sample axis.
    epochs : int
        Passes over the data (a fresh seeded shuffle each).
    seed : int
        Seed of the shuffling generator.
    batch_size : int
        Mini-batch size.
    lr : float
        Adam learning rate.
    desc : str
        Label for progress and log lines.
    device : str
        Torch device (``cpu``, ``cuda``): the model and the whole data set
        move there for the run; the shuffles are drawn on the CPU, so the
        batches are the same on any device. The model stays there.

    Returns
    -------
    list of float
        Mean training loss (per element) of every epoch, measured during it.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    dev = torch.device(device)
    x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(dev)
    n = x.shape[0]
    gen = torch.Generator().manual_seed(seed)
    model.to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.MSELoss()
    history: list[float] = []
    model.train()
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        perm = torch.randperm(n, generator=gen).to(dev)
        total = torch.zeros((), dtype=torch.float64, device=dev)
        starts = range(0, n, batch_size)
        for start in _progress(starts, f"{desc} {epoch}/{epochs}", total=len(starts)):
            xb = x[perm[start : start + batch_size]]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), xb)
            loss.backward()
            opt.step()
            total += loss.detach().double() * xb.shape[0]
        history.append(float(total) / n)  # the one wait for the device per epoch
        logger.info(
            "%s epoch %d/%d: train MSE %.6f (%.1f s)",
            desc,
            epoch,
            epochs,
            history[-1],
            time.perf_counter() - t0,
        )
    model.eval()
    return history


@torch.no_grad()
def evaluate_mse(model: nn.Module, data: np.ndarray, chunk: int = 4096) -> float:
    """Mean squared reconstruction error per element, in eval mode.

    Parameters
    ----------
    model : torch.nn.Module
        Maps a batch to its reconstruction; it runs on the device its parameters are on.
    data : numpy.ndarray
        ``float32`` samples, first axis the sample axis.
    chunk : int
        Samples per forward pass.

    Returns
    -------
    float
        ``mean((model(x) - x) ** 2)`` over all samples and elements.
    """
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    sse = torch.zeros((), dtype=torch.float64, device=dev)
    for start in range(0, x.shape[0], chunk):
        xb = x[start : start + chunk].to(dev)
        sse += ((model(xb) - xb).double() ** 2).sum()
    model.train(was_training)
    return float(sse) / x.numel()
