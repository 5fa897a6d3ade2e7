"""DataflowLoader wiring (spec §1–2, §7), real worker processes, delivered-batch accounting, joint loading."""

from __future__ import annotations

import logging

import pytest
import torch
from dataflow_helpers import SimulatedWorkersLoader, ids, make_loaders, records, run_steps

from ff_core.data.dataflow import (
    DataflowLoader,
    DataParallelCoords,
    DefaultBatchCollator,
    IdentityProcessor,
    IterableDistributor,
    JointDataflowLoader,
    ListBatchCollator,
    MapDistributor,
    PoolPackingBatcher,
    SampleBatcher,
    SequentialPackingBatcher,
    SimpleBatcher,
)


class Reverser(SampleBatcher):
    """A custom batcher that reorders and does not declare the resume contract."""

    def batches(self, samples):
        buf = list(samples)
        for i in range(len(buf) - 2, -1, -2):
            yield [buf[i + 1], buf[i]]


def test_batch_size_is_sugar_and_exactly_one_is_required():
    dl = DataflowLoader(MapDistributor(records(6)), IdentityProcessor(), batch_size=3)
    assert isinstance(dl.batcher, SimpleBatcher) and isinstance(dl.collator, DefaultBatchCollator)
    assert [len(ids(b)) for b in dl] == [3, 3]
    with pytest.raises(ValueError, match="either a batcher= or a batch_size="):
        DataflowLoader(MapDistributor(records(6)), IdentityProcessor())
    with pytest.raises(ValueError, match="either a batcher= or a batch_size="):
        DataflowLoader(MapDistributor(records(6)), IdentityProcessor(), SimpleBatcher(2), batch_size=2)
    with pytest.raises(ValueError, match="persistent_workers"):
        DataflowLoader(MapDistributor(records(6)), IdentityProcessor(), batch_size=2, persistent_workers=True)


def test_unsafe_combinations_fail_at_construction():
    with pytest.raises(ValueError, match="cannot resume safely"):
        DataflowLoader(MapDistributor(records(6)), IdentityProcessor(), Reverser())
    dl = DataflowLoader(MapDistributor(records(6), shuffle=False), IdentityProcessor(), Reverser(), resumable=False)
    assert dl.mode == "none" and [ids(b) for b in dl] == [[5, 4], [3, 2], [1, 0]]
    with pytest.raises(ValueError, match="cannot fast-forward"):
        DataflowLoader(IterableDistributor(range(4)), IdentityProcessor(), batch_size=2, resumable=True)


def test_iterable_source_is_not_resumable_and_restarts(caplog):
    dl = DataflowLoader(IterableDistributor(records(5)), IdentityProcessor(), batch_size=2)
    assert dl.mode == "none" and [ids(b) for b in dl] == [[0, 1], [2, 3], [4]]
    with caplog.at_level(logging.WARNING):
        dl.load_state_dict(dl.state_dict())
    assert "not resumable" in caplog.text


def test_len_is_the_rest_of_the_epoch():
    dl = DataflowLoader(MapDistributor(records(10)), IdentityProcessor(), batch_size=3,
                        coords=DataParallelCoords(0, 2))
    assert len(dl) == 2  # ceil(10 / (2·3)); the last step runs into epoch 1 (soft boundary)
    packed = DataflowLoader(MapDistributor(records(10)), IdentityProcessor(), PoolPackingBatcher(8, size_fn=len))
    with pytest.raises(TypeError, match="steps_per_epoch"):
        len(packed)


def test_oversize_samples_are_dropped_logged_and_counted(caplog):
    data = [{"id": i, "n": n} for i, n in enumerate([3, 50, 4, 4, 60, 2])]
    dl = DataflowLoader(MapDistributor(data, shuffle=False), IdentityProcessor(),
                        SequentialPackingBatcher(max_sequence_length=8, size_fn=lambda s: s["n"]),
                        ListBatchCollator(), steps_per_epoch=3)
    with caplog.at_level(logging.ERROR):
        got = [ids(b) for b in dl]
    assert got == [[0, 2], [3, 5], [0, 2]]  # 1 and 4 dropped; the stream wraps into epoch 1, dropping 1 again
    assert dl.dropped_samples == 3 and dl.state_dict()["dropped"] == 3
    assert "dropped a sample" in caplog.text


@pytest.mark.parametrize("kind", ["global", "stream"])
def test_real_workers_match_the_simulation_and_prefetch_is_not_counted(kind):
    """With num_workers=2 workers run ahead; the state after 3 delivered batches resumes at batch 4."""
    def build(cls):
        kw = dict(batch_size=2) if kind == "global" else dict(
            batcher=PoolPackingBatcher(6, pool_size=3, max_batch_size=2, size_fn=lambda s: 1 + s["id"] % 4),
            collator=ListBatchCollator(), steps_per_epoch=8)
        return cls(MapDistributor(records(13), seed=4), IdentityProcessor(), num_workers=2, prefetch_factor=4,
                   **kw)
    expected = [ids(b) for b in build(SimulatedWorkersLoader)]
    real = build(DataflowLoader)
    it = iter(real)
    head = [ids(next(it)) for _ in range(3)]
    state = real.state_dict()
    del it
    resumed = build(DataflowLoader)
    resumed.load_state_dict(state)
    assert head + [ids(b) for b in resumed] == expected


def test_commit_pins_the_consumed_position_despite_lookahead():
    dl = DataflowLoader(MapDistributor(records(20), seed=2), IdentityProcessor(), batch_size=2, stamp_key="seq")
    it = iter(dl)
    batches = [next(it) for _ in range(5)]  # a fetcher ran two batches ahead of the model
    assert [b["seq"] for b in batches] == [1, 2, 3, 4, 5]
    dl.commit(3)
    again = DataflowLoader(MapDistributor(records(20), seed=2), IdentityProcessor(), batch_size=2)
    again.load_state_dict(dl.state_dict())
    assert ids(next(iter(again))) == ids(batches[3])


def joint(seed=7, **kw):
    a = DataflowLoader(MapDistributor(records(9), seed=1), IdentityProcessor(), batch_size=2, **kw)
    b = DataflowLoader(MapDistributor([{"id": 100 + i} for i in range(5)], seed=2), IdentityProcessor(),
                       batch_size=1, **kw)
    return JointDataflowLoader({"a": {"dataloader": a, "ratio": 1}, "b": {"dataloader": b, "ratio": 3}},
                               seed=seed, steps_per_epoch=6)


def test_joint_tags_batches_choice_depends_on_seed_and_step_only_and_resumes():
    whole = joint()
    full = [(b["dataset_name"], ids(b)) for _ in range(3) for b in whole]
    assert {n for n, _ in full} == {"a", "b"}
    assert [joint().choice(t) for t in range(30)] == [joint(coords=DataParallelCoords(1, 2)).choice(t)
                                                      for t in range(30)]
    j = joint()
    it = iter(j)
    head = [(b["dataset_name"], ids(b)) for b in (next(it) for _ in range(4))]
    state = j.state_dict()
    r = joint()
    r.load_state_dict(state)
    rest = [(b["dataset_name"], ids(b)) for _ in range(3) for b in r]
    assert head + rest[: len(full) - 4] == full
    with pytest.raises(ValueError, match="reserved"):
        JointDataflowLoader({"global_id": {"dataloader": j.loaders[0], "ratio": 1}})
    with pytest.raises(ValueError, match=r"'seed' is 7 in the checkpoint but 8"):
        joint(seed=8).load_state_dict(state)


def test_ranks_of_a_ddp_step_see_distinct_samples():
    loaders = make_loaders(lambda: MapDistributor(records(24), seed=0), 3, 2, batch_size=2)
    steps = run_steps(loaders, 4)
    seen = [i for step in steps for batch in step for i in batch]
    assert sorted(seen) == list(range(24))
    assert all(isinstance(b, list) for step in steps for b in step)
    assert torch.is_tensor(next(iter(loaders[0]))["id"])
