"""Moved to :mod:`server_kit.drivers.orchestrator`; this path keeps working for one release."""

import warnings

from .drivers.config import MODEL_DELIVERY  # noqa: F401 - public in the old module, outside its __all__
from .drivers.fleet import ADMISSIONS_LOGGED  # noqa: F401 - likewise
from .drivers.orchestrator import *  # noqa: F403
from .drivers.orchestrator import __all__  # noqa: F401

warnings.warn("server_kit.orchestrator has moved to server_kit.drivers.orchestrator", DeprecationWarning,
              stacklevel=2)
