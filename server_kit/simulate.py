"""Moved to :mod:`server_kit.drivers.simulate`; this path keeps working for one release."""

import warnings

from .drivers.simulate import *  # noqa: F403
from .drivers.simulate import __all__  # noqa: F401

warnings.warn("server_kit.simulate has moved to server_kit.drivers.simulate", DeprecationWarning, stacklevel=2)
