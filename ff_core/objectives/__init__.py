"""Training objectives: each consumes the Adapter interface only."""

from ff_core.objectives.base import LossOutput, Objective
from ff_core.objectives.flow_matching import TimestepSampler
from ff_core.objectives.sft import SFTObjective

__all__ = ["LossOutput", "Objective", "SFTObjective", "TimestepSampler"]
