"""Built-in batchers (spec §2 table, §3 packing recipes).

All three honour the resume contract of :class:`SampleBatcher`: between two yielded batches their only state is
the pulled-but-unbatched samples, in pull order, so the loader can resume them exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .base import SampleBatcher

Sample = dict[str, Any]


class SimpleBatcher(SampleBatcher):
    """Fixed-size batches in stream order.

    Args:
        batch_size: Samples per batch.
        drop_last: Drop a final short batch when a finite stream ends (streaming sources only: over a
            resumable source the stream never ends inside an epoch, see docs/dataflow.md).
    """

    resumable = True

    def __init__(self, batch_size: int, drop_last: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"SimpleBatcher: batch_size must be >= 1, found {batch_size}")
        self.batch_size, self.drop_last = batch_size, drop_last
        self.fixed_batch_size = batch_size

    def batches(self, samples: Iterator[Sample]) -> Iterator[list[Sample]]:
        batch: list[Sample] = []
        for sample in samples:
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "SimpleBatcher", "batch_size": self.batch_size}


class PoolPackingBatcher(SampleBatcher):
    """Token-budget packing that reorders within a pool to minimise padding (spec §3 "Token-budget packing").

    The budget counts padded tokens: a batch of n samples whose largest costs m tokens uses n·m ≤ budget, so it
    never exceeds ``max_tokens``. The oldest pooled sample anchors every batch (nothing starves); the others are
    added by ``batching_strategy``: ``"prefer_closest"`` (closest size to the anchor first, least padding) or
    ``"prefer_first"`` (pool order). A sample costing more than ``max_tokens`` is dropped, logged and counted.

    Args:
        max_tokens: Padded-token budget of one batch.
        pool_size: Samples held for choosing; larger packs tighter but reorders further.
        max_batch_size: Most samples in one batch.
        long_threshold: A multi-sample batch whose largest sample costs at least this gets half the budget
            (spec §7: memory headroom for long sequences).
        batching_strategy: ``"prefer_closest"`` or ``"prefer_first"``.
        apply_long_sample_halving: Enable the halving above.
        size_fn: Cost of a sample; default ``len(sample["input_ids"])``.
    """

    resumable = True
    STRATEGIES = ("prefer_closest", "prefer_first")

    def __init__(
        self,
        max_tokens: int,
        pool_size: int = 16,
        max_batch_size: int = 1,
        long_threshold: int = 6400,
        batching_strategy: str = "prefer_closest",
        apply_long_sample_halving: bool = True,
        size_fn: Callable[[Sample], int] | None = None,
    ) -> None:
        for key, value in (("max_tokens", max_tokens), ("pool_size", pool_size), ("max_batch_size", max_batch_size)):
            if value < 1:
                raise ValueError(f"PoolPackingBatcher: {key} must be >= 1, found {value}")
        if batching_strategy not in self.STRATEGIES:
            raise ValueError(f"PoolPackingBatcher: batching_strategy must be one of {self.STRATEGIES}, "
                             f"found {batching_strategy!r}")
        self.max_tokens, self.pool_size, self.max_batch_size = max_tokens, pool_size, max_batch_size
        self.long_threshold, self.batching_strategy = long_threshold, batching_strategy
        self.apply_long_sample_halving, self.size_fn = apply_long_sample_halving, size_fn

    def sample_size(self, sample: Sample) -> int:
        return int(self.size_fn(sample)) if self.size_fn is not None else len(sample["input_ids"])

    def budget(self, largest: int) -> int:
        """Token budget of a multi-sample batch whose largest sample costs ``largest``.

        Args:
            largest: Cost of the batch's largest sample.
        """
        if self.apply_long_sample_halving and largest >= self.long_threshold:
            return self.max_tokens // 2
        return self.max_tokens

    def batches(self, samples: Iterator[Sample]) -> Iterator[list[Sample]]:
        stream, pool, exhausted = iter(samples), [], False
        while True:
            while not exhausted and len(pool) < self.pool_size:  # refill only when choosing (resume contract)
                sample = next(stream, None)
                if sample is None:
                    exhausted = True
                elif (n := self.sample_size(sample)) > self.max_tokens:
                    self.drop(sample, f"costs {n} tokens > max_tokens={self.max_tokens}")
                else:
                    pool.append((sample, n))
            if not pool:
                return
            chosen = self._choose(pool)
            batch = [pool[i][0] for i in chosen]
            pool = [entry for i, entry in enumerate(pool) if i not in chosen]
            yield batch

    def _choose(self, pool: list[tuple[Sample, int]]) -> list[int]:
        anchor = pool[0][1]
        rest = range(1, len(pool))
        if self.batching_strategy == "prefer_closest":
            rest = sorted(rest, key=lambda i: abs(pool[i][1] - anchor))
        chosen, largest = [0], anchor
        for i in rest:
            if len(chosen) >= self.max_batch_size:
                break
            big = max(largest, pool[i][1])
            if (len(chosen) + 1) * big <= self.budget(big):
                chosen.append(i)
                largest = big
        return sorted(chosen)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "PoolPackingBatcher", "max_tokens": self.max_tokens, "pool_size": self.pool_size,
                "max_batch_size": self.max_batch_size, "strategy": self.batching_strategy,
                "long_threshold": self.long_threshold, "halving": self.apply_long_sample_halving}


def video_token_count(shape: Sequence[int], spatial: int, temporal: int, patch: int, layout: str = "CTHW") -> int:
    """Transformer tokens of one media item: (H/(s·p))·(W/(s·p))·(1 + (T−1)/t), with T = 1 for images.

    Args:
        shape: Tensor shape in ``layout`` (an image is ``CHW``, i.e. the layout without ``T``).
        spatial: Tokenizer (VAE) spatial compression s.
        temporal: Tokenizer temporal compression t.
        patch: Transformer spatial patch size p.
        layout: Axis letters of a video shape, e.g. ``"CTHW"`` or ``"TCHW"``.
    """
    axes = layout if len(shape) == len(layout) else layout.replace("T", "")
    if len(shape) != len(axes):
        raise ValueError(f"video_token_count: shape {tuple(shape)} does not match layout {layout!r}")
    dims = dict(zip(axes, shape))
    frames = dims.get("T", 1)
    cell = spatial * patch
    return (dims["H"] // cell) * (dims["W"] // cell) * (1 + (frames - 1) // temporal)
