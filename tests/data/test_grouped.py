"""GRPO's prompt groups: each step's P prompts x K samples dealt over W ranks, deterministically, whole groups."""

from collections import Counter

import pytest

from ff_core.data.dataflow import (
    BatchCollator,
    DataflowLoader,
    DataParallelCoords,
    GroupedDistributor,
    IdentityProcessor,
    check_grouping,
)


class Items(BatchCollator):
    def collate(self, samples):
        return samples


def rank_batches(world: int, rank: int, steps: int, prompts=3, group=4, rows=7, seed=0) -> list[list]:
    distributor = GroupedDistributor(list(range(rows)), group, prompts, seed=seed)
    loader = DataflowLoader(distributor, IdentityProcessor(), collator=Items(),
                            batch_size=check_grouping(prompts, group, world),
                            coords=DataParallelCoords(rank, world))  # fmt: skip
    out = []
    while len(out) < steps:  # loader epochs (N*K / (P*K) steps, soft boundaries) one after the other
        out += [[(item.group, item.k, item.item) for item in batch] for batch in loader]
    return out[:steps]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_every_step_holds_whole_groups_spread_over_the_ranks(world):
    """Over the W ranks, step s holds exactly the K samples of prompts s*P .. s*P + P - 1 of the prompt order; each
    (group, k) pair once, one row per group; rank r's slice is the r-th contiguous slice of the sample-major block,
    so a group's samples are spread over the ranks (with W dividing K: K / W of every group on every rank)."""
    ranks = [rank_batches(world, r, steps=5) for r in range(world)]
    for step in range(5):
        pairs = [pair for r in range(world) for pair in ranks[r][step]]
        assert Counter((g, k) for g, k, _ in pairs) == Counter((g, k) for g in range(3 * step, 3 * step + 3)
                                                               for k in range(4))  # fmt: skip
        assert len({(g, row) for g, _, row in pairs}) == 3  # one row per group
        block = [(g, k) for k in range(4) for g in range(3 * step, 3 * step + 3)]
        size = 12 // world
        for r in range(world):
            assert [(g, k) for g, k, _ in ranks[r][step]] == block[r * size : (r + 1) * size]
            if 4 % world == 0:  # K / W samples of every group of the step on every rank
                groups = range(3 * step, 3 * step + 3)
                assert Counter(g for g, _, _ in ranks[r][step]) == {g: 4 // world for g in groups}


def test_prompt_order_is_a_permutation_per_epoch_and_reproducible():
    """Groups 0..6 are epoch 0's permutation of the 7 rows, 7..13 epoch 1's; the same seed gives the same order."""
    steps = rank_batches(1, 0, steps=5)
    rows = {g: row for batch in steps for g, _, row in batch}
    assert sorted(rows[g] for g in range(7)) == list(range(7))
    assert sorted(rows[g] for g in range(7, 14)) == list(range(7))
    assert steps == rank_batches(1, 0, steps=5)
    assert steps != rank_batches(1, 0, steps=5, seed=1)


def test_indivisible_step_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"3 \* 4 = 12 samples per step do not divide over 5 data-parallel ranks; "
                                         r"change model.objective.prompts_per_step or model.objective.group_size"):
        check_grouping(3, 4, 5)
