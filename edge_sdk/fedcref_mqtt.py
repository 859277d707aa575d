"""Moved to :mod:`edge_sdk.fedcref.mqtt`; this path keeps working for one release."""

import warnings

from .fedcref.mqtt import *  # noqa: F403
from .fedcref.mqtt import __all__  # noqa: F401

warnings.warn("edge_sdk.fedcref_mqtt has moved to edge_sdk.fedcref.mqtt", DeprecationWarning, stacklevel=2)
