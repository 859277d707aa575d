"""Moved to :mod:`server_kit.fedcref.mqtt`; this path keeps working for one release."""

import warnings

from .fedcref.mqtt import *  # noqa: F403
from .fedcref.mqtt import __all__  # noqa: F401

warnings.warn("server_kit.fedcref_mqtt has moved to server_kit.fedcref.mqtt", DeprecationWarning, stacklevel=2)
