"""Prompt groups for online RL (GRPO): every step, P prompts, each sampled K times, spread over the ranks.

Group-relative advantages (Flow-GRPO, Liu et al. 2025, sec. 4) compare the K samples of one prompt, so a step must
hold whole groups. :class:`GroupedDistributor` lays out one global order (the loader shards it; docs/dataflow.md)
in blocks of ``P * K`` items, one block per step: block ``s`` holds the (prompt, k) pairs of prompts
``s*P .. s*P + P - 1`` of the shuffled prompt order, sample-major (``q = k*P + p``: first sample 0 of each prompt,
then sample 1, ...). With ``W`` data-parallel ranks and a loader batch of ``P*K / W`` (one stream per rank), the
loader deals each step's block to the ranks in contiguous slices (docs/dataflow.md, mode ``global``), so each group's
K samples are spread over the ranks (with ``W`` dividing ``K``: ``K / W`` of them on every rank, and every rank sees
every prompt of the step), the same way on every run; the order itself does not depend on ``W``. Flow-GRPO's
``DistributedKRepeatSampler`` spreads a group the same way, by a shuffle. Each item carries its group id (the prompt's
position in the prompt order, unique over the run), which the trainer gathers with the rewards to normalise
advantages per group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .distributors import MapDistributor


@dataclass(frozen=True)
class GroupedItem:
    """One (prompt, sample) pair of a step.

    Attributes:
        group: the prompt's position in the run's prompt order (the group id; equal on every rank).
        k: which of the group's K samples.
        item: the dataset row.
    """

    group: int
    k: int
    item: Any


class GroupedDistributor(MapDistributor):
    """A map-style dataset as a global order of prompt groups (module docstring), reshuffled every prompt epoch.

    Args:
        dataset: the prompt rows (``__len__``, ``__getitem__``).
        group_size: K, samples per prompt.
        prompts_per_step: P, prompts per step (over all ranks).
        shuffle: reshuffle the prompts every epoch (``MapDistributor``'s permutation of ``(seed, epoch)``).
        seed: shuffle seed.
        name: label in errors and the resume fingerprint.
        identity: the dataset's content identity (resume fingerprint).
    """

    def __init__(self, dataset: Any, group_size: int, prompts_per_step: int, shuffle: bool = True, seed: int = 0,
                 name: str = "", identity: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        if group_size < 1 or prompts_per_step < 1:
            raise ValueError(f"GroupedDistributor: group_size and prompts_per_step must be >= 1, got {group_size}, "
                             f"{prompts_per_step}")  # fmt: skip
        super().__init__(dataset, shuffle=shuffle, seed=seed, name=name, identity=identity)
        self.group_size, self.prompts_per_step = group_size, prompts_per_step

    @property
    def epoch_length(self) -> int:
        return len(self.dataset) * self.group_size

    def pair_at(self, position: int) -> tuple[int, int]:
        """``(group, k)`` of global position ``position``: the prompt's place in the prompt order and the sample."""
        block, q = divmod(position, self.prompts_per_step * self.group_size)
        k, p = divmod(q, self.prompts_per_step)  # sample-major: a group's samples spread over the ranks' slices
        return block * self.prompts_per_step + p, k

    def fetch(self, address: Any) -> GroupedItem:
        group, k = self.pair_at(int(address))
        return GroupedItem(group, k, self.dataset[self.index_at(group)])

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "kind": "GroupedDistributor", "group_size": self.group_size,
                "prompts_per_step": self.prompts_per_step, "order": "sample-major"}  # fmt: skip
