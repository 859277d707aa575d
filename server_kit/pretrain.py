"""Federated pre-training of the sketch autoencoder, and export of its encoder.

The paper (Prigent et al., Section V) pre-trains the autoencoder whose
encoder makes the sketches either centrally on public data (the shipped
``fmnist_fc_encoder``) or *federated*, by FedAvg over the clients' own
images before any sketch is made. The MNIST setting: 50 clients sampled per
round, 10 rounds, 3 local epochs, Adam lr 1e-3, batch 32.

:func:`federated_ae_pretrain` runs that loop in one process, through the
real wire format: every round the server encodes the global weights as one
``MODEL`` envelope (:func:`model_message`); each sampled client decodes it,
trains with :func:`edge_sdk.trainer.train_autoencoder_local` and answers
with an ``UPDATE`` envelope (:func:`update_message`), which the server
decodes, checks against the model's tensor spec and adds to a
:class:`~server_kit.aggregate.StreamingFedAvg` weighted by the sample count.

Bytes are the lengths of those envelopes as :func:`edge_sdk.protocol.encode_message`
writes them, counted once per sampled client per round in each direction:
``bytes_down`` is what the sampled clients receive, ``bytes_up`` what they
send. (Over MQTT the server publishes a round's model once and the broker
fans it out; the count here is the client-side traffic, which is also the
broker's egress.) MQTT framing and TCP/IP headers are not included. With
equal-sized envelopes the total is exactly
``rounds * clients_per_round * (model message + update message)``; the fully
connected 784-50-20 autoencoder's state is 81,304 float32 values, so about
325 KB each way per client and round.

:func:`export_encoder` writes the encoder half of the trained weights as an
ONNX file with its ``manifest.json`` entry (through
:func:`server_kit.export.export_family` and :func:`server_kit.export.update_manifest`,
which also verify the file against torch), so that
``edge_sdk.OnnxEncoder(name, models_dir=out_dir)`` loads it with its hash
checked. The file's size is what the server sends to every client that
sketches with it.

torch is imported only inside the functions that need it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from edge_sdk._validation import check_positive_int
from edge_sdk.protocol import (
    SERVER_ID,
    Kind,
    Message,
    decode_message,
    encode_message,
    parse_tensors,
    tensors_body,
)
from edge_sdk.trainer import initial_weights, state_spec, train_autoencoder_local

from .report import progress_bar

__all__ = [
    "FEDERATION",
    "MODEL_KEY",
    "SERVER_ID",
    "ExportedEncoder",
    "PretrainResult",
    "client_ids",
    "export_encoder",
    "federated_ae_pretrain",
    "model_message",
    "update_message",
]

log = logging.getLogger(__name__)

#: Federation id written in the pre-training envelopes.
FEDERATION = "pretrain"
#: Model key of the autoencoder in the envelopes' meta.
MODEL_KEY = "ae"


# --------------------------------------------------------------------------- wire


def client_ids(n_clients: int) -> list[str]:
    """Ids of ``n_clients`` clients: ``c00``, ``c01``, ... zero-padded to one width.

    One width for all keeps every client's update envelope the same length.
    """
    width = max(2, len(str(max(int(n_clients) - 1, 0))))
    return [f"c{i:0{width}d}" for i in range(int(n_clients))]


def model_message(
    weights: Mapping[str, np.ndarray], round: int, *, federation: str = FEDERATION
) -> bytes:
    """The ``MODEL`` envelope the server sends a sampled client in round ``round``.

    Parameters
    ----------
    weights : mapping of str to numpy.ndarray
        The global autoencoder ``state_dict``.
    round : int
        Round number (the envelope's round field).
    federation : str
        Federation id.

    Returns
    -------
    bytes
        The whole payload, as :func:`edge_sdk.protocol.encode_message` writes it.
    """
    return encode_message(
        Message(
            Kind.MODEL,
            federation,
            SERVER_ID,
            round=int(round),
            meta={"key": MODEL_KEY},
            body=tensors_body(weights),
        )
    )


def update_message(
    weights: Mapping[str, np.ndarray],
    cid: str,
    round: int,
    n_samples: int,
    *,
    federation: str = FEDERATION,
) -> bytes:
    """The ``UPDATE`` envelope client ``cid`` sends back after local training.

    The meta holds the model key and the sample count (the FedAvg weight);
    nothing that varies in length from round to round.
    """
    return encode_message(
        Message(
            Kind.UPDATE,
            federation,
            cid,
            round=int(round),
            meta={"model_key": MODEL_KEY, "n_samples": int(n_samples)},
            body=tensors_body(weights),
        )
    )


# --------------------------------------------------------------------------- pre-training


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


def federated_ae_pretrain(
    client_images: Sequence[np.ndarray],
    *,
    architecture: str = "fc_ae_784_50_20",
    rounds: int = 10,
    clients_per_round: int = 50,
    epochs: int = 3,
    lr: float = 1e-3,
    batch_size: int = 32,
    seed: int = 0,
    progress: bool = False,
    threads: Optional[int] = 1,
    initial: Optional[Mapping[str, np.ndarray]] = None,
) -> PretrainResult:
    """Pre-train an autoencoder by FedAvg over the clients' images.

    Every round samples ``clients_per_round`` distinct clients uniformly
    (seeded), sends each the global weights, trains them locally for
    ``epochs`` epochs (MSE, Adam, a fresh optimiser per client and round)
    and replaces the global weights by the sample-weighted average of the
    returned ones. Weights travel as real envelopes, see the module notes.

    Parameters
    ----------
    client_images : sequence of numpy.ndarray
        One array of images per client, floating point in [0, 1], shaped as
        :func:`edge_sdk.trainer.train_autoencoder_local` accepts them
        (``(n, 28, 28)`` or ``(n, 784)`` for ``fc_ae_784_50_20``).
    architecture : str
        Autoencoder key of :data:`edge_sdk.nets.ARCHITECTURES`.
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
        Seeds the initial weights (:func:`edge_sdk.trainer.initial_weights`),
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
    from server_kit.aggregate import StreamingFedAvg

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

    t_start = time.perf_counter()
    glob = (
        initial_weights(architecture, int(seed))
        if initial is None
        else {k: np.array(v, copy=True) for k, v in initial.items()}
    )
    spec = state_spec(glob)
    ids = client_ids(len(images))
    rng = np.random.default_rng(int(seed))
    bytes_down = bytes_up = 0
    history: list[dict[str, Any]] = []
    bar = progress_bar(n_rounds * per_round, "federated AE pre-training", bool(progress))
    try:
        for rnd in range(1, n_rounds + 1):
            t0 = time.perf_counter()
            chosen = np.sort(rng.choice(len(images), size=per_round, replace=False))
            payload = model_message(glob, rnd)
            acc = StreamingFedAvg(glob, device="cpu")
            round_down = round_up = 0
            loss_sum = 0.0
            for i in chosen.tolist():
                cid = ids[i]
                # client side: what arrived is decoded and checked like on a device
                received = decode_message(payload, expected_sender=SERVER_ID)
                weights = parse_tensors(received.body, spec=spec)
                round_down += len(payload)
                res = train_autoencoder_local(
                    architecture,
                    weights,
                    images[i],
                    epochs=n_epochs,
                    lr=float(lr),
                    batch_size=bs,
                    seed=_local_seed(int(seed), rnd, i),
                    threads=threads,
                )
                up = update_message(res.weights, cid, rnd, res.n_samples)
                round_up += len(up)
                # server side: decode, check against the model's spec, accumulate
                msg = decode_message(up, expected_sender=cid, expected_federation=FEDERATION)
                acc.add(parse_tensors(msg.body, spec=spec), int(msg.meta["n_samples"]))
                loss_sum += res.loss * res.n_samples
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(round=rnd, mse=f"{res.loss:.4f}")
            glob = acc.result()
            bytes_down += round_down
            bytes_up += round_up
            entry = {
                "round": rnd,
                "clients": [ids[i] for i in chosen.tolist()],
                "loss": loss_sum / acc.total_samples,
                "bytes_down": round_down,
                "bytes_up": round_up,
                "seconds": time.perf_counter() - t0,
            }
            history.append(entry)
            log.info(
                "pre-training round %d/%d: %d clients, train MSE %.5f, %.1f s",
                rnd,
                n_rounds,
                per_round,
                entry["loss"],
                entry["seconds"],
            )
    finally:
        if bar is not None:
            bar.close()
    return PretrainResult(
        weights=glob,
        bytes_down=int(bytes_down),
        bytes_up=int(bytes_up),
        seconds=time.perf_counter() - t_start,
        history=history,
    )


# --------------------------------------------------------------------------- export


@dataclass(frozen=True)
class ExportedEncoder:
    """The ONNX encoder :func:`export_encoder` wrote; usable as a path (``os.fspath``).

    Attributes
    ----------
    name : str
        Its artifact name in the manifest.
    path : pathlib.Path
        The ``.onnx`` file.
    nbytes : int
        Size of the file: what the server sends each client that sketches.
    sha256 : str
        The hash recorded in the manifest.
    models_dir : pathlib.Path
        The folder holding the file and ``manifest.json``.
    entry : dict
        The manifest entry written.
    """

    name: str
    path: Path
    nbytes: int
    sha256: str
    models_dir: Path
    entry: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __fspath__(self) -> str:
        return os.fspath(self.path)


def export_encoder(
    weights: Mapping[str, np.ndarray],
    architecture: str,
    out_dir: str | os.PathLike[str],
    name: str = "fed_ae_encoder",
    *,
    metadata: Optional[Mapping[str, Any]] = None,
) -> ExportedEncoder:
    """Export the encoder of autoencoder ``weights`` to ONNX, with a manifest entry.

    Writes ``<name>.onnx`` (the encoder alone, dynamic batch axis, output
    ``z``), the whole autoencoder's weights as safetensors (``<stem>.safetensors``,
    ``<stem>`` being ``name`` without a trailing ``_encoder``, else
    ``<name>_weights``) and adds or replaces the ``name`` entry of
    ``out_dir/manifest.json`` (other entries are kept). The ONNX file is
    checked against the torch encoder by :func:`server_kit.export.verify_onnx`
    (absolute difference below 1e-5) before the manifest is written.

    Parameters
    ----------
    weights : mapping of str to numpy.ndarray
        A ``state_dict`` of ``architecture`` (for example
        :attr:`PretrainResult.weights`).
    architecture : str
        Autoencoder key of :data:`server_kit.nets.ARCHITECTURES`.
    out_dir : str or os.PathLike
        Destination folder (created if needed).
    name : str
        Artifact name (and file stem) of the encoder.
    metadata : mapping, optional
        Extra JSON-serialisable fields for the manifest entry (for example
        the pre-training settings and bytes).

    Returns
    -------
    ExportedEncoder
        Path, size in bytes, sha256 and folder of the encoder; it is
        path-like, so ``OnnxEncoder(result)`` and
        ``OnnxEncoder(name, models_dir=out_dir)`` both load it.

    Raises
    ------
    ValueError
        On an unknown or non-autoencoder architecture, weights that do not
        fit it, or a name that is not a plain file stem.
    """
    import torch

    from server_kit.export import export_family, update_manifest
    from server_kit.nets import ARCHITECTURES, EncoderOnly, build_model, count_params

    if not isinstance(name, str) or not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"name must be a plain file stem, got {name!r}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    model = build_model(architecture)
    if not callable(getattr(model, "encode", None)) or not hasattr(model, "encoder"):
        raise ValueError(f"architecture {architecture!r} is not an autoencoder")
    try:
        state = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in weights.items()}
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"weights do not fit architecture {architecture!r}: {e}") from None
    model.eval()

    latent = int(model.latent_dim)
    if hasattr(model, "in_features"):
        sample_shape = [int(model.in_features)]
        side = math.isqrt(sample_shape[0])
        image_shape = [side, side] if side * side == sample_shape[0] else None
        channels = 1
    else:  # the convolutional autoencoder
        sample_shape = [int(model.channels[0]), 32, 32]
        image_shape = [32, 32]
        channels = int(model.channels[0])
    fields: dict[str, Any] = {"latent_dim": latent, "output_shape": [latent]}
    if hasattr(model, "latent_shape"):
        fields["latent_shape"] = list(model.latent_shape)
    common: dict[str, Any] = {
        "channels": channels,
        "trained": True,
        "training_data": "federated pre-training on the clients' own images (server_kit.pretrain)",
        "recipe": "server_kit.pretrain.export_encoder(federated_ae_pretrain(...).weights, ...)",
    }
    if image_shape is not None:
        common["image_shape"] = image_shape
    if channels > 1:
        common["layout"] = "NCHW"
    if metadata:
        common.update(dict(metadata))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = name[: -len("_encoder")] if name.endswith("_encoder") and name != "_encoder" else ""
    entries = export_family(
        model,
        out=out,
        architecture=architecture,
        weights_name=stem or f"{name}_weights",
        exports=[
            {
                "name": name,
                "module": EncoderOnly(model),
                "params": count_params(model.encoder),
                "role": "encoder",
                "output_name": "z",
                "sample_shape": sample_shape,
                "fields": fields,
            }
        ],
        common=common,
    )
    update_manifest(out, entries)
    entry = entries[name]
    path = out / entry["file"]
    return ExportedEncoder(
        name=name,
        path=path,
        nbytes=int(path.stat().st_size),
        sha256=str(entry["sha256"]),
        models_dir=out,
        entry=dict(entry),
    )
