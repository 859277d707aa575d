"""Federated pre-training of the sketch autoencoder, and export of its encoder.

The paper (Prigent et al., Section V) pre-trains the autoencoder whose
encoder makes the sketches either centrally on public data (the shipped
``fmnist_fc_encoder``) or *federated*, by FedAvg over the clients' own
images before any sketch is made. The MNIST setting: 50 clients sampled per
round, 10 rounds, 3 local epochs, Adam lr 1e-3, batch 32.

:func:`federated_ae_pretrain` runs that loop in one process, through the
real wire format: every round the server encodes the global weights as one
``MODEL`` envelope (:func:`model_message`); each sampled client decodes it,
trains with :func:`edge_sdk.training.trainer.train_autoencoder_local` and answers
with an ``UPDATE`` envelope (:func:`update_message`), which the server
decodes, checks against the model's tensor spec and hands to
:class:`AEPretraining`, which averages a round's answers with a
:class:`~server_kit.aggregate.StreamingFedAvg` weighted by the sample count.
:class:`AEPretraining` is the one implementation of the rounds' server side:
the MQTT orchestrator uses it too, and only carries the messages.

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

The package, one job per module: :mod:`.rounds` (the rounds' state, shared
by both drivers), :mod:`.inprocess` (the in-process driver), :mod:`.wire`
(the envelopes), :mod:`.encoder` (the export of the encoder) and :mod:`.settings`
(the pre-training settings a strategy carries and their defaults).

torch is imported only inside the functions that need it.
"""


from __future__ import annotations

from .encoder import ExportedEncoder, export_encoder
from .inprocess import PretrainResult, federated_ae_pretrain
from .rounds import AEPretraining, AERound, sample_fraction
from .settings import PRETRAIN_DEFAULTS, pretrain_config
from .wire import FEDERATION, MODEL_KEY, SERVER_ID, client_ids, model_message, update_message

__all__ = [
    "FEDERATION",
    "MODEL_KEY",
    "PRETRAIN_DEFAULTS",
    "SERVER_ID",
    "AEPretraining",
    "AERound",
    "ExportedEncoder",
    "PretrainResult",
    "client_ids",
    "export_encoder",
    "federated_ae_pretrain",
    "model_message",
    "pretrain_config",
    "sample_fraction",
    "update_message",
]
