"""The four dataflow roles (spec composable-dataloader-guide §2) and the resumable-source protocol.

``DataflowLoader`` wires them in the fixed order distribute → process → batch → collate. Beyond the spec, a
distributor that can resume exposes a :class:`Cursor` over one *global* item order (the same on every rank,
independent of world size and worker count); the loader shards that order itself, so resume state is a position
in it rather than per-rank environment variables (spec §5).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)


def stream_slot(position: int, origin: int, dp_world_size: int, num_workers: int) -> tuple[int, int]:
    """The (dp_rank, worker_id) that owns item ``position`` of a global order sharded from ``origin``.

    Streams are numbered worker-major: item i goes to stream i mod (W·N) == worker·W + rank. With one worker per
    rank this is the spec's rule (§6, ``i % (W·N) == rank·N + worker``); with several, the DataLoader visits its
    workers round-robin, so worker-major numbering makes the items consumed after any whole step a prefix of the
    global order — the property that lets a run resume under a different world size or worker count.

    Args:
        position: Index in the global order.
        origin: Index at which the current sharding started (a resume point).
        dp_world_size: Number of data-parallel ranks W.
        num_workers: Number of streams per rank N (DataLoader workers, at least 1).
    """
    i = position - origin
    return i % dp_world_size, (i // dp_world_size) % num_workers


class DataDistributor(ABC):
    """Owns the raw items and yields one (rank, worker)'s disjoint slice of them (spec §2)."""

    #: Whether :meth:`cursor` is implemented, i.e. the source can fast-forward to a position by index arithmetic.
    resumable: bool = False

    @abstractmethod
    def stream(self, dp_rank: int, dp_world_size: int, worker_id: int, num_workers: int) -> Iterator[Any]:
        """Yield this (rank, worker)'s slice of raw items.

        Args:
            dp_rank: Data-parallel rank in ``[0, dp_world_size)``.
            dp_world_size: Number of data-parallel ranks.
            worker_id: DataLoader worker index in ``[0, num_workers)``.
            num_workers: Streams per rank (``max(1, DataLoader num_workers)``).
        """

    def fingerprint(self) -> dict[str, Any]:
        """What fixes the item order; saved with resume state and compared on load (STYLE 13)."""
        return {"kind": type(self).__name__}


class Cursor(ABC):
    """A position in a resumable distributor's global, infinite item order (epochs concatenated)."""

    position: int

    @abstractmethod
    def skip(self, n: int) -> None:
        """Advance by ``n`` items without reading them (index arithmetic only).

        Args:
            n: Number of items to pass over, ``>= 0``.
        """

    @abstractmethod
    def take(self) -> tuple[Any, Any]:
        """Read the item at the current position and advance by one; returns ``(address, raw_item)``.

        The address is a small picklable value that :meth:`IndexedDistributor.fetch` turns back into the item.
        """

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """A plain dict from which :meth:`IndexedDistributor.cursor` rebuilds this exact position."""


class IndexedDistributor(DataDistributor):
    """A distributor with random access into one global order: resumable at any position (spec §5, extended)."""

    resumable = True

    @property
    @abstractmethod
    def epoch_length(self) -> int:
        """Items per epoch of the global order (the dataset length for a map-style source)."""

    @abstractmethod
    def cursor(self, state: Mapping[str, Any] | None = None) -> Cursor:
        """A cursor at the position described by ``state`` (``None``: the very start).

        Args:
            state: A dict produced by :meth:`Cursor.state`.
        """

    @abstractmethod
    def fetch(self, address: Any) -> Any:
        """The raw item at an address returned by :meth:`Cursor.take`.

        Args:
            address: As returned by ``Cursor.take``.
        """

    def stream(self, dp_rank: int, dp_world_size: int, worker_id: int, num_workers: int) -> Iterator[Any]:
        """Yield this stream's items of the global order, forever (see :func:`stream_slot`)."""
        for _address, item in self.walk(dp_rank, dp_world_size, worker_id, num_workers, self.cursor()):
            yield item

    def walk(
        self, dp_rank: int, dp_world_size: int, worker_id: int, num_workers: int, cursor: Cursor, origin: int = 0
    ) -> Iterator[tuple[Any, Any]]:
        """Like :meth:`stream` from ``cursor``, yielding ``(address, item)``; skipped items are never read.

        Args:
            dp_rank: Data-parallel rank.
            dp_world_size: Number of data-parallel ranks.
            worker_id: Stream index on this rank.
            num_workers: Streams per rank.
            cursor: Where to start; advanced in place.
            origin: Global index at which this sharding started.
        """
        period = dp_world_size * num_workers
        mine = worker_id * dp_world_size + dp_rank
        while True:
            offset = (cursor.position - origin) % period
            cursor.skip((mine - offset) % period)
            yield cursor.take()


class RawItemProcessor(ABC):
    """Turns one raw item into one sample dict (decode, tokenize, …; spec §2)."""

    @abstractmethod
    def process(self, item: Any) -> dict[str, Any]:
        """Args:
        item: One raw item as yielded by the distributor.
        """


class SampleBatcher(ABC):
    """Decides which samples form a batch (spec §2).

    Resume contract (``resumable = True``): between two yielded batches the batcher's only state is the ordered
    list of samples it has pulled but neither yielded nor dropped, kept in pull order, and every dropped sample
    goes through :meth:`drop`. Feeding those pending samples first to a fresh batcher then reproduces the rest of
    the run exactly. Custom batchers default to ``False``; the loader refuses them over a resumable source.
    """

    resumable: bool = False
    #: Samples per batch when every batch holds exactly this many (enables world-size-free resume); else None.
    fixed_batch_size: int | None = None
    _drop_listener: Callable[[Any], None] | None = None

    @abstractmethod
    def batches(self, samples: Iterator[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        """Group a stream of samples into batches.

        Args:
            samples: Processed samples in stream order.
        """

    def sample_size(self, sample: dict[str, Any]) -> int:
        """Cost of one sample in the batcher's budget unit (only packing batchers use it).

        Args:
            sample: One processed sample.
        """
        return 1

    def drop(self, sample: dict[str, Any], reason: str) -> None:
        """Discard a sample that can never be batched: logged as an error and counted, never silent.

        Args:
            sample: The discarded sample.
            reason: Why, for the log line.
        """
        log.error("%s dropped a sample: %s", type(self).__name__, reason)
        self.dropped = getattr(self, "dropped", 0) + 1
        if self._drop_listener is not None:
            self._drop_listener(sample)

    def fingerprint(self) -> dict[str, Any]:
        """What fixes the batch boundaries; part of the resume fingerprint where it matters."""
        return {"kind": type(self).__name__}


class BatchCollator(ABC):
    """Turns a group of samples into one batch for ``model.forward`` (spec §2)."""

    @abstractmethod
    def collate(self, samples: list[dict[str, Any]]) -> Any:
        """Args:
        samples: The samples of one batch, as chosen by the batcher.
        """
