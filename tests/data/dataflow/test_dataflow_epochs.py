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


def interrupted(n, batch, world, cut, seed, distributor=SamplerDistributor):
    """``world`` ranks stopped after ``cut`` batches of epoch 0: (their batches, the state every rank saves)."""
    loaders = make_loaders(lambda: distributor(records(n), seed=seed), world, 1, batch_size=batch)
    its = [iter(dl) for dl in loaders]
    consumed = [[ids(next(it)) for _ in range(cut)] for it in its]
    states = [dl.state_dict() for dl in loaders]
    assert all(s == states[0] for s in states)
    return consumed, states[0]


def resumed(n, batch, world, state, seed, epochs=1, distributor=SamplerDistributor):
    """``world`` fresh ranks loaded from ``state``: per rank, the batches of the rest of the epoch (then ``epochs - 1``
    more), each list of epochs per rank."""
    loaders = make_loaders(lambda: distributor(records(n), seed=seed), world, 1, batch_size=batch)
    for dl in loaders:
        dl.load_state_dict(state)
    return [[[ids(b) for b in dl] for _ in range(epochs)] for dl in loaders]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), batch=st.integers(1, 6), world=st.integers(1, 4), new_world=st.integers(1, 4),
       cut=st.integers(0, 40), seed=st.integers(0, 5))
def test_an_epoch_resumed_on_another_world_size_serves_every_sample_once(n, batch, world, new_world, cut, seed):
    """Killed on ``world`` ranks after ``cut`` batches, resumed on ``new_world``: the first part is torch's own
    DistributedSampler epoch (the reference); the two parts together serve every sample of the epoch, each once,
    besides the padding repeats of the resumed layout (``DistributedSampler``'s rule: ``ceil(m / W') * W' - m`` of
    the ``m`` samples left, repeated); every new rank has the same number of batches; the next epoch is torch's epoch
    for the new world size."""
    per_epoch = math.ceil(math.ceil(n / world) / batch)
    cut = cut % per_epoch  # mid-epoch (a cut on the boundary is an ordinary start of epoch 1)
    consumed, state = interrupted(n, batch, world, cut, seed)
    for rank in range(world):
        assert consumed[rank] == torch_epoch(n, batch, world, rank, 0, seed)[:cut]
    rest = resumed(n, batch, new_world, state, seed, epochs=2)
    first = [i for batches in consumed for b in batches for i in b]
    second = [i for ranks in rest for b in ranks[0] for i in b]
    left = n - len(first)
    assert len(set(first)) == len(first)  # a stopped epoch never reached DistributedSampler's padding
    if new_world == world:  # the same layout: simply the rest of torch's epoch
        assert all(consumed[r] + rest[r][0] == torch_epoch(n, batch, world, r, 0, seed) for r in range(world))
    else:  # the rest, each sample once, its own first samples repeated as padding
        assert sorted(set(first) | set(second)) == list(range(n)) and not set(first) & set(second)
        assert len(second) == math.ceil(left / new_world) * new_world
    assert len({len(ranks[0]) for ranks in rest}) == 1 and len(rest[0][0]) == math.ceil(math.ceil(left / new_world)
                                                                                          / batch)
    for rank in range(new_world):
        assert rest[rank][1] == torch_epoch(n, batch, new_world, rank, 1, seed)


def test_an_epoch_resumed_on_another_world_size_keeps_its_order():
    """The rest of the epoch is the epoch's order less what was served, dealt as DistributedSampler deals (every
    W'-th), by hand: 10 records unshuffled, batch 2, two ranks stop after one batch ([0, 2] and [1, 3] served)."""
    consumed, state = interrupted(10, 2, 2, 1, 0, distributor=lambda d, seed: SamplerDistributor(d, shuffle=False))
    assert consumed == [[[0, 2]], [[1, 3]]]
    one = resumed(10, 2, 1, state, 0, distributor=lambda d, seed: SamplerDistributor(d, shuffle=False))
    assert one == [[[[4, 5], [6, 7], [8, 9]]]]
    three = resumed(10, 2, 3, state, 0, distributor=lambda d, seed: SamplerDistributor(d, shuffle=False))
    assert three == [[[[4, 7]]], [[[5, 8]]], [[[6, 9]]]]


def test_world_size_changing_twice_in_one_epoch():
    """2 ranks → 1 → 3 within one epoch of 31 shuffled records: every record served, the repeats only padding."""
    n, batch, seed = 31, 2, 4
    consumed, state = interrupted(n, batch, 2, 3, seed)
    loaders = make_loaders(lambda: SamplerDistributor(records(n), seed=seed), 1, 1, batch_size=batch)
    loaders[0].load_state_dict(state)
    it = iter(loaders[0])
    middle = [ids(next(it)) for _ in range(4)]
    state = loaders[0].state_dict()
    assert state["segments"] == [{"world": 2, "batches": 3}] and state["epoch_step"] == 7
    last = resumed(n, batch, 3, state, seed)
    served = [i for part in (*consumed, middle, *(r[0] for r in last)) for b in part for i in b]
    left = n - 12 - 8
    assert sorted(set(served)) == list(range(n)) and len(served) == n + (math.ceil(left / 3) * 3 - left)


def test_a_state_saved_before_the_world_size_left_the_fingerprint_still_loads():
    [dl] = make_loaders(lambda: SamplerDistributor(records(10)), 1, 1, batch_size=2)
    first = ids(next(iter(dl)))
    state = dl.state_dict()
    del state["world"]
    state["fingerprint"]["dp_world_size"] = 1  # as ff.dataflow/1 states were written until 2026-12
    same = make_loaders(lambda: SamplerDistributor(records(10)), 1, 1, batch_size=2)[0]
    same.load_state_dict(state)
    assert len(same) == 4
    other = make_loaders(lambda: SamplerDistributor(records(10)), 2, 1, batch_size=2)
    for o in other:
        o.load_state_dict(state)
    assert sorted(i for o in other for b in o for i in ids(b)) == sorted(set(range(10)) - set(first))


def test_another_batch_size_is_refused_naming_the_field():
    [dl] = make_loaders(lambda: SamplerDistributor(records(10)), 1, 1, batch_size=2)
    next(iter(dl))
    other = make_loaders(lambda: SamplerDistributor(records(10)), 1, 1, batch_size=3)[0]
    with pytest.raises(ValueError, match=r"fingerprint field 'batcher\.batch_size' is 2 in the checkpoint but 3"):
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
