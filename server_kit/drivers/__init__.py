"""The drivers: what runs a federation with the strategy objects of :mod:`server_kit.strategies`.

- :class:`Orchestrator` (:mod:`.orchestrator`, settings :class:`ServerConfig` in :mod:`.config`):
  the real server, over MQTT. Its parts each live in a module of this package: the link to the
  broker (:mod:`.link`, also FedCRef's), the fleet (:mod:`.fleet`), the intake of device messages
  (:mod:`.intake`), model delivery (:mod:`.delivery`), assignment (:mod:`.assignment`), checkpoints
  (:mod:`.checkpoint`), round records (:mod:`.records`) and the autoencoder pre-training phase
  (:mod:`.ae_phase`).
- :class:`Simulator` (:mod:`.simulate`): the same strategies in one process, bytes counted as sent.
"""

from .config import ServerConfig
from .orchestrator import Orchestrator
from .simulate import Simulator

__all__ = ["Orchestrator", "ServerConfig", "Simulator"]
