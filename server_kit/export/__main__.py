"""``python -m server_kit.export``: the same command as ``fedsketch export``."""

import sys

from .cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
