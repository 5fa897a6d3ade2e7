"""SequentialPackingBatcher: order-preserving pack-until-budget (spec §3 "Order-preserving sequence packing")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from .base import SampleBatcher
from .batchers import Sample, SimpleBatcher, video_token_count


class SequentialPackingBatcher(SampleBatcher):
    """Packs samples in stream order until the budget is hit; never reorders.

    Exactly one limit: ``max_sequence_length`` (token-budget mode: the summed token cost of a batch stays within
    it) or ``max_samples_per_batch`` (count-only mode). The token cost of a sample is its text tokens plus, for its
    media, (H/(s·p))·(W/(s·p))·(1+(T−1)/t) (see :func:`video_token_count`). A sample costing more than the budget
    alone is dropped with a logged error and counted in ``dropped`` (and in ``DataflowLoader.dropped_samples``).

    Args:
        max_sequence_length: Token budget of one batch (packed tokens, summed).
        max_samples_per_batch: Samples per batch in count-only mode.
        tokenizer_spatial_compression_factor: VAE spatial compression s.
        tokenizer_temporal_compression_factor: VAE temporal compression t.
        patch_spatial: Transformer spatial patch size p.
        media_key: Sample key of the media tensor (or its shape as a sequence of ints).
        media_layout: Axis letters of a video's shape; an image drops the ``T``.
        text_tokens_key: Sample key whose length counts as text tokens (absent: 0).
        size_fn: Replaces the built-in cost entirely.
    """

    resumable = True

    def __init__(
        self,
        max_sequence_length: int | None = None,
        max_samples_per_batch: int | None = None,
        tokenizer_spatial_compression_factor: int = 8,
        tokenizer_temporal_compression_factor: int = 4,
        patch_spatial: int = 2,
        media_key: str = "video",
        media_layout: str = "CTHW",
        text_tokens_key: str = "input_ids",
        size_fn: Callable[[Sample], int] | None = None,
    ) -> None:
        if (max_sequence_length is None) == (max_samples_per_batch is None):
            raise ValueError("SequentialPackingBatcher: set exactly one of max_sequence_length (token budget) and "
                             f"max_samples_per_batch (count only), found {max_sequence_length=}, "
                             f"{max_samples_per_batch=}")
        limit = max_sequence_length if max_sequence_length is not None else max_samples_per_batch
        if limit < 1:
            raise ValueError(f"SequentialPackingBatcher: the limit must be >= 1, found {limit}")
        self.max_sequence_length, self.max_samples_per_batch = max_sequence_length, max_samples_per_batch
        self.spatial = tokenizer_spatial_compression_factor
        self.temporal = tokenizer_temporal_compression_factor
        self.patch = patch_spatial
        self.media_key, self.media_layout, self.text_tokens_key = media_key, media_layout, text_tokens_key
        self.size_fn = size_fn

    def sample_size(self, sample: Sample) -> int:
        if self.size_fn is not None:
            return int(self.size_fn(sample))
        tokens = len(sample[self.text_tokens_key]) if self.text_tokens_key in sample else 0
        media = sample.get(self.media_key)
        if media is not None:
            shape = tuple(media.shape) if isinstance(media, torch.Tensor) else tuple(media)
            tokens += video_token_count(shape, self.spatial, self.temporal, self.patch, self.media_layout)
        return tokens

    def batches(self, samples: Iterator[Sample]) -> Iterator[list[Sample]]:
        if self.max_samples_per_batch is not None:  # count-only mode is fixed-size batching, keeping the tail
            yield from SimpleBatcher(self.max_samples_per_batch).batches(samples)
            return
        budget, batch, used = self.max_sequence_length, [], 0
        for sample in samples:
            n = self.sample_size(sample)
            if n > budget:
                self.drop(sample, f"costs {n} tokens > max_sequence_length={budget}")
                continue
            if batch and used + n > budget:
                # Yield before keeping `sample`: it is then the only pulled-but-unbatched sample (resume contract).
                yield batch
                batch, used = [], 0
            batch.append(sample)
            used += n
        if batch:
            yield batch

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "SequentialPackingBatcher", "max_sequence_length": self.max_sequence_length,
                "max_samples_per_batch": self.max_samples_per_batch}
