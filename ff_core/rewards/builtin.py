"""ff_core's own rewards, registered through the same ``ff_rewards`` hook as any plugin's (STYLE 11)."""

from __future__ import annotations

from ff_core.hookspecs import hookimpl
from ff_core.rewards.base import Reward


@hookimpl
def ff_rewards() -> list[type[Reward]]:
    # Only classes: the CLIP model loads when a recipe builds the reward (transformers imports lazily, in __init__).
    from ff_core.rewards.audio import AudioLoudnessReward
    from ff_core.rewards.clip import ClipScoreReward
    from ff_core.rewards.image import BrightnessReward, ColourReward, JpegCompressibilityReward

    return [ColourReward, BrightnessReward, JpegCompressibilityReward, AudioLoudnessReward, ClipScoreReward]
