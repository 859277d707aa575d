"""Moved to :mod:`server_kit.strategies.ocfl`; this path keeps working for one release."""

import warnings

from .strategies.ocfl import *  # noqa: F403
from .strategies.ocfl import __all__  # noqa: F401

warnings.warn("server_kit.ocfl has moved to server_kit.strategies.ocfl", DeprecationWarning, stacklevel=2)
