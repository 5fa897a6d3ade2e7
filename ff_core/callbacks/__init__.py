"""Lightning callbacks ff ships: checkpoints with LoRA export, validation sample grids, loss curves."""

from ff_core.callbacks.checkpoint import FlowCheckpoint
from ff_core.callbacks.samples import LossCurve, SampleGrid

__all__ = ["FlowCheckpoint", "LossCurve", "SampleGrid"]
