"""minimax-h3-fl2va and minimax-h3-ref2va against the adapter conformance kit's plumbing checks (stage shapes and
dtypes, sampling, LoRA targets and export, train / eval modes, sharding blocks, preprocessing identity, ...). Parity
with ``MiniMaxH3ModularPipeline`` is checked in test_minimax_fl2va.py / test_minimax_ref2va.py, which drive the
pipeline's generator through the realised prefix (the kit's reference run draws the prefix noise itself)."""

from __future__ import annotations

import math

import torch
from ff_minimax.fl2va import MiniMaxH3FL2VAAdapter
from ff_minimax.ref2va import MiniMaxH3Ref2VAAdapter
from ff_minimax.testing import TINY_FRAMES, TINY_SIZE, build_tiny_minimax

from ff_core.adapter import ConditionInput
from ff_core.data.media import DecodedAudio
from ff_core.testing.conformance import AdapterConformance

ADAPTER_KWARGS = {"height": TINY_SIZE, "width": TINY_SIZE, "num_frames": TINY_FRAMES}


def _image(seed: int, height: int = 20, width: int = 28) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


class _H3Targets:
    prompts = ("a red square with a low tone",)

    def make_targets(self, adapter, n):
        g = torch.Generator().manual_seed(0)
        t = torch.arange(adapter.audio_samples) / adapter.audio_rate
        return [[torch.randint(0, 256, (TINY_FRAMES, 3, TINY_SIZE, TINY_SIZE), generator=g, dtype=torch.uint8),
                 (0.3 * torch.sin(2 * math.pi * 220.0 * (i + 1) * t)).repeat(2, 1)] for i in range(n)]  # fmt: skip


class TestMiniMaxH3FL2VAConformance(_H3Targets, AdapterConformance):
    adapter_cls = MiniMaxH3FL2VAAdapter
    adapter_kwargs = ADAPTER_KWARGS

    def build_checkpoint(self, path):
        return build_tiny_minimax(path, variant="fl2va")

    def make_inputs(self, adapter, folder):
        """The first-plus-last form (both optional slots bound)."""
        return [ConditionInput(self.prompts[0], None, [
            {"type": "image", "data": _image(1), "path": folder / "first.png", "slot": "first_frame"},
            {"type": "image", "data": _image(2, 24, 18), "path": folder / "last.png", "slot": "last_frame"}])]


class TestMiniMaxH3Ref2VAConformance(_H3Targets, AdapterConformance):
    adapter_cls = MiniMaxH3Ref2VAAdapter
    adapter_kwargs = {**ADAPTER_KWARGS, "reference_image_short_edge": 16}

    def build_checkpoint(self, path):
        return build_tiny_minimax(path, variant="ref2va")

    def make_inputs(self, adapter, folder):
        """An image, an audio clip at 8 kHz (resampled to the audio VAE's rate), another image."""
        tone = 0.3 * torch.sin(2 * math.pi * 330.0 * torch.arange(8000) / 8000)[None]
        return [ConditionInput(self.prompts[0], None, [
            {"type": "image", "data": _image(1), "path": folder / "a.png"},
            {"type": "audio", "data": DecodedAudio(tone, 8000), "path": folder / "s.wav", "sample_rate": 8000},
            {"type": "image", "data": _image(3, 16, 24), "path": folder / "b.png"}])]
