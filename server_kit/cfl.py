"""Moved to :mod:`server_kit.strategies.cfl`; this path keeps working for one release."""

import warnings

from .strategies.cfl import *  # noqa: F403
from .strategies.cfl import __all__  # noqa: F401

warnings.warn("server_kit.cfl has moved to server_kit.strategies.cfl", DeprecationWarning, stacklevel=2)
