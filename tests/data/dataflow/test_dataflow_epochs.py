"""SamplerDistributor (resume mode "epoch"): every epoch is one complete traversal with torch's DistributedSampler
semantics (spec dataset-guide, "Offline dataloader and epoch semantics"), checked against torch itself —
``DataLoader(dataset, batch_size=B, sampler=DistributedSampler(..., drop_last=False))`` after ``set_epoch(e)`` is the
independent reference — for dataset sizes, batch sizes and world sizes that do and do not divide."""

from __future__ import annotations

import math

import pytest
import torch
from dataflow_helpers import ids, make_loaders, records
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from ff_core.data.dataflow import DataflowLoader, DataParallelCoords, IdentityProcessor, SamplerDistributor
from ff_core.data.dataflow.batchers import PoolPackingBatcher, SimpleBatcher


def torch_epoch(n: int, batch: int, world: int, rank: int, epoch: int, seed: int, shuffle: bool = True):
    """What torch's own DataLoader + DistributedSampler yield on ``rank`` in ``epoch``: the reference."""
    sampler = DistributedSampler(records(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return [ids(b) for b in DataLoader(records(n), batch_size=batch, sampler=sampler)]


def ff_epochs(n: int, batch: int, world: int, workers: int, seed: int, epochs: int, shuffle: bool = True):
    loaders = make_loaders(lambda: SamplerDistributor(records(n), shuffle=shuffle, seed=seed), world, workers,
                           batch_size=batch)
    return [[[ids(b) for b in dl] for dl in loaders] for _ in range(epochs)]  # [epoch][rank][batch]


@pytest.mark.parametrize("n", [1, 5, 24, 25, 31])
@pytest.mark.parametrize("batch", [1, 5, 8])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_epoch_is_torchs_distributed_sampler_traversal(n, batch, world):
    got = ff_epochs(n, batch, world, workers=1, seed=3, epochs=3)
    per_epoch = math.ceil(math.ceil(n / world) / batch)
    for epoch, ranks in enumerate(got):
        for rank, batches in enumerate(ranks):
            assert batches == torch_epoch(n, batch, world, rank, epoch, seed=3), (epoch, rank)
            assert len(batches) == per_epoch  # the same count on every rank, in every epoch
        # One complete traversal: every index at least once; only DistributedSampler's tail padding repeats.
        seen = [i for batches in ranks for b in batches for i in b]
        assert set(seen) == set(range(n)) and len(seen) == math.ceil(n / world) * world


def test_24_records_batch_5_gives_5_batches_an_epoch_with_every_record_once():
    """The issue's case: the last batch of an epoch is partial (4) instead of borrowing from the next epoch."""
    for epoch, [batches] in enumerate(ff_epochs(24, 5, 1, workers=1, seed=0, epochs=4)):
        assert [len(b) for b in batches] == [5, 5, 5, 5, 4], epoch
        assert sorted(i for b in batches for i in b) == list(range(24))


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_deliver_the_dataloaders_order(workers):
    assert ff_epochs(23, 2, 2, workers, seed=1, epochs=2) == ff_epochs(23, 2, 2, 1, seed=1, epochs=2)


def test_real_worker_processes_deliver_the_same_batches():
    def run(num_workers):
        dl = DataflowLoader(SamplerDistributor(records(13), seed=5), IdentityProcessor(), batch_size=3,
                            num_workers=num_workers, coords=DataParallelCoords(1, 2))
        return [[ids(b) for b in dl] for _ in range(2)]

    assert run(2) == run(0) == [torch_epoch(13, 3, 2, 1, e, seed=5) for e in range(2)]


def test_no_shuffle_keeps_dataset_order_and_pads_like_torch():
    assert ff_epochs(5, 2, 2, 1, seed=0, epochs=1, shuffle=False) == [[[[0, 2], [4]], [[1, 3], [0]]]]
    assert [[torch_epoch(5, 2, 2, r, 0, 0, shuffle=False) for r in range(2)]] == [[[[0, 2], [4]], [[1, 3], [0]]]]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), batch=st.integers(1, 6), world=st.integers(1, 4), workers=st.integers(1, 3),
       cut=st.integers(0, 60), seed=st.integers(0, 5))
def test_resume_at_any_batch_continues_the_uninterrupted_run(n, batch, world, workers, cut, seed):
    """Stop after ``cut`` batches (mid-epoch or on a boundary), save every rank's state, resume in fresh loaders
    (another worker count too): the rest of the run is the uninterrupted one's, batch for batch."""
    def loaders(w):
        return make_loaders(lambda: SamplerDistributor(records(n), seed=seed), world, w, batch_size=batch)

    per_epoch = math.ceil(math.ceil(n / world) / batch)
    total = cut + per_epoch + 1
    full = [[ids(b) for _ in range(math.ceil(total / per_epoch) + 1) for b in dl] for dl in loaders(workers)]
    first = loaders(workers)
    its = [iter(dl) for dl in first]
    for k in range(cut):
        if k and k % per_epoch == 0:
            its = [iter(dl) for dl in first]
        for it in its:
            next(it)
    states = [dl.state_dict() for dl in first]
    assert all(s == states[0] for s in states)  # one state restores every rank
    assert (states[0]["epoch"], states[0]["epoch_step"]) == divmod(cut, per_epoch)
    resumed = loaders(1 + workers % 3)
    rest = []
    for dl, state in zip(resumed, states):
        dl.load_state_dict(state)
        batches = [ids(b) for b in dl]  # the rest of the interrupted epoch
        assert len(dl) == per_epoch  # a fresh iter() covers a whole epoch again
        batches += [ids(b) for b in dl]
        rest.append(batches)
    for rank in range(world):
        assert rest[rank] == full[rank][cut : cut + len(rest[rank])]


def test_resume_under_another_world_size_is_refused_naming_the_field():
    [dl] = make_loaders(lambda: SamplerDistributor(records(10)), 1, 1, batch_size=2)
    next(iter(dl))
    other = make_loaders(lambda: SamplerDistributor(records(10)), 2, 1, batch_size=2)[0]
    with pytest.raises(ValueError, match=r"fingerprint field 'dp_world_size' is 1 in the checkpoint but 2"):
        other.load_state_dict(dl.state_dict())


def test_epoch_mode_needs_in_order_fixed_size_batches():
    dist = SamplerDistributor(records(10))
    with pytest.raises(ValueError, match="final partial batch"):
        DataflowLoader(dist, IdentityProcessor(), batcher=SimpleBatcher(2, drop_last=True))
    with pytest.raises(ValueError, match="found PoolPackingBatcher"):
        DataflowLoader(dist, IdentityProcessor(), batcher=PoolPackingBatcher(8, size_fn=lambda s: 1))
    with pytest.raises(ValueError, match="steps_per_epoch cannot be set"):
        DataflowLoader(dist, IdentityProcessor(), batch_size=2, steps_per_epoch=3)
    with pytest.raises(ValueError, match="dataset is empty"):
        SamplerDistributor([], name="train")
    assert DataflowLoader(dist, IdentityProcessor(), batch_size=2).mode == "epoch"
    assert torch.equal(torch.tensor(dist.rank_indices(0, 0, 1)).sort().values, torch.arange(10))
