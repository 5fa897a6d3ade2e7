"""Built-in distributors (spec §2 table, §6 sharding): map-style, epoch-sharded (torch's DistributedSampler),
iterable, and rank-partitioned sources.

The mixture lives in ``mixture.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from ff_core.seeding import derive_seed

from .base import Cursor, DataDistributor, IndexedDistributor, stream_slot


class _MapCursor(Cursor):
    def __init__(self, source: MapDistributor, position: int) -> None:
        self.source, self.position = source, position

    def skip(self, n: int) -> None:
        self.position += n

    def take(self) -> tuple[Any, Any]:
        address = self.position
        self.position += 1
        return address, self.source.fetch(address)

    def state(self) -> dict[str, Any]:
        return {"position": self.position}


class MapDistributor(IndexedDistributor):
    """A map-style dataset, reshuffled every epoch, resumable at any position (spec §2, §5).

    The global order is epoch 0's permutation, then epoch 1's, …; epoch ``e``'s permutation depends only on
    ``(seed, e)``. Jumping to position 10^6 costs one permutation, not 10^6 reads.

    Args:
        dataset: Any object with ``__len__`` and ``__getitem__`` (a ``torch.utils.data.Dataset``, a list, …).
        shuffle: Reshuffle every epoch; ``False`` keeps dataset order.
        seed: Shuffle seed.
        name: Label used in error messages and the resume fingerprint.
        identity: The dataset's content identity (e.g. ``{dataset: {"rows", "sha256"}}``), added to the resume
            fingerprint so a state saved for other content is refused.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0, name: str = "",
                 identity: Mapping[str, Any] | None = None) -> None:
        if len(dataset) == 0:
            raise ValueError(f"MapDistributor{f'({name!r})' if name else ''}: the dataset is empty")
        self.dataset, self.shuffle, self.seed, self.name = dataset, shuffle, seed, name
        self.identity = identity
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def epoch_length(self) -> int:
        return len(self.dataset)

    def permutation(self, epoch: int) -> torch.Tensor | None:
        """Epoch ``epoch``'s order of dataset indices (``None`` when not shuffling).

        Args:
            epoch: Epoch index.
        """
        if not self.shuffle:
            return None
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a cursor only ever straddles two epochs
                self._perms.pop(min(self._perms))
            g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
            self._perms[epoch] = torch.randperm(len(self.dataset), generator=g)
        return self._perms[epoch]

    def index_at(self, position: int) -> int:
        """Dataset index of global position ``position``.

        Args:
            position: Index into the global (epoch-concatenated) order.
        """
        epoch, offset = divmod(position, len(self.dataset))
        perm = self.permutation(epoch)
        return offset if perm is None else int(perm[offset])

    def cursor(self, state: Mapping[str, Any] | None = None) -> Cursor:
        return _MapCursor(self, int(state["position"]) if state else 0)

    def fetch(self, address: Any) -> Any:
        return self.dataset[self.index_at(int(address))]

    def fingerprint(self) -> dict[str, Any]:
        return _with_identity({"kind": "MapDistributor", "name": self.name, "length": len(self.dataset),
                               "shuffle": self.shuffle, "seed": self.seed}, self.identity)


class SamplerDistributor(DataDistributor):
    """A map-style dataset traversed completely every epoch, sharded by ``torch.utils.data.DistributedSampler``.

    The offline trainers' epoch semantics (spec dataset-guide, "Offline dataloader and epoch semantics"): epoch ``e``
    on rank ``r`` serves exactly the indices of ``DistributedSampler(num_replicas=W, rank=r, shuffle, seed,
    drop_last=False)`` after ``set_epoch(e)`` — a permutation seeded by ``seed + e``, its first indices repeated to
    fill the last round when ``W`` does not divide the dataset, taken with stride ``W``. Batched in order (a final
    partial batch allowed), every rank has ``ceil(ceil(N / W) / B)`` batches in every epoch, and nothing crosses an
    epoch boundary. DataflowLoader runs it in resume mode ``"epoch"``: the state is ``(epoch, batches delivered in
    it)``, the same on every rank.

    Args:
        dataset: Any object with ``__len__`` and ``__getitem__``.
        shuffle: Reshuffle every epoch (``DistributedSampler(shuffle=...)``); ``False`` keeps dataset order.
        seed: The sampler's seed; epoch ``e`` is shuffled with ``seed + e``, as torch does.
        name: Label used in error messages and the resume fingerprint.
        identity: The dataset's content identity, added to the resume fingerprint (see :class:`MapDistributor`).
    """

    resumable = True

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0, name: str = "",
                 identity: Mapping[str, Any] | None = None) -> None:
        if len(dataset) == 0:
            raise ValueError(f"SamplerDistributor{f'({name!r})' if name else ''}: the dataset is empty")
        self.dataset, self.shuffle, self.seed, self.name = dataset, shuffle, seed, name
        self.identity = identity
        self._indices: dict[tuple[int, int, int], list[int]] = {}

    @property
    def epoch_length(self) -> int:
        return len(self.dataset)

    def samples_per_rank(self, dp_world_size: int) -> int:
        """Samples every rank traverses per epoch (``DistributedSampler.num_samples`` with ``drop_last=False``).

        Args:
            dp_world_size: Number of data-parallel ranks.
        """
        return math.ceil(len(self.dataset) / dp_world_size)

    def batches_per_epoch(self, dp_world_size: int, batch_size: int) -> int:
        """Batches every rank yields per epoch, the last one possibly partial.

        Args:
            dp_world_size: Number of data-parallel ranks.
            batch_size: Samples per batch.
        """
        return math.ceil(self.samples_per_rank(dp_world_size) / batch_size)

    def rank_indices(self, epoch: int, dp_rank: int, dp_world_size: int) -> list[int]:
        """Dataset indices rank ``dp_rank`` traverses in epoch ``epoch``, in order (torch computes them).

        Args:
            epoch: Data epoch (``sampler.set_epoch``).
            dp_rank: Data-parallel rank.
            dp_world_size: Number of data-parallel ranks.
        """
        key = (epoch, dp_rank, dp_world_size)
        if key not in self._indices:
            self._indices.clear()  # a loader only ever reads one epoch at a time
            sampler = DistributedSampler(range(len(self.dataset)), num_replicas=dp_world_size, rank=dp_rank,
                                         shuffle=self.shuffle, seed=self.seed, drop_last=False)
            sampler.set_epoch(epoch)
            self._indices[key] = list(sampler)
        return self._indices[key]

    # -- an epoch resumed under another world size ----------------------------------------------------------------
    # A DistributedSampler epoch is the epoch's order padded to a multiple of W (position p holds order[p % n]), each
    # rank taking its positions (stride W here; contiguous blocks in GroupedSamplerDistributor). After k batches of B
    # on every rank, the consumed positions are each rank's first k·B; the rest of the epoch is the order's other
    # positions below n, in order, laid out the same way over the new world size (padded again, so that every rank
    # still yields the same number of batches). ``segments`` lists the earlier layouts of the epoch: (W, samples each
    # rank took under it), oldest first.
    def epoch_order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order before padding: ``DistributedSampler``'s with one replica.

        Args:
            epoch: Data epoch.
        """
        return self.rank_indices(epoch, 0, 1)

    @staticmethod
    def rank_positions(n: int, dp_rank: int, dp_world_size: int) -> range:
        """Positions of the padded order (length ``ceil(n / W) * W``) that rank ``dp_rank`` takes, in order: every
        ``W``-th from ``dp_rank``, as ``DistributedSampler`` takes them.

        Args:
            n: Length of the order before padding.
            dp_rank: Data-parallel rank.
            dp_world_size: Number of data-parallel ranks.
        """
        return range(dp_rank, math.ceil(n / dp_world_size) * dp_world_size, dp_world_size)

    def remaining_order(self, epoch: int, segments: tuple[tuple[int, int], ...]) -> list[int]:
        """What is left of epoch ``epoch``'s order after ``segments`` (each ``(W, samples per rank)``) were served.

        Args:
            epoch: Data epoch.
            segments: Earlier layouts of this epoch, oldest first.
        """
        key = ("rest", epoch, segments)
        if key not in self._indices:
            order = self.epoch_order(epoch)
            for world, taken in segments:
                n = len(order)
                consumed = {p for r in range(world) for p in self.rank_positions(n, r, world)[:taken] if p < n}
                order = [index for p, index in enumerate(order) if p not in consumed]
            self._indices.clear()
            self._indices[key] = order
        return self._indices[key]

    def segment_indices(self, epoch: int, dp_rank: int, dp_world_size: int,
                        segments: tuple[tuple[int, int], ...]) -> list[int]:
        """Rank ``dp_rank``'s indices for the rest of epoch ``epoch`` after ``segments`` (no segment: exactly
        :meth:`rank_indices`, torch's).

        Args:
            epoch: Data epoch.
            dp_rank: Data-parallel rank.
            dp_world_size: Number of data-parallel ranks now.
            segments: Earlier layouts of this epoch as ``(W, samples per rank)``, oldest first.
        """
        if not segments:
            return self.rank_indices(epoch, dp_rank, dp_world_size)
        rest = self.remaining_order(epoch, segments)
        return [rest[p % len(rest)] for p in self.rank_positions(len(rest), dp_rank, dp_world_size)]

    def fetch(self, index: int) -> Any:
        return self.dataset[index]

    def stream(self, dp_rank: int, dp_world_size: int, worker_id: int, num_workers: int) -> Iterator[Any]:
        """Epoch after epoch, this rank's indices dealt round-robin over its streams (without DataflowLoader)."""
        for epoch in itertools.count():
            for k, index in enumerate(self.rank_indices(epoch, dp_rank, dp_world_size)):
                if k % num_workers == worker_id:
                    yield self.fetch(index)

    def fingerprint(self) -> dict[str, Any]:
        return _with_identity({"kind": "SamplerDistributor", "name": self.name, "length": len(self.dataset),
                               "shuffle": self.shuffle, "seed": self.seed}, self.identity)


def _with_identity(fingerprint: dict[str, Any], identity: Mapping[str, Any] | None) -> dict[str, Any]:
    # Without an identity the fingerprint stays as it was, so states saved before identities existed still load.
    return fingerprint if identity is None else {**fingerprint, "records": dict(identity)}


class IterableDistributor(DataDistributor):
    """A streaming source (an ``IterableDataset``, a HF streaming split, a list, …), round-robin sharded.

    Item i goes to the stream that :func:`stream_slot` names. **Not resumable**: a stream cannot be fast-forwarded
    without reading it, so a resumed run restarts the source from its beginning (spec §5).

    Args:
        iterable: Re-iterable source; every stream iterates it and keeps its own share.
        name: Label used in error messages and the resume fingerprint.
    """

    def __init__(self, iterable: Any, name: str = "") -> None:
        self.iterable, self.name = iterable, name

    def stream(self, dp_rank: int, dp_world_size: int, worker_id: int, num_workers: int) -> Iterator[Any]:
        for i, item in enumerate(self.iterable):
            if stream_slot(i, 0, dp_world_size, num_workers) == (dp_rank, worker_id):
                yield item

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "IterableDistributor", "name": self.name}


def apportion_ranks(ratios: list[float], world_size: int) -> list[int]:
    """Split ``world_size`` ranks among sources by ratio, at least one each (largest remainder).

    Args:
        ratios: Positive weights, one per source.
        world_size: Ranks to split.
    """
    if world_size < len(ratios):
        raise ValueError(f"RankPartitionedDistributor: {len(ratios)} datasets need at least as many data-parallel "
                         f"ranks, found dp_world_size={world_size}")
    spare = world_size - len(ratios)
    total = sum(ratios)
    exact = [spare * r / total for r in ratios]
    counts = [1 + math.floor(e) for e in exact]
    order = sorted(range(len(ratios)), key=lambda k: (exact[k] - math.floor(exact[k])), reverse=True)
    for k in order[: world_size - sum(counts)]:
        counts[k] += 1
    return counts


class RankPartitionedDistributor(DataDistributor):
    """Whole data-parallel ranks go to different datasets by ratio (spec §6); each dataset is sharded over the
    ranks that share it and their workers. Not resumable (see docs/dataflow.md).

    Args:
        datasets: ``{name: {"dataset": ..., "ratio": r}}``; a dataset may be a :class:`DataDistributor`, a
            map-style dataset (wrapped in ``MapDistributor(shuffle, seed)``) or an iterable.
        shuffle: Shuffle map-style datasets.
        seed: Shuffle seed for map-style datasets.
    """

    def __init__(self, datasets: Mapping[str, Mapping[str, Any]], shuffle: bool = True, seed: int = 0) -> None:
        if not datasets:
            raise ValueError("RankPartitionedDistributor: datasets is empty")
        self.names = list(datasets)
        self.ratios = [float(datasets[n]["ratio"]) for n in self.names]
        for n, r in zip(self.names, self.ratios):
            if not r > 0:
                raise ValueError(f"RankPartitionedDistributor: datasets[{n!r}].ratio must be > 0, found {r}")
        self.sources = [_as_distributor(datasets[n]["dataset"], n, shuffle, seed) for n in self.names]

    def assignment(self, dp_rank: int, dp_world_size: int) -> tuple[str, int, int]:
        """``(dataset name, rank within its group, group size)`` for a rank.

        Args:
            dp_rank: Data-parallel rank.
            dp_world_size: Number of data-parallel ranks.
        """
        start = 0
        for name, size in zip(self.names, apportion_ranks(self.ratios, dp_world_size)):
            if dp_rank < start + size:
                return name, dp_rank - start, size
            start += size
        raise AssertionError("unreachable")

    def stream(self, dp_rank: int, dp_world_size: int, worker_id: int, num_workers: int) -> Iterator[Any]:
        name, group_rank, group_size = self.assignment(dp_rank, dp_world_size)
        yield from self.sources[self.names.index(name)].stream(group_rank, group_size, worker_id, num_workers)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "RankPartitionedDistributor", "ratios": dict(zip(self.names, self.ratios)),
                "sources": {n: s.fingerprint() for n, s in zip(self.names, self.sources)}}


def _as_distributor(obj: Any, name: str, shuffle: bool, seed: int) -> DataDistributor:
    if isinstance(obj, DataDistributor):
        return obj
    is_iterable_dataset = isinstance(obj, torch.utils.data.IterableDataset)
    if hasattr(obj, "__len__") and hasattr(obj, "__getitem__") and not is_iterable_dataset:
        return MapDistributor(obj, shuffle=shuffle, seed=seed, name=name)
    return IterableDistributor(obj, name=name)
