"""Test-wide settings.

Many tests train small models in several threads or processes at once (client
threads of an in-memory federation, client processes of a real one). On a
2-core machine torch's default of one worker thread per core then
oversubscribes the CPU badly (seen: 1 s of work taking 30 s), so the suite
runs torch and OpenMP single-threaded, in this process and in the processes
it starts.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the edge profile has no torch; nothing to tune
    pass
