"""Moved to :mod:`edge_sdk.transport.netloop`; this path keeps working for one release."""

import warnings

from .transport.netloop import *  # noqa: F403
from .transport.netloop import __all__  # noqa: F401

warnings.warn("edge_sdk.netloop has moved to edge_sdk.transport.netloop", DeprecationWarning, stacklevel=2)
