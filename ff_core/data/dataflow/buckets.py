"""Same-shape buckets: batches that never mix geometries, so nothing is padded (spec §3, "bucketing").

Every sample carries its bucket (``sample["bucket"]``, an index into ``batch_sizes``); the batcher keeps one queue per
bucket and yields a bucket's batch the moment it holds that bucket's batch size. Batch sizes may differ per bucket:
give a large-token bucket fewer samples, so every batch fills the same token budget (``batch_size_b =
max_tokens // tokens_b``) with no padded token at all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .base import SampleBatcher

Sample = dict[str, Any]


class BucketBatcher(SampleBatcher):
    """Homogeneous batches per bucket, yielded as soon as a bucket is full; partial buckets are flushed (oldest first)
    when a finite stream ends.

    Resume contract: between two batches its only state is the queued samples, and a bucket fills in pull order, so
    feeding the pending samples (in pull order) to a fresh batcher rebuilds the same queues.

    Args:
        batch_sizes: samples per batch of each bucket (``sample[key]`` indexes it).
        key: the sample key holding the bucket index.
    """

    resumable = True

    def __init__(self, batch_sizes: Sequence[int], key: str = "bucket") -> None:
        if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
            raise ValueError(f"BucketBatcher: batch_sizes must be integers >= 1, found {list(batch_sizes)}")
        self.batch_sizes, self.key = tuple(batch_sizes), key
        self.fixed_batch_size = batch_sizes[0] if len(set(batch_sizes)) == 1 and len(batch_sizes) == 1 else None

    def batches(self, samples: Iterator[Sample]) -> Iterator[list[Sample]]:
        queues: dict[int, list[Sample]] = {}
        for sample in samples:
            bucket = sample[self.key]
            if not 0 <= bucket < len(self.batch_sizes):
                self.drop(sample, f"bucket {bucket} is not one of the {len(self.batch_sizes)} buckets")
                continue
            queue = queues.setdefault(bucket, [])
            queue.append(sample)
            if len(queue) == self.batch_sizes[bucket]:
                del queues[bucket]
                yield queue
        # A finite stream ended: the partial buckets, oldest first (dicts keep insertion order).
        yield from queues.values()

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "BucketBatcher", "batch_sizes": list(self.batch_sizes), "key": self.key}
