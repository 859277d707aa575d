"""The one error of ``fedsketch bench`` that ends it: a message for one line and the exit code."""

from __future__ import annotations

__all__ = ["EXIT_BROKER", "EXIT_USAGE", "BenchError"]

#: Exit code of bad input: a data file that fits no encoder, an unknown name, a missing optional package.
EXIT_USAGE = 2
#: Exit code of a broker that cannot be reached or refuses the device's credentials.
EXIT_BROKER = 3


class BenchError(Exception):
    """Why the benchmark cannot go on: ``fedsketch bench: error: <message>``, then exit ``code``.

    Parameters
    ----------
    message : str
        One line, saying what was wrong and what would be right.
    code : int
        The exit status: :data:`EXIT_USAGE` (2) or :data:`EXIT_BROKER` (3).
    """

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = int(code)
