"""Distributors: disjoint and complete slices, per-epoch reshuffle, mixtures, rank partitions (spec §2, §6)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ff_core.data.dataflow import (
    IterableDistributor,
    MapDistributor,
    MixtureDistributor,
    RankPartitionedDistributor,
    apportion_ranks,
    stream_slot,
)

SETTINGS = settings(max_examples=40, deadline=None)


def take_streams(dist, W, N, per_stream):
    return {(r, w): list(itertools.islice(dist.stream(r, W, w, N), per_stream)) for r in range(W) for w in range(N)}


@SETTINGS
@given(W=st.integers(1, 5), N=st.integers(1, 4), length=st.integers(1, 60), seed=st.integers(0, 10**6))
def test_map_streams_disjoint_and_complete_per_epoch(W, N, length, seed):
    """Over one epoch the W·N streams partition the dataset; item i of the order goes to stream_slot(i)."""
    dist = MapDistributor(list(range(length)), seed=seed)
    periods = -(-length // (W * N))
    streams = take_streams(dist, W, N, periods)
    order = [dist.index_at(p) for p in range(periods * W * N)]
    for p, idx in enumerate(order):
        r, w = stream_slot(p, 0, W, N)
        assert streams[(r, w)][p // (W * N)] == idx
    first_epoch = order[:length]
    assert sorted(first_epoch) == list(range(length))


@SETTINGS
@given(W=st.integers(1, 4), N=st.integers(1, 3), length=st.integers(1, 40))
def test_iterable_streams_disjoint_and_complete(W, N, length):
    dist = IterableDistributor(list(range(length)))
    got = [x for r in range(W) for w in range(N) for x in dist.stream(r, W, w, N)]
    assert sorted(got) == list(range(length))


def test_stream_slot_is_the_spec_rule_with_one_worker_and_worker_major_otherwise():
    # spec §6: i % (W·N) == rank·N + worker; with N == 1 both numberings agree.
    assert [stream_slot(i, 0, 4, 1) for i in range(5)] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 0)]
    # worker-major: consecutive items go to consecutive ranks, then the next worker
    assert [stream_slot(i, 0, 2, 2) for i in range(5)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 0)]


def test_map_reshuffles_per_epoch_deterministically():
    a, b = MapDistributor(list(range(50)), seed=3), MapDistributor(list(range(50)), seed=3)
    e0 = [a.index_at(p) for p in range(50)]
    e1 = [a.index_at(p) for p in range(50, 100)]
    assert e0 != e1 and sorted(e1) == list(range(50))
    assert e1 == [b.index_at(p) for p in range(50, 100)]  # depends on (seed, epoch) only, not on history
    assert [MapDistributor(list(range(50)), shuffle=False).index_at(p) for p in range(50)] == list(range(50))


def test_map_rejects_empty_dataset():
    with pytest.raises(ValueError, match="empty"):
        MapDistributor([], name="train")


@SETTINGS
@given(seed=st.integers(0, 1000), start=st.integers(0, 3000), n=st.integers(0, 3000))
def test_mixture_skip_equals_reading(seed, start, n):
    """Skipping n positions by bincount lands exactly where reading them one by one does."""
    def mix():
        return MixtureDistributor({"a": (MapDistributor(list(range(7)), seed=1), 3.0),
                                   "b": (MapDistributor(list(range(100, 113)), seed=2), 1.0)}, seed=seed)
    read, jump = mix().cursor(), mix().cursor()
    read.skip(start)
    jump.skip(start)
    for _ in range(n):
        read.take()
    jump.skip(n)
    assert jump.state() == read.state()
    assert jump.take()[1] == read.take()[1]


def test_mixture_follows_ratios_and_is_seeded():
    mix = MixtureDistributor({"a": (MapDistributor(list(range(10))), 3.0),
                              "b": (MapDistributor(list(range(100, 110))), 1.0)}, seed=5)
    cur = mix.cursor()
    names = Counter(cur.take()[0][0] for _ in range(8000))
    assert abs(names["a"] / 8000 - 0.75) < 0.03
    other = MixtureDistributor({"a": (MapDistributor(list(range(10))), 3.0),
                                "b": (MapDistributor(list(range(100, 110))), 1.0)}, seed=5).cursor()
    c1 = mix.cursor()
    assert [c1.take()[1] for _ in range(200)] == [other.take()[1] for _ in range(200)]
    assert mix.epoch_length == 20


def test_mixture_of_iterables_is_not_resumable_but_streams():
    mix = MixtureDistributor({"a": (IterableDistributor(range(50)), 1.0), "b": (IterableDistributor(range(50)), 1.0)})
    assert not mix.resumable
    assert len(list(mix.stream(0, 1, 0, 1))) >= 50
    with pytest.raises(ValueError, match="not resumable"):
        mix.cursor()


def test_mixture_validates_ratio_and_sources():
    with pytest.raises(ValueError, match=r"sources\['a'\] ratio must be > 0"):
        MixtureDistributor({"a": (MapDistributor([1]), 0)})
    with pytest.raises(ValueError, match="must be a DataDistributor"):
        MixtureDistributor({"a": ([1, 2], 1.0)})


@pytest.mark.parametrize("W", [2, 3, 5, 8])
def test_rank_partition_assigns_whole_ranks_and_shards_within_groups(W):
    dist = RankPartitionedDistributor({"big": {"dataset": list(range(100)), "ratio": 3},
                                       "small": {"dataset": list(range(1000, 1030)), "ratio": 1}}, seed=0)
    sizes = apportion_ranks([3, 1], W)
    assert sum(sizes) == W and min(sizes) >= 1
    got = {"big": [], "small": []}
    for r in range(W):
        name, _, _ = dist.assignment(r, W)
        for w in range(2):
            got[name] += list(itertools.islice(dist.stream(r, W, w, 2), 200 if name == "big" else 30))
    # the ranks of a group (and their workers) share that group's dataset between them
    assert set(got["big"]) == set(range(100)) and set(got["small"]) == set(range(1000, 1030))


def test_rank_partition_needs_a_rank_per_dataset():
    dist = RankPartitionedDistributor({"a": {"dataset": [1], "ratio": 1}, "b": {"dataset": [2], "ratio": 1}})
    with pytest.raises(ValueError, match="dp_world_size=1"):
        dist.assignment(0, 1)
