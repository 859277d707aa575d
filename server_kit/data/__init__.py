"""Data for the server kit: dataset loaders and seeded federated partitioners.

Loaders (:mod:`server_kit.data.idx`): :func:`load_mnist`,
:func:`load_fashion_mnist` and :func:`load_idx_dataset` read the original IDX
files and check their published sha256; :func:`load_digits_images` is
scikit-learn's 8x8 digits (imported when called). Partitioners
(:mod:`server_kit.data.partition`) return :class:`ClientData` records with
each client's true group; :func:`save_client` / :func:`load_client` write and
read a client's ``.npz``. ``fedsketch-data split`` (:mod:`server_kit.data.split`)
does both from the command line.

Behind those two faces: :mod:`~server_kit.data.clients` (the record, its
file), :mod:`~server_kit.data.shards` and :mod:`~server_kit.data.class_sets`
(the seeded draws, the OCFL sets), :mod:`~server_kit.data.sources`,
:mod:`~server_kit.data.split_partition` and :mod:`~server_kit.data.split_output`
(the command's steps). Every name below is importable from ``partition`` or ``idx``.

Only numpy is imported here; nothing in this package imports torch.
"""

from server_kit.data.idx import (
    DATASETS,
    IDX_DTYPES,
    IDX_FILES,
    KNOWN_SHA256,
    load_fashion_mnist,
    load_idx_dataset,
    load_mnist,
    parse_idx,
    read_idx,
)
from server_kit.data.partition import (
    OCFL_CLASS_SETS,
    OCFL_IMBALANCED_SHARES,
    OCFL_OVERLAPPING_CLASS_SETS,
    OCFL_SPLITS,
    ClientData,
    class_set_groups,
    dirichlet_indices,
    group_assignment,
    group_sizes_from_shares,
    label_flip_groups,
    load_client,
    load_digits_images,
    pathological_partition,
    rotation_groups,
    rotation_partition,
    save_client,
    summarize,
)

__all__ = [
    "ClientData",
    "DATASETS",
    "IDX_DTYPES",
    "IDX_FILES",
    "KNOWN_SHA256",
    "OCFL_CLASS_SETS",
    "OCFL_IMBALANCED_SHARES",
    "OCFL_OVERLAPPING_CLASS_SETS",
    "OCFL_SPLITS",
    "class_set_groups",
    "dirichlet_indices",
    "group_assignment",
    "group_sizes_from_shares",
    "label_flip_groups",
    "load_client",
    "load_digits_images",
    "load_fashion_mnist",
    "load_idx_dataset",
    "load_mnist",
    "parse_idx",
    "pathological_partition",
    "read_idx",
    "rotation_groups",
    "rotation_partition",
    "save_client",
    "summarize",
]
