"""FedCRef on the server: association graph, communities, FedAvg per community, stopping.

FedCRef (Nardi, Valerio and Passarella) clusters unlabelled data spread over
devices that each hold a few of many unknown categories. The device's side is
:mod:`edge_sdk.fedcref` (:class:`~edge_sdk.fedcref.FedCRefClient`); this
package holds the coordinator and its drivers:

* :class:`FedCRefServer` relays the clients' cluster autoencoders (all-to-all
  exchange through the broker: each device may read only what the server
  republishes, so the ACL holds), collects each client's side of the
  association test, builds the association graph (an edge where both sides
  are at most ``theta``), takes its connected components of at least two
  clusters as communities, trains one autoencoder per community by FedAvg
  (:func:`server_kit.aggregate.fedavg`) for ``community_rounds`` rounds,
  runs the community check (the member clients test the other community
  models against their own community's; two communities whose models pass
  it both ways, by a majority of each one's member clusters, merge), sends the community models to the active
  clients for refinement, removes
  the clients whose clustering is stable (agreement at least ``tau``) from
  the active set, and stops when no client is active, when the numbers of
  communities and isolated clusters stay within 10% over 3 iterations, or
  after ``max_iterations``.
* :func:`run_fedcref` runs a whole federation in one process, every object
  passing through the real wire encoding (:func:`edge_sdk.protocol.encode_message`
  with :func:`~edge_sdk.protocol.tensors_body`, decoded back with
  :func:`~edge_sdk.protocol.decode_message` and
  :func:`~edge_sdk.protocol.parse_tensors`), so the bytes are counted
  exactly, chunk envelopes included.
* :func:`export_communities` writes the community autoencoders to ONNX
  (they output reconstructions); a device labels new data with them through
  :class:`edge_sdk.fedcref.OnnxCommunityLabeler`, ONNX Runtime alone.

Wiring (what the MQTT layer has to carry; every object is ``(meta, tensors)``,
``meta["type"]`` names it; topics as in :class:`edge_sdk.protocol.Topics`):

==================  ========  ==============================  ===========================
object ``type``     kind      from -> to                      topic
==================  ========  ==============================  ===========================
hello               HELLO     client -> server                ``clients/<id>/hello``
iterate             CMD       server -> each client           ``clients/<id>/cmd``
cluster_models      UPDATE    client -> server                ``clients/<id>/update``
cluster_models      MODEL     server -> every other client    ``clients/<id>/cmd`` (relay)
association         FEATURES  client -> server                ``clients/<id>/sketch``
community_model     MODEL     server -> member clients        ``clients/<id>/cmd``
community_update    UPDATE    member client -> server         ``clients/<id>/update``
community_check     MODEL     server -> member clients        ``clients/<id>/cmd``
community_check     FEATURES  member client -> server         ``clients/<id>/sketch``
community_models    MODEL     server -> each active client    ``clients/<id>/cmd``
refined             METRICS   client -> server                ``clients/<id>/metrics``
==================  ========  ==============================  ===========================

Clients only write under their own ``clients/<id>/`` and read their commands
and the cluster models, as the deployed ACL allows: all-to-all exchange goes
through the server. Bytes count one delivery per recipient.

Deviations from the paper: the community check is ours (``merge_communities=False``
turns it off). The cluster-level test compares a cluster's own model, fitted to
those very samples, with a model that never saw them, and on MNIST it links only
55 to 72 % of the pairs of one digit: a digit held by many devices could stay split
in two communities with nothing to join them. Community models were all trained
by FedAvg for the same rounds, so the same statistic between two of them measures
the categories rather than that advantage. Where it is silent: the community model
starts from the model of its largest member cluster; a community round is
``community_epochs`` local epochs on the union of a client's member clusters
(one update per client and community); the community models go to the
active clients only (stable clients do not refine); after refinement a
cluster's model is the one that defined it (own or community) until the
client's next training, and a client whose refinement chose a community
model trains its own cluster models once more even when stable, so that
every published cluster model is trained on that client's cluster
(Algorithm 1, line 8; ``own_models=False`` publishes the community model,
whose copies pass the association test at exactly 0 whatever their
samples). Two readings are ours and switchable: the
association test scales the error differences relative to the errors
(``normalization="relative"``; ``"minmax"`` is the other reading, see
:func:`edge_sdk.fedcref.association_statistic`), and refinement treats an own
cluster's model and its communities' models as one candidate
(``link_communities=True``; False is Algorithm 2 verbatim, see
:meth:`edge_sdk.fedcref.FedCRefClient.refine`).

Where each job lives:

* :mod:`~server_kit.fedcref.graph`: the association graph, its communities,
  the stopping rule;
* :mod:`~server_kit.fedcref.server`: :class:`FedCRefServer`, the coordinator's
  state and rules;
* :mod:`~server_kit.fedcref.wire`: :class:`Wire`, the in-process envelopes and
  their byte count;
* :mod:`~server_kit.fedcref.run`: :func:`run_fedcref`, the in-process driver;
* :mod:`~server_kit.fedcref.mqtt`: :class:`~server_kit.fedcref.mqtt.FedCRefCoordinator`,
  the driver over a broker (imported on its own);
* :mod:`~server_kit.fedcref.export`: :func:`export_communities`;
* :mod:`~server_kit.fedcref.partition`: :func:`class_subset_partition`, the
  paper's federation for experiments.
"""

from .export import export_communities
from .graph import (
    AssociationAudit,
    association_audit,
    association_edges,
    community_links,
    connected_components,
    stop_rule_met,
    wrong_associations,
)
from .partition import class_subset_partition
from .run import FedCRefResult, run_fedcref
from .server import FedCRefServer
from .wire import Wire

__all__ = [
    "AssociationAudit",
    "FedCRefResult",
    "FedCRefServer",
    "Wire",
    "association_audit",
    "association_edges",
    "class_subset_partition",
    "community_links",
    "connected_components",
    "export_communities",
    "run_fedcref",
    "stop_rule_met",
    "wrong_associations",
]
