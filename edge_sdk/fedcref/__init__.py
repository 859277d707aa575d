"""FedCRef on the device: local clusters, one small autoencoder per cluster, refinement.

FedCRef (Nardi, Valerio and Passarella, "Federated Clustering: An
Unsupervised Cluster-Wise Training for Decentralized Data Distributions")
clusters unlabelled data spread over many devices, each holding a few of many
unknown categories, without sharing data and without knowing how many
categories exist. This package is the device's side; the server's side (the
association graph, communities, FedAvg per community, the stopping rule and
the in-process driver) is :mod:`server_kit.fedcref`.

What a device does (Algorithm 1 and 2 of the paper):

1. Local initial clustering: K-means or Ward's hierarchical clustering
   (:func:`partition_points`) on the latent codes of an
   :class:`~edge_sdk.encoder.OnnxEncoder` (raw pixels without one), the
   number of clusters ``K_i`` given or chosen by silhouette
   (:func:`estimate_n_clusters`); or the paper's simulated "dirty"
   initialisation (:func:`dirty_labels`) for experiments.
2. One small autoencoder per local cluster (:data:`ARCHITECTURES`: the paper's
   784-100-64-32 with its mirror for 28x28 images, 64-48-32-16 for 8x8
   digits; ReLU, sigmoid output, Adam, MSE), trained on the device.
3. Its side of the bidirectional association test: for each own cluster
   ``Q_iq`` and each received model ``M_jp``, the ``alpha``-th percentile of
   the normalised per-sample differences ``|E_iq->iq - E_jp->iq|``
   (:func:`association_statistic`: relative to the errors by default, or
   min-max scaled); the server keeps the pairs where both sides are at most
   ``theta``.
4. FedAvg rounds for the communities its clusters belong to (local epochs on
   the member clusters' samples), then the community check: each of its
   clusters in a community tests the other community models against its
   community's model with the same statistic
   (:func:`~edge_sdk.fedcref.association.community_check_matrix`); the server
   merges what passes both ways.
5. Refinement by lowest reconstruction error over its own and the
   community models (:func:`refine_labels`, Algorithm 2; an own cluster's
   model and its communities' models count as one candidate, see
   :meth:`FedCRefClient.refine`), and its stability, the Hungarian-matched
   agreement of its labels before and after (:func:`hungarian_accuracy`).

Every exchanged object is a pair ``(meta, tensors)``: a JSON-able dict and a
dict of numpy arrays, ready for :func:`edge_sdk.protocol.tensors_body` and
:func:`edge_sdk.protocol.encode_message`, so that the MQTT wiring is a thin
layer over :class:`FedCRefClient`.

A device without torch can still label new data with the exported community
models: :class:`OnnxCommunityLabeler` runs them with ONNX Runtime alone and
picks, per sample, the model with the lowest reconstruction error.

Where each job lives:

* :mod:`~edge_sdk.fedcref.checks`: validation of the inputs and settings;
* :mod:`~edge_sdk.fedcref.clustering`: the initial clustering, refinement
  (Algorithm 2) and the Hungarian-matched accuracy;
* :mod:`~edge_sdk.fedcref.models`: the cluster autoencoders (torch);
* :mod:`~edge_sdk.fedcref.association`: the association test and the
  community check's statistics;
* :mod:`~edge_sdk.fedcref.errors`: :class:`~edge_sdk.fedcref.errors.ErrorTable`,
  each model's errors on the device's samples;
* :mod:`~edge_sdk.fedcref.client`: :class:`FedCRefClient`, the device's state,
  initial clustering, cluster models and association test;
* :mod:`~edge_sdk.fedcref.community`: what the device does with community
  models (FedAvg rounds, the community check, refinement), inherited by
  :class:`FedCRefClient`;
* :mod:`~edge_sdk.fedcref.labeler`: :class:`OnnxCommunityLabeler`;
* :mod:`~edge_sdk.fedcref.mqtt`: :class:`~edge_sdk.fedcref.mqtt.FedCRefEdge`, the
  device's loop behind a broker (imported on its own).

torch, scikit-learn and scipy are imported inside the functions that need
them: importing this package stays light.
"""

from .association import (
    NORMALIZATIONS,
    association_statistic,
    check_normalization,
    minmax_normalize,
    node_key,
    normalized_differences,
)
from .checks import check_alpha, check_tau, check_theta
from .client import FedCRefClient
from .clustering import (
    DEFAULT_ENCODERS,
    INIT_METHODS,
    POINT_METHODS,
    dirty_labels,
    estimate_n_clusters,
    hungarian_accuracy,
    partition_points,
    refine_labels,
)
from .labeler import OnnxCommunityLabeler
from .models import (
    ARCHITECTURES,
    architecture_for,
    build_cluster_ae,
    initial_ae_weights,
    join_models,
    reconstruction_errors,
    split_models,
    train_cluster_ae,
)

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_ENCODERS",
    "FedCRefClient",
    "INIT_METHODS",
    "POINT_METHODS",
    "NORMALIZATIONS",
    "OnnxCommunityLabeler",
    "architecture_for",
    "association_statistic",
    "build_cluster_ae",
    "check_alpha",
    "check_normalization",
    "check_tau",
    "check_theta",
    "dirty_labels",
    "estimate_n_clusters",
    "hungarian_accuracy",
    "initial_ae_weights",
    "join_models",
    "minmax_normalize",
    "node_key",
    "normalized_differences",
    "partition_points",
    "reconstruction_errors",
    "refine_labels",
    "split_models",
    "train_cluster_ae",
]
