"""FedCRef's cluster autoencoders: architectures, construction, training, reconstruction errors.

One small autoencoder per local cluster (:data:`ARCHITECTURES`: the paper's
784-100-64-32 with its mirror for 28x28 images, 64-48-32-16 for 8x8 digits;
ReLU, sigmoid output, Adam, MSE). Weights travel as plain ``state_dict`` mappings of
float32 numpy arrays; several models share one tensor dict through
:func:`join_models` and :func:`split_models`.

torch is imported inside the functions that need it (:func:`import_torch`):
importing this module stays light.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from ..training.torch_support import using_threads
from ..training.train_loop import run_epochs
from ..validation import check_int, check_positive

__all__ = [
    "ARCHITECTURES",
    "architecture_for",
    "as_inputs",
    "build_cluster_ae",
    "check_architecture",
    "import_torch",
    "initial_ae_weights",
    "join_models",
    "reconstruction_errors",
    "split_models",
    "train_cluster_ae",
]

#: Autoencoder name -> layer widths of the encoder (the decoder mirrors it).
#: Hidden layers and the latent use ReLU, the output a sigmoid (the paper's
#: Table 2: 174,840 parameters for 784-100-64-32).
ARCHITECTURES: dict[str, tuple[int, ...]] = {
    "fedcref_ae_784_100_64_32": (784, 100, 64, 32),
    "fedcref_ae_64_48_32_16": (64, 48, 32, 16),
}


def architecture_for(n_features: int) -> str:
    """The default cluster autoencoder for flattened inputs of ``n_features`` values."""
    for name, dims in ARCHITECTURES.items():
        if dims[0] == int(n_features):
            return name
    raise ValueError(
        f"no FedCRef autoencoder for {n_features} input features; known: "
        + ", ".join(f"{k} ({v[0]})" for k, v in ARCHITECTURES.items())
    )


def check_architecture(architecture: Optional[str], n_features: int) -> str:
    """The cluster autoencoder for ``n_features`` inputs: ``architecture`` once checked, or the default."""
    name = architecture_for(n_features) if architecture is None else architecture
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown FedCRef architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    if ARCHITECTURES[name][0] != n_features:
        raise ValueError(
            f"architecture {name!r} takes {ARCHITECTURES[name][0]} features, "
            f"x has {n_features}"
        )
    return name


def split_models(tensors: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Split ``{"<id>/<param>": array}`` back into ``{id: {param: array}}`` (see :func:`join_models`)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, arr in tensors.items():
        key, sep, param = name.partition("/")
        if not sep or not key or not param:
            raise ValueError(f"tensor name {name!r} is not of the form '<model id>/<parameter>'")
        out.setdefault(key, {})[param] = arr
    return out


def join_models(models: Mapping[Any, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Several models in one tensor dict, names prefixed ``"<id>/"``."""
    out: dict[str, np.ndarray] = {}
    for key, weights in models.items():
        for param, arr in weights.items():
            out[f"{key}/{param}"] = arr
    return out


# --------------------------------------------------------------------------- torch side


def import_torch() -> Any:
    """The torch module, or an ``ImportError`` that says what needs it (and what does not)."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the test environment has torch
        raise ImportError(
            "training FedCRef's cluster autoencoders needs torch; OnnxCommunityLabeler works without it"
        ) from e
    return torch


def build_cluster_ae(architecture: str) -> Any:
    """A fresh torch autoencoder of :data:`ARCHITECTURES` (random weights, caller's RNG).

    ``encoder`` is ``Linear, ReLU`` per layer down to the latent (ReLU
    included, as the paper's Table 2), ``decoder`` mirrors it and ends with a
    sigmoid; ``forward`` returns the flattened reconstruction.
    """
    torch = import_torch()
    from torch import nn

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown FedCRef architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    dims = ARCHITECTURES[architecture]

    class ClusterAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_features = dims[0]
            enc: list[nn.Module] = []
            for a, b in zip(dims[:-1], dims[1:]):
                enc += [nn.Linear(a, b), nn.ReLU()]
            rev = dims[::-1]
            dec: list[nn.Module] = []
            for i, (a, b) in enumerate(zip(rev[:-1], rev[1:])):
                dec += [nn.Linear(a, b), nn.Sigmoid() if i == len(rev) - 2 else nn.ReLU()]
            self.encoder = nn.Sequential(*enc)
            self.decoder = nn.Sequential(*dec)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decoder(self.encoder(x.reshape(x.shape[0], -1)))

    return ClusterAE()


def _numpy_state(model: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().astype(np.float32, copy=True) for k, v in model.state_dict().items()}


def initial_ae_weights(architecture: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded initial weights (``torch.manual_seed(seed)`` then the constructor; caller's RNG kept)."""
    torch = import_torch()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return _numpy_state(build_cluster_ae(architecture))


_MODULES = threading.local()  # one evaluation module per architecture and thread


def _module(architecture: str, weights: Mapping[str, np.ndarray]) -> Any:
    """A cached module of ``architecture`` holding ``weights`` (eval mode), private to this thread."""
    torch = import_torch()
    cache = getattr(_MODULES, "models", None)
    if cache is None:
        cache = _MODULES.models = {}
    model = cache.get(architecture)
    if model is None:
        with torch.random.fork_rng(devices=[]):
            model = build_cluster_ae(architecture)
        cache[architecture] = model
    try:
        model.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in weights.items()},
                              strict=True)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"weights do not fit architecture {architecture!r}: {e}") from None
    return model.eval()


def as_inputs(x: Any, n_features: int) -> np.ndarray:
    """Samples ``x`` checked (floating point, at least one) and flattened to ``(n, n_features)`` float32."""
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"x must be floating point in [0, 1], got dtype {arr.dtype}")
    if arr.ndim < 1 or arr.shape[0] == 0:
        raise ValueError(f"x holds no samples (shape {arr.shape})")
    flat = arr.reshape(arr.shape[0], -1)
    if flat.shape[1] != n_features:
        raise ValueError(f"x has {flat.shape[1]} values per sample, the autoencoder takes {n_features}")
    return np.ascontiguousarray(flat, dtype=np.float32)


def train_cluster_ae(
    architecture: str,
    weights: Mapping[str, np.ndarray],
    x: Any,
    *,
    epochs: int = 20,
    lr: float = 1e-3,
    batch_size: int = 32,
    seed: int | None = 0,
    threads: int | None = None,
) -> tuple[dict[str, np.ndarray], float]:
    """Train an autoencoder from ``weights`` on samples ``x`` (Adam, MSE, shuffled mini-batches).

    Parameters
    ----------
    architecture : str
        A key of :data:`ARCHITECTURES`.
    weights : mapping of str to numpy.ndarray
        Starting ``state_dict`` (not modified).
    x : array-like, shape (n, ...)
        Samples in [0, 1], flattened to the architecture's input size.
    epochs, lr, batch_size : int, float, int
        Passes, Adam learning rate, mini-batch size.
    seed : int or None
        Seeds the shuffling (the caller's torch RNG is restored).
    threads : int, optional
        torch intra-op threads during the call.

    Returns
    -------
    weights : dict of str to numpy.ndarray
        Trained float32 ``state_dict``.
    loss : float
        Mean squared error per element over the last epoch.
    """
    torch = import_torch()
    n_epochs = check_int(epochs, "epochs")
    bs = check_int(batch_size, "batch_size")
    rate = check_positive(lr, "lr")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown FedCRef architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    xa = as_inputs(x, ARCHITECTURES[architecture][0])
    n = xa.shape[0]
    with using_threads(torch, threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if seed is None else int(seed))
        model = build_cluster_ae(architecture)
        try:
            model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in weights.items()},
                                  strict=True)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"weights do not fit architecture {architecture!r}: {e}") from None
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(seed))
        opt = torch.optim.Adam(model.parameters(), lr=rate)
        xt = torch.from_numpy(xa)
        model.train()

        def batch_loss(idx: Any) -> Any:
            batch = xt[idx]
            return torch.mean((model(batch) - batch) ** 2)

        last = run_epochs(opt, batch_loss, n, epochs=n_epochs, batch_size=bs, generator=gen)
        if not math.isfinite(last):
            raise RuntimeError(f"autoencoder training diverged (loss {last})")
        return _numpy_state(model), last


def reconstruction_errors(architecture: str, weights: Mapping[str, np.ndarray], x: Any,
                          *, chunk: int = 4096) -> np.ndarray:
    """Per-sample mean squared reconstruction error of an autoencoder (torch).

    Parameters
    ----------
    architecture : str
        A key of :data:`ARCHITECTURES`.
    weights : mapping of str to numpy.ndarray
        The model's ``state_dict``.
    x : array-like, shape (n, ...)
        Samples in [0, 1].
    chunk : int
        Samples per forward pass.

    Returns
    -------
    numpy.ndarray of float64, shape (n,)
    """
    torch = import_torch()
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown FedCRef architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    xa = as_inputs(x, ARCHITECTURES[architecture][0])
    model = _module(architecture, weights)
    out = np.empty(xa.shape[0], dtype=np.float64)
    with torch.no_grad():
        for start in range(0, xa.shape[0], chunk):
            xb = torch.from_numpy(xa[start : start + chunk])
            out[start : start + xb.shape[0]] = torch.mean((model(xb) - xb) ** 2, dim=1).double().numpy()
    return out
