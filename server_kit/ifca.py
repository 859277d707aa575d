"""Moved to :mod:`server_kit.strategies.ifca`; this path keeps working for one release."""

import warnings

from .strategies.ifca import *  # noqa: F403
from .strategies.ifca import __all__  # noqa: F401

warnings.warn("server_kit.ifca has moved to server_kit.strategies.ifca", DeprecationWarning, stacklevel=2)
