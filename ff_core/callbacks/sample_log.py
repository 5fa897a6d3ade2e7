"""Which training samples each rank consumed, and the noise it drew, step by step: one JSON line per batch, one
file per rank.

Useful to audit the data order and the training noise of a run (shuffling, sharding across ranks, what a resumed
run replays or skips): ``<dirpath>/rank<r>.jsonl`` gets
``{"step": 12, "epoch": 1, "ids": [3, 17], "sigma": [[0.41, 0.87]], "noise_seed": 1234}`` after every training
batch, where ``step`` is the optimiser step count after the batch, ``sigma`` the noise levels drawn (one row per
Monte-Carlo draw, one column per sample) and ``noise_seed`` the seed of the batch's noise generator (both as
``FlowModule.training_step`` returns them). Lines are appended and flushed at once, so a killed run keeps every
line of the steps it finished, and a resumed run continues the same files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

from ff_core.callbacks.samples import log_dir


class SampleLog(L.Callback):
    """Append the ids (and noise) of every consumed training batch to ``<dirpath>/rank<global_rank>.jsonl``.

    Args:
        dirpath: folder of the per-rank files; ``None``: ``<log_dir>/sample_log``.
        key: batch key holding the sample ids (a tensor or a list); ``index`` is the record's position in the
            data module's split.
        outputs: keys of the training step's output to record too, when present (tensors as nested lists).
    """

    def __init__(
        self, dirpath: str | None = None, key: str = "index", outputs: tuple[str, ...] = ("sigma", "noise_seed")
    ) -> None:
        self.dirpath, self.key, self.outputs = dirpath, key, tuple(outputs)
        self.path: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        root = Path(self.dirpath) if self.dirpath else log_dir(trainer) / "sample_log"
        self.path = root / f"rank{trainer.global_rank}.jsonl"

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ids = batch[self.key]
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        row = {"step": trainer.global_step, "epoch": trainer.current_epoch, "ids": ids}
        if isinstance(outputs, Mapping):
            for name in self.outputs:
                value = outputs.get(name)
                if value is not None:
                    row[name] = value.tolist() if isinstance(value, torch.Tensor) else value
        line = json.dumps(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def read_sample_log(path: str | Path, max_step: int | None = None) -> list[dict[str, Any]]:
    """The rows (``step``, ``epoch``, ``ids``, the recorded outputs) of a :class:`SampleLog` file, in order,
    optionally only up to optimiser step ``max_step``.

    Args:
        path: one rank's ``.jsonl`` file.
        max_step: keep the batches whose ``step`` is at most this (e.g. a checkpoint's ``global_step``).
    """
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if max_step is None or r["step"] <= max_step]
