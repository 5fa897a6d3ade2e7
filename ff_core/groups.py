"""Prompt groups over data-parallel ranks (online RL): how a step's ``P`` prompts x ``K`` samples divide over ``W``
ranks, the arithmetic the loader (:class:`~ff_core.data.dataflow.GroupedDistributor`) and the GRPO objective share."""

from __future__ import annotations


def check_grouping(prompts_per_step: int, group_size: int, dp_world_size: int) -> int:
    """Samples per rank and step, ``P * K / W``; a clear error when ``W`` does not divide ``P * K``.

    Args:
        prompts_per_step: P.
        group_size: K.
        dp_world_size: W.
    """
    total = prompts_per_step * group_size
    if total % dp_world_size:
        raise ValueError(
            f"GRPO: prompts_per_step * group_size = {prompts_per_step} * {group_size} = {total} samples per step do "
            f"not divide over {dp_world_size} data-parallel ranks; change model.objective.prompts_per_step or "
            "model.objective.group_size"
        )
    return total // dp_world_size
