"""Training objectives: each consumes the Adapter interface only."""

from ff_core.objectives.base import LossOutput, Objective
from ff_core.objectives.dpo import DPOObjective
from ff_core.objectives.flow_matching import TimestepSampler
from ff_core.objectives.grpo import GRPOObjective
from ff_core.objectives.nft import NFTObjective
from ff_core.objectives.sft import SFTObjective

__all__ = [
    "DPOObjective", "GRPOObjective", "LossOutput", "NFTObjective", "Objective", "SFTObjective", "TimestepSampler",
]
