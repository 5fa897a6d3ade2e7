"""``ff predict`` output: every generated sample written to disk with its prompt.

``<log_dir>/predictions/00007.png`` for the evaluation row with index 7 (several outputs per sample get ``_1``,
``_2`` … suffixes; videos are animated GIFs, audio 16-bit WAV: :mod:`ff_core.callbacks.media_log`), and one JSON
line per sample in ``predictions/rank<r>.jsonl``: ``{"index", "prompt", "files"}``.
Files are written atomically; each rank writes the rows it generated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter

from ff_core.atomic import write_bytes_atomic
from ff_core.callbacks.media_log import check_video_format, encode_output, samples_from_outputs
from ff_core.callbacks.samples import log_dir


class MediaWriter(BasePredictionWriter):
    """Write the media ``FlowModule.predict_step`` generates (images as PNG, videos as GIF or MP4, audio as WAV).

    Args:
        dirpath: output folder; ``None``: ``<log_dir>/predictions``.
        video_format: ``gif`` (default) or ``mp4`` (H.264 through PyAV, at the adapter's frame rate).
    """

    def __init__(self, dirpath: str | None = None, video_format: str = "gif") -> None:
        super().__init__(write_interval="batch")
        self.dirpath = dirpath
        self.video_format = check_video_format(video_format, "MediaWriter")
        self.out_dir: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.out_dir = Path(self.dirpath) if self.dirpath else log_dir(trainer) / "predictions"

    def write_on_batch_end(self, trainer, pl_module, prediction: Any, batch_indices, batch, batch_idx,
                           dataloader_idx) -> None:
        lines = []
        for sample in samples_from_outputs(prediction):
            sample.video_format = self.video_format
            files = []
            for position in range(len(sample.media)):
                name = sample.file_name(position)
                write_bytes_atomic(self.out_dir / name, encode_output(sample, position))
                files.append(name)
            lines.append(json.dumps({"index": sample.index, "prompt": sample.prompt, "files": files}))
        index_file = self.out_dir / f"rank{trainer.global_rank}.jsonl"
        index_file.parent.mkdir(parents=True, exist_ok=True)
        with index_file.open("a") as f:
            f.write("".join(line + "\n" for line in lines))
