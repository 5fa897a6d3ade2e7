"""Audio rewards that need no downloaded weights."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ff_core.rewards.base import Reward, RewardBatch


def rms_dbfs(waveform: Tensor, floor_db: float = -100.0) -> Tensor:
    """RMS level in dB relative to full scale: ``20 log10(sqrt(mean(x^2)))`` over every channel and sample of a float
    (C, N) waveform in [-1, 1]. A full-scale square wave is 0 dBFS, a full-scale sine -3.01 dBFS (no AES17 +3 dB
    correction); silence is clamped to ``floor_db``."""
    rms = waveform.float().pow(2).mean().sqrt()
    return (20 * torch.log10(rms.clamp_min(10 ** (floor_db / 20)))).clamp_min(floor_db)


class AudioLoudnessReward(Reward):
    """The loudness of the first audio output, as RMS dBFS (:func:`rms_dbfs`; <= 0, 0 at full-scale square wave).
    With ``target_db``: ``-|dBFS - target_db|``, maximal (0) at exactly that level.

    Args:
        target_db: level to aim at in dBFS (e.g. -20); ``None`` rewards loudness itself.
        floor_db: level reported for silence (and anything quieter).
    """

    name = "audio_loudness"
    media_types = ("audio",)

    def __init__(self, target_db: float | None = None, floor_db: float = -100.0) -> None:
        super().__init__()
        if not (math.isfinite(floor_db) and floor_db < 0):
            raise ValueError(f"floor_db must be a negative number, got {floor_db}")
        if target_db is not None and not floor_db <= target_db <= 0:
            raise ValueError(f"target_db must be in [floor_db, 0] = [{floor_db}, 0], got {target_db}")
        self.target_db = target_db
        self.floor_db = floor_db

    def __call__(self, batch: RewardBatch) -> Tensor:
        levels = torch.stack([rms_dbfs(x.to(self.device), self.floor_db)
                              for x in batch.outputs(self.media_types, self.name)])
        return levels if self.target_db is None else -(levels - self.target_db).abs()
