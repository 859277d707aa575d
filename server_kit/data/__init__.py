"""Data loading for the server kit (readers and, later, partitioners).

Only numpy is needed here; nothing in this package imports torch.
"""

from server_kit.data.idx import IDX_DTYPES, load_idx_dataset, read_idx

__all__ = ["IDX_DTYPES", "load_idx_dataset", "read_idx"]
