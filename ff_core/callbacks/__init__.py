"""Lightning callbacks ff ships: checkpoints with LoRA export, validation sample grids, loss curves, sample logs,
prediction writing."""

from ff_core.callbacks.checkpoint import FlowCheckpoint
from ff_core.callbacks.media_writer import MediaWriter
from ff_core.callbacks.sample_log import SampleLog, read_sample_log
from ff_core.callbacks.samples import LossCurve, SampleGrid

__all__ = ["FlowCheckpoint", "LossCurve", "MediaWriter", "SampleGrid", "SampleLog", "read_sample_log"]
