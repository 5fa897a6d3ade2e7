"""Two-level shuffling for shards with many rows per row group (MosaicML streaming's and litdata's scheme).

A per-sample random order over such files decodes a whole group for nearly every row (Parquet cannot decode part
of a group). Instead: shuffle the order of row groups, cut that order into windows of ``window`` groups, and
shuffle the rows inside each window. A reader that keeps ``window`` decoded groups
(``TensorParquetDataset(cached_groups >= window)``) then decodes every group once per epoch. The order mixes
rows of ``window`` groups at a time, less than a full permutation: use it for the reference layout (many rows
per group); for ff's layout (one row per group) a plain permutation costs nothing extra.
"""

from __future__ import annotations

import numpy as np
import torch

from ff_core.seeding import derive_seed


def two_level_order(group_bounds: np.ndarray, seed: int, epoch: int, window: int = 4) -> torch.Tensor:
    """A permutation of all rows: groups shuffled, then rows shuffled within each window of ``window`` groups.

    Deterministic in ``(seed, epoch)`` (the same in every process, so resume stays exact).

    Args:
        group_bounds: row group ``g`` holds rows ``group_bounds[g]`` to ``group_bounds[g + 1] - 1``
            (:attr:`TensorParquetDataset.group_bounds`).
        seed: shuffle seed.
        epoch: epoch number; each epoch has its own order.
        window: groups whose rows are mixed together (keep ``cached_groups`` at least this).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    bounds = torch.as_tensor(np.asarray(group_bounds, dtype=np.int64))
    g = torch.Generator().manual_seed(derive_seed(seed, epoch))
    groups = torch.randperm(len(bounds) - 1, generator=g)
    out = []
    for w in range(0, len(groups), window):
        rows = torch.cat([torch.arange(int(bounds[k]), int(bounds[k + 1])) for k in groups[w: w + window]])
        out.append(rows[torch.randperm(len(rows), generator=g)])
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)
