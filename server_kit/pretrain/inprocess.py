"""The in-process driver of federated AE pre-training: every client trained here, through real envelopes.

Each round, :class:`~server_kit.pretrain.rounds.AEPretraining` (the state
both drivers share) is opened with the sampled clients; the global weights
go out as one ``MODEL`` envelope, each client decodes it, trains with
:func:`edge_sdk.training.trainer.train_autoencoder_local` and answers with an
``UPDATE`` envelope, which the server side decodes, checks and hands to the
state; closing the round averages the answers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from edge_sdk.protocol import SERVER_ID, decode_message, parse_tensors
from edge_sdk.training.torch_support import resolve_device
from edge_sdk.training.trainer import initial_weights, train_autoencoder_local
from edge_sdk.validation import check_positive_int

from ..report import progress_bar
from .rounds import AEPretraining
from .wire import FEDERATION, client_ids, model_message, update_message

__all__ = ["PretrainResult", "federated_ae_pretrain"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainResult:
    """What :func:`federated_ae_pretrain` returns.

    Attributes
    ----------
    weights : dict of str to numpy.ndarray
        The final global autoencoder ``state_dict`` (float32).
    bytes_down : int
        Sum of the ``MODEL`` envelope lengths received by the sampled
        clients, over all rounds.
    bytes_up : int
        Sum of their ``UPDATE`` envelope lengths.
    seconds : float
        Wall-clock time of the whole pre-training.
    history : list of dict
        One entry per round: ``round``, ``clients`` (ids), ``loss`` (mean
        last-epoch training MSE per element, weighted by sample count),
        ``bytes_down``, ``bytes_up``, ``seconds``.
    """

    weights: dict[str, np.ndarray]
    bytes_down: int
    bytes_up: int
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def bytes_total(self) -> int:
        """``bytes_down + bytes_up``."""
        return int(self.bytes_down + self.bytes_up)


def _local_seed(seed: int, rnd: int, client: int) -> int:
    """A 63-bit training seed for one client in one round, derived from the run's seed."""
    state = np.random.SeedSequence([int(seed), int(rnd), int(client)]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


@dataclass(frozen=True)
class _Settings:
    """The checked settings of one pre-training run."""

    architecture: str
    rounds: int
    per_round: int
    epochs: int
    lr: float
    batch_size: int
    seed: int
    threads: Optional[int]
    device: str = "cpu"


def _checked(
    client_images: Sequence[np.ndarray], *, architecture: str, rounds: int, clients_per_round: int,
    epochs: int, lr: float, batch_size: int, seed: int, threads: Optional[int], device: str = "cpu",
) -> tuple[list[np.ndarray], _Settings]:
    """The clients' images and the run's settings, checked; the first fault found is raised."""
    images = list(client_images)
    if not images:
        raise ValueError("client_images is empty: federated pre-training needs clients")
    for i, x in enumerate(images):
        if not hasattr(x, "shape") or len(x.shape) < 2 or x.shape[0] < 1:
            raise ValueError(
                f"client_images[{i}] must be an array of at least one image, "
                f"got {getattr(x, 'shape', type(x).__name__)}"
            )
    n_rounds = check_positive_int(rounds, "rounds")
    per_round = check_positive_int(clients_per_round, "clients_per_round")
    n_epochs = check_positive_int(epochs, "epochs")
    bs = check_positive_int(batch_size, "batch_size")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if per_round > len(images):
        raise ValueError(
            f"clients_per_round ({per_round}) exceeds the number of clients ({len(images)})"
        )
    if (
        isinstance(lr, bool)
        or not isinstance(lr, (int, float, np.integer, np.floating))
        or not (math.isfinite(lr) and lr > 0)
    ):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    return images, _Settings(architecture, n_rounds, per_round, n_epochs, float(lr), bs, int(seed), threads,
                             resolve_device(device))


def federated_ae_pretrain(
    client_images: Sequence[np.ndarray], *, architecture: str = "fc_ae_784_50_20", rounds: int = 10,
    clients_per_round: int = 50, epochs: int = 3, lr: float = 1e-3, batch_size: int = 32, seed: int = 0,
    progress: bool = False, threads: Optional[int] = 1, initial: Optional[Mapping[str, np.ndarray]] = None,
    device: str = "cpu",
) -> PretrainResult:
    """Pre-train an autoencoder by FedAvg over the clients' images.

    Every round samples ``clients_per_round`` distinct clients uniformly
    (seeded), sends each the global weights, trains them locally for
    ``epochs`` epochs (MSE, Adam, a fresh optimiser per client and round)
    and replaces the global weights by the sample-weighted average of the
    returned ones. Weights travel as real envelopes, see :mod:`server_kit.pretrain`.

    Parameters
    ----------
    client_images : sequence of numpy.ndarray
        One array of images per client, floating point in [0, 1], shaped as
        :func:`edge_sdk.training.trainer.train_autoencoder_local` accepts them
        (``(n, 28, 28)`` or ``(n, 784)`` for ``fc_ae_784_50_20``).
    architecture : str
        Autoencoder key of :data:`edge_sdk.training.nets.ARCHITECTURES`.
    rounds : int
        Federated rounds.
    clients_per_round : int
        Clients sampled per round, at most the number of clients.
    epochs : int
        Local epochs per round.
    lr : float
        Adam learning rate of the local training.
    batch_size : int
        Local mini-batch size.
    seed : int
        Seeds the initial weights (:func:`edge_sdk.training.trainer.initial_weights`),
        the client sampling and every local shuffle: a run is reproducible
        on one machine with one thread count.
    progress : bool
        Show a tqdm bar over the local trainings.
    threads : int, optional
        Torch intra-op threads of the local training. Default 1: the small
        matrix products of these autoencoders run faster on one thread (on 2
        shared cores, 10 local trainings of the 784-50-20 autoencoder took
        0.5 s on 1 thread and about 10 s on 2). None leaves torch's setting.
    initial : mapping, optional
        Starting weights instead of the seeded initialisation (for example
        the centrally pre-trained autoencoder, to fine-tune it).
    device : {"cpu", "cuda", "auto"}
        Where the clients train and the server averages (``auto``: CUDA when
        torch sees it).

    Returns
    -------
    PretrainResult
        Final weights, bytes down and up, seconds and per-round history.

    Raises
    ------
    ValueError
        On no clients, a client without images, bad hyper-parameters, more
        clients per round than clients, or images the architecture cannot
        take (raised by the local training of the first client holding them).
    """
    images, settings = _checked(
        client_images, architecture=architecture, rounds=rounds, clients_per_round=clients_per_round,
        epochs=epochs, lr=lr, batch_size=batch_size, seed=seed, threads=threads, device=device)
    t_start = time.perf_counter()
    start = (
        initial_weights(architecture, settings.seed)
        if initial is None
        else {k: np.array(v, copy=True) for k, v in initial.items()}
    )
    driver = _InProcessRounds(images, settings, AEPretraining(start, device=settings.device))
    history = driver.run(progress)
    return PretrainResult(
        weights=driver.state.weights,
        bytes_down=sum(h["bytes_down"] for h in history),
        bytes_up=sum(h["bytes_up"] for h in history),
        seconds=time.perf_counter() - t_start,
        history=history,
    )


class _InProcessRounds:
    """The in-process transport: envelopes encoded and decoded, clients trained by direct calls."""

    def __init__(self, images: list[np.ndarray], settings: _Settings, state: AEPretraining) -> None:
        self.images, self.settings, self.state = images, settings, state
        self.ids = client_ids(len(images))
        self.rng = np.random.default_rng(settings.seed)
        self.bar: Any = None

    def run(self, progress: bool) -> list[dict[str, Any]]:
        """Every round, in order; their history entries."""
        s = self.settings
        self.bar = progress_bar(s.rounds * s.per_round, "federated AE pre-training", bool(progress))
        try:
            return [self.run_round(rnd) for rnd in range(1, s.rounds + 1)]
        finally:
            if self.bar is not None:
                self.bar.close()

    def run_round(self, rnd: int) -> dict[str, Any]:
        """Sample the round's clients, send, train, receive, average; the round's history entry."""
        t0 = time.perf_counter()
        chosen = np.sort(self.rng.choice(len(self.images), size=self.settings.per_round, replace=False))
        self.state.begin_round(rnd, [self.ids[i] for i in chosen.tolist()])
        payload = model_message(self.state.weights, rnd)
        round_down = round_up = 0
        for i in chosen.tolist():
            round_up += self.client_turn(payload, rnd, i)
            round_down += len(payload)
        done = self.state.close_round()
        entry = {
            "round": rnd,
            "clients": done.clients,
            "loss": done.loss,
            "bytes_down": round_down,
            "bytes_up": round_up,
            "seconds": time.perf_counter() - t0,
        }
        log.info(
            "pre-training round %d/%d: %d clients, train MSE %.5f, %.1f s",
            rnd,
            self.settings.rounds,
            self.settings.per_round,
            entry["loss"],
            entry["seconds"],
        )
        return entry

    def client_turn(self, payload: bytes, rnd: int, i: int) -> int:
        """Client ``i`` trains from ``payload`` and answers; the server keeps the answer. Its length."""
        cid, s = self.ids[i], self.settings
        # client side: what arrived is decoded and checked like on a device
        received = decode_message(payload, expected_sender=SERVER_ID)
        weights = parse_tensors(received.body, spec=self.state.spec)
        res = train_autoencoder_local(
            s.architecture,
            weights,
            self.images[i],
            epochs=s.epochs,
            lr=s.lr,
            batch_size=s.batch_size,
            seed=_local_seed(s.seed, rnd, i),
            threads=s.threads,
            device=s.device,
        )
        up = update_message(res.weights, cid, rnd, res.n_samples)
        # server side: decode, check against the model's spec, keep for the round's average
        msg = decode_message(up, expected_sender=cid, expected_federation=FEDERATION)
        self.state.receive(cid, parse_tensors(msg.body, spec=self.state.spec), int(msg.meta["n_samples"]),
                           res.loss)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(round=rnd, mse=f"{res.loss:.4f}")
        return len(up)
