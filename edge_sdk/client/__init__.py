"""The device's runtime (``fedsketch-client``): the edge client, its connection, its state, its command handlers.

:mod:`~edge_sdk.client.edge_client` is the client itself (:class:`EdgeClient`);
:mod:`~edge_sdk.client.link` its connection to the server; :mod:`~edge_sdk.client.state`
what the server's runs gave it; :mod:`~edge_sdk.client.commands` one handler per
command; :mod:`~edge_sdk.client.keep`, :mod:`~edge_sdk.client.encoders` and
:mod:`~edge_sdk.client.drift` what it keeps between commands; :mod:`~edge_sdk.client.cli`
the console script.
"""

from .edge_client import KEEPS_MODELS, EdgeClient

__all__ = ["KEEPS_MODELS", "EdgeClient"]
