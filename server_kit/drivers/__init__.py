"""The server drivers: the MQTT :class:`Orchestrator` and its settings, :class:`ServerConfig`.

The orchestrator's parts (the link to the broker, the fleet, the intake of
device messages, model delivery, assignment, checkpoints, the autoencoder
pre-training phase) each live in a module of this package.
"""

from .config import ServerConfig
from .orchestrator import Orchestrator

__all__ = ["Orchestrator", "ServerConfig"]
