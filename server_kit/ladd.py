"""Moved to :mod:`server_kit.strategies.ladd`; this path keeps working for one release."""

import warnings

from .strategies.ladd import *  # noqa: F403
from .strategies.ladd import __all__  # noqa: F401

warnings.warn("server_kit.ladd has moved to server_kit.strategies.ladd", DeprecationWarning, stacklevel=2)
