"""Batchers and collators: budgets never exceeded, order kept where promised, drops counted, token cost."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ff_core.data.dataflow import (
    ListBatchCollator,
    PoolPackingBatcher,
    SequentialPackingBatcher,
    SimpleBatcher,
    video_token_count,
)

SETTINGS = settings(max_examples=60, deadline=None)
sizes = st.lists(st.integers(1, 120), min_size=0, max_size=60)


def samples(ns):
    return [{"id": i, "n": n} for i, n in enumerate(ns)]


@SETTINGS
@given(ns=sizes, budget=st.integers(1, 100), pool=st.integers(1, 8), mbs=st.integers(1, 6),
       threshold=st.integers(1, 100), strategy=st.sampled_from(PoolPackingBatcher.STRATEGIES),
       halving=st.booleans())
def test_pool_packing_never_exceeds_budget_and_loses_nothing(ns, budget, pool, mbs, threshold, strategy, halving):
    b = PoolPackingBatcher(budget, pool_size=pool, max_batch_size=mbs, long_threshold=threshold,
                           batching_strategy=strategy, apply_long_sample_halving=halving, size_fn=lambda s: s["n"])
    batches = list(b.batches(iter(samples(ns))))
    for batch in batches:
        padded = len(batch) * max(s["n"] for s in batch)
        assert 1 <= len(batch) <= mbs and padded <= budget
        if len(batch) > 1:
            assert padded <= b.budget(max(s["n"] for s in batch))
    emitted = sorted(s["id"] for batch in batches for s in batch)
    assert emitted == [i for i, n in enumerate(ns) if n <= budget]
    assert getattr(b, "dropped", 0) == sum(n > budget for n in ns)


@SETTINGS
@given(ns=sizes, budget=st.integers(1, 150))
def test_sequential_packing_keeps_order_and_budget(ns, budget):
    b = SequentialPackingBatcher(max_sequence_length=budget, size_fn=lambda s: s["n"])
    batches = list(b.batches(iter(samples(ns))))
    assert all(sum(s["n"] for s in batch) <= budget for batch in batches)
    assert [s["id"] for batch in batches for s in batch] == [i for i, n in enumerate(ns) if n <= budget]
    assert getattr(b, "dropped", 0) == sum(n > budget for n in ns)


@SETTINGS
@given(ns=sizes, cut=st.integers(0, 20), kind=st.sampled_from(["pool", "sequential", "simple"]))
def test_resume_contract_pending_samples_reproduce_the_rest(ns, cut, kind):
    """Feeding (pulled − yielded − dropped) first to a fresh batcher continues identically (base.SampleBatcher)."""
    def make():
        if kind == "pool":
            return PoolPackingBatcher(60, pool_size=4, max_batch_size=3, long_threshold=40, size_fn=lambda s: s["n"])
        if kind == "sequential":
            return SequentialPackingBatcher(max_sequence_length=100, size_fn=lambda s: s["n"])
        return SimpleBatcher(3)
    data = samples(ns)
    full = [[s["id"] for s in b] for b in make().batches(iter(data))]
    pulled, gone = [], set()
    first = make()
    first._drop_listener = lambda s: gone.add(s["id"])
    src = iter(data)

    def tracked():
        for s in src:
            pulled.append(s)
            yield s
    head = []
    gen = first.batches(tracked())
    for batch in gen:
        head.append([s["id"] for s in batch])
        gone.update(s["id"] for s in batch)
        if len(head) == cut:
            break
    if len(head) < cut:
        return
    pending = [s for s in pulled if s["id"] not in gone]
    rest = [[s["id"] for s in b] for b in make().batches(iter(pending + list(src)))]
    assert head + rest == full


def test_sequential_needs_exactly_one_limit():
    with pytest.raises(ValueError, match="exactly one"):
        SequentialPackingBatcher()
    with pytest.raises(ValueError, match="exactly one"):
        SequentialPackingBatcher(max_sequence_length=10, max_samples_per_batch=2)
    count = SequentialPackingBatcher(max_samples_per_batch=2)
    assert [[s["id"] for s in b] for b in count.batches(iter(samples([1] * 5)))] == [[0, 1], [2, 3], [4]]


def test_video_token_cost_by_hand():
    """Wan-like tokenizer s=8, t=4, patch p=2 on a 33×480×832 clip:
    (480/16)·(832/16)·(1 + 32/4) = 30·52·9 = 14040 video tokens, plus 7 text tokens."""
    assert video_token_count((3, 33, 480, 832), 8, 4, 2) == 14040
    assert video_token_count((3, 480, 832), 8, 4, 2) == 30 * 52  # an image: T = 1
    assert video_token_count((33, 3, 480, 832), 8, 4, 2, layout="TCHW") == 14040
    b = SequentialPackingBatcher(max_sequence_length=20000)
    assert b.sample_size({"video": torch.zeros(3, 33, 480, 832, dtype=torch.uint8), "input_ids": [0] * 7}) == 14047
    assert b.sample_size({"video": (3, 33, 480, 832)}) == 14040
    with pytest.raises(ValueError, match="layout"):
        video_token_count((3, 4), 8, 4, 2)


def test_pool_packing_validation_and_default_size():
    with pytest.raises(ValueError, match="batching_strategy"):
        PoolPackingBatcher(10, batching_strategy="best")
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        PoolPackingBatcher(0)
    assert PoolPackingBatcher(10).sample_size({"input_ids": [1, 2, 3]}) == 3


def test_list_collator_keeps_variable_media_as_lists():
    batch = ListBatchCollator(list_keys=["audio"]).collate([
        {"video": torch.zeros(3, 5, 8, 8), "emb": torch.ones(4), "audio": torch.ones(2), "caption": "a", "fps": 24},
        {"video": torch.zeros(3, 9, 8, 8), "emb": torch.ones(4), "audio": torch.ones(2), "caption": "b", "fps": 16},
    ])
    assert isinstance(batch["video"], list) and batch["video"][1].shape == (3, 9, 8, 8)
    assert batch["emb"].shape == (2, 4) and isinstance(batch["audio"], list)
    assert batch["caption"] == ["a", "b"] and batch["fps"].tolist() == [24, 16]
