"""How to install FedSketch or one of its extras, in the words every hint uses.

The package is on no index: a machine installs the sdist (or a wheel) that
``make dist`` builds in a checkout's ``dist/``. Every message that tells a
user to install something (a device without torch, the server's commands, the
Flower adapter) takes its wording from :func:`install_hint`.
"""

from __future__ import annotations

from ._version import __version__

__all__ = ["SDIST", "install_hint"]

#: The file ``make dist`` builds (``dist/``), which every install line names.
SDIST = f"fedsketch-{__version__}.tar.gz"


def install_hint(extra: str | None = None) -> str:
    """``pip install './fedsketch-X.tar.gz[extra]'`` and where that file comes from.

    >>> install_hint("train")  # doctest: +ELLIPSIS
    "pip install './fedsketch-...tar.gz[train]' (the sdist that make dist builds, or its wheel)"
    """
    spec = f"./{SDIST}[{extra}]" if extra else f"./{SDIST}"
    return f"pip install '{spec}' (the sdist that make dist builds, or its wheel)"
