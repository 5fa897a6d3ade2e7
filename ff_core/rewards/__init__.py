"""Rewards over decoded media and prompts (see :mod:`ff_core.rewards.base` and docs/objectives.md, "Rewards")."""

from ff_core.rewards.base import (
    GROUPWISE,
    POINTWISE,
    Reward,
    RewardBatch,
    Rewards,
    RewardScores,
    RewardSpec,
)

__all__ = ["GROUPWISE", "POINTWISE", "Reward", "RewardBatch", "RewardScores", "RewardSpec", "Rewards"]
