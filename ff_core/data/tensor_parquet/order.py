"""Training orders for shards whose row groups hold many rows (``data.row_group_window``).

Parquet cannot decode part of a row group, and shards from other writers often hold a whole chunk file (16–1000
rows of 10–30 MB) in one group (DESIGN.md, "Engineering notes"). A uniformly random row order then decodes a whole
group for nearly every row. These distributors shuffle at two levels instead, as MosaicML streaming and litdata
shuffle shards (:func:`~ff_core.data.tensor_parquet.two_level_order`): the order of row groups, then the rows within
each window of ``window`` consecutive groups; a reader keeping ``window`` decoded groups
(``TensorParquetDataset(cached_groups=window)``) decodes each group once per epoch and rank. The order is a
function of ``(seed, epoch)`` only, so resume stays exact. Shards written by ff (one row per group) need none of
this: a plain permutation costs nothing extra there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ff_core.data.dataflow import MapDistributor, SamplerDistributor
from ff_core.data.tensor_parquet import two_level_order
from ff_core.data.tensor_parquet.rows import TensorRows


def _check_window(window: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"data.row_group_window must be an integer >= 1, got {window!r}")
    return window


class GroupedSamplerDistributor(SamplerDistributor):
    """The offline trainers' epochs (every epoch one complete traversal, the same number of batches on every rank;
    :class:`~ff_core.data.dataflow.SamplerDistributor`) in a two-level order over row groups.

    Epoch ``e``'s order is ``two_level_order(rows.group_bounds, seed, e, window)``, padded as
    ``DistributedSampler(drop_last=False)`` pads (its first rows repeated up to a multiple of the world size); rank
    ``r`` takes the ``r``-th contiguous block of it, not every ``W``-th row, so the ranks share few groups and each
    group is decoded by about one rank per epoch.

    Args:
        dataset: the shard rows.
        window: row groups whose rows are mixed together.
        shuffle: shuffle every epoch; ``False`` keeps dataset order (sharded in blocks).
        seed: shuffle seed.
        name: label in messages and the resume fingerprint.
        identity: the rows' identity, in the resume fingerprint.
    """

    def __init__(self, dataset: TensorRows, window: int, shuffle: bool = True, seed: int = 0, name: str = "",
                 identity: Mapping[str, Any] | None = None) -> None:
        super().__init__(dataset, shuffle=shuffle, seed=seed, name=name, identity=identity)
        self.window = _check_window(window)
        self.bounds = dataset.group_bounds

    def epoch_order(self, epoch: int) -> list[int]:
        return (two_level_order(self.bounds, self.seed, epoch, self.window) if self.shuffle
                else torch.arange(len(self.dataset))).tolist()  # fmt: skip

    @staticmethod
    def rank_positions(n: int, dp_rank: int, dp_world_size: int) -> range:
        """Rank ``dp_rank``'s contiguous block of the padded order (length ``ceil(n / W) * W``)."""
        per_rank = math.ceil(n / dp_world_size)
        return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)

    def rank_indices(self, epoch: int, dp_rank: int, dp_world_size: int) -> list[int]:
        key = (epoch, dp_rank, dp_world_size)
        if key not in self._indices:
            self._indices.clear()
            order = self.epoch_order(epoch)
            self._indices[key] = [order[p % len(order)] for p in self.rank_positions(len(order), dp_rank,
                                                                                      dp_world_size)]
        return self._indices[key]

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "kind": "GroupedSamplerDistributor", "window": self.window}


class GroupedMapDistributor(MapDistributor):
    """:class:`~ff_core.data.dataflow.MapDistributor` (one global order, epochs concatenated, resumable anywhere)
    whose epoch ``e`` is ``two_level_order(rows.group_bounds, seed, e, window)`` instead of a uniform permutation.

    The loader deals the global order round-robin over ranks and workers, so each stream reads every group of a
    window: keep ``window`` at most the reader's ``cached_groups`` (the data module does).

    Args:
        dataset: the shard rows.
        window: row groups whose rows are mixed together.
        shuffle: shuffle every epoch; ``False`` keeps dataset order.
        seed: shuffle seed.
        name: label in messages and the resume fingerprint.
        identity: the rows' identity, in the resume fingerprint.
    """

    def __init__(self, dataset: TensorRows, window: int, shuffle: bool = True, seed: int = 0, name: str = "",
                 identity: Mapping[str, Any] | None = None) -> None:
        super().__init__(dataset, shuffle=shuffle, seed=seed, name=name, identity=identity)
        self.window = _check_window(window)
        self.bounds = dataset.group_bounds

    def permutation(self, epoch: int) -> torch.Tensor | None:
        if not self.shuffle:
            return None
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a cursor only ever straddles two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = two_level_order(self.bounds, self.seed, epoch, self.window)
        return self._perms[epoch]

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "kind": "GroupedMapDistributor", "window": self.window}
