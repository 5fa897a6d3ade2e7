"""``ff predict`` output: every generated sample written to disk with its prompt.

``<log_dir>/predictions/00007.png`` for the evaluation row with index 7 (several outputs per sample get ``_1``,
``_2`` … suffixes), and one JSON line per sample in ``predictions/rank<r>.jsonl``: ``{"index", "prompt", "files"}``.
Files are written atomically; each rank writes the rows it generated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from PIL import Image

from ff_core.callbacks.samples import log_dir, save_png


class MediaWriter(BasePredictionWriter):
    """Write the media ``FlowModule.predict_step`` generates (images as PNG).

    Args:
        dirpath: output folder; ``None``: ``<log_dir>/predictions``.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.dirpath = dirpath
        self.out_dir: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.out_dir = Path(self.dirpath) if self.dirpath else log_dir(trainer) / "predictions"

    def write_on_batch_end(self, trainer, pl_module, prediction: Any, batch_indices, batch, batch_idx,
                           dataloader_idx) -> None:
        lines = []
        for index, prompt, media in zip(prediction["index"], prediction["prompt"], prediction["media"]):
            files = []
            for position, item in enumerate(media):
                name = f"{index:05d}" + (f"_{position}" if position else "")
                files.append(self._write(item, name))
            lines.append(json.dumps({"index": index, "prompt": prompt, "files": files}))
        index_file = self.out_dir / f"rank{trainer.global_rank}.jsonl"
        index_file.parent.mkdir(parents=True, exist_ok=True)
        with index_file.open("a") as f:
            f.write("".join(line + "\n" for line in lines))

    def _write(self, item: Any, name: str) -> str:
        if not (isinstance(item, torch.Tensor) and item.dtype == torch.uint8 and item.ndim == 3):
            raise NotImplementedError(f"MediaWriter writes images (uint8 (3, H, W)) so far, got {type(item).__name__}")
        save_png(Image.fromarray(item.permute(1, 2, 0).cpu().numpy()), self.out_dir / f"{name}.png")
        return f"{name}.png"
