"""Moved to :mod:`server_kit.strategies.flis`; this path keeps working for one release."""

import warnings

from .strategies.flis import *  # noqa: F403
from .strategies.flis import __all__  # noqa: F401

warnings.warn("server_kit.flis has moved to server_kit.strategies.flis", DeprecationWarning, stacklevel=2)
