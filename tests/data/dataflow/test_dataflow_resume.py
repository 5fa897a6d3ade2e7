"""Exact resume (issue 4 §8): a resumed run continues the uninterrupted one with nothing repeated or skipped,
including into a different world size / worker count / batch size where promised (mode "global")."""

from __future__ import annotations

import pytest
from dataflow_helpers import (
    CountingProcessor,
    flatten_global,
    make_loaders,
    records,
    run_steps,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ff_core.data.dataflow import (
    DataParallelCoords,
    ListBatchCollator,
    MapDistributor,
    MixtureDistributor,
    PoolPackingBatcher,
    SequentialPackingBatcher,
    merge_rank_states,
)

SETTINGS = settings(max_examples=120, deadline=None)
layouts = st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5))  # (world size, workers, batch size)


def map_source(length, seed):
    return lambda: MapDistributor(records(length), seed=seed)


@SETTINGS
@given(layout=layouts, length=st.integers(1, 40), seed=st.integers(0, 99), steps=st.integers(1, 30))
def test_global_order_does_not_depend_on_layout(layout, length, seed, steps):
    """Concatenating every rank's batches step by step gives the distributor's own order, for any W, N, B:
    over an epoch the slices are disjoint and complete."""
    W, N, B = layout
    loaders = make_loaders(map_source(length, seed), W, N, batch_size=B)
    got = flatten_global(run_steps(loaders, steps))
    dist = map_source(length, seed)()
    assert got == [dist.index_at(p) for p in range(len(got))]
    first_epoch = got[:length]
    assert len(set(first_epoch)) == len(first_epoch)


@SETTINGS
@given(before=layouts, after=layouts, length=st.integers(1, 40), seed=st.integers(0, 99),
       cut=st.integers(0, 25), more=st.integers(1, 25))
def test_global_resume_into_any_layout(before, after, length, seed, cut, more):
    """Save rank 0's state after `cut` steps (all Lightning keeps), resume under another W / N / B: the resumed
    run continues the same global order from the same global position."""
    loaders = make_loaders(map_source(length, seed), before[0], before[1], batch_size=before[2])
    done = flatten_global(run_steps(loaders, cut)) if cut else []
    state = loaders[0].state_dict()
    resumed = make_loaders(map_source(length, seed), after[0], after[1], batch_size=after[2])
    for dl in resumed:
        dl.load_state_dict(state)
    rest = flatten_global(run_steps(resumed, more))
    dist = map_source(length, seed)()
    assert done + rest == [dist.index_at(p) for p in range(len(done) + len(rest))]


def mixture_source(seed):
    return lambda: MixtureDistributor({"a": (MapDistributor(records(13), seed=1), 2.0),
                                       "b": (MapDistributor([{"id": 100 + i} for i in range(7)], seed=2), 1.0)},
                                      seed=seed)


@SETTINGS
@given(before=layouts, after=layouts, seed=st.integers(0, 99), cut=st.integers(0, 20), more=st.integers(1, 20))
def test_mixture_resume_into_any_layout(before, after, seed, cut, more):
    loaders = make_loaders(mixture_source(seed), before[0], before[1], batch_size=before[2])
    done = flatten_global(run_steps(loaders, cut)) if cut else []
    state = loaders[0].state_dict()
    resumed = make_loaders(mixture_source(seed), after[0], after[1], batch_size=after[2])
    for dl in resumed:
        dl.load_state_dict(state)
    rest = flatten_global(run_steps(resumed, more))
    cursor = mixture_source(seed)().cursor()
    assert done + rest == [cursor.take()[1]["id"] for _ in range(len(done) + len(rest))]


def packers(kind, budget):
    if kind == "pool":
        return PoolPackingBatcher(budget, pool_size=4, max_batch_size=3, long_threshold=9,
                                  size_fn=lambda s: s["n"])
    return SequentialPackingBatcher(max_sequence_length=budget, size_fn=lambda s: s["n"])


def sized_source(length, seed):
    return lambda: MapDistributor([{"id": i, "n": 1 + (i * 7) % 9} for i in range(length)], seed=seed)


@SETTINGS
@given(W=st.integers(1, 3), N=st.integers(1, 3), kind=st.sampled_from(["pool", "sequential"]),
       length=st.integers(1, 30), seed=st.integers(0, 99), budget=st.integers(5, 20),
       spe=st.integers(1, 6), cut=st.integers(0, 15), more=st.integers(1, 15))
def test_stream_mode_resume_is_exact(W, N, kind, length, seed, budget, spe, cut, more):
    """Packing batchers (mode "stream"): per-rank sequences after a resume equal the uninterrupted ones; the
    merged state carries every rank's streams and each batcher's pending samples."""
    def build():
        return make_loaders(sized_source(length, seed), W, N, batcher=packers(kind, budget),
                            collator=ListBatchCollator(), steps_per_epoch=spe)
    full = run_steps(build(), cut + more)
    loaders = build()
    done = run_steps(loaders, cut) if cut else []
    state = merge_rank_states([dl.local_state_dict() for dl in loaders])
    resumed = build()
    for dl in resumed:
        dl.load_state_dict(state)
    assert done + run_steps(resumed, more) == full


class Big:
    """A 2·10^6-item map-style dataset that costs nothing to build."""

    def __len__(self):
        return 2_000_000

    def __getitem__(self, i):
        return {"id": i}


def test_resume_does_not_process_skipped_items():
    """Fast-forward is index arithmetic: after resuming at position ~10^6 only the served batch is processed."""
    proc = CountingProcessor()
    (dl,) = make_loaders(lambda: MapDistributor(Big()), 1, 1, batch_size=4, processor=proc)
    dl.load_state_dict({**dl.state_dict(), "cursor": {"position": 1_000_000}})
    next(iter(dl))
    assert proc.calls == 4


def test_fingerprint_mismatch_names_the_field():
    (a,) = make_loaders(map_source(10, 0), 1, 1, batch_size=2)
    (b,) = make_loaders(map_source(10, 1), 1, 1, batch_size=2)
    with pytest.raises(ValueError, match=r"'distributor\.seed' is 0 in the checkpoint but 1"):
        b.load_state_dict(a.state_dict())
    kw = dict(batcher=packers("pool", 10), collator=ListBatchCollator())
    (s2,) = make_loaders(sized_source(10, 0), 1, 2, **kw)
    (s3,) = make_loaders(sized_source(10, 0), 1, 3, **kw)
    with pytest.raises(ValueError, match="'num_workers' is 2 in the checkpoint but 3"):
        s3.load_state_dict(s2.state_dict())
    with pytest.raises(ValueError, match="format"):
        s3.load_state_dict({"format": "other"})


def test_stream_state_needs_every_rank():
    loaders = make_loaders(sized_source(10, 0), 2, 1, batcher=packers("sequential", 10),
                           collator=ListBatchCollator(), steps_per_epoch=3)
    with pytest.raises(RuntimeError, match="merge_rank_states"):
        loaders[0].state_dict()  # world size 2 without torch.distributed: the caller must gather
    run_steps(loaders, 2)
    merged = merge_rank_states([dl.local_state_dict() for dl in loaders])
    assert set(merged["streams"]) == {"0/0", "1/0"}
    assert DataParallelCoords(1, 2).rank == 1
