"""The reward interface and ff_core's own rewards (see :mod:`ff_core.rewards.base` and docs/objectives.md, "Rewards").

A recipe's configured set of rewards (names resolved through the plugin registry, weights, scoring and combining) is
:class:`ff_core.objectives.rewards.Rewards`.
"""

from ff_core.rewards.base import GROUPWISE, POINTWISE, Reward, RewardBatch, RewardSpec

__all__ = ["GROUPWISE", "POINTWISE", "Reward", "RewardBatch", "RewardSpec"]
