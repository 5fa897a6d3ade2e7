"""The worker side of DataflowLoader: distribute → process → batch → collate, with a resume stamp per batch.

Each batch leaves a worker as ``(stamp, batch)``; the main process reads the stamp only when it hands the batch
on, so batches prefetched by workers but never delivered never move the saved position (spec §5 counted the
same way, with per-batch stamp tensors).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import IterableDataset

from .base import BatchCollator, DataDistributor, RawItemProcessor, SampleBatcher
from .coords import WorkerCoords


@dataclass
class Plan:
    """What one ``iter(loader)`` must produce on one rank, set by the main process before workers start.

    Args:
        mode: ``"global"``, ``"stream"``, ``"epoch"`` or ``"none"`` (see state.py).
        rank: Data-parallel rank.
        world_size: Data-parallel world size.
        num_streams: Streams per rank (``max(1, num_workers)``).
        steps: Batches this rank yields in this iteration; ``None`` until the source ends (or forever).
        first_step: Batches this rank delivered before this iteration (rotates streams over workers).
        cursor: Mode "global": cursor state at the start.
        origin: Mode "stream": global index at which the stream sharding started.
        streams: Mode "stream": ``{"rank/stream": {"cursor", "pending"}}``.
        epoch: Loader epoch; mode "none" over a resumable source serves that epoch of its order.
        epoch_step: Mode "epoch": batches of ``epoch`` this rank delivered before this iteration (in its current
            layout).
        segments: Mode "epoch": the epoch's earlier layouts as ``(W, samples each rank took)`` when it was resumed
            under another world size (``SamplerDistributor.segment_indices``); empty otherwise.
    """

    mode: str
    rank: int
    world_size: int
    num_streams: int
    steps: int | None
    first_step: int = 0
    cursor: dict[str, Any] | None = None
    origin: int = 0
    streams: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    epoch_step: int = 0
    segments: tuple[tuple[int, int], ...] = ()


def _owned(sample: Any) -> Any:
    # A shallow copy gives every pulled sample its own identity, even when a dataset returns the same dict twice.
    return dict(sample) if isinstance(sample, dict) else sample


class DataflowStream(IterableDataset):
    """The IterableDataset a DataflowLoader iterates; one copy per worker.

    Args:
        distributor: Source of raw items.
        processor: Raw item → sample.
        batcher: Samples → groups.
        collator: Group → batch.
    """

    def __init__(self, distributor: DataDistributor, processor: RawItemProcessor, batcher: SampleBatcher,
                 collator: BatchCollator) -> None:
        self.distributor, self.processor, self.batcher, self.collator = distributor, processor, batcher, collator
        self.plan: Plan | None = None

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
        return self.iterate(WorkerCoords.detect().worker_id)

    def iterate(self, worker_id: int) -> Iterator[tuple[dict[str, Any], Any]]:
        """The ``(stamp, batch)`` pairs of one worker's share of the current plan.

        Args:
            worker_id: DataLoader worker index (0 in the main process).
        """
        if self.plan is None:
            raise RuntimeError("DataflowStream: iterate it through DataflowLoader, which sets the plan")
        run = {"global": self._global, "stream": self._stream, "epoch": self._epoch, "none": self._plain}[
            self.plan.mode]
        return run(self.plan, worker_id)

    def _global(self, plan: Plan, worker_id: int) -> Iterator[tuple[dict[str, Any], Any]]:
        # Global batch s of this iteration is items [p0 + s·W·B, p0 + (s+1)·W·B) of the distributor's order;
        # rank r takes the r-th block of B. Worker w serves the steps s ≡ w (mod N), the DataLoader's round-robin,
        # so after any delivered step the consumed items are a prefix of the order.
        B, W, r = self.batcher.fixed_batch_size, plan.world_size, plan.rank
        cursor = self.distributor.cursor(plan.cursor)  # type: ignore[attr-defined]
        p0 = cursor.position
        ends: deque[tuple[int, dict[str, Any]]] = deque()

        def samples() -> Iterator[dict[str, Any]]:
            for s in range(worker_id, plan.steps, plan.num_streams):
                cursor.skip(p0 + (s * W + r) * B - cursor.position)
                items = [cursor.take()[1] for _ in range(B)]
                cursor.skip(p0 + (s + 1) * W * B - cursor.position)
                ends.append((s, cursor.state()))
                for item in items:  # only this rank's items are ever processed
                    yield _owned(self.processor.process(item))

        for batch in self.batcher.batches(samples()):
            step, end = ends.popleft()
            yield {"step": step, "cursor": end, "dropped": 0}, self.collator.collate(batch)

    def _epoch(self, plan: Plan, worker_id: int) -> Iterator[tuple[dict[str, Any], Any]]:
        # Batch k of the epoch is items [k·B, (k+1)·B) of this rank's DistributedSampler indices (the last one may be
        # short); worker w serves the iteration's steps s ≡ w (mod N), the DataLoader's round-robin, so the delivered
        # order is the one a DataLoader(batch_size=B, sampler=DistributedSampler(...)) yields.
        B, dist = self.batcher.fixed_batch_size, self.distributor
        indices = dist.segment_indices(plan.epoch, plan.rank, plan.world_size, plan.segments)  # type: ignore
        for s in range(worker_id, plan.steps, plan.num_streams):
            k = plan.epoch_step + s
            samples = [_owned(self.processor.process(dist.fetch(i))) for i in indices[k * B : (k + 1) * B]]  # type: ignore
            yield {"step": s, "dropped": 0}, self.collator.collate(samples)

    def _stream(self, plan: Plan, worker_id: int) -> Iterator[tuple[dict[str, Any], Any]]:
        # Each (rank, stream) walks its own slice at its own pace; its stamp records where its cursor is and which
        # pulled samples the batcher still holds (by address), so a resume re-reads exactly those first.
        N, r = plan.num_streams, plan.rank
        stream_id = (plan.first_step + worker_id) % N
        key = f"{r}/{stream_id}"
        saved = plan.streams.get(key) or {"cursor": None, "pending": []}
        dist = self.distributor
        cursor = dist.cursor(saved["cursor"])  # type: ignore[attr-defined]
        pulled: OrderedDict[int, Any] = OrderedDict()
        dropped = [0]

        def on_drop(sample: Any) -> None:
            pulled.pop(id(sample), None)
            dropped[0] += 1

        def samples() -> Iterator[dict[str, Any]]:
            for address in saved["pending"]:
                sample = _owned(self.processor.process(dist.fetch(address)))  # type: ignore[attr-defined]
                pulled[id(sample)] = address
                yield sample
            for address, item in dist.walk(r, plan.world_size, stream_id, N, cursor, plan.origin):  # type: ignore
                sample = _owned(self.processor.process(item))
                pulled[id(sample)] = address
                yield sample

        self.batcher._drop_listener = on_drop
        my_steps = None if plan.steps is None else range(worker_id, plan.steps, N)
        if my_steps is not None and not my_steps:
            return
        for k, batch in enumerate(self.batcher.batches(samples())):
            for sample in batch:
                pulled.pop(id(sample), None)
            stamp = {"stream": key, "cursor": cursor.state(), "pending": list(pulled.values()), "dropped": dropped[0]}
            dropped[0] = 0
            yield stamp, self.collator.collate(batch)
            if my_steps is not None and k + 1 >= len(my_steps):
                return

    def _plain(self, plan: Plan, worker_id: int) -> Iterator[tuple[dict[str, Any], Any]]:
        dropped = [0]
        self.batcher._drop_listener = lambda _sample: dropped.__setitem__(0, dropped[0] + 1)
        stream = self._epoch_stream(plan, worker_id)
        samples = (_owned(self.processor.process(item)) for item in stream)
        limit = None if plan.steps is None else len(range(worker_id, plan.steps, plan.num_streams))
        for k, batch in enumerate(self.batcher.batches(samples)):
            if limit is not None and k >= limit:
                return
            stamp = {"dropped": dropped[0]}
            dropped[0] = 0
            yield stamp, self.collator.collate(batch)

    def _epoch_stream(self, plan: Plan, worker_id: int) -> Iterator[Any]:
        dist = self.distributor
        if not dist.resumable:
            yield from dist.stream(plan.rank, plan.world_size, worker_id, plan.num_streams)
            return
        # A resumable source used without resume (resumable=False): serve one epoch of its order per iter().
        length = dist.epoch_length  # type: ignore[attr-defined]
        cursor = dist.cursor()  # type: ignore[attr-defined]
        cursor.skip(plan.epoch * length)
        for _address, item in dist.walk(plan.rank, plan.world_size, worker_id, plan.num_streams, cursor,  # type: ignore
                                        plan.epoch * length):
            if cursor.position > (plan.epoch + 1) * length:
                return
            yield item
