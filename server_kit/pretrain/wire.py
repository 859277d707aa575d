"""The pre-training envelopes: client ids, the server's ``MODEL`` and a client's ``UPDATE`` message."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edge_sdk.protocol import SERVER_ID, Kind, Message, encode_message, tensors_body

__all__ = ["FEDERATION", "MODEL_KEY", "SERVER_ID", "client_ids", "model_message", "update_message"]

#: Federation id written in the pre-training envelopes.
FEDERATION = "pretrain"
#: Model key of the autoencoder in the envelopes' meta.
MODEL_KEY = "ae"


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
