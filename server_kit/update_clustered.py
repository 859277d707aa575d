"""Moved to :mod:`server_kit.strategies.update_clustered`; this path keeps working for one release."""

import warnings

from .strategies.update_clustered import *  # noqa: F403
from .strategies.update_clustered import __all__  # noqa: F401

warnings.warn("server_kit.update_clustered has moved to server_kit.strategies.update_clustered", DeprecationWarning, stacklevel=2)
