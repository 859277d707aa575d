"""Moved to :mod:`server_kit.strategies.kmeans_weights`; this path keeps working for one release."""

import warnings

from .strategies.kmeans_weights import *  # noqa: F403
from .strategies.kmeans_weights import __all__  # noqa: F401

warnings.warn("server_kit.kmeans_weights has moved to server_kit.strategies.kmeans_weights", DeprecationWarning, stacklevel=2)
