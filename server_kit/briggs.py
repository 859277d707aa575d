"""Moved to :mod:`server_kit.strategies.briggs`; this path keeps working for one release."""

import warnings

from .strategies.briggs import *  # noqa: F403
from .strategies.briggs import __all__  # noqa: F401

warnings.warn("server_kit.briggs has moved to server_kit.strategies.briggs", DeprecationWarning, stacklevel=2)
