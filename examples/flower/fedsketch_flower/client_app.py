"""The node: FedSketch's ClientApp (ONNX sketch, local training, evaluation) on this node's share."""

from __future__ import annotations

from flwr.app import Context

from edge_sdk.flower import NodeData, client_app

from .task import nodes, setup


def load(context: Context) -> NodeData:
    """This node's data: share ``partition-id`` of the run's partition."""
    i = int(context.node_config["partition-id"])
    c = nodes(context.run_config, int(context.node_config["num-partitions"]))[i]
    return NodeData(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, index=i)


# the encoder follows the data: digits' or the 28x28 one for MNIST
app = client_app(load, encoder=lambda run_config: setup(run_config)[1])
