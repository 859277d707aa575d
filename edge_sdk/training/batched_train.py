"""Many clients' local training at once: one model's parameters stacked per client, one step for all.

:func:`train_local_batched` trains the clients of a round that share an
architecture and settings together, as :func:`edge_sdk.training.trainer.train_local`
would train each alone, and gives the same models within float tolerance:

* **The same batches.** Each client's shuffles come from its own generator
  seeded with its own seed (one ``torch.randperm`` per epoch, as the epoch
  loop of :mod:`edge_sdk.training.train_loop` draws them), cut into slices of
  ``batch_size``. A client's steps are its epochs' slices one after another;
  step ``s`` of the batch is step ``s`` of every client that has one.
* **One step for all.** The parameters are stacked (``(clients, *shape)``)
  and ``torch.func.vmap`` runs ``functional_call`` and its gradient over the
  clients. Slices shorter than ``batch_size`` (a client's last slice of an
  epoch) are padded and masked: each client's loss is the mean over its real
  samples, so its gradient is what it would be alone.
* **Each client's own optimiser.** Adam (torch's update, with each client's
  own step count for the bias corrections) or plain SGD, applied to the
  clients that have a step; a client whose steps are over (fewer samples)
  keeps its parameters and moments unchanged.
* **Eager or compiled steps** (:class:`Step`). Eager, each of a step's
  operations is launched from Python. Compiled, ``torch.compile`` fuses the
  whole step (forward, gradient, optimiser) into a few kernels, and with
  ``graphs`` on CUDA each step replays as one CUDA graph; the models are the
  eager ones within float tolerance. The first call of a shape compiles for
  seconds; on 2 CPU cores a compiled digits CNN step then ran 2.2 times as
  fast, a LeNet-5 step 1.3 times (``benchmarks/gpu.py`` measures each on its
  machine).

It serves the architectures whose training does not depend on the batch
being one client's: no buffers (BatchNorm's running statistics) and no
dropout (:func:`batchable`), which are the digits CNN and LeNet-5; others
train one client at a time. On a GPU a round's clients then run as one
stream of large kernels instead of thousands of small ones. torch is
imported when a batch is trained.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional

import numpy as np

from ..models.model_checks import check_data, check_weights
from .torch_support import build_classifier, import_torch, using_threads
from .trainer import TrainResult, _check_settings, _finished

__all__ = ["ClientJob", "ResidentData", "Step", "architecture_batchable", "batchable", "check_step",
           "train_local_batched"]

_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, which train_local uses
_EPS = 1e-8


@dataclass(frozen=True)
class ClientJob:
    """One client's part of a batch: its starting weights, its data and its seed (see ``train_local``)."""

    weights: Mapping[str, np.ndarray]
    x: np.ndarray
    y: np.ndarray
    seed: Optional[int] = None
    #: The client's name in a :class:`ResidentData` (None: its data is copied to the device for this call).
    key: Optional[str] = None


class ResidentData:
    """Each client's checked samples and labels kept on one torch device across calls (a simulator's whole run).

    A client's copy is made on first use and again only when its arrays are
    replaced (new data); :func:`train_local_batched` then concatenates the
    copies there instead of copying the round's data from the host.
    """

    def __init__(self, device: str) -> None:
        self.device = import_torch().device(device)
        self._held: dict[str, tuple[Any, Any, np.ndarray, np.ndarray]] = {}

    def get(self, key: str, info: Any, x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
        """``key``'s samples and labels on the device (checked as ``train_local`` checks them)."""
        torch = import_torch()
        held = self._held.get(key)
        if held is None or held[2] is not x or held[3] is not y:
            xa, ya = check_data(info, x, y)
            held = self._held[key] = (torch.from_numpy(xa).to(self.device), torch.from_numpy(ya).to(self.device), x, y)
        return held[0], held[1]


def batchable(model: Any) -> bool:
    """Whether a torch model trains the same stacked as alone: no buffers, no dropout."""
    import torch

    if any(True for _ in model.buffers()):
        return False
    return not any(isinstance(m, torch.nn.modules.dropout._DropoutNd) for m in model.modules())


@dataclass
class _Plan:
    """The batch's steps: sample indices into the concatenated data, masks, counts (steps x clients)."""

    index: np.ndarray  # (steps, clients, batch) int64, into the concatenated samples
    mask: np.ndarray  # (steps, clients, batch) float32: 1 for a real sample
    count: np.ndarray  # (steps, clients) int64: real samples of the step (0: no step)
    last_epoch: list[slice]  # per client: its last epoch's steps


def _plan(torch: Any, sizes: Sequence[int], seeds: Sequence[int], epochs: int, batch_size: int) -> _Plan:
    """Every client's slices, drawn as the epoch loop draws them, aligned step by step."""
    per_client, last = [], []
    offset = 0
    for n, seed in zip(sizes, seeds):
        gen = torch.Generator()
        gen.manual_seed(int(seed))
        slices = []
        for _ in range(epochs):
            perm = torch.randperm(n, generator=gen).numpy() + offset
            slices += [perm[s : s + batch_size] for s in range(0, n, batch_size)]
        per_epoch = math.ceil(n / batch_size)
        last.append(slice(len(slices) - per_epoch, len(slices)))
        per_client.append(slices)
        offset += n
    steps = max(len(s) for s in per_client)
    index = np.zeros((steps, len(sizes), batch_size), dtype=np.int64)
    mask = np.zeros((steps, len(sizes), batch_size), dtype=np.float32)
    count = np.zeros((steps, len(sizes)), dtype=np.int64)
    for c, slices in enumerate(per_client):
        for s, idx in enumerate(slices):
            index[s, c, : idx.size] = idx
            mask[s, c, : idx.size] = 1.0
            count[s, c] = idx.size
    return _Plan(index, mask, count, last)


class Step(str, Enum):
    """How a batch's steps run: torch's eager kernels, or the step compiled (and on CUDA, replayed as a graph)."""

    #: Each operation launched from Python, step after step.
    EAGER = "eager"
    #: The whole step (forward, gradient, optimiser) compiled by ``torch.compile`` into fused kernels.
    COMPILE = "compile"
    #: As ``COMPILE``, with ``mode="reduce-overhead"``: on CUDA each step replays a CUDA graph (one launch).
    GRAPHS = "graphs"


def check_step(step: Step | str) -> Step:
    """``step`` as a :class:`Step`, or a ``ValueError`` naming the choices."""
    if step not in {s.value for s in Step}:
        raise ValueError(f"step must be one of {', '.join(s.value for s in Step)}, got {step!r}")
    return Step(step)


@dataclass
class _Moments:
    """The optimiser's state: each client's step count and (Adam) first and second moments."""

    steps: Any
    m: dict[str, Any]
    v: dict[str, Any]


def _moments(torch: Any, name: str, params: Mapping[str, Any]) -> _Moments:
    clients = next(iter(params.values())).shape[0]
    device = next(iter(params.values())).device
    zeros = {k: torch.zeros_like(p) for k, p in params.items()} if name == "adam" else {}
    return _Moments(torch.zeros(clients, dtype=torch.float64, device=device), zeros,
                    {k: torch.zeros_like(params[k]) for k in zeros})


def _update(torch: Any, name: str, lr: float, params: dict[str, Any], grads: Mapping[str, Any], state: _Moments,
            active: Any, all_active: bool) -> tuple[dict[str, Any], _Moments]:
    """One optimiser step, Adam (torch's update, each client its own step count) or SGD; idle clients unchanged."""
    steps = state.steps + active.double()
    out, m_out, v_out = {}, {}, {}
    if name == "sgd":
        for k, p in params.items():
            new = p - lr * grads[k]
            out[k] = new if all_active else torch.where(_along(active, p), new, p)
        return out, _Moments(steps, m_out, v_out)
    b1, b2 = _BETAS
    t = steps.clamp(min=1.0)
    step_size = (lr / (1.0 - b1 ** t)).float()
    bc2_sqrt = torch.sqrt(1.0 - b2 ** t).float()
    for k, p in params.items():
        g, m, v = grads[k], state.m[k], state.v[k]
        m_new = m.lerp(g, 1.0 - b1)
        v_new = torch.addcmul(v * b2, g, g, value=1.0 - b2)
        denom = v_new.sqrt() / _along(bc2_sqrt, p) + _EPS
        new = p - _along(step_size, p) * (m_new / denom)
        if all_active:
            out[k], m_out[k], v_out[k] = new, m_new, v_new
        else:
            on = _along(active, p)
            out[k], m_out[k], v_out[k] = torch.where(on, new, p), torch.where(on, m_new, m), torch.where(on, v_new, v)
    return out, _Moments(steps, m_out, v_out)


def _along(per_client: Any, like: Any) -> Any:
    """A per-client vector shaped to broadcast over a stacked tensor ``(clients, ...)``."""
    return per_client.reshape((-1,) + (1,) * (like.dim() - 1))


def _step_function(torch: Any, model: Any, optimizer: str, lr: float, step: Step) -> Callable[..., Any]:
    """One step of every client: ``(params, moments, x, y, mask, count, all_active) -> (params, moments, losses)``.

    Compiled (``step`` not eager), every step takes the masked path
    (``all_active`` is ignored): one graph for all steps, whose idle
    clients' selection leaves active ones' values as they are.
    """
    from torch.func import functional_call, grad_and_value, vmap

    def client_loss(p: dict[str, Any], xb: Any, yb: Any, mb: Any, cb: Any) -> Any:
        out = functional_call(model, p, (xb,))
        per = torch.nn.functional.cross_entropy(out, yb, reduction="none")
        return (per * mb).sum() / cb

    grad_fn = vmap(grad_and_value(client_loss))

    def one(params: dict[str, Any], state: _Moments, xb: Any, yb: Any, mb: Any, count: Any,
            all_active: bool) -> tuple[dict[str, Any], _Moments, Any]:
        grads, loss = grad_fn(params, xb, yb, mb, count.clamp(min=1).float())
        params, state = _update(torch, optimizer, lr, params, grads, state, count > 0, all_active)
        return params, state, loss.detach().double() * count

    if step is Step.EAGER:
        return one
    compiled = torch.compile(functools.partial(one, all_active=False), dynamic=False,
                             mode="reduce-overhead" if step is Step.GRAPHS else "default")
    return lambda params, state, xb, yb, mb, count, all_active: compiled(params, state, xb, yb, mb, count)


def _run(torch: Any, model: Any, params: dict[str, Any], x: Any, y: Any, plan: _Plan, optimizer: str,
         lr: float, device: Any, step: Step = Step.EAGER) -> tuple[dict[str, Any], np.ndarray]:
    """The batch's steps; returns the trained parameters and each step's summed loss per client (steps x clients)."""
    one = _step_function(torch, model, optimizer, float(lr), step)
    state = _moments(torch, optimizer, params)
    index = torch.from_numpy(plan.index).to(device)
    mask = torch.from_numpy(plan.mask).to(device)
    count = torch.from_numpy(plan.count).to(device)
    losses = torch.zeros(plan.count.shape, dtype=torch.float64, device=device)
    graphs = step is Step.GRAPHS and torch.device(device).type == "cuda"
    for s in range(plan.count.shape[0]):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are this one's inputs
        idx = index[s]
        params, state, losses[s] = one(params, state, x[idx], y[idx], mask[s], count[s], bool(plan.count[s].all()))
    return params, losses.cpu().numpy()


def train_local_batched(
    architecture: str,
    jobs: Sequence[ClientJob],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    optimizer: str = "adam",
    device: str = "cpu",
    threads: Optional[int] = None,
    resident: Optional[ResidentData] = None,
    step: Step | str = Step.EAGER,
) -> list[TrainResult]:
    """Train several clients' copies of one architecture together; one result per job, in order.

    Each result is what ``train_local(architecture, job.weights, job.x,
    job.y, epochs=, lr=, batch_size=, optimizer=, seed=job.seed)`` returns,
    within float tolerance (the module docstring says how); ``seconds`` is
    the batch's time shared equally among its clients. With ``resident`` (on
    ``device``), the jobs that name a ``key`` take their data from it.
    ``step``: how the steps run (:class:`Step`); compiled, the models are
    those of the eager steps within float tolerance, not bit for bit, and
    the first call of a shape compiles (seconds).

    Raises
    ------
    ValueError
        On bad settings, weights or data (the messages of ``train_local``),
        no job, or an architecture that is not :func:`batchable`.
    RuntimeError
        If a client's training diverges (its weights become NaN or Inf), as
        ``train_local`` would for that client.
    """
    n_epochs, bs = _check_settings(epochs, batch_size, lr, None, threads, optimizer)
    step = check_step(step)
    if not jobs:
        raise ValueError("train_local_batched needs at least one job")
    torch = import_torch()
    model, info = build_classifier(architecture)
    if not batchable(model):
        raise ValueError(f"architecture {architecture!r} has buffers or dropout: "
                         "its clients train one at a time (train_local)")
    dev = torch.device(device)
    weights = [check_weights(info, j.weights) for j in jobs]
    if resident is not None and resident.device != dev:
        raise ValueError(f"resident data on {resident.device}, training on {dev}")
    data = [resident.get(j.key, info, j.x, j.y) if resident is not None and j.key is not None
            else tuple(torch.from_numpy(a) for a in check_data(info, j.x, j.y)) for j in jobs]
    seeds = [int(j.seed) if j.seed is not None else int(torch.seed() % (1 << 63)) for j in jobs]
    sizes = [int(xa.shape[0]) for xa, _ in data]
    t0 = time.perf_counter()
    with using_threads(torch, threads):
        plan = _plan(torch, sizes, seeds, n_epochs, bs)
        x = torch.cat([xa.to(dev) for xa, _ in data])
        y = torch.cat([ya.to(dev) for _, ya in data])
        params = {k: torch.from_numpy(np.stack([w[k] for w in weights])).to(dev)
                  for k, _ in model.named_parameters()}
        model.to(dev).train()
        params, losses = _run(torch, model, params, x, y, plan, optimizer, lr, dev, step)
        stacked = {k: v.detach().cpu().numpy() for k, v in params.items()}
    seconds = (time.perf_counter() - t0) / len(jobs)
    out = []
    for c, n in enumerate(sizes):
        state = {k: np.array(stacked[k][c], dtype=np.float32) for k in stacked}
        last = float(losses[plan.last_epoch[c], c].sum()) / n
        out.append(_finished(architecture, state, n, n_epochs, last, lr, seconds, "samples, loss"))
    return out


@functools.cache
def architecture_batchable(architecture: str) -> bool:
    """Whether an architecture's clients can train in a batch (:func:`batchable` of a fresh model)."""
    model, _ = build_classifier(architecture)
    return batchable(model)
